"""Per-token evidence of a cell and the decisions built on it: distribution metrics against the float model,
paired intervals over windows, and the three-way verdict.

Every record of the grid keeps, beside its JSON, the per-token numbers it was computed from in a safetensors
sidecar (:func:`sidecar_path`, named with its SHA-256 in the record's ``evidence`` block), so an interval can be
computed again, and a resumed grid or a card checks what it reuses:

- ``nll`` (windows × window, float32): each scored token's negative log-likelihood, in the windows' order;
- a quantised cell adds ``kld`` (float32), the KL divergence of its next-token distribution from the float
  model's at that position, and ``top1`` (uint8), 1 where both models' most likely next token is the same.

**Distribution metrics** (:func:`distribution_metrics`), as llama.cpp's ``llama-perplexity --kl-divergence``
defines them (``tools/perplexity/perplexity.cpp`` in ggml-org/llama.cpp: ``kl_divergence``, ``log_softmax`` with
``kl_divergence_result``), with P the float model's distribution, Q the quantised one's, on the same tokens:

- per token ``KLD = Σ_v P(v) (ln P(v) − ln Q(v))`` over the **full** vocabulary, in float64 from float32 logits.
  llama.cpp stores P as 16-bit log-probabilities and drops the terms with ln P(v) ≤ −16; qbench keeps P exact
  (it recomputes the float logits beside the quantised ones), so its KLD is the exact one;
- ``kld_mean`` ± ``kld_mean_se``: mean over tokens, and llama.cpp's uncertainty sqrt((E[x²] − E[x]²)/(n − 1))
  (0 for n ≤ 10, as there); ``kld_median``, ``kld_p90``, ``kld_p99``, ``kld_p999``, ``kld_max``: llama.cpp's
  percentile, linear interpolation at fraction · (n − 1) of the sorted values (the median the mean of the two
  middle values for even n);
- ``top1_agreement`` ("same top p"): the fraction of tokens whose most likely next token is the same under P and
  Q, ± sqrt(p(1 − p)/(n − 1));
- ``rms_delta_p``: sqrt(mean(Δp²)), Δp = Q(target) − P(target), with llama.cpp's uncertainty 0.5/rms · se(Δp²);
- ``ln_ppl_ratio`` = mean NLL_Q − mean NLL_P and ``ln_ppl_ratio_se`` = sqrt(se_Q² + se_P² − 2 cov): the paired
  per-token uncertainty llama.cpp prints.

llama.cpp scores the second half of each chunk only; qbench scores every position of its windows (its protocol,
``qbench.eval.metrics``). All fractions are stored as fractions (0–1); tables show them in percent.

**Intervals** (:func:`cluster_interval`). Tokens of one window share their context, so their errors are not
independent, and the per-token standard error above is too small (the tests show it covering the true change
far less often than 95 %). The decisions use windows as the unit: for window i, d_i = mean NLL_Q − mean NLL_P over
its tokens (all windows have the same length, so mean(d) is the change in mean NLL). Windows of one document are
not independent either (a document's topic and style make a quantised model err alike in all of them), so where
the windows were drawn across documents (``--sample documents``, ``qbench.eval.sampling``) the documents are the
clusters: the 95 % interval of mean(d) is mean(d) ± t(0.975, G − 1) · se with G documents and the cluster-robust
se² = G/(G − 1) · Σ_g (Σ_{i∈g} (d_i − mean))² / n² — with one window per document (the default design) exactly
the paired t over windows, mean(d) ± t(0.975, n − 1) · sd(d)/√n, which is what a record of the first windows
(``--sample first``, every window its own cluster) uses. Student's t is exact for integer degrees of freedom
(:func:`t_quantile`); ``ppl_change_ci95`` is 100 · (exp(·) − 1) of the ends, in percent. The same interval gives
``kld_mean_ci95`` (per-window mean KLD) and ``top1_agreement_ci95``. One cluster gives no interval (no variance to
estimate); the record's ``interval`` block names the method, the windows, the clusters and the degrees of freedom.

**Verdicts** (:func:`decide`): with ``tolerance`` in the metric's unit, *within* when the interval's upper end is
≤ the tolerance, *beyond* when its lower end is > the tolerance, *undecided* when it straddles it (or when no
interval exists). Never a point estimate against a threshold. For an undecided cell, :func:`decide` says how
many tokens would decide it :data:`DECIDE_POWER` of the time if its mean and per-window spread are what was
observed: the fewest windows m with (t₀.₉₇₅,ₘ₋₁ + z_power) · sd / √m ≤ |mean − tolerance|.

**Sequential looks** (``--resolve``, :class:`Look`): a cell tested again on more tokens while undecided gets
several chances to be called *within*; at the 95 % level each time, a cell exactly at the tolerance would be
called within more often than 2.5 %. ``--resolve`` plans its looks in advance (the budget, twice it, … up to the
cap: K looks) and splits the one-sided :data:`ALPHA` over them (Bonferroni): look k decides on the interval
mean ± t(1 − α/K, n_k − 1) · sd/√n_k, so over all its looks such a cell is called within at most α of the time
(and *beyond* at most α likewise). A record that carries a ``sequential`` block
(:meth:`Look.to_dict`, set by ``qbench.studies.resolve`` on a copy in memory) is decided that way; every other
record at 95 %.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.errors import UserError

# the metrics, the level and the tolerance's words live in a torch-free module (the card's sentences read them);
# every name stays importable from here. ALPHA: one-sided, LEVEL's two tails split (--resolve's looks share it)
from qbench.eval.tolerance import ALPHA as ALPHA
from qbench.eval.tolerance import DEFAULT_METRIC as DEFAULT_METRIC
from qbench.eval.tolerance import LEVEL as LEVEL
from qbench.eval.tolerance import METRICS as METRICS
from qbench.eval.tolerance import check_metric as check_metric
from qbench.eval.tolerance import deciding_interval, interval_text
from qbench.eval.tolerance import default_tolerance as default_tolerance
from qbench.eval.tolerance import tolerance_text as tolerance_text

SIDECAR_SUFFIX = ".tokens.safetensors"
SEQUENTIAL_RULE = "bonferroni"  # how --resolve splits ALPHA over its planned looks: ALPHA / looks each
# How often the tokens a card suggests for an undecided cell decide it, at the cell's observed mean and spread. The
# budget at which the interval's half-width just reaches the tolerance decides only half the time.
DECIDE_POWER = 0.8
WITHIN, BEYOND, UNDECIDED = "within", "beyond", "undecided"
VERDICTS = (WITHIN, BEYOND, UNDECIDED)
TOLERANCE_REL_EPS = 1e-9  # float rounding of a change computed as a ratio, far below any meant difference


def sidecar_path(record_path: Path) -> Path:
    """The per-token sidecar of the record at ``record_path``: ``<stem>.tokens.safetensors`` beside it."""
    return record_path.with_name(record_path.stem + SIDECAR_SUFFIX)


def encode(tensors: Mapping[str, Tensor]) -> tuple[bytes, dict[str, Any]]:
    """The sidecar's bytes and the record's ``evidence`` block (file set by the writer, SHA-256, shapes)."""
    from safetensors.torch import save

    data = save({k: v.contiguous() for k, v in tensors.items()})
    block = {
        "file": None,
        "sha256": hashlib.sha256(data).hexdigest(),
        "tensors": {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()},
    }
    return data, block


def read(record_path: Path, record: Mapping[str, Any]) -> dict[str, Tensor] | None:
    """The per-token tensors a record names, or None when it names none (an older record: "no interval"), the
    file is missing, or its hash differs from the record's (then the record cannot be trusted and is redone)."""
    from safetensors.torch import load

    block = record.get("evidence") or {}
    if not block.get("file") or not block.get("sha256"):
        return None
    try:
        data = (Path(record_path).parent / block["file"]).read_bytes()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != block["sha256"]:
        return None
    return load(data)


