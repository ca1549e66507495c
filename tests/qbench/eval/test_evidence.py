"""Per-token evidence, llama.cpp's distribution metrics, cluster intervals and three-way verdicts
(``qbench.eval.evidence``), each checked against its formula written out independently (numpy), a table, or a
simulation with a known truth."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qbench.eval import evidence
from qbench.eval.evidence import BEYOND, UNDECIDED, WITHIN, decide


# Student's t 0.975 quantiles from a printed table (Abramowitz & Stegun, table 26.10).
@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (7, 2.365), (10, 2.228), (30, 2.042)],
)
def test_t_quantile_matches_the_printed_table(df, expected):
    assert evidence.t_quantile(0.975, df) == pytest.approx(expected, abs=6e-4)


def test_t_quantile_against_scipy_when_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 6, 11, 64, 999, 5000):
        for p in (0.9, 0.975, 0.995):
            assert evidence.t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-6)


def test_t_quantile_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="df"):
        evidence.t_quantile(0.975, 0)
    with pytest.raises(ValueError, match="p="):
        evidence.t_quantile(0.4, 3)


def test_llama_cpp_mean_uncertainty_and_percentiles():
    rng = np.random.default_rng(0)
    x = rng.exponential(0.01, size=1001)
    mean, se = evidence.mean_and_uncertainty(torch.tensor(x))
    assert mean == pytest.approx(x.mean())
    assert se == pytest.approx(math.sqrt((np.mean(x * x) - x.mean() ** 2) / (len(x) - 1)))
    ordered = torch.tensor(np.sort(x))
    for f in (0.5, 0.9, 0.99, 0.999):  # llama.cpp's interpolation is numpy's 'linear' percentile
        assert evidence.percentile(ordered, f) == pytest.approx(np.percentile(x, 100 * f))
    assert evidence.mean_and_uncertainty(torch.ones(5))[1] == 0.0  # ≤ 10 values: no uncertainty, as there


def test_distribution_metrics_follow_their_definitions():
    rng = np.random.default_rng(1)
    kld = rng.gamma(0.5, 0.02, size=(6, 50))
    top1 = (rng.random((6, 50)) < 0.93).astype(np.uint8)
    m = evidence.distribution_metrics(torch.tensor(kld, dtype=torch.float32), torch.tensor(top1))
    flat = kld.astype(np.float32).astype(np.float64).ravel()
    assert m["kld_mean"] == pytest.approx(flat.mean())
    assert m["kld_median"] == pytest.approx(np.median(flat))
    assert m["kld_p99"] == pytest.approx(np.percentile(flat, 99))
    assert m["kld_max"] == pytest.approx(flat.max())
    p = top1.mean()
    assert m["top1_agreement"] == pytest.approx(p)
    assert m["top1_agreement_se"] == pytest.approx(math.sqrt(p * (1 - p) / (top1.size - 1)))
    per_window = kld.astype(np.float32).astype(np.float64).mean(axis=1)
    half = 2.571 * per_window.std(ddof=1) / math.sqrt(6)  # t(0.975, 5)
    assert m["kld_mean_ci95"] == pytest.approx([per_window.mean() - half, per_window.mean() + half], rel=1e-3)


def test_paired_metrics_llama_cpp_ratio_uncertainty_and_delta_p():
    rng = np.random.default_rng(2)
    fp = rng.gamma(3.0, 1.5, size=(8, 64))
    q = fp + rng.normal(0.02, 0.05, size=fp.shape)
    m = evidence.paired_metrics(torch.tensor(q), torch.tensor(fp))
    assert m["ln_ppl_ratio"] == pytest.approx(q.mean() - fp.mean())
    # the paired per-token uncertainty is the standard error of the per-token differences
    d = (q - fp).ravel()
    assert m["ln_ppl_ratio_se"] == pytest.approx(
        math.sqrt((np.mean(d * d) - d.mean() ** 2) / (d.size - 1)), rel=1e-6
    )
    dp = np.exp(-q) - np.exp(-fp)
    assert m["rms_delta_p"] == pytest.approx(math.sqrt(np.mean(dp * dp)))
    w = (q - fp).mean(axis=1)
    half = 2.365 * w.std(ddof=1) / math.sqrt(8)  # t(0.975, 7)
    low, high = m["ppl_change_ci95"]
    assert low == pytest.approx(100 * math.expm1(w.mean() - half), rel=1e-3)
    assert high == pytest.approx(100 * math.expm1(w.mean() + half), rel=1e-3)
    assert m["interval"]["windows"] == 8 and m["interval"]["df"] == 7


def _simulate(rng, windows, tokens, effect, window_sd, token_sd, rho):
    """Per-token NLL differences with a per-window effect and AR(1) noise along each window: tokens of a window
    share a context, as in a language model."""
    shared = rng.normal(0, window_sd, size=(windows, 1))
    noise = np.empty((windows, tokens))
    noise[:, 0] = rng.normal(0, token_sd, size=windows)
    for t in range(1, tokens):
        noise[:, t] = rho * noise[:, t - 1] + math.sqrt(1 - rho * rho) * rng.normal(0, token_sd, size=windows)
    return effect + shared + noise


def test_the_cluster_interval_covers_the_true_change_at_its_nominal_rate():
    """On correlated synthetic data the window-cluster interval covers the true change ~95 % of the time; the
    per-token interval llama.cpp prints (independent tokens) covers it far less often."""
    rng = np.random.default_rng(3)
    truth, trials, cluster_hits, token_hits = 0.01, 1000, 0, 0
    for _ in range(trials):
        d = _simulate(rng, windows=8, tokens=64, effect=truth, window_sd=0.02, token_sd=0.1, rho=0.8)
        fp = np.full_like(d, 3.0)
        m = evidence.paired_metrics(torch.tensor(fp + d), torch.tensor(fp))
        low, high = (math.log1p(v / 100) for v in m["ppl_change_ci95"])
        cluster_hits += low <= truth <= high
        token_hits += abs(m["ln_ppl_ratio"] - truth) <= 1.96 * m["ln_ppl_ratio_se"]
    assert 0.93 <= cluster_hits / trials <= 0.97
    assert token_hits / trials < 0.80


def _documents(rng, documents, per_document, tokens, truth, doc_sd, window_sd):
    """Per-token NLL differences of ``documents`` × ``per_document`` windows: a document effect shared by all its
    windows (its topic and style), a window effect and correlated token noise, as drawn across documents."""
    doc = np.repeat(rng.normal(0, doc_sd, size=documents), per_document)[:, None]
    d = _simulate(rng, documents * per_document, tokens, truth, window_sd, token_sd=0.1, rho=0.8)
    labels = [f"doc{i}" for i in range(documents) for _ in range(per_document)]
    return d + doc, labels


@pytest.mark.parametrize("per_document", [4, 8])
def test_the_document_cluster_interval_holds_its_rate_where_windows_share_documents(per_document):
    """Windows of one document share an effect: the interval that clusters by document covers the true change
    at its nominal 95 %; the one that takes every window as independent covers it far less often."""
    rng = np.random.default_rng(11 + per_document)
    truth, trials, clustered, naive = 0.01, 800, 0, 0
    for _ in range(trials):
        d, labels = _documents(rng, 6, per_document, 16, truth, doc_sd=0.1, window_sd=0.005)
        fp = np.full_like(d, 3.0)
        for clusters in (labels, None):
            m = evidence.paired_metrics(torch.tensor(fp + d), torch.tensor(fp), clusters)
            low, high = (math.log1p(v / 100) for v in m["ppl_change_ci95"])
            if clusters is None:
                naive += low <= truth <= high
            else:
                clustered += low <= truth <= high
                assert m["interval"]["clusters"] == 6 and m["interval"]["df"] == 5
    assert 0.93 <= clustered / trials <= 0.97
    assert naive / trials < 0.80


def test_one_window_per_document_is_the_plain_paired_t():
    rng = np.random.default_rng(2)
    x = torch.tensor(rng.normal(0.01, 0.02, size=12))
    plain = evidence.cluster_interval(x)
    clustered = evidence.cluster_interval(x, clusters=[f"d{i}" for i in range(12)])
    assert clustered == pytest.approx(plain, rel=1e-12)
    assert (
        evidence.cluster_interval(x, clusters=["one"] * 12) is None
    )  # one document: no variance to estimate
    with pytest.raises(ValueError, match="11 cluster labels for 12 windows"):
        evidence.cluster_interval(x, clusters=["a"] * 11)


def _record(change, ci, windows=8, window=64, status="ok", **extra):
    ln = math.log1p(change / 100)
    return {
        "status": status,
        "protocol": {"window": window},
        "metrics": {
            "ppl_change_pct": change,
            "ppl_change_ci95": ci,
            "ln_ppl_ratio": ln,
            "interval": {"windows": windows},
            **extra,
        },
    }


def test_three_way_verdicts():
    assert decide(_record(0.4, [0.1, 0.9]), 1.0).verdict == WITHIN
    assert decide(_record(0.4, [0.1, 1.0]), 1.0).verdict == WITHIN  # the upper end on the line is within
    assert decide(_record(1.6, [1.2, 2.0]), 1.0).verdict == BEYOND
    undecided = decide(_record(0.97, [0.4, 1.5]), 1.0)
    assert undecided.verdict == UNDECIDED and undecided.tokens_to_decide is not None
    assert decide(_record(-0.06, [-0.5, 0.4]), 1.0).verdict == WITHIN  # a lower perplexity is within
    assert decide(_record(0.2, None), 1.0).verdict == UNDECIDED  # no interval: never a pass
    assert decide({"status": "nonfinite", "metrics": {}}, 1.0).verdict == BEYOND


def test_tokens_to_decide_is_the_fewest_windows_that_decide_four_times_in_five():
    """The windows :func:`decide` asks for are the fewest m with (t_{m-1} + z_0.8)·sd/√m within the distance to
    the tolerance; and a simulation at that budget, with the cell's mean and spread, decides ~80 % of the time
    (the previous rule, 1.96·sd/√m = distance, decided about half the time)."""
    rng = np.random.default_rng(4)
    d = rng.normal(0.008, 0.01, size=(8, 1)) * np.ones((8, 16))
    fp = np.full_like(d, 3.0)
    m = evidence.paired_metrics(torch.tensor(fp + d), torch.tensor(fp))
    record = {
        "status": "ok",
        "protocol": {"window": 16},
        "metrics": {**m, "ppl_change_pct": 100 * math.expm1(m["ln_ppl_ratio"])},
    }
    decision = decide(record, 100 * math.expm1(m["ln_ppl_ratio"] + 0.003))
    assert decision.verdict == UNDECIDED
    windows = int(decision.tokens_to_decide / 16)
    sd = m["interval"]["sd_ln_ppl_ratio"]
    z = evidence._normal_quantile(evidence.DECIDE_POWER)
    reach = lambda k: (evidence.t_quantile(0.975, k - 1) + z) * sd / math.sqrt(k)  # noqa: E731
    assert reach(windows) <= 0.003 < reach(windows - 1)
    sims = np.random.default_rng(5).normal(
        0.0, sd, size=(4000, windows)
    )  # the tolerance 0.003 above the mean
    half = evidence.t_quantile(0.975, windows - 1) * sims.std(axis=1, ddof=1) / math.sqrt(windows)
    decided = np.abs(sims.mean(axis=1) - 0.003) > half
    assert decided.mean() == pytest.approx(0.8, abs=0.03)


def test_kld_and_top1_verdicts_use_their_own_intervals():
    r = _record(
        0.5,
        [0.1, 0.9],
        kld_mean=0.004,
        kld_mean_ci95=[0.003, 0.005],
        top1_agreement=0.97,
        top1_agreement_ci95=[0.96, 0.98],
    )
    assert decide(r, 0.01, "kld").verdict == WITHIN
    assert decide(r, 0.004, "kld").verdict == UNDECIDED
    assert decide(r, 5.0, "top1").verdict == WITHIN  # at most 4 % of top tokens changed
    assert decide(r, 1.0, "top1").verdict == BEYOND  # at least 2 % changed
    with pytest.raises(Exception, match="did you mean 'kld'"):
        decide(r, 1.0, "kl")


def test_sidecar_round_trip_and_a_changed_file_is_not_trusted(tmp_path):
    tensors = {"nll": torch.rand(3, 5), "top1": torch.ones(3, 5, dtype=torch.uint8)}
    data, block = evidence.encode(tensors)
    record_path = tmp_path / "cell.json"
    side = evidence.sidecar_path(record_path)
    side.write_bytes(data)
    record = {"evidence": {**block, "file": side.name}}
    back = evidence.read(record_path, record)
    assert torch.equal(back["nll"], tensors["nll"]) and back["top1"].dtype == torch.uint8
    side.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert evidence.read(record_path, record) is None
    assert evidence.read(record_path, {"evidence": None}) is None


def test_token_comparison_is_the_exact_kl_divergence():
    from qbench.eval.metrics import token_comparison

    torch.manual_seed(0)
    ref = torch.randn(2, 7, 300)
    out = ref + 0.1 * torch.randn(2, 7, 300)
    out[0, 3] = ref[0, 3]
    kld, same = token_comparison(out, ref, chunk=5)
    p = torch.softmax(ref.double(), -1).numpy().reshape(-1, 300)
    q = torch.softmax(out.double(), -1).numpy().reshape(-1, 300)
    expected = (p * (np.log(p) - np.log(q))).sum(-1)
    assert np.allclose(kld.numpy(), expected, atol=1e-7)
    assert kld[3].item() == 0.0 and bool(same[3])
    assert torch.equal(same, (out.argmax(-1) == ref.argmax(-1)).flatten())


@pytest.mark.parametrize("scale", [1.0, 0.1, 1e-2, 1e-3, 1e-4])
def test_token_comparison_keeps_its_relative_accuracy_for_tiny_divergences(scale):
    """The float32 form (log1p of a centred sum) against float64 Σ p·(log p − log q): per token within
    10⁻⁶·(√KL + KL), the bound its docstring states, from KL ≈ 0.4 down to ≈ 5·10⁻⁹ (a float32 difference of
    log-softmaxes would be off by orders of magnitude there)."""
    from qbench.eval.metrics import token_comparison

    torch.manual_seed(1)
    ref = 3 * torch.randn(1, 64, 8192)
    out = ref + scale * torch.randn_like(ref)
    kld, _ = token_comparison(out, ref)
    p = torch.log_softmax(ref.double(), -1)
    q = torch.log_softmax(out.double(), -1)
    expected = (p.exp() * (p - q)).sum(-1).flatten()
    assert ((kld.double() - expected).abs() <= 1e-6 * (expected.sqrt() + expected)).all()
