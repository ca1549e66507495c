"""Every transform acts, or is refused, on tiny random models of fifteen transformers families (seventeen
layouts, Falcon's three attention branches) — and none lets a position see the future.

For each family (2 layers, d 32, vocab 128, random weights) and each transform — float, two fake weight
schemes, the KV cache under the ``window``, ``kivi`` and ``per-token`` schemes — two things are checked:

- acted: the transform changed the logits and a probe (forward hooks on the fake-quant layers; the KV
  quantisers' call counters) saw it run in every decoder layer;
- causal: changing the last token leaves every earlier position's logits unchanged. ``window`` takes a key
  channel's range over the whole window, so it is not causal by construction; ``kivi`` and ``per-token`` are.
  ``kivi`` (queries read different versions of the cache) is refused where the attention module computes
  attention itself.

The statistics hooks (``observe_any``: block outputs and attention probabilities) are checked to record every
layer. ``python -m tests.qbench.eval.test_architectures`` prints the architecture table.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from models.errors import UserError
from qbench.eval.adapters import context_length, decoder_layers, forward_observed, observe_any
from qbench.quant import FakeQuantLinear, get_scheme, quantize
from qbench.quant.kv import KVConfig, apply_kv

VOCAB, T = 128, 12
SCHEMES = ("absmax-fine", "zeropoint-int4")
KV = {
    "kv2-win": KVConfig(2, "window"),
    "kv2-kivi": KVConfig(2, "kivi:group=4,residual=4"),  # groups small enough for the 12-token test
    "kv2-tok": KVConfig(2, "per-token"),
}
CAUSAL_BY_DESIGN = {
    "float": True,
    **dict.fromkeys(SCHEMES, True),
    "kv2-win": False,
    "kv2-kivi": True,
    "kv2-tok": True,
}
TRANSFORMS = tuple(CAUSAL_BY_DESIGN)
ATOL = 1e-5


def family_configs() -> dict:
    """Tiny configs; sliding windows (Mistral, Gemma 3, GPT-Neo's local layer) shorter than the T-token test."""
    import transformers as tf

    small = dict(vocab_size=VOCAB)
    llama_like = dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **small,
    )
    return {
        "gpt2": lambda: tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **small),
        "llama": lambda: tf.LlamaConfig(**llama_like),
        "mistral": lambda: tf.MistralConfig(sliding_window=4, **llama_like),
        "qwen2": lambda: tf.Qwen2Config(**llama_like),
        "qwen3": lambda: tf.Qwen3Config(head_dim=8, **llama_like),
        "gemma3": lambda: tf.Gemma3TextConfig(
            head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"], **llama_like
        ),
        "phi3": lambda: tf.Phi3Config(pad_token_id=0, **llama_like),
        "opt": lambda: tf.OPTConfig(
            num_hidden_layers=2,
            hidden_size=32,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            **small,
        ),
        "gpt_neox": lambda: tf.GPTNeoXConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            **small,
        ),
        "gptj": lambda: tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=64, **small),
        "falcon": lambda: tf.FalconConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, **small
        ),
        # Falcon-RW (ALiBi, no rotary) and Falcon-40B's layout (grouped k/v broadcast to every head before
        # the cache update) take other branches of the same attention module.
        "falcon_alibi": lambda: tf.FalconConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, alibi=True, multi_query=False, **small
        ),
        "falcon_40b": lambda: tf.FalconConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
            **small,
        ),
        "bloom": lambda: tf.BloomConfig(n_layer=2, hidden_size=32, n_head=4, **small),
        "mpt": lambda: tf.MptConfig(n_layers=2, d_model=32, n_heads=4, max_seq_len=64, **small),
        "gpt_neo": lambda: tf.GPTNeoConfig(
            num_layers=2,
            hidden_size=32,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
            **small,
        ),
        "xglm": lambda: tf.XGLMConfig(
            num_layers=2, d_model=32, attention_heads=4, ffn_dim=64, max_position_embeddings=64, **small
        ),
    }


