"""``--protocol llama.cpp`` and the ``--kl-divergence`` printout (``qbench.eval.llamacpp_protocol``): the chunks
against perplexity.cpp's index arithmetic, the scored positions through perplexity, KLD and top-1, the records, the
statistics against a plain numpy recomputation, the printout's layout, and — where llama-cpp-python is installed —
qbench's perplexity of a tiny model against llama.cpp's own on the same chunks."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.errors import UserError
from qbench.eval.llamacpp_protocol import (
    LLAMA_CPP,
    LLAMA_CPP_WINDOW,
    QBENCH,
    kld_statistics,
    llama_cpp_windows,
    median,
    percentile,
    protocol_name,
    render_kld_printout,
)
from qbench.eval.metrics import Protocol, make_windows, perplexity, token_comparison
from qbench.eval.sampling import SAMPLES
from tests.qbench.conftest import micro_config, trained_like


@pytest.fixture(scope="module")
def model():
    return trained_like(micro_config())


# ----------------------------------------------------------------------------------------------- the chunks


def perplexity_cpp_chunks(tokens: np.ndarray, n_ctx: int, bos: int | None, n_chunks: int):
    """perplexity.cpp's ``perplexity`` loop, index for index: per chunk the tokens decoded (BOS replacing the
    first when the vocabulary adds one) and the (position, token) pairs ``process_logits`` scores."""
    first = n_ctx // 2
    decoded, scored = [], []
    for i in range(min(n_chunks, len(tokens) // n_ctx)):
        start = i * n_ctx
        chunk = [int(t) for t in tokens[start : start + n_ctx]]
        if bos is not None:
            chunk[0] = bos
        decoded.append(chunk)
        tokens_data = tokens[start + first :]  # tokens.data() + start + first
        scored.append([(first + j, int(tokens_data[j + 1])) for j in range(n_ctx - 1 - first)])
    return decoded, scored


@pytest.mark.parametrize("window", [16, 15, 3])
@pytest.mark.parametrize("bos", [0, None])
def test_chunks_are_llama_perplexitys(window, bos):
    stream = np.arange(10, 10 + 200)
    ids, targets, first = llama_cpp_windows(stream, window, bos, tokens=window * 5)
    decoded, scored = perplexity_cpp_chunks(stream, window, bos, 5)
    assert ids.tolist() == decoded
    assert first == window // 2 and targets.shape == (5, window - 1 - first)
    for row, pairs in enumerate(scored):
        assert [(first + k, int(t)) for k, t in enumerate(targets[row])] == pairs


def test_a_budget_beyond_the_text_takes_every_whole_chunk_and_a_short_one_refuses():
    stream = np.arange(100)
    ids, _, _ = llama_cpp_windows(stream, 16, 0, tokens=10**6)
    assert ids.shape == (6, 16)  # 100 // 16, as n_chunk = tokens.size() / n_ctx
    assert llama_cpp_windows(stream, 16, 0, tokens=1)[0].shape == (1, 16)  # at least one chunk
    with pytest.raises(UserError, match="fewer than one chunk of 128"):
        llama_cpp_windows(stream, 128, 0, tokens=10**6)
    with pytest.raises(UserError, match=r"at least 3 under --protocol llama\.cpp"):
        llama_cpp_windows(stream, 2, 0, tokens=100)


def test_the_protocol_field_defaults_and_records(tokenizer):
    assert Protocol().to_dict().get("protocol") is None  # the default writes no key: records as before
    assert protocol_name({}) == protocol_name(None) == QBENCH
    p = Protocol(protocol=LLAMA_CPP)
    assert p.window == LLAMA_CPP_WINDOW and p.to_dict()["protocol"] == LLAMA_CPP
    assert protocol_name(p.to_dict()) == LLAMA_CPP
    with pytest.raises(UserError, match="unknown protocol 'llama'"):
        Protocol(protocol="llama")
    with pytest.raises(UserError, match=r"--window 512 \(--protocol llama.cpp's default"):
        make_windows(tokenizer, p, context=32)


def test_make_windows_cuts_the_stream_into_chunks(tokenizer):
    from models.tokenizer import separator_id
    from trainers.data import token_stream

    w = make_windows(tokenizer, Protocol(protocol=LLAMA_CPP, window=32, tokens=32 * 5), context=32)
    stream = np.asarray(token_stream("embedded", "validation", tokenizer)[: 5 * 32], dtype=np.int64)
    chunks = torch.from_numpy(stream.reshape(5, 32))
    assert w.first == 16 and w.ids.shape == (5, 32) and w.targets.shape == (5, 15)
    assert (w.ids[:, 0] == separator_id(tokenizer)).all() and torch.equal(w.ids[:, 1:], chunks[:, 1:])
    assert torch.equal(w.targets, chunks[:, 17:]) and w.scored_tokens == 5 * 15
    default = make_windows(tokenizer, Protocol(tokens=32 * 5, window=32), context=32)
    assert default.first == 0 and default.every_position and not w.every_position


# --------------------------------------------------------------------------- scoring exactly those positions


def test_perplexity_nll_kld_and_top1_are_of_the_scored_positions_only(model, tokenizer):
    w = make_windows(tokenizer, Protocol(protocol=LLAMA_CPP, window=32, tokens=32 * 6), context=32)
    other = trained_like(micro_config(), seed=1)
    with torch.no_grad():
        logits, ref = model(w.ids), other(w.ids)
    scored = logits[:, 16:31]
    nll = F.cross_entropy(scored.reshape(-1, scored.size(-1)), w.targets.reshape(-1), reduction="none")
    for batch_size in (1, 4):
        out = perplexity(model, w, batch_size, reference=other)
        assert out["tokens"] == 6 * 15 and out["per_token"]["nll"].shape == (6, 15)
        assert out["perplexity"] == pytest.approx(math.exp(nll.double().mean().item()), rel=1e-6)
        kld, same = token_comparison(scored, ref[:, 16:31])
        torch.testing.assert_close(out["per_token"]["kld"].flatten(), kld, rtol=1e-5, atol=1e-7)
        assert torch.equal(out["per_token"]["top1"].flatten().bool(), same)


def _old_cell_identity(record: dict) -> str:
    """``harness.cell_identity`` as it was before the ``protocol`` field: a default record's identity must not move."""
    protocol = record.get("protocol") or {}
    fields = ("corpus", "split", "tokens", "window", "bos", "batch_size", "outlier_windows", "dtype")
    key = {
        "model": record["model"].get("fingerprint"),
        "scheme": record.get("scheme"),
        "mode": record.get("mode"),
        "kv": record.get("kv"),
        "protocol": {k: protocol.get(k) for k in fields},
        "seed": record.get("seed"),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]


