import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from models.checkpoint import load_checkpoint
from models.hf import to_hf_model
from qbench.eval.metrics import (
    Protocol,
    linear_ranges,
    make_windows,
    massive_activations,
    outlier_metrics,
    perplexity,
)
from tests.qbench.conftest import micro_config, trained_like


@pytest.fixture(scope="module")
def model():
    return trained_like(micro_config(attn="softmax1"))


def test_windows_follow_the_protocol(tokenizer):
    p = Protocol(tokens=320, window=32, bos=True)
    w = make_windows(tokenizer, p, context=32)
    assert w.ids.shape == w.targets.shape == (10, 32) and w.scored_tokens == 320
    assert torch.equal(w.ids[:, 1:], w.targets[:, :-1])  # each position predicts the next stream token
    assert (w.ids[:, 0] == tokenizer.convert_tokens_to_ids("<|endoftext|>")).all()
    no_bos = make_windows(tokenizer, replace(p, bos=False, window=31), context=32)
    assert torch.equal(w.ids[1, 1:], no_bos.ids[1])  # same stream tokens, BOS in front
    assert no_bos.scored_tokens == 10 * 31  # without BOS a window's first token is context only
    huge = make_windows(tokenizer, replace(p, tokens=10**9), context=32)
    assert huge.clamped and huge.scored_tokens <= huge.available_tokens


def test_perplexity_is_exp_of_mean_token_nll_and_batch_invariant(model, tokenizer):
    w = make_windows(tokenizer, Protocol(tokens=32 * 6, window=32), context=32)
    logits = model(w.ids)
    expected = math.exp(F.cross_entropy(logits.reshape(-1, 8192), w.targets.reshape(-1)).item())
    for batch_size in (1, 4, 6):
        assert perplexity(model, w, batch_size)["perplexity"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("bos", [True, False])
def test_the_trainers_validation_perplexity_is_qbenchs_float_perplexity(model, tokenizer, bos):
    """One window cutter: the trainer's validation loss and ``qbench run --sample first``'s float perplexity on
    the same checkpoint and token budget are the same number."""
    import contextlib

    from models.tokenizer import separator_id
    from trainers.batches import validation_windows
    from trainers.data import token_stream
    from trainers.loop import evaluate

    stream = token_stream("embedded", "validation", tokenizer)
    x, y = validation_windows(stream, 32, separator_id(tokenizer) if bos else None, max_tokens=200)
    trainer = math.exp(evaluate(model, x, y, batch=4, autocast=contextlib.nullcontext()))
    w = make_windows(tokenizer, Protocol(tokens=200, window=32, bos=bos, sample="first"), context=32)
    assert torch.equal(w.ids, x) and torch.equal(w.targets, y)
    assert perplexity(model, w, 4)["perplexity"] == pytest.approx(trainer, rel=1e-6)


def test_transformers_model_gives_the_same_statistics_as_ours(model, tokenizer):
    """Hooks on decoder layers + eager (softmax1_eager) attention reproduce the observation API exactly."""
    w = make_windows(tokenizer, Protocol(tokens=32 * 4, window=32), context=32)
    ours = outlier_metrics(model, w, n_windows=4)
    theirs = outlier_metrics(to_hf_model(model, tokenizer), w, n_windows=4)
    for key in ("kurtosis_first", "kurtosis_other", "max_abs", "first_token_top1_share", "first_token_mass"):
        assert theirs[key] == pytest.approx(ours[key], rel=1e-4), key
    assert ours["kurtosis_other"] > 10  # the planted outlier channel shows
    ours, theirs = linear_ranges(model, w, 4), linear_ranges(to_hf_model(model, tokenizer), w, 4)
    for key in ("max_input_crest", "min_input_int8_sqnr_db", "max_weight_crest"):  # Conv1D read as (in, out)
        assert theirs[key] == pytest.approx(ours[key], rel=1e-4), key
    assert len(theirs["per_layer"]) == len(ours["per_layer"]) == 9  # 2 blocks x 4 linears + the LM head


def test_massive_activations_are_found_where_planted(tokenizer):
    model = trained_like(micro_config())
    with torch.no_grad():
        model.transformer.wte.weight[:, 9] = 0.0
        model.transformer.wpe.weight[0, 9] = 5000.0  # first position, channel 9
    w = make_windows(tokenizer, Protocol(tokens=32 * 2, window=32), context=32)
    found = massive_activations(model, w, n_windows=2)
    layer0 = found["layers"][0]
    assert 9 in layer0["channels"] and layer0["positions"]["first"] == 2 and layer0["positions"]["other"] == 0
    assert layer0["top"][0] > 4000


def test_checkpoint_round_trip_keeps_perplexity(ckpt_dir, tokenizer):
    saved = trained_like(micro_config(attn="softmax1"))  # the model conftest saved (seeded build)
    ckpt = load_checkpoint(ckpt_dir)
    w = make_windows(tokenizer, Protocol(tokens=64, window=32), context=32)
    before, after = perplexity(saved, w), perplexity(ckpt.model, w)
    assert math.isfinite(before["perplexity"]) and torch.equal(
        before.pop("per_token")["nll"], after.pop("per_token")["nll"]
    )
    assert before == after


def test_linear_ranges_follow_their_definitions(tokenizer):
    from qbench.quant.granularity import PerTensor, per_sequence
    from qbench.quant.primitives import fake_quantize

    model = trained_like(micro_config())
    with torch.no_grad():
        model.transformer.h[1].attn.c_proj.weight[3, 7] = 5.0  # a weight outlier in one layer
    w = make_windows(tokenizer, Protocol(tokens=32 * 4, window=32), context=32)
    seen = {}
    layer = model.transformer.h[0].mlp.c_proj
    handle = layer.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach()))
    model(w.ids[:3])
    handle.remove()
    ranges = linear_ranges(model, w, n_windows=3)
    x, mine = seen["x"], ranges["per_layer"]["transformer.h.0.mlp.c_proj"]
    assert mine["input_crest"] == pytest.approx((x.abs().max() / x.pow(2).mean().sqrt()).item(), rel=1e-5)
    # The SQNR is that of the quantiser's own per-tensor int8 scheme, one scale per sequence.
    xq = fake_quantize(x, 8, per_sequence(PerTensor(), x.dim()), symmetric=True)
    sqnr = 10 * math.log10((x.pow(2).sum() / (x - xq).pow(2).sum()).item())
    assert mine["input_int8_sqnr_db"] == pytest.approx(sqnr, abs=1e-3)
    weight = model.transformer.h[1].attn.c_proj.weight
    crest = (weight.abs().max() / weight.pow(2).mean().sqrt()).item()
    assert ranges["per_layer"]["transformer.h.1.attn.c_proj"]["weight_crest"] == pytest.approx(
        crest, rel=1e-5
    )
    assert ranges["max_weight_crest"] == pytest.approx(crest, rel=1e-5) and crest > 20  # others: ~4
    assert ranges["per_layer"]["lm_head"]["lm_head"] and ranges["windows"] == 3
    body = [v for k, v in ranges["per_layer"].items() if k != "lm_head"]
    assert ranges["min_input_int8_sqnr_db"] == min(v["input_int8_sqnr_db"] for v in body)