FAMILIES = tuple(family_configs())


def build_family(family: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # std 0.2: attention far from uniform, so a quantised cache visibly moves the logits
    config = family_configs()[family]()
    config.initializer_range = 0.2
    return AutoModelForCausalLM.from_config(config).eval()


def run(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def test_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch and the same batch with only its last token changed."""
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    return ids, changed


test_inputs.__test__ = False  # a helper, not a test


def _fake_layer_probe(model: nn.Module) -> tuple[list[int], list]:
    """Forward hooks counting, per decoder layer, calls of its fake-quant linear layers."""
    counts = [0] * len(decoder_layers(model))
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        for module in layer.modules():
            if isinstance(module, FakeQuantLinear):

                def hit(*_args, i=i) -> None:
                    counts[i] += 1

                handles.append(module.register_forward_hook(hit))
    return counts, handles


def apply_transform(model: nn.Module, name: str) -> nn.Module:
    if name == "float":
        return model
    if name in KV:
        return apply_kv(model, KV[name])
    return quantize(model, get_scheme(name), mode="fake")


def check(model: nn.Module, name: str) -> dict:
    """One cell of the table: whether ``name`` acted in every layer, and whether the result is causal.

    A refusal (UserError) is a valid outcome: it is recorded with its message."""
    ids, changed = test_inputs()
    try:
        transformed = apply_transform(model, name)
    except UserError as e:
        return {"refused": str(e)}
    if name in KV:
        per_layer = [
            [m.qbench_kv for m in layer.modules() if hasattr(m, "qbench_kv")]
            for layer in decoder_layers(transformed)
        ]
        before = [sum(q.calls for q in qs) for qs in per_layer]
        logits = run(transformed, ids)
        after = [sum(q.calls for q in qs) for qs in per_layer]
        every_layer = all(a > b for a, b in zip(after, before, strict=True))
    elif name == "float":
        logits, every_layer = run(transformed, ids), None
    else:
        counts, handles = _fake_layer_probe(transformed)
        logits = run(transformed, ids)
        for handle in handles:
            handle.remove()
        every_layer = all(counts)
    leak = (logits[:, :-1] - run(transformed, changed)[:, :-1]).abs().max().item()
    moved = None if name == "float" else (logits - run(model, ids)).abs().max().item()
    return {"every_layer": every_layer, "moved": moved, "leak": leak, "causal": leak <= ATOL}


@pytest.fixture(scope="module")
def family_models() -> dict[str, nn.Module]:
    return {}


def _model(cache: dict, family: str) -> nn.Module:
    if family not in cache:
        cache[family] = build_family(family)
    return cache[family]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_transform_acts_in_every_layer_and_stays_causal(family_models, family, transform):
    result = check(_model(family_models, family), transform)
    if "refused" in result:  # a refusal must be one line naming the model class
        assert "\n" not in result["refused"] and "ForCausalLM" in result["refused"]
        return
    if transform != "float":
        assert result["every_layer"], f"{transform} did not run in every layer of {family}"
        assert result["moved"] > 1e-4, f"{transform} left {family}'s logits unchanged"
    if CAUSAL_BY_DESIGN[transform]:
        assert result["causal"], (
            f"{family} under {transform}: earlier positions moved by {result['leak']:.3g}"
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_statistics_hooks_record_every_layer(family_models, family):
    model = _model(family_models, family)
    ids, _ = test_inputs()
    n, implementation = len(decoder_layers(model)), model.config._attn_implementation
    with observe_any(model, attention=True) as obs:
        forward_observed(model, ids, obs)
    assert len(obs.hidden) == n and all(h.shape[:2] == ids.shape for h in obs.hidden)
    assert len(obs.attention) == n and all(a.shape[-2:] == (T, T) for a in obs.attention)
    assert model.config._attn_implementation == implementation  # eager only while observing


def test_a_kv_cache_that_cannot_be_reached_is_refused(family_models, monkeypatch):
    """Claiming the registry route for GPT-Neo (whose attention never calls it) must not pass silently."""
    import qbench.quant.kv as kv

    monkeypatch.setattr(kv, "_uses_attention_registry", lambda module: True)
    with pytest.raises(UserError, match=r"did not run in 2 of 2 attention modules of GPTNeoForCausalLM") as e:
        apply_kv(_model(family_models, "gpt_neo"), KVConfig(2))
    assert "\n" not in str(e.value)


def test_falcon_keeps_its_implementation_and_its_causal_mask(family_models):
    """Falcon's attention computes itself before transformers 5.25 (its name must stay "sdpa": eager would add an
    sdpa-style mask and see the future) and goes through the attention registry from 5.25 (wrapped, as Llama).
    Either way the float model keeps "sdpa" and the quantised copy stays causal."""
    import qbench.quant.kv as kvmod

    model = _model(family_models, "falcon")
    kv = apply_kv(model, KVConfig(2, "per-token"))
    registry = kvmod._uses_attention_registry(model.transformer.h[0].self_attention)
    assert model.config._attn_implementation == "sdpa"
    assert kv.config._attn_implementation == (f"{kvmod.KV_PREFIX}sdpa" if registry else "sdpa")
    ids, _ = test_inputs()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = kv(input_ids=ids).logits, kv(input_ids=changed).logits
    torch.testing.assert_close(
        a[:, :-1], b[:, :-1], rtol=0, atol=0
    )  # the last token never reaches earlier ones
    assert not torch.equal(a[:, -1], b[:, -1])


def test_a_cache_during_generation_is_read_back_quantised(family_models):
    """Prefill then one step with a real cache equals the full forward (per-token statistics are causal)."""
    for family in ("falcon", "bloom", "mpt", "gpt_neo", "xglm"):
        kv = apply_kv(_model(family_models, family), KV["kv2-tok"])
        ids, _ = test_inputs()
        with torch.no_grad():
            full = kv(input_ids=ids, use_cache=False).logits
            prefill = kv(input_ids=ids[:, :-1], use_cache=True)
            step = kv(input_ids=ids[:, -1:], cache=prefill.past_key_values, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-4, atol=1e-4, msg=family)


def test_observers_refuse_a_layer_whose_hook_never_runs():
    """A forward that bypasses a hooked decoder layer: the statistics would silently miss it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB)
    ).eval()
    ids, _ = test_inputs()
    hooked = model.transformer.h[1]

    class Bypass(nn.Module):  # runs the block's computation without going through its hooks
        def forward(self, *args, **kwargs):
            return hooked.forward(*args, **kwargs)

    match = r"did not run in layer\(s\) 1 of GPT2LMHeadModel"
    with pytest.raises(UserError, match=match) as e, observe_any(model) as obs:
        model.transformer.h[1] = Bypass()  # the hooked block is no longer what the forward calls
        forward_observed(model, ids, obs)
    assert "\n" not in str(e.value)