def test_default_records_keep_their_identity_and_a_llama_cpp_cell_has_its_own():
    """A record written before the ``protocol`` and ``sample`` fields keeps its identity (its file); a llama.cpp
    cell, a documents sample and the first windows of today's corpus each have their own."""
    from qbench.eval.harness import cell_identity

    written = Protocol(window=32, sample="first").to_dict()
    del written["sample"]  # what a record of the first windows held before the field existed
    record = {
        "model": {"fingerprint": "abc"},
        "scheme": {"name": "absmax-coarse"},
        "mode": "fake",
        "kv": None,
        "protocol": {**written, "dtype": "float32"},
        "seed": 0,
    }
    assert cell_identity(record) == _old_cell_identity(record)
    llama = {**record, "protocol": {**record["protocol"], "protocol": LLAMA_CPP}}
    assert cell_identity(llama) != cell_identity(record)
    others = [
        {**record, "protocol": {**Protocol(window=32, sample=s).to_dict(), "dtype": "float32"}}
        for s in SAMPLES
    ]
    assert len({cell_identity(r) for r in [record, *others]}) == 3


def test_run_records_the_protocol_and_prints_llama_cpps_block(ckpt_dir, tmp_path, capsys):
    from qbench.cli import main
    from qbench.eval.harness import GridSpec, run_grid

    argv = [
        "run",
        "--ckpt",
        ckpt_dir,
        "--scheme",
        "absmax-coarse",
        "--protocol",
        "llama.cpp",
        "--window",
        "32",
    ]
    argv += [
        "--tokens",
        "320",
        "--batch-size",
        "4",
        "--no-attention",
        "--output-path",
        tmp_path,
        "--kld-printout",
    ]
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert "protocol llama.cpp, window 32, 10 windows, 150 tokens scored" in out
    assert "====== KL divergence statistics ======" in out and "Same top p:" in out
    spec = GridSpec(
        [str(ckpt_dir)],
        ["absmax-coarse"],
        protocol=Protocol(protocol=LLAMA_CPP, window=32, tokens=320, batch_size=4),
        output_path=tmp_path,
        attention=False,
    )
    fp, cell = run_grid(spec)  # reused from disk: the same cells
    p = cell["protocol"]
    assert p["protocol"] == LLAMA_CPP and p["stride"] == 32 and p["scored_positions"] == [16, 30]
    assert p["tokens_scored"] == cell["metrics"]["tokens"] == 150 and cell["evidence"]["tensors"]["nll"][
        1
    ] == [10, 15]
    from qbench.studies.llamacpp import record_printouts

    ((_, stats),) = record_printouts([fp, cell], tmp_path)
    assert stats.ppl_q == pytest.approx(cell["metrics"]["perplexity"], rel=1e-9)
    assert stats.ppl_base == pytest.approx(fp["metrics"]["perplexity"], rel=1e-9)
    assert stats.kld_mean == pytest.approx(cell["metrics"]["kld_mean"], rel=1e-9)
    assert render_kld_printout(stats) in out