# ----------------------------------------------------------------------------------------------- statistics


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with integer ``df`` degrees of freedom.

    From the exact two-sided CDF A(t | ν) = P(|T| ≤ t) for integer ν (Abramowitz & Stegun 26.7.3 and 26.7.4:
    finite sums in θ = atan(t/√ν)), inverted by bisection; ν > 1000 uses the normal quantile's Cornish–Fisher
    correction (A&S 26.7.5), within 1e-6 there."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df ≥ 1, got p={p}, df={df}")
    target = 2 * p - 1  # two-sided coverage
    if df > 1000:
        z = _normal_quantile(p)
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_two_sided(mid, df) < target else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def _t_two_sided(t: float, df: int) -> float:
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:  # 26.7.3: (2/π)[θ + sinθ (cosθ + (2/3)cos³θ + … + (2·4…(ν−3))/(1·3…(ν−2)) cos^(ν−2)θ)]
        term, total = math.cos(theta), 0.0
        if df > 1:
            total = term
            for k in range(3, df - 1, 2):
                term *= c2 * (k - 1) / k
                total += term
        return 2 / math.pi * (theta + s * total)
    term, total = 1.0, 1.0  # 26.7.4: sinθ [1 + (1/2)cos²θ + (1·3)/(2·4)cos⁴θ + … ]
    for k in range(2, df - 1, 2):
        term *= c2 * (k - 1) / k
        total += term
    return s * total