def test_an_intervention_whose_layer_never_runs_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from qbench.studies.intervene import Site, intervention

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB)
    ).eval()
    ids, _ = test_inputs()
    sites = [Site(layer=1, channel=0, threshold=0.0, mean=0.0, count=1)]
    with torch.no_grad(), intervention(model, sites, "zero") as editor:
        run(model, ids)  # the edit runs ...
        assert editor.edited > 0
        hooked = model.transformer.h[1]

        class Bypass(nn.Module):
            def forward(self, *args, **kwargs):
                return hooked.forward(*args, **kwargs)

        model.transformer.h[1] = Bypass()
        with pytest.raises(UserError, match=r"intervention did not run in layer\(s\) 1 of GPT2LMHeadModel"):
            run(model, ids)  # ... and a forward that skips it is refused


def test_attention_metrics_refuse_layers_without_probabilities(family_models, monkeypatch):
    from contextlib import nullcontext

    import qbench.eval.adapters as adapters

    model = _model(family_models, "llama")
    monkeypatch.setattr(
        adapters, "_eager_attention", lambda m: nullcontext()
    )  # sdpa returns no probabilities
    ids, _ = test_inputs()
    match = "attention probabilities for 0 of its 2 layers"
    with pytest.raises(UserError, match=match), observe_any(model, attention=True) as obs:
        forward_observed(model, ids, obs)