def test_the_per_head_sink_and_the_massive_sites_refine_the_summaries(tokenizer):
    from qbench.eval.metrics import attention_sink_per_head, massive_activation_sites

    model = trained_like(micro_config())
    with torch.no_grad():
        model.transformer.wte.weight[:, 9] = 0.0
        model.transformer.wpe.weight[0, 9] = 5000.0  # first position, channel 9: massive in every window
    w = make_windows(tokenizer, Protocol(tokens=32 * 3, window=32), context=32)
    summary = outlier_metrics(model, w, n_windows=3, attention=True)
    heads = attention_sink_per_head(model, w, n_windows=3, batch_size=2)  # two batches: sums carry over
    top1 = torch.tensor(heads["top1_share"], dtype=torch.float64)
    mass = torch.tensor(heads["mass"], dtype=torch.float64)
    assert top1.shape == mass.shape == (2, 4)  # layers × heads
    # every head sees as many queries, so the mean over heads and layers is the summary's share
    assert top1.mean().item() == pytest.approx(summary["first_token_top1_share"], rel=1e-9)
    assert mass.mean().item() == pytest.approx(summary["first_token_mass"], rel=1e-9)
    sites = massive_activation_sites(model, w, tokenizer, n_windows=3, limit=2)
    counts = massive_activations(model, w, n_windows=3)["layers"]
    assert [s["count"] for s in sites] == [c["count"] for c in counts]
    assert [s["channels"] for s in sites] == [c["channels"] for c in counts]
    first = sites[0]
    assert first["positions"] == [0] and len(first["sites"]) == 2
    assert {s["channel"] for s in first["sites"]} == {9} and first["sites"][0]["value"] > 4000
    assert first["sites"][0]["token"] == tokenizer.decode([int(w.ids[0, 0])])