@functools.lru_cache(maxsize=64)
def _normal_quantile(p: float) -> float:
    lo, hi = 0.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(-mid / math.sqrt(2)) < p else (lo, mid)
    return (lo + hi) / 2


def mean_and_uncertainty(values: Tensor) -> tuple[float, float]:
    """llama.cpp's ``mean_and_uncertainty``: the mean and sqrt((E[x²] − E[x]²)/(n − 1)), 0 for n ≤ 10."""
    x = values.double().flatten()
    n = x.numel()
    if n < 1:
        return float("nan"), float("nan")
    mean = x.mean().item()
    var = (x.square().mean() - mean * mean).item()
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def percentile(sorted_values: Tensor, fraction: float) -> float:
    """llama.cpp's ``percentile`` of ascending ``sorted_values``: linear interpolation at fraction · (n − 1)."""
    n = sorted_values.numel()
    if fraction <= 0:
        return sorted_values[0].item()
    if fraction >= 1:
        return sorted_values[-1].item()
    p = fraction * (n - 1)
    i = int(p)
    p -= i
    return ((1 - p) * sorted_values[i].double() + p * sorted_values[min(i + 1, n - 1)].double()).item()


def cluster_interval(
    per_window: Tensor, level: float = LEVEL, clusters: Sequence[Hashable] | None = None
) -> tuple[float, float, float, float] | None:
    """(mean, low, high, sd) of the per-window values' mean, with G independent clusters of windows (``clusters``:
    a label per window; None: every window its own):

        mean ± t((1 + level)/2, G − 1) · se,   se² = G / (G − 1) · Σ_g (Σ_{i ∈ g} (x_i − mean))² / n²

    the cluster-robust (CR1) standard error of a mean. With every window its own cluster it is sd/√n, the plain
    paired t. ``sd`` is the per-window spread the interval implies, se·√n. None for G < 2 (no variance)."""
    x = per_window.double().flatten()
    n = x.numel()
    if clusters is None:
        groups = n
        if n < 2:
            return None
        mean, sd = x.mean().item(), x.std(unbiased=True).item()
        se = sd / math.sqrt(n)
    else:
        if len(clusters) != n:
            raise ValueError(f"{len(clusters)} cluster labels for {n} windows")
        labels: dict[Hashable, int] = {}
        index = torch.tensor([labels.setdefault(c, len(labels)) for c in clusters])
        groups = len(labels)
        if groups < 2:
            return None
        mean = x.mean().item()
        sums = torch.zeros(groups, dtype=torch.float64).index_add_(0, index, x - mean)
        se = math.sqrt(groups / (groups - 1) * sums.square().sum().item()) / n
        sd = se * math.sqrt(n)
    half = t_quantile((1 + level) / 2, groups - 1) * se
    return mean, mean - half, mean + half, sd