def test_context_length_without_one_in_the_config_comes_from_the_window(family_models):
    bloom = _model(family_models, "bloom")
    with pytest.raises(UserError, match="--window") as e:
        context_length(bloom)
    assert "BloomForCausalLM" in str(e.value) and "\n" not in str(e.value)
    assert context_length(bloom, 16) == 16
    assert context_length(_model(family_models, "mpt")) == 64  # max_seq_len sizes MPT's ALiBi table
    assert context_length(_model(family_models, "gpt2"), 16) == 64  # a config's own length wins


# ------------------------------------------------------------------------------------------------ the table


def kv_route(model: nn.Module) -> str:
    """Where the KV quantiser intercepts the cache: the wrapped attention function or the cache stand-in."""
    kv = apply_kv(model, KVConfig(8, "per-token"))
    return "attention function" if kv.config._attn_implementation.startswith("qbench_kv+") else "cache.update"


def table() -> str:
    """The architecture table (markdown): per family and transform, causal and quantiser-ran."""
    header = ["family", "model class", "KV cache via", *TRANSFORMS, "statistics hooks"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for family in FAMILIES:
        model = build_family(family)
        cells = [family, type(model).__name__, kv_route(model)]
        for name in TRANSFORMS:
            r = check(model, name)
            if "refused" in r:
                cells.append("refused")
                continue
            causal = "causal" if r["causal"] else f"not causal ({r['leak']:.2g})"
            ran = (
                "" if name == "float" else (", ran in all layers" if r["every_layer"] else ", MISSED layers")
            )
            cells.append(causal + ran)
        with observe_any(model, attention=True) as obs:
            forward_observed(model, test_inputs()[0], obs)
        n = len(decoder_layers(model))
        cells.append(f"{len(obs.hidden)}/{n} outputs, {len(obs.attention)}/{n} attentions")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon", "gpt_neo", "xglm"])
def test_qbench_run_loads_the_family_and_its_kv_cache_moves_perplexity(family, tokenizer, tmp_path):
    """End to end (load, windows, KV cache): Bloom has no context length, so the window comes from --window."""
    from dataclasses import replace

    from qbench.eval.harness import GridSpec, run_grid
    from qbench.eval.metrics import Protocol

    config = family_configs()[family]()
    config.vocab_size, config.initializer_range = len(tokenizer), 0.2
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / family)
    tokenizer.save_pretrained(tmp_path / family)
    protocol = Protocol(tokens=15 * 4, batch_size=4, outlier_windows=1, window=16)
    ppl = {}
    for bits in (8, 2):
        spec = GridSpec(
            models=[str(tmp_path / family)],
            schemes=["fp"],
            protocol=protocol,
            output_path=tmp_path / f"kv{bits}",
            attention=False,
            kv=KVConfig(bits, "per-token"),  # kivi is refused where the module computes attention itself
        )
        records = run_grid(spec)
        assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
        assert records[-1]["scheme"]["name"] == f"fp+kv{bits}-tok"
        ppl[bits] = records[-1]["metrics"]["perplexity"]
        assert records[-1]["protocol"]["window"] == 16
    assert ppl[8] != ppl[2]  # the cache is quantised (they were equal when it silently was not)
    if family == "bloom":
        with pytest.raises(UserError, match="--window"):
            run_grid(replace(spec, protocol=replace(protocol, window=None), output_path=tmp_path / "none"))