# ------------------------------------------------------------------------------- the statistics, by numpy


def _evidence(n: int = 1000, seed: int = 0):
    rng = np.random.default_rng(seed)
    base = rng.gamma(2.0, 1.5, n).astype(np.float32)
    q = (base + rng.normal(0.05, 0.3, n)).clip(0.001).astype(np.float32)
    kld = rng.exponential(0.02, n).astype(np.float32)
    same = rng.random(n) < 0.9
    return q, base, kld, same


def test_the_statistics_are_plain_numpys():
    q, b, k, same = _evidence()
    s = kld_statistics(torch.from_numpy(q).view(10, 100), b, k, same)
    q, b, k = q.astype(np.float64), b.astype(np.float64), k.astype(np.float64)
    n = q.size
    se = lambda x: np.std(x) / math.sqrt(n - 1)  # noqa: E731 (population sd, as llama.cpp's E[x²] − E[x]²)
    ppl_q, ppl_b = math.exp(q.mean()), math.exp(b.mean())
    cov = np.mean(q * b) - q.mean() * b.mean()
    dp = np.exp(-q) - np.exp(-b)
    rms = math.sqrt(np.mean(dp**2))
    want = {
        "ppl_q": ppl_q,
        "ppl_q_se": ppl_q * se(q),
        "ppl_base": ppl_b,
        "ppl_base_se": ppl_b * se(b),
        "ln_ppl_correlation": np.corrcoef(q, b)[0, 1],
        "ln_ppl_ratio": np.mean(q - b),
        "ln_ppl_ratio_se": se(q - b),
        "ppl_ratio": math.exp(np.mean(q - b)),
        "ppl_ratio_se": math.exp(np.mean(q - b)) * se(q - b),
        "ppl_diff": ppl_q - ppl_b,
        "ppl_diff_se": math.sqrt(
            (ppl_q * se(q)) ** 2 + (ppl_b * se(b)) ** 2 - 2 * ppl_q * ppl_b * cov / (n - 1)
        ),
        "kld_mean": k.mean(),
        "kld_mean_se": se(k),
        "kld_max": k.max(),
        "kld_median": np.median(k),
        "kld_min": k.min(),
        "delta_p_mean": dp.mean(),
        "delta_p_mean_se": se(dp),
        "delta_p_max": dp.max(),
        "delta_p_median": np.median(dp),
        "delta_p_min": dp.min(),
        "delta_p_rms": rms,
        "delta_p_rms_se": 0.5 / rms * se(dp**2),
        "same_top": same.mean(),
        "same_top_se": math.sqrt(same.mean() * (1 - same.mean()) / (n - 1)),
    }
    names = {"p99_9": 99.9, "p99": 99, "p95": 95, "p90": 90, "p10": 10, "p5": 5, "p1": 1, "p0_1": 0.1}
    for name, pct in names.items():
        want[f"kld_{name}"] = np.percentile(k, pct)
    for name, pct in {**names, "p75": 75, "p25": 25}.items():
        want[f"delta_p_{name}"] = np.percentile(dp, pct)
    got = s.to_dict()
    assert got["tokens"] == n and set(got) == {*want, "tokens"}
    spread = {"kld": k.max() - k.min(), "delta_p": dp.max() - dp.min()}
    for key, value in want.items():
        # float32 per-token values, as llama.cpp's; a percentile also interpolates at fraction · (n − 1) rounded to
        # float32 (998.001 ± 6e-5 for 99.9 % of 1,000), weighting its neighbours' gap by up to 1e-4
        percentile_of = re.fullmatch(r"(kld|delta_p)_p[0-9_]+", key)
        atol = 1e-4 * spread[percentile_of.group(1)] if percentile_of else 1e-7
        assert got[key] == pytest.approx(value, rel=2e-5, abs=atol), key


def test_percentile_and_median_are_llama_cpps():
    v = np.array([1, 2, 3, 4, 10], dtype=np.float32)
    assert percentile(v, 0.5) == 3.0 and percentile(v, 0.9) == pytest.approx(7.6, rel=1e-6)
    assert percentile(v, 0.0) == 1.0 and percentile(v, 1.0) == 10.0
    assert median(v) == 3.0 and median(v[:4]) == 2.5  # even count: half the two middle values