def cluster_count(clusters: Sequence[Hashable] | None, windows: int) -> int:
    """G: the number of distinct clusters (``windows`` when there are no labels)."""
    return windows if clusters is None else len(set(clusters))


def _pct(x: float) -> float:
    return 100 * math.expm1(x) if x < 700 else float("inf")


def paired_metrics(nll: Tensor, fp_nll: Tensor, clusters: Sequence[Hashable] | None = None) -> dict[str, Any]:
    """``ppl_change_ci95`` (percent; windows, or with ``clusters`` the documents, as clusters), ``ln_ppl_ratio`` ±
    its per-token paired uncertainty (llama.cpp's) and ``rms_delta_p`` of a quantised cell's per-token NLL against
    the float model's."""
    if nll.shape != fp_nll.shape:
        raise ValueError(f"per-token NLL of shape {tuple(nll.shape)} against the float {tuple(fp_nll.shape)}")
    q, p = nll.double(), fp_nll.double()
    n = q.numel()
    mq, sq = mean_and_uncertainty(q)
    mp, sp = mean_and_uncertainty(p)
    cov = ((q * p).mean() - mq * mp).item() / (n - 1) if n >= 10 else 0.0  # llama.cpp's covariance
    ratio_se = math.sqrt(max(sq * sq + sp * sp - 2 * cov, 0.0))
    delta_p = torch.exp(-q) - torch.exp(-p)
    mse, mse_se = mean_and_uncertainty(delta_p.square())
    rms = math.sqrt(mse)
    out: dict[str, Any] = {
        "ln_ppl_ratio": mq - mp,
        "ln_ppl_ratio_se": ratio_se,
        "rms_delta_p": rms,
        "rms_delta_p_se": 0.5 / rms * mse_se if rms > 0 else 0.0,
        "ppl_change_ci95": None,
        "interval": _interval_block(q.shape[0], clusters),
    }
    interval = cluster_interval((q - p).mean(dim=1), clusters=clusters)
    if interval is not None and all(math.isfinite(v) for v in interval):
        _, low, high, sd = interval
        out["ppl_change_ci95"] = [_pct(low), _pct(high)]
        out["interval"]["sd_ln_ppl_ratio"] = sd
    return out


def _interval_block(windows: int, clusters: Sequence[Hashable] | None = None) -> dict[str, Any]:
    if clusters is None:
        return {
            "method": "paired t over windows (clusters)",
            "level": LEVEL,
            "windows": windows,
            "df": windows - 1,
        }
    groups = cluster_count(clusters, windows)
    return {
        "method": "paired t over documents (clusters of windows, CR1 standard error)",
        "level": LEVEL,
        "windows": windows,
        "clusters": groups,
        "df": groups - 1,
    }


def distribution_metrics(
    kld: Tensor, top1: Tensor, clusters: Sequence[Hashable] | None = None
) -> dict[str, Any]:
    """llama.cpp's KL-divergence and same-top statistics of per-token ``kld`` and ``top1`` (windows × window),
    plus their 95 % cluster intervals over windows, or ``clusters`` of them (``kld_mean_ci95``,
    ``top1_agreement_ci95``)."""
    flat = kld.double().flatten()
    n = flat.numel()
    ordered = flat.sort().values
    mean, se = mean_and_uncertainty(flat)
    same = top1.double()
    agreement = same.mean().item()
    out: dict[str, Any] = {
        "kld_mean": mean,
        "kld_mean_se": se,
        "kld_median": percentile(ordered, 0.5),
        "kld_p90": percentile(ordered, 0.9),
        "kld_p99": percentile(ordered, 0.99),
        "kld_p999": percentile(ordered, 0.999),
        "kld_max": ordered[-1].item(),
        "top1_agreement": agreement,
        "top1_agreement_se": math.sqrt(agreement * (1 - agreement) / (n - 1)) if n > 1 else 0.0,
        "kld_mean_ci95": None,
        "top1_agreement_ci95": None,
    }
    k = cluster_interval(kld.double().mean(dim=1), clusters=clusters)
    t = cluster_interval(same.mean(dim=1), clusters=clusters)
    if k is not None:
        out["kld_mean_ci95"] = [k[1], k[2]]
    if t is not None:
        out["top1_agreement_ci95"] = [t[1], t[2]]
    return out


