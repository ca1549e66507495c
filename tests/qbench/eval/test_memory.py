"""Peak memory of the statistics and the perplexity does not grow with the number of windows.

What would make it grow (seen: ``qbench card`` on SmolLM2-135M killed at 22 GB): transformers'
``output_attentions`` keeping every layer's (B, nh, T, T) map until the forward pass ends, and a whole batch's
(B, T, vocabulary) logits plus cross-entropy's copy of them. The tests count what is alive at once instead of
timing or measuring RSS, so they are exact on any CPU.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import qbench.eval.metrics as metrics
from qbench.eval.adapters import MAX_DEFAULT_WINDOW, default_window, forward_observed, observe_any
from qbench.eval.metrics import Windows, forward_rows, outlier_metrics, perplexity


def tiny_llama(context: int = 64):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128,
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
    )
    return tf.LlamaForCausalLM(config).eval()


def windows(n: int, t: int = 16) -> Windows:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, t + 1), generator=g)
    return Windows(ids[:, :-1], ids[:, 1:], n * t, n * (t + 1), False, t)


def test_one_attention_map_alive_at_a_time():
    """Each layer's map reaches the consumer as its module returns it and is gone before the next layer's."""
    model = tiny_llama()
    alive_max = [0]
    refs: list[weakref.ref] = []

    class Consumer(list):
        def append(self, probs):
            gc.collect()
            refs.append(weakref.ref(probs))
            alive_max[0] = max(alive_max[0], sum(r() is not None for r in refs))

    ids = windows(2).ids
    with observe_any(model, attention=True) as obs:
        obs.attention = Consumer()
        forward_observed(model, ids, obs)
    assert len(refs) == 3  # every layer's map was seen ...
    assert alive_max[0] == 1  # ... and none outlived its layer (output_attentions keeps all 3)


def test_forward_batches_shrink_to_the_budget(monkeypatch):
    """With a budget of one window's logits, every forward pass sees one window, and the numbers do not move."""
    model = tiny_llama()
    w = windows(6)
    full = perplexity(model, w, batch_size=6)
    stats_full = outlier_metrics(model, w, n_windows=6, batch_size=6)
    seen: list[int] = []
    real = metrics.logits
    monkeypatch.setattr(metrics, "LOGITS_BUDGET", 4 * 16 * 128)  # one window of 16 tokens x 128 logits
    monkeypatch.setattr(metrics, "logits", lambda m, ids: seen.append(len(ids)) or real(m, ids))
    assert forward_rows(model, 6, 16) == 1
    small = perplexity(model, w, batch_size=6)
    assert set(seen) == {1} and len(seen) == 6
    assert small["nll"] == pytest.approx(full["nll"], rel=1e-6) and small["tokens"] == full["tokens"]
    stats_small = outlier_metrics(model, w, n_windows=6, batch_size=6)
    assert stats_small["kurtosis_other"] == pytest.approx(stats_full["kurtosis_other"], rel=1e-5)
    assert stats_small["first_token_mass"] == pytest.approx(stats_full["first_token_mass"], rel=1e-5)


def test_attention_budget_bounds_the_batch(monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(metrics, "ATTENTION_BUDGET", 4 * 4 * 16 * 16 * 2)  # two windows' maps of 4 heads
    assert forward_rows(model, 8, 16, attention=True) == 2
    assert forward_rows(model, 8, 16, attention=False) == 8


def test_the_default_window_is_capped_as_lm_eval_caps_it():
    assert default_window(tiny_llama(context=8192)) == MAX_DEFAULT_WINDOW == 2048
    assert default_window(tiny_llama(context=64)) == 64
    assert default_window(tiny_llama(context=8192), 4096) == 4096  # an explicit --window wins


def test_a_window_that_cannot_fit_is_refused_in_one_line(monkeypatch):
    from models.errors import UserError

    monkeypatch.setattr(metrics, "available_memory", lambda: 2**10)  # 1 KiB free
    with pytest.raises(
        UserError,
        match=r"needs ~.* GiB \(logits over a 128-token vocabulary\), .* GiB available beside the model's .* GiB "
        r"of weights; use a smaller --window .*--dtype bfloat16",
    ):
        perplexity(tiny_llama(), windows(2, t=64))


def test_a_model_larger_than_the_memory_left_is_refused_before_loading(monkeypatch, ckpt_dir, hf_llama_dir):
    """The weights' size comes from the files' headers (no tensor read), at the dtype asked for."""
    import qbench.eval.load as load
    from models.errors import UserError

    params = load.stored_parameters(ckpt_dir)
    assert params == load.load_model(str(ckpt_dir)).model.num_parameters()
    monkeypatch.setattr(
        metrics, "available_memory", lambda: 3 * params
    )  # float32 does not fit, bfloat16 does
    with pytest.raises(UserError, match=r"float32 weights, .* available here; load it with --dtype bfloat16"):
        load.load_model(str(ckpt_dir))
    assert load.load_model(str(ckpt_dir), dtype="bfloat16").model is not None
    with pytest.raises(UserError, match=r"B parameters: ~.* GiB of float32 weights"):
        load.load_model(str(hf_llama_dir))


def test_the_weights_counted_are_the_files_a_load_reads(tmp_path):
    """A sharded folder: the shards its index names; a single file: model.safetensors only (not a second copy in
    another dtype, not a trainer's state); a file that is no safetensors: unknown, never read whole."""
    import json

    from safetensors.torch import save_file

    import qbench.eval.load as load

    sharded, single = tmp_path / "sharded", tmp_path / "single"
    sharded.mkdir(), single.mkdir()
    save_file({"a": torch.zeros(3, 4)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(5)}, str(sharded / "model-00002-of-00002.safetensors"))
    save_file(
        {"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(sharded / "model.safetensors")
    )  # consolidated too
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load.stored_parameters(sharded) == 17
    save_file({"w": torch.zeros(6, 7)}, str(single / "model.safetensors"))
    save_file({"w": torch.zeros(6, 7, dtype=torch.float16)}, str(single / "model.fp16.safetensors"))
    save_file({"m": torch.zeros(100)}, str(single / "trainer_state.safetensors"))
    assert load.stored_parameters(single) == 42
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    assert load.stored_parameters(garbage) is None
