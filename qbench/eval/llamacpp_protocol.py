"""llama.cpp's perplexity protocol and its ``--kl-divergence`` statistics, reproduced on qbench's evidence.

Both read from ``tools/perplexity/perplexity.cpp`` in ggml-org/llama.cpp (the names below are its functions and
variables; docs/metrics.md maps each printed statistic onto them).

**The protocol** (``--protocol llama.cpp``; function ``perplexity``): the tokenised text is cut into consecutive,
non-overlapping chunks of ``n_ctx`` tokens (``--window``, default :data:`LLAMA_CPP_WINDOW` = 512, its ``-c``),
``n_chunk = tokens.size() / n_ctx`` of them (``--tokens`` / window here, its ``--chunks``); when the vocabulary
adds BOS, BOS *replaces* each chunk's first token (``tokens[seq_start] = llama_vocab_bos(vocab)``), otherwise the
chunk is fed as it is (``--no-bos``); every chunk is a fresh sequence (``llama_memory_clear``), and only the
logits of positions ``first = n_ctx/2`` … ``n_ctx − 2`` are scored, position j predicting the chunk's token
j + 1 — ``n_ctx − 1 − first`` tokens per chunk (255 of 512), the last position's logits unused
(``process_logits(…, tokens_data, n_ctx - 1 - first, …)``). qbench's own protocol scores every position of its
windows (``qbench.eval.metrics``). In qbench's terms (:func:`llama_cpp_windows`): the model's inputs are the
chunks with BOS in front, ``Windows.first = n_ctx/2`` and the targets the tokens those positions predict; the
stream is qbench's (each document preceded by ``<|endoftext|>``, qbench's BOS), where llama.cpp tokenises the raw
file with one BOS in front of all of it — the same chunks whenever the two token streams are the same.

**The KL-divergence printout** (function ``kl_divergence``, its accumulator ``kl_divergence_result`` and the
per-token ``log_softmax(n_vocab, logits, base_log_prob, tok, kld)``): :func:`kld_statistics` computes every
statistic ``llama-perplexity --kl-divergence`` prints at its end from per-token evidence — the quantised and the
float model's NLL of each scored token, the KL divergence and whether the two top tokens agree, which every qbench
cell stores (``qbench.eval.evidence``) — with llama.cpp's own arithmetic: float32 per-token values and products,
float64 sums, ``mean_and_uncertainty`` and ``covariance`` as there, its float32 ``percentile`` and median.
:func:`render_kld_printout` prints them in its layout, label for label. Two inputs differ from llama.cpp's,
deliberately: qbench's KL divergence is exact over the full vocabulary (``qbench.eval.metrics.token_comparison``;
llama.cpp reads the base model back from 16-bit log-probabilities and drops the terms with ln P(v) ≤ −16), and the
base NLL and top token come from the float model's own logits (llama.cpp's from those 16-bit values).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from models.errors import UserError, unknown_choice

if TYPE_CHECKING:  # numpy and torch are imported where used: the command line's parser imports this module
    import numpy as np
    from torch import Tensor


QBENCH = "qbench"
LLAMA_CPP = "llama.cpp"
PROTOCOLS = (QBENCH, LLAMA_CPP)
LLAMA_CPP_WINDOW = 512  # llama-perplexity's default context (params.n_ctx = 512 in its main)
# llama.cpp prints the statistics block only from this many scored tokens on (``if (kld.count < 100) return;``)
LLAMA_CPP_MIN_TOKENS = 100


def check_protocol(name: str) -> str:
    """``name`` when it is a protocol qbench knows, else a one-line error with a suggestion."""
    if name not in PROTOCOLS:
        raise unknown_choice("protocol", name, PROTOCOLS)
    return name


def protocol_name(protocol: Mapping[str, Any] | None) -> str:
    """The protocol a record's ``protocol`` block was scored under: its ``protocol`` key, "qbench" without one
    (every record of the default protocol, and every record written before the option existed)."""
    return str((protocol or {}).get("protocol") or QBENCH)


def scored_span(window: int) -> tuple[int, int]:
    """(first scored position, scored positions per chunk) of a ``window``-token chunk: (n_ctx/2, n_ctx − 1 − n_ctx/2)."""
    first = window // 2
    return first, window - 1 - first


def llama_cpp_windows(
    stream: Any, window: int, bos_id: int | None, tokens: int, split: str | None = None, corpus: str = "text"
) -> tuple[Tensor, Tensor, int]:
    """(inputs, targets, first) of llama-perplexity's chunks of ``stream``: ``min(tokens, len(stream)) // window``
    consecutive chunks (at least one), each of ``window`` stream tokens with its first token replaced by
    ``bos_id`` (None: kept), and the tokens positions ``first`` … ``window − 2`` predict (``targets[:, k]`` is
    the chunk's token ``first + 1 + k``)."""
    import numpy as np
    import torch

    first, per_chunk = scored_span(window)
    if per_chunk < 1:
        raise UserError(
            f"--window must be at least 3 under --protocol llama.cpp (it scores positions window/2 … window − 2), "
            f"got {window}"
        )
    if len(stream) < window:
        raise UserError(
            f"the {split} split of {corpus!r} has {len(stream)} tokens, fewer than one chunk of {window}; use a "
            "larger corpus or a smaller --window"
        )
    n = max(1, min(tokens // window, len(stream) // window))
    chunks = torch.from_numpy(np.asarray(stream[: n * window], dtype=np.int64).reshape(n, window))
    ids = chunks.clone()
    if bos_id is not None:
        ids[:, 0] = bos_id
    return ids, chunks[:, first + 1 :].contiguous(), first


def llama_cpp_record(window: int, first: int, scored: int) -> dict[str, Any]:
    """What a record's ``protocol`` adds (and replaces) under the llama.cpp protocol: chunks of ``window`` tokens,
    ``scored`` positions from ``first`` on (``metrics.Windows``' fields)."""
    last = first + scored - 1
    return {
        "stride": window,  # chunks are consecutive: BOS replaces a token, it adds none
        "scored_positions": [first, last],
        "perplexity": "token-level, exp(mean NLL) over positions window/2 … window − 2 of consecutive chunks, "
        "BOS replacing each chunk's first token (llama.cpp's llama-perplexity)",
    }


# ----------------------------------------------------------------------------------- the --kl-divergence block


@dataclass(frozen=True)
class KLDivergenceStats:
    """Every statistic of ``llama-perplexity --kl-divergence``'s final block; fractions as fractions (0–1), the
    printout shows the Δp and "same top" ones in percent as llama.cpp does."""

    tokens: int
    # ====== Perplexity statistics ======
    ppl_q: float
    ppl_q_se: float
    ppl_base: float
    ppl_base_se: float
    ln_ppl_correlation: float  # Cor(ln(PPL(Q)), ln(PPL(base))); NaN when an uncertainty is 0 (≤ 10 tokens)
    ln_ppl_ratio: float
    ln_ppl_ratio_se: float
    ppl_ratio: float
    ppl_ratio_se: float
    ppl_diff: float
    ppl_diff_se: float
    # ====== KL divergence statistics ======
    kld_mean: float
    kld_mean_se: float
    kld_max: float
    kld_p99_9: float
    kld_p99: float
    kld_p95: float
    kld_p90: float
    kld_median: float
    kld_p10: float
    kld_p5: float
    kld_p1: float
    kld_p0_1: float
    kld_min: float
    # ====== Token probability statistics ======
    delta_p_mean: float
    delta_p_mean_se: float
    delta_p_max: float
    delta_p_p99_9: float
    delta_p_p99: float
    delta_p_p95: float
    delta_p_p90: float
    delta_p_p75: float
    delta_p_median: float
    delta_p_p25: float
    delta_p_p10: float
    delta_p_p5: float
    delta_p_p1: float
    delta_p_p0_1: float
    delta_p_min: float
    delta_p_rms: float
    delta_p_rms_se: float
    same_top: float
    same_top_se: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# fraction → field suffix, in llama.cpp's printing order
KLD_PERCENTILES = ((0.999, "p99_9"), (0.99, "p99"), (0.95, "p95"), (0.90, "p90"))
KLD_LOWER = ((0.10, "p10"), (0.05, "p5"), (0.01, "p1"), (0.001, "p0_1"))
DELTA_P_UPPER = (*KLD_PERCENTILES, (0.75, "p75"))
DELTA_P_LOWER = ((0.25, "p25"), *KLD_LOWER)


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """perplexity.cpp's ``mean_and_uncertainty``: (sum/n, sqrt((sum2/n − mean²)/(n − 1))), the latter 0 unless
    positive with n > 10."""
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def covariance(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    """perplexity.cpp's ``covariance`` of two means: (E[ab] − E[a]E[b])/(n − 1), 0 for n < 10."""
    if count < 10:
        return 0.0
    return (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


def percentile(values: np.ndarray, fraction: float) -> float:
    """perplexity.cpp's ``percentile`` of ascending float32 ``values``, in its float32 arithmetic: linear
    interpolation at fraction · (n − 1)."""
    import numpy as np

    f = np.float32(fraction)
    if f <= 0:
        return float(values[0])
    if f >= 1:
        return float(values[-1])
    p = np.float32(f * np.float32(values.size - 1))
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, values.size - 1)])


def median(values: np.ndarray) -> float:
    """perplexity.cpp's median of ascending float32 ``values``: the middle one, or 0.5f × the two middle ones."""
    import numpy as np

    n = values.size
    if n % 2 == 0:
        return float(np.float32(0.5) * (values[n // 2] + values[n // 2 - 1]))
    return float(values[n // 2])


def _flat(x: Any, dtype: Any) -> np.ndarray:
    import numpy as np

    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False).ravel()


def kld_statistics(nll_q: Any, nll_base: Any, kld: Any, same_top: Any) -> KLDivergenceStats:
    """The ``--kl-divergence`` statistics of per-token evidence on the same scored tokens: ``nll_q`` and
    ``nll_base`` the quantised and the float (base) model's negative log-probability of each token (−logprob),
    ``kld`` KL(P_base ‖ Q) at each position, ``same_top`` whether both models' most likely token agree there
    (any shapes with the same number of elements: windows × positions as qbench stores them, or flat).

    llama.cpp's arithmetic: NLL, their products, p = expf(−nll) and Δp = p_Q − p_base in float32 per token, the
    sums in float64 (``kl_divergence_result``), then ``mean_and_uncertainty``, ``covariance``, the float32
    ``percentile`` and median of the sorted float32 KLD and Δp values — given the same per-token values, llama.cpp's
    arithmetic step for step (summation order aside)."""
    import numpy as np

    q, b = _flat(nll_q, np.float32), _flat(nll_base, np.float32)
    k, same = _flat(kld, np.float64), _flat(same_top, bool)
    n = q.size
    if not n or not (b.size == k.size == same.size == n):
        raise ValueError(
            f"per-token evidence of {q.size}, {b.size}, {k.size} and {same.size} tokens: need the same n ≥ 1"
        )
    f64 = np.float64
    sum_nll, sum_nll2 = q.sum(dtype=f64), (q * q).sum(dtype=f64)  # `nll*nll`: a float product
    sum_base, sum_base2 = b.sum(dtype=f64), (b * b).sum(dtype=f64)
    sum_nll_base = (q * b).sum(dtype=f64)
    p_diff = np.exp(-q) - np.exp(-b)  # float32: expf(-nll) - expf(-nll_base)
    p_diff2 = (p_diff * p_diff).astype(f64)  # `const double p_diff2 = p_diff*p_diff`: a float product

    ln_q, ln_q_se = mean_and_uncertainty(float(sum_nll), float(sum_nll2), n)
    ln_b, ln_b_se = mean_and_uncertainty(float(sum_base), float(sum_base2), n)
    ppl_q, ppl_b = math.exp(ln_q), math.exp(ln_b)
    ppl_q_se, ppl_b_se = ppl_q * ln_q_se, ppl_b * ln_b_se
    cov = covariance(float(sum_nll), float(sum_base), float(sum_nll_base), n)
    cor = cov / (ln_q_se * ln_b_se) if ln_q_se * ln_b_se > 0 else float("nan")
    ln_ratio = ln_q - ln_b
    ln_ratio_se = math.sqrt(max(ln_q_se**2 + ln_b_se**2 - 2.0 * cov, 0.0))
    ratio = math.exp(ln_ratio)
    ppl_cov = ppl_q * ppl_b * cov
    diff_se = math.sqrt(max(ppl_q_se**2 + ppl_b_se**2 - 2.0 * ppl_cov, 0.0))

    kld_mean, kld_se = mean_and_uncertainty(float(k.sum()), float((k * k).sum()), n)
    kld_sorted = np.sort(k.astype(np.float32))  # kld_values: float
    dp_sorted = np.sort(p_diff.astype(np.float32))
    dp_mean, dp_se = mean_and_uncertainty(float(p_diff.sum(dtype=f64)), float(p_diff2.sum()), n)
    mse, mse_se = mean_and_uncertainty(float(p_diff2.sum()), float((p_diff2 * p_diff2).sum()), n)
    rms = math.sqrt(mse)
    top = float(same.sum()) / n

    fields: dict[str, Any] = {
        "tokens": n,
        "ppl_q": ppl_q,
        "ppl_q_se": ppl_q_se,
        "ppl_base": ppl_b,
        "ppl_base_se": ppl_b_se,
        "ln_ppl_correlation": cor,
        "ln_ppl_ratio": ln_ratio,
        "ln_ppl_ratio_se": ln_ratio_se,
        "ppl_ratio": ratio,
        "ppl_ratio_se": ratio * ln_ratio_se,
        "ppl_diff": ppl_q - ppl_b,
        "ppl_diff_se": diff_se,
        "kld_mean": kld_mean,
        "kld_mean_se": kld_se,
        "kld_max": float(kld_sorted[-1]),
        "kld_median": median(kld_sorted),
        "kld_min": float(kld_sorted[0]),
        "delta_p_mean": dp_mean,
        "delta_p_mean_se": dp_se,
        "delta_p_max": float(dp_sorted[-1]),
        "delta_p_median": median(dp_sorted),
        "delta_p_min": float(dp_sorted[0]),
        "delta_p_rms": rms,
        "delta_p_rms_se": 0.5 / rms * mse_se if rms > 0 else 0.0,
        "same_top": top,
        "same_top_se": math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0,
    }
    for fraction, name in (*KLD_PERCENTILES, *KLD_LOWER):
        fields[f"kld_{name}"] = percentile(kld_sorted, fraction)
    for fraction, name in (*DELTA_P_UPPER, *DELTA_P_LOWER):
        fields[f"delta_p_{name}"] = percentile(dp_sorted, fraction)
    return KLDivergenceStats(**fields)


def stats_from_evidence(cell: Mapping[str, Tensor], fp: Mapping[str, Tensor]) -> KLDivergenceStats:
    """:func:`kld_statistics` of a quantised cell's per-token evidence (``nll``, ``kld``, ``top1``) against its
    float record's (``nll``), as ``qbench.eval.evidence.read`` returns them."""
    if "kld" not in cell or "top1" not in cell:
        raise ValueError("the cell's evidence has no kld/top1: it is not a quantised cell's")
    if tuple(cell["nll"].shape) != tuple(fp["nll"].shape):
        raise ValueError(
            f"the cell scored {tuple(cell['nll'].shape)} tokens and the float record {tuple(fp['nll'].shape)}: "
            "not the same protocol"
        )
    return kld_statistics(cell["nll"], fp["nll"], cell["kld"], cell["top1"])


def _pm(value: float, se: float) -> str:
    return f"{value:10.6f} ± {se:10.6f}"  # printf's "%10.6lf ± %10.6lf"


# the percentile labels as llama.cpp prints them ("%%" of its printf formats is "%")
_LABEL = {"p99_9": "99.9%", "p99": "99.0%", "p95": "95.0%", "p90": "90.0%", "p75": "75.0%", "p25": "25.0%"}
_LABEL |= {"p10": "10.0%", "p5": " 5.0%", "p1": " 1.0%", "p0_1": " 0.1%"}


def render_kld_printout(stats: KLDivergenceStats) -> str:
    """``stats`` in the layout and with the labels ``llama-perplexity --kl-divergence`` prints its final block
    (``kl_divergence`` in perplexity.cpp; its printf formats, %10.6lf as ``10.6f``). llama.cpp prints nothing
    under 100 tokens; here a note says so above the block."""
    s = stats

    def kld(name: str) -> str:
        return f"{_LABEL[name]}   KLD: {getattr(s, f'kld_{name}'):10.6f}"

    def dp(name: str) -> str:
        return f"{_LABEL[name]}   Δp: {100.0 * getattr(s, f'delta_p_{name}'):6.3f}%"

    lines = []
    if s.tokens < LLAMA_CPP_MIN_TOKENS:
        lines.append(
            f"(only {s.tokens} tokens: llama.cpp prints these statistics from {LLAMA_CPP_MIN_TOKENS} tokens on)"
        )
    lines += [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {_pm(s.ppl_q, s.ppl_q_se)}",
        f"Mean PPL(base)                : {_pm(s.ppl_base, s.ppl_base_se)}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100.0 * s.ln_ppl_correlation:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {_pm(s.ln_ppl_ratio, s.ln_ppl_ratio_se)}",
        f"Mean PPL(Q)/PPL(base)         : {_pm(s.ppl_ratio, s.ppl_ratio_se)}",
        f"Mean PPL(Q)-PPL(base)         : {_pm(s.ppl_diff, s.ppl_diff_se)}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {_pm(s.kld_mean, s.kld_mean_se)}",
        f"Maximum KLD: {s.kld_max:10.6f}",
        *(kld(name) for _, name in KLD_PERCENTILES),
        f"Median  KLD: {s.kld_median:10.6f}",
        *(kld(name) for _, name in KLD_LOWER),
        f"Minimum KLD: {s.kld_min:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100.0 * s.delta_p_mean:6.3f} ± {100.0 * s.delta_p_mean_se:5.3f} %",
        f"Maximum Δp: {100.0 * s.delta_p_max:6.3f}%",
        *(dp(name) for _, name in DELTA_P_UPPER),
        f"Median  Δp: {100.0 * s.delta_p_median:6.3f}%",
        *(dp(name) for _, name in DELTA_P_LOWER),
        f"Minimum Δp: {100.0 * s.delta_p_min:6.3f}%",
        f"RMS Δp    : {100.0 * s.delta_p_rms:6.3f} ± {100.0 * s.delta_p_rms_se:5.3f} %",
        f"Same top p: {100.0 * s.same_top:6.3f} ± {100.0 * s.same_top_se:5.3f} %",
    ]
    return "\n".join(lines)


def describe(record: Mapping[str, Any]) -> str:
    """One line naming a cell and what its statistics are over: model, scheme/mode, protocol, window, tokens."""
    protocol = record.get("protocol") or {}
    name = protocol_name(protocol)
    scored = (
        "positions window/2 … window − 2 of each chunk"
        if name == LLAMA_CPP
        else "every position of each window (llama.cpp scores the second half of each chunk: --protocol llama.cpp)"
    )
    return (
        f"{record['model']['name']} {record['scheme']['name']}/{record['mode']} — protocol {name}, window "
        f"{protocol.get('window')}, {protocol.get('windows')} windows, {protocol.get('tokens_scored')} tokens "
        f"scored ({scored})"
    )