def bits_per_byte(total_nll: float, scored_bytes: int | None) -> float | None:
    """lm-evaluation-harness's ``bits_per_byte``: the scored tokens' total NLL (nats) / (ln 2 · their bytes)."""
    if not scored_bytes or not math.isfinite(total_nll):
        return None
    return total_nll / (math.log(2) * scored_bytes)


# ----------------------------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Look:
    """One of ``--resolve``'s planned looks at a cell (module docstring, docs/metrics.md): look ``look`` of the
    ``looks`` planned, deciding at the one-sided ``alpha`` — :data:`ALPHA` split evenly over the looks
    (Bonferroni), so that over all its looks a cell exactly at the tolerance is called *within* at most
    ``alpha_total`` of the time."""

    look: int
    looks: int
    alpha: float
    rule: str = SEQUENTIAL_RULE
    alpha_total: float = ALPHA

    @classmethod
    def planned(cls, look: int, looks: int, alpha_total: float = ALPHA) -> Look:
        """Look ``look`` (1-based) of ``looks``, each spending ``alpha_total / looks``."""
        if not 1 <= look <= looks:
            raise ValueError(f"look {look} of {looks}")
        return cls(look, looks, alpha_total / looks, SEQUENTIAL_RULE, alpha_total)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "look": self.look,
            "looks": self.looks,
            "alpha_one_sided": self.alpha,
            "alpha_total": self.alpha_total,
        }

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> Look:
        return cls(
            int(block["look"]),
            int(block["looks"]),
            float(block["alpha_one_sided"]),
            str(block.get("rule", SEQUENTIAL_RULE)),
            float(block.get("alpha_total", ALPHA)),
        )


@dataclass(frozen=True)
class Decision:
    """A cell's verdict against a tolerance on one metric: the point change, its 95 % interval (None: none),
    the verdict, and for an undecided cell the tokens that would decide it at the observed variance. A verdict
    of one of ``--resolve``'s looks (``sequential``) was decided on that look's wider interval (:class:`Look`):
    the rule, the look, the one-sided alpha it spent, the critical t and that interval."""

    metric: str
    value: float | None
    low: float | None
    high: float | None
    verdict: str
    tokens_to_decide: int | None = None
    reason: str | None = None  # why undecided without an interval
    sequential: Mapping[str, Any] | None = None  # qbench.eval.tolerance.Sequential

    @property
    def within(self) -> bool:
        return self.verdict == WITHIN

    def to_dict(self) -> dict[str, Any]:
        """The decision as a row holds it (a --resolve look's ``sequential`` goes to the row's steps instead:
        ``qbench.studies.resolve``)."""
        return {
            "metric": self.metric,
            "value": self.value,
            "ci95": None if self.low is None else [self.low, self.high],
            "verdict": self.verdict,
            "tokens_to_decide": self.tokens_to_decide,
            "reason": self.reason,
        }


def _look_of(record: Mapping[str, Any], look: Look | None) -> Look | None:
    if look is not None:
        return look
    block = record.get("sequential")
    return Look.from_dict(block) if block else None


