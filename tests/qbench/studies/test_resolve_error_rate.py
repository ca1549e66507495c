"""``--resolve``'s error rate over all its looks: a cell whose true change sits exactly at the tolerance is called
*within* at most 2.5 % of the time (``qbench.studies.resolve``, docs/metrics.md "Verdicts").

The simulation draws per-window differences d_i (mean NLL_Q − mean NLL_P of window i) with true mean exactly
ln(1 + tolerance) and runs :func:`~qbench.studies.resolve.resolve` itself: the first look scores the first n
windows, each later look the first 2n, 4n, … (a larger token budget cuts the same stream from its start, so it
holds the earlier windows: ``trainers.batches.validation_windows``), each record's interval is the evidence's own
cluster interval. With the same 95 % test at every look (the rule before) the rate is well above 2.5 %; this
test fails for that rule (:func:`test_the_same_level_at_every_look_calls_it_within_too_often`)."""

from __future__ import annotations

import math

import pytest
import torch

from qbench.eval import evidence
from qbench.eval.evidence import ALPHA, LEVEL, WITHIN, Look, cluster_interval, decide, widened
from qbench.studies.resolve import planned_looks, resolve, rule_text

WINDOW = 32  # tokens per window: only the token counts resolve passes around depend on it
FIRST = 8  # windows at the first look
TOLERANCE = 1.0  # percent


def _record(d: torch.Tensor) -> dict:
    """A quantised record of per-window differences ``d`` as ``evidence.paired_metrics`` makes it: the change is
    exp(mean d) − 1 (all windows of one length), its 95 % interval the cluster interval over windows."""
    n = d.numel()
    mean, low, high, _ = cluster_interval(d)
    return {
        "status": "ok",
        "protocol": {"tokens_scored": n * WINDOW, "window": WINDOW},
        "metrics": {
            "ppl_change_pct": 100 * math.expm1(mean),
            "ppl_change_ci95": [100 * math.expm1(low), 100 * math.expm1(high)],
            "ln_ppl_ratio": mean,
            "interval": {"windows": n, "df": n - 1},
        },
    }