def test_one_pass_statistics_equal_their_separate_passes(tokenizer):
    """The float cell reads the massive activations from the outlier pass's block outputs, and the card's profile
    takes the per-head sink and the massive sites from one pass: the same findings as separate passes."""
    from qbench.eval.metrics import (
        attention_sink_and_massive_sites,
        attention_sink_per_head,
        joined_hidden,
        massive_activation_sites,
    )

    model = trained_like(micro_config())
    with torch.no_grad():
        model.transformer.wpe.weight[0, 9] = 5000.0
    w = make_windows(tokenizer, Protocol(tokens=32 * 3, window=32), context=32)
    hidden = []
    outlier_metrics(model, w, n_windows=3, batch_size=2, attention=True, hidden=hidden)
    assert len(hidden) == 2  # two batches, joined per layer along the windows
    joined = massive_activations(model, w, n_windows=3, hidden=joined_hidden(hidden))
    alone = massive_activations(model, w, n_windows=3)
    for a, b in zip(joined["layers"], alone["layers"], strict=True):
        assert (a["count"], a["channels"], a["positions"]) == (b["count"], b["channels"], b["positions"])
        assert a["top"] == pytest.approx(b["top"], rel=1e-5) and a["median"] == pytest.approx(
            b["median"], rel=1e-5
        )
    heads, sites = attention_sink_and_massive_sites(model, w, tokenizer, n_windows=3, batch_size=2)
    assert heads == attention_sink_per_head(model, w, n_windows=3, batch_size=2)
    separate = massive_activation_sites(model, w, tokenizer, n_windows=3)
    assert [(s["count"], s["channels"], s["positions"]) for s in sites] == [
        (s["count"], s["channels"], s["positions"]) for s in separate
    ]


def test_perplexity_builds_no_autograd_graph(model, tokenizer):
    """An evaluation keeps no graph: with one, every forward pass held its activations until the batch's logits
    were dropped (a SmolLM2 float record peaked at 4.95 GiB instead of 1.67 GiB)."""
    w = make_windows(tokenizer, Protocol(tokens=32 * 2, window=32), context=32)
    seen = []
    handle = model.register_forward_hook(lambda _m, _a, out: seen.append(out.requires_grad))
    try:
        perplexity(model, w, 2)
    finally:
        handle.remove()
    assert seen == [False] and any(p.requires_grad for p in model.parameters())


def test_the_documents_sample_scores_sixteen_windows_across_documents_and_sources(tokenizer):
    """The default sample: at the card's quick budget (4,096 tokens) 16 windows of 256 tokens, each from another
    document, from every source of the embedded corpus; the record says where each window came from."""
    from qbench.eval.metrics import protocol_record

    p = Protocol(tokens=4096)
    assert p.sample == "documents" and Protocol(protocol="llama.cpp").sample == "first"
    w = make_windows(tokenizer, p, context=1024)
    assert w.window == 256 and w.ids.shape == (16, 256) and not w.clamped
    assert len(set(w.clusters)) == 16 and {s.source for s in w.sampled} == {"sotu", "shakespeare", "factbook"}
    record = protocol_record(p, w, tokenizer, "float32")
    assert record["sample"] == "documents" and record["sample_seed"] == 0 and record["stride"] is None
    sampled = record["sampled"]
    assert sampled["documents"] == 16 and sum(sampled["sources"].values()) == 16
    assert [a["document"] for a in sampled["windows_at"]] == w.clusters
    # each window is the piece's tokens at its offset, BOS in front
    from trainers.data import stream_index, token_stream

    stream = token_stream("embedded", "validation", tokenizer)
    index = stream_index(stream, int(w.ids[0, 0]))
    at = sampled["windows_at"][3]
    start = int(index.starts[index.ids.index(at["piece"])]) + at["offset"]
    assert w.targets[3].tolist() == stream[start : start + 256].tolist()
    # the first windows: the stream's start, as every record before sampling
    first = make_windows(tokenizer, replace(p, sample="first"), context=1024)
    assert first.window == 1024 and first.clusters is None
    assert first.targets[0].tolist() == stream[0:1024].tolist()
    other = make_windows(tokenizer, replace(p, sample_seed=1), context=1024)
    assert other.clusters != w.clusters


def test_bad_sample_choices_are_one_line_errors():
    from models.errors import UserError

    with pytest.raises(UserError, match=r"--sample 'document' \(did you mean 'documents'\?\)"):
        Protocol(sample="document")
    with pytest.raises(UserError, match=r"--sample documents with --protocol llama\.cpp"):
        Protocol(sample="documents", protocol="llama.cpp")
    with pytest.raises(UserError, match=r"--sample-seed must be a non-negative integer, got -1"):
        Protocol(sample_seed=-1)


def test_the_sampling_window_cap_equals_the_adapters():
    from qbench.eval.adapters import MAX_DEFAULT_WINDOW
    from qbench.eval.sampling import MAX_WINDOW, default_window

    assert MAX_WINDOW == MAX_DEFAULT_WINDOW
    assert [default_window(t, 8192, "documents") for t in (512, 4096, 8192, 16384, 32768, 10**6)] == [
        128,
        256,
        512,
        1024,
        2048,
        2048,
    ]
    assert default_window(4096, 8192, "first") == 2048 and default_window(4096, 64, "documents") == 64