def decide(
    record: Mapping[str, Any], tolerance: float, metric: str = DEFAULT_METRIC, look: Look | None = None
) -> Decision:
    """The verdict of a quantised record's ``metric`` against ``tolerance`` (in the metric's unit, see
    :data:`METRICS`): *within* / *beyond* / *undecided* from its 95 % interval (module docstring) — or, at one of
    ``--resolve``'s looks (``look``, or the record's ``sequential`` block), from that look's wider interval at
    one-sided ``look.alpha``. A failed cell (NaN, unsupported) is *beyond*; a record without an interval (older
    evidence, one window) is *undecided*."""
    check_metric(metric)
    look = _look_of(record, look)
    m = record.get("metrics") or {}
    if record.get("status", "ok") != "ok":
        return Decision(metric, None, None, None, BEYOND, reason=str(record.get("status")))
    value, ci = deciding_interval(m, metric)  # top1: the share of tokens whose top token changed, in percent
    if value is None or not math.isfinite(value):
        return Decision(metric, None, None, None, BEYOND, reason="not finite")
    if ci is None:
        why = (
            "no interval: one window"
            if m.get("interval")
            else "no interval: the record has no per-token evidence"
        )
        return Decision(metric, value, None, None, UNDECIDED, reason=why)
    low, high = ci
    sequential = None
    if look is not None:
        df = _df(record)
        if df is None:
            return Decision(metric, value, low, high, UNDECIDED, reason="no windows: no look's interval")
        decide_low, decide_high, critical = widened(metric, ci, df, look.alpha)
        sequential = {
            **look.to_dict(),
            "df": df,
            "critical_t": critical,
            "interval": [decide_low, decide_high],
        }
    else:
        decide_low, decide_high = low, high
    # the slack of sweep.within_tolerance: (ppl / fp − 1) · 100 makes an exact +1 % 1.0000000000000009
    slack = TOLERANCE_REL_EPS * max(abs(tolerance), 1.0)
    if decide_high <= tolerance + slack:
        return Decision(metric, value, low, high, WITHIN, sequential=sequential)
    if decide_low > tolerance + slack:
        return Decision(metric, value, low, high, BEYOND, sequential=sequential)
    quantile = (1 + LEVEL) / 2 if look is None else 1 - look.alpha
    return Decision(
        metric,
        value,
        low,
        high,
        UNDECIDED,
        tokens_to_decide=_tokens_to_decide(record, metric, tolerance, quantile),
        sequential=sequential,
    )


def _df(record: Mapping[str, Any]) -> int | None:
    """The degrees of freedom of a record's interval: windows − 1 (None without two windows)."""
    interval = (record.get("metrics") or {}).get("interval") or {}
    df = interval.get("df")
    if df is None and interval.get("windows"):
        df = int(interval["windows"]) - 1
    return int(df) if df and df >= 1 else None


# Each metric's interval is symmetric on its own scale: the perplexity change's in ln(ppl ratio) (the mean of the
# per-window NLL differences), KLD and the top-1 share as they are.
_SCALES = {
    "ppl": (lambda pct: math.log1p(pct / 100), lambda x: _pct(x)),
    "kld": (lambda x: x, lambda x: x),
    "top1": (lambda x: x, lambda x: x),
}


def widened(metric: str, ci95: list[float], df: int, alpha: float) -> tuple[float, float, float]:
    """(low, high, t) of the interval mean ± t(1 − ``alpha``, df) · sd/√n, from the record's 95 % interval
    ``ci95`` (in the metric's unit as :func:`decide` reads it) with the same mean and sd/√n: its half-width times
    t(1 − alpha, df) / t(0.975, df), on the scale where it is symmetric."""
    to, back = _SCALES[metric]
    lo, hi = to(ci95[0]), to(ci95[1])
    centre, half = (lo + hi) / 2, (hi - lo) / 2
    critical = t_quantile(1 - alpha, df)
    half *= critical / t_quantile((1 + LEVEL) / 2, df)
    return back(centre - half), back(centre + half), critical