def _within_rate(factor: int, reps: int, seed: int) -> float:
    """The share of ``reps`` simulated cells at the tolerance that ``--resolve`` with a cap of ``factor`` × the
    first budget ends up calling *within*."""
    gen = torch.Generator().manual_seed(seed)
    at_tolerance = math.log1p(TOLERANCE / 100)
    draws = at_tolerance + 0.02 * torch.randn(reps, FIRST * factor, generator=gen, dtype=torch.float64)
    tokens = FIRST * WINDOW
    within = 0
    for d in draws:
        final, _ = resolve(
            _record(d[:FIRST]), lambda t, d=d: _record(d[: t // WINDOW]), tokens, factor * tokens, TOLERANCE
        )
        within += decide(final, TOLERANCE).verdict == WITHIN
    return within / reps


def _slack(reps: int) -> float:
    """Three binomial standard errors at the nominal rate."""
    return 3 * math.sqrt(ALPHA * (1 - ALPHA) / reps)


@pytest.fixture
def fast(monkeypatch):
    """The tokens an undecided cell would need (a search, irrelevant to the verdict) left out: the simulation's
    cells sit on the tolerance, where that search is longest."""
    monkeypatch.setattr(evidence, "_tokens_to_decide", lambda *args, **kwargs: None)


@pytest.fixture
def same_level(monkeypatch):
    """The rule before: every look tested at the one-sided 2.5 % (the 95 % interval) again."""
    monkeypatch.setattr(
        Look,
        "planned",
        classmethod(lambda cls, look, looks, alpha_total=ALPHA: cls(look, looks, alpha_total)),
    )


# 20,000 cells per cap, seed 0: 4× 2.24 % (the same level at each look: 5.99 %), 16× 2.16 % (8.66 %)
@pytest.mark.parametrize(("factor", "reps"), [(4, 10000), (16, 5000)])
def test_a_cell_at_the_tolerance_is_called_within_at_most_at_the_nominal_rate(fast, factor, reps):
    rate = _within_rate(factor, reps, seed=1)
    assert rate <= ALPHA + _slack(reps), f"{factor}× cap: called within {rate:.2%} of the time"


@pytest.mark.parametrize(("factor", "reps"), [(4, 10000), (16, 5000)])
def test_the_same_level_at_every_look_calls_it_within_too_often(fast, same_level, factor, reps):
    """The assertion above fails for the rule before: the simulation tells the two apart."""
    rate = _within_rate(factor, reps, seed=1)
    assert rate > ALPHA + _slack(reps), f"{factor}× cap: called within {rate:.2%} of the time"


def test_the_looks_are_planned_before_the_first():
    assert planned_looks(4096, 16384) == [4096, 8192, 16384]
    assert planned_looks(128, 300) == [128, 256, 300]  # the last look at the cap itself
    assert planned_looks(4096, 4096 * 16) == [4096 * 2**k for k in range(5)]
    assert planned_looks(4096, 4096) == [4096]  # nothing to resolve: the plain decision
    assert Look.planned(2, 3).alpha == pytest.approx(ALPHA / 3)
    with pytest.raises(ValueError):
        Look.planned(4, 3)


def test_each_look_decides_on_its_own_wider_interval():
    d = torch.tensor([0.004, 0.012, 0.009, 0.015, 0.006, 0.011, 0.010, 0.013], dtype=torch.float64)
    record = _record(d)
    ci = record["metrics"]["ppl_change_ci95"]
    low, high, t = widened("ppl", ci, 7, ALPHA)  # the nominal level gives the 95 % interval back
    assert (low, high) == pytest.approx(ci, rel=1e-12) and t == pytest.approx(evidence.t_quantile(0.975, 7))
    low3, high3, t3 = widened("ppl", ci, 7, ALPHA / 3)
    assert low3 < ci[0] and high3 > ci[1] and t3 == pytest.approx(evidence.t_quantile(1 - ALPHA / 3, 7))
    plain = decide(record, 2.0)
    assert plain.verdict == WITHIN and "sequential" not in plain.to_dict()  # without a look: as it always was
    tolerance = (ci[1] + high3) / 2  # within at 95 %, not at look 1 of 3
    looked = decide(record, tolerance, look=Look.planned(1, 3))
    assert decide(record, tolerance).verdict == WITHIN and looked.verdict == "undecided"
    assert "sequential" not in looked.to_dict()  # the row's decision keeps its shape: the steps say the look
    block = looked.sequential
    assert block["rule"] == "bonferroni" and block["look"] == 1 and block["looks"] == 3
    assert block["alpha_one_sided"] == pytest.approx(ALPHA / 3) and block["interval"] == [low3, high3]
    assert decide({**record, "sequential": Look.planned(1, 3).to_dict()}, tolerance).verdict == "undecided"
    ratio = evidence.t_quantile(1 - ALPHA / 2, 9) / evidence.t_quantile(0.5 + LEVEL / 2, 9)
    for metric in ("kld", "top1"):  # symmetric as they are: widened about their centre
        assert widened(metric, [0.1, 0.3], 9, ALPHA / 2)[:2] == pytest.approx(
            [0.2 - 0.1 * ratio, 0.2 + 0.1 * ratio]
        )


def test_a_resolved_cell_says_its_rule_and_the_alpha_of_each_look():
    d = torch.tensor([0.004, 0.012, 0.009, 0.015, 0.006, 0.011, 0.010, 0.013] * 4, dtype=torch.float64)
    d = d + 0.003 * torch.arange(32, dtype=torch.float64).sin()
    first = _record(d[:8])
    tolerance = first["metrics"]["ppl_change_pct"] + 0.05  # near the point: undecided at the first look
    final, steps = resolve(first, lambda t: _record(d[: t // WINDOW]), 8 * WINDOW, 32 * WINDOW, tolerance)
    looks = [s["sequential"] for s in steps]
    assert len(steps) >= 2 and [s["look"] for s in looks] == list(range(1, len(steps) + 1))
    assert all(s["rule"] == "bonferroni" and s["looks"] == 3 for s in looks)
    assert all(s["alpha_one_sided"] == pytest.approx(ALPHA / 3) for s in looks)
    assert [s["interval"][0] < s2["ci95"][0] for s, s2 in zip(looks, steps, strict=True)] == [True] * len(
        steps
    )
    assert final["sequential"]["look"] == len(steps) and "sequential" not in first  # a copy: the record stays
    decision = decide(final, tolerance)
    assert decision.verdict == steps[-1]["verdict"] and decision.sequential["look"] == len(steps)
    assert rule_text(steps).startswith("each look at a one-sided α of 0.025/3 = 0.0083 (Bonferroni")
    assert rule_text([{"tokens_scored": 64, "verdict": "undecided"}]) == ""  # steps from before the rule