def test_few_tokens_give_no_uncertainty_as_in_llama_cpp():
    q, b, k, same = _evidence(10)
    s = kld_statistics(q, b, k, same)
    assert s.ppl_q_se == s.kld_mean_se == s.ln_ppl_ratio_se == 0.0  # mean_and_uncertainty: 0 for n ≤ 10
    assert math.isnan(s.ln_ppl_correlation)
    assert render_kld_printout(s).startswith("(only 10 tokens: llama.cpp prints")
    with pytest.raises(ValueError, match="need the same n"):
        kld_statistics(q, b[:5], k, same)


def test_the_printout_is_llama_cpps_layout():
    text = render_kld_printout(kld_statistics(*_evidence()))
    labels = [line.split(":")[0] if ":" in line else line for line in text.splitlines()]
    assert labels == [
        "====== Perplexity statistics ======",
        "Mean PPL(Q)                   ",
        "Mean PPL(base)                ",
        "Cor(ln(PPL(Q)), ln(PPL(base)))",
        "Mean ln(PPL(Q)/PPL(base))     ",
        "Mean PPL(Q)/PPL(base)         ",
        "Mean PPL(Q)-PPL(base)         ",
        "",
        "====== KL divergence statistics ======",
        "Mean    KLD",
        "Maximum KLD",
        "99.9%   KLD",
        "99.0%   KLD",
        "95.0%   KLD",
        "90.0%   KLD",
        "Median  KLD",
        "10.0%   KLD",
        " 5.0%   KLD",
        " 1.0%   KLD",
        " 0.1%   KLD",
        "Minimum KLD",
        "",
        "====== Token probability statistics ======",
        "Mean    Δp",
        "Maximum Δp",
        "99.9%   Δp",
        "99.0%   Δp",
        "95.0%   Δp",
        "90.0%   Δp",
        "75.0%   Δp",
        "Median  Δp",
        "25.0%   Δp",
        "10.0%   Δp",
        " 5.0%   Δp",
        " 1.0%   Δp",
        " 0.1%   Δp",
        "Minimum Δp",
        "RMS Δp    ",
        "Same top p",
    ]
    lines = text.splitlines()
    assert lines[1].count("±") == 1 and len(lines[1].split(": ")[1]) == len("  1.000000 ±   1.000000")
    assert lines[3].endswith("%") and lines[-1].endswith(" %")  # "%6.2lf%%" and "%6.3lf ± %5.3lf %%"


# ------------------------------------------------------------------------------------- llama.cpp itself


def test_qbench_reproduces_llama_cpps_perplexity_on_the_same_chunks(tmp_path, tokenizer):
    """A tiny Llama, written as an F32 GGUF, scored by qbench under --protocol llama.cpp and by llama.cpp on the
    same chunks (BOS first, positions n_ctx/2 … n_ctx − 2): measured 7e-8 relative on perplexity, 3e-5 nats at
    most per token (float32 kernels); asserted within 1e-3 relative, 1e-3 nats per token."""
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from models import build, preset_config
    from models.gguf_export import write_gguf
    from qbench.studies.llamacpp import chunk_evidence, quantize_gguf

    config = replace(
        preset_config("tiny"),
        family="llama",
        norm="rmsnorm",
        pos="rope",
        mlp="swiglu",
        bias=False,
        init_std=0.1,  # logits spread over several nats: the softmax is exercised, not a near-uniform one
    )
    model = build(config, seed=0).eval()
    path = write_gguf(model, tmp_path / "m-F32.gguf", tokenizer)
    w = make_windows(tokenizer, Protocol(protocol=LLAMA_CPP, window=128, tokens=128 * 6), config.context)
    ours = perplexity(model, w, 4)
    theirs = chunk_evidence(path, w.ids, w.first)
    assert theirs["nll"].shape == tuple(ours["per_token"]["nll"].shape) == (6, 63)
    llama_ppl = math.exp(theirs["nll"].astype(np.float64).mean())
    assert llama_ppl == pytest.approx(ours["perplexity"], rel=1e-3)
    assert np.abs(theirs["nll"] - ours["per_token"]["nll"].numpy()).max() < 1e-3

    # llama.cpp's own Q8_0 of it against its F32, printed as llama-perplexity --kl-divergence prints it
    q8 = quantize_gguf(path, tmp_path / "m-Q8_0.gguf", "Q8_0")
    ev = chunk_evidence(q8, w.ids, w.first, base=path)
    stats = kld_statistics(ev["nll"], theirs["nll"], ev["kld"], ev["top1"])
    assert stats.ppl_base == pytest.approx(ours["perplexity"], rel=1e-3)
    assert 0 < stats.kld_mean < 0.05 and stats.same_top > 0.8
    assert "Mean PPL(base)                : " in render_kld_printout(stats)