def _tokens_to_decide(
    record: Mapping[str, Any], metric: str, tolerance: float, quantile: float = (1 + LEVEL) / 2
) -> int | None:
    """Tokens that decide this cell :data:`DECIDE_POWER` of the time, were its mean and per-window spread the
    observed ones: the fewest windows m (more than it has; documents at its windows per document, when its interval
    clusters by document) whose interval mean ± t·sd/√m, its centre spread by sd/√m, leaves ``tolerance`` with that probability — (t_{m−1} + z_power)·sd/√m ≤ |mean − tolerance| — times
    the window; t at ``quantile`` (0.975; at one of --resolve's looks, 1 − that look's alpha). (With
    t·sd/√m = |mean − tolerance| the interval's centre lands on either side of its reach: half the time.)"""
    m = record.get("metrics") or {}
    protocol = record.get("protocol") or {}
    interval = m.get("interval") or {}
    windows, per_window = interval.get("windows"), protocol.get("window")
    if not windows or not per_window:
        return None
    # the unit the interval counts: documents (clusters of windows) when it has them, else windows
    groups = int(interval.get("clusters") or windows)
    per_group = windows / groups
    if metric == "ppl":
        ci, mean, goal = m["ppl_change_ci95"], m.get("ln_ppl_ratio"), math.log1p(tolerance / 100)
        low, high = math.log1p(ci[0] / 100), math.log1p(ci[1] / 100)
    elif metric == "kld":
        (low, high), mean, goal = m["kld_mean_ci95"], m.get("kld_mean"), tolerance
    else:
        ci, goal = m["top1_agreement_ci95"], tolerance / 100
        mean, low, high = 1 - m["top1_agreement"], 1 - ci[1], 1 - ci[0]
    if mean is None or groups < 2:
        return None
    distance = abs(mean - goal)
    if distance == 0:
        return None  # exactly on the line: no number of tokens decides it
    half = (high - low) / 2
    sd = half * math.sqrt(groups) / t_quantile((1 + LEVEL) / 2, groups - 1)
    if not math.isfinite(sd):
        return None
    z = _normal_quantile(DECIDE_POWER)

    def enough(m: int) -> bool:  # t falls with m: a monotone test, so a bisection finds the fewest
        return (t_quantile(quantile, m - 1) + z) * sd / math.sqrt(m) <= distance

    lo, hi = groups, groups + 1  # lo is not enough (it is undecided now), hi is searched for
    while not enough(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return math.ceil(hi * per_group) * int(per_window)


def check_tolerance(tolerance: float, metric: str) -> float:
    if not math.isfinite(tolerance) or tolerance < 0 or (metric == "top1" and tolerance > 100):
        name, unit = METRICS[metric][0], METRICS[metric][1]
        valid = "a share from 0 to 100" if metric == "top1" else "a finite number ≥ 0"
        raise UserError(
            f"--tolerance {tolerance:g} is out of range for --metric {metric} ({name}, in {unit}); give {valid}"
        )
    return tolerance


def row_fields(record: Mapping[str, Any], tolerance: float, metric: str = DEFAULT_METRIC) -> dict[str, Any]:
    """What a table row (sweep, card, compare) shows of a quantised record beside its change: the verdict and
    interval of ``metric``, the perplexity interval, KL divergence and top-1 agreement."""
    m = record.get("metrics") or {}
    d = decide(record, tolerance, metric)
    return {
        "verdict": d.verdict,
        "within_tolerance": d.within,
        "decision": d.to_dict(),
        "ppl_change_ci95": m.get("ppl_change_ci95"),
        "kld_mean": m.get("kld_mean"),
        "kld_p99": m.get("kld_p99"),
        "top1_agreement": m.get("top1_agreement"),
        "tokens_to_decide": d.tokens_to_decide,
    }


def format_interval(
    change: float | None,
    ci: list[float] | None,
    verdict: str | None = None,
    metric: str = DEFAULT_METRIC,
    tolerance: float | None = None,
) -> str:
    """``+0.97 ±0.56 ?``: a change in percent (on ``metric`` kld: ``0.0123 ±0.0022 nats``; top1: ``1.23 ±0.43 %``,
    the share of tokens whose top-1 token changed) with the half-width of its 95 % interval and the verdict's mark
    (``?`` undecided, ``✗`` beyond, nothing within); ``(no interval)`` when the record has none."""
    if change is None or not math.isfinite(change):
        return "NaN"
    text = interval_text(change, ci, metric, tolerance, style="pm")
    if verdict == UNDECIDED:
        text += " ?"
    elif verdict == BEYOND:
        text += " ✗"
    return text
