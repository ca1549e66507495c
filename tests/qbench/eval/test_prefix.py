"""``qbench.eval.prefix``: replaying the float model's block outputs gives the same perplexity to the last bit.

For our GPT-2 and Llama layouts (four blocks, units visited forwards and backwards) and for every transformers
family of ``test_architectures`` (fifteen families, seventeen layouts), a model quantised in one block only is
evaluated twice — plainly, and with blocks 0..b-1 replayed from the stored float outputs — and the two
perplexities must be equal (``==``, not close). The comparison that decides where replay starts must find the
quantised block exactly, refuse a change outside the blocks, and a replay of the wrong batches must fail loudly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.config import family_config
from models.transformer import build
from qbench.eval.adapters import decoder_layers
from qbench.eval.metrics import Windows, perplexity
from qbench.eval.prefix import BlockPrefix, same_module
from qbench.quant import get_scheme, quantize
from qbench.quant.apply import select_layers
from qbench.quant.kv import KVConfig, apply_kv, attach_kv
from tests.qbench.eval.test_architectures import FAMILIES, VOCAB, build_family

SCHEME = "absmax-fine"


def micro_config(family: str, n_layer: int = 2):
    return family_config(family, n_layer=n_layer, n_head=4, d_model=32, d_ff=64, context=32, vocab_size=512)


def windows(vocab: int, n: int = 5, t: int = 12) -> Windows:
    ids = torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(4))
    return Windows(ids, targets, n * t, n * t, False, t)


def quantised_in(model: torch.nn.Module, block: int, kv: KVConfig | None = None) -> torch.nn.Module:
    """``model`` quantised in decoder block ``block`` only (every other target kept float)."""
    scheme = get_scheme(SCHEME)
    prefix = next(n for n, m in model.named_modules() if m is decoder_layers(model)[block]) + "."
    others = [t for t in select_layers(model, scheme) if not t.startswith(prefix)]
    copy = quantize(model, scheme, mode="fake", exclude=others)
    return attach_kv(copy, kv) if kv is not None else copy


def both(
    prefix: BlockPrefix, qmodel: torch.nn.Module, w: Windows, batch: int = 2
) -> tuple[float, float, int]:
    """(plain perplexity, replayed perplexity, first changed block)."""
    plain = perplexity(qmodel, w, batch)["perplexity"]
    first = prefix.first_changed_block(qmodel)
    with prefix.replay(qmodel, first, w.ids, batch, "cpu"):
        replayed = perplexity(qmodel, w, batch)["perplexity"]
    return plain, replayed, first


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_ours_replay_is_exact_forwards_and_backwards(family):
    model = build(micro_config(family, n_layer=4), seed=0).eval()
    w = windows(model.config.vocab_size)
    prefix = BlockPrefix(model)
    for block in (1, 2, 3, 1, 0):  # forwards (stored states advance), then back (recomputed from the start)
        plain, replayed, first = both(prefix, quantised_in(model, block), w)
        assert first == block
        assert replayed == plain, (block, plain, replayed)
    # 4 replays (block 0 has nothing to replay), 1+2+3+1 blocks skipped, one capture per distinct target
    assert prefix.stats == {"replayed": 4, "blocks_skipped": 7, "captures": 4}


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_families_replay_is_exact(family):
    model = build_family(family)
    w = windows(VOCAB)
    prefix = BlockPrefix(model)
    plain, replayed, first = both(prefix, quantised_in(model, 1), w)
    assert first == 1, f"{family}: the quantised block is 1, the comparison says {first}"
    assert replayed == plain
    assert prefix.stats["blocks_skipped"] == 1


@pytest.mark.parametrize("which", ["ours", "transformers-llama", "transformers-gpt2"])
def test_with_a_quantised_kv_cache_the_reference_carries_it(which):
    if which == "ours":
        model, block = build(micro_config("llama", n_layer=3), seed=0).eval(), 2
    else:
        model, block = build_family(which.split("-")[1]), 1
    kv = KVConfig(4, "kivi:group=4,residual=4")
    w = windows(model.config.vocab_size)
    prefix = BlockPrefix(apply_kv(model, kv))
    plain, replayed, first = both(prefix, quantised_in(model, block, kv), w)
    assert first == block and replayed == plain
    # against the float reference without the cache, the cache's blocks differ from the first one: no replay
    assert BlockPrefix(model).first_changed_block(quantised_in(model, block, kv)) == 0


def test_a_change_outside_the_blocks_means_no_replay():
    model = build(micro_config("llama", n_layer=3), seed=0).eval()
    copy = quantize(model, get_scheme(SCHEME), mode="fake", exclude=["*"], allow_empty=True)
    assert BlockPrefix(model).first_changed_block(copy) == 3  # nothing quantised: every block replays
    # the embedding differs (a tensor of its own: the copy shares the float model's storage, so an edit in place
    # would reach the float model too): nothing before block 0 is shared
    edited = copy.transformer.wte.weight.detach().clone()
    edited[0, 0] += 1e-3
    copy.transformer.wte.weight = torch.nn.Parameter(edited, requires_grad=False)
    assert BlockPrefix(model).first_changed_block(copy) == 0
    with_head = dataclasses.replace(get_scheme(SCHEME), quantize_lm_head=True)
    head = quantize(model, with_head, mode="fake", exclude=["transformer.*"])
    assert BlockPrefix(model).first_changed_block(head) == 0


def test_a_hook_outside_the_blocks_means_no_replay_and_the_reference_may_be_built_late():
    """A hook on the model may run passes of its own (the KV sink finder's float pre-pass) through the replayed
    blocks; and a reference built by a factory is built once, on first use."""
    model = build(micro_config("llama", n_layer=3), seed=0).eval()
    built = []
    prefix = BlockPrefix(lambda: built.append(1) or model)
    assert not built
    copy = quantised_in(model, 2)
    assert prefix.first_changed_block(copy) == 2 and prefix.first_changed_block(copy) == 2 and built == [1]
    handle = copy.register_forward_pre_hook(lambda *args: None)
    assert prefix.first_changed_block(copy) == 0
    handle.remove()


def test_same_module_sees_weights_hooks_and_patched_forwards():
    a = build(micro_config("gpt2"), seed=0).eval()
    b = build(micro_config("gpt2"), seed=0).eval()
    assert same_module(a, b)
    handle = b.transformer.h[0].register_forward_hook(lambda *args: None)
    assert not same_module(a, b)
    handle.remove()
    b.transformer.h[1].mlp.forward = lambda x: x
    assert not same_module(a, b)
    del b.transformer.h[1].mlp.forward
    with torch.no_grad():
        b.transformer.h[1].ln_1.weight[3] = float(
            torch.nextafter(b.transformer.h[1].ln_1.weight[3], torch.tensor(2.0))
        )
    assert not same_module(a, b)


def test_replaying_other_batches_fails_loudly():
    model = build(micro_config("gpt2", n_layer=3), seed=0).eval()
    w = windows(model.config.vocab_size)
    prefix = BlockPrefix(model)
    qmodel = quantised_in(model, 2)
    with pytest.raises(RuntimeError, match="not the batch"), prefix.replay(qmodel, 2, w.ids, 2, "cpu"):
        perplexity(qmodel, Windows(w.ids.flip(0), w.targets, 60, 60, False, 12), 2)
    swapped = w.ids.clone()
    swapped[[0, 1]] = swapped[
        [1, 0]
    ]  # two windows swapped inside the first batch: same plain sum, other order
    with pytest.raises(RuntimeError, match="not the batch"), prefix.replay(qmodel, 2, w.ids, 2, "cpu"):
        perplexity(qmodel, Windows(swapped, w.targets, 60, 60, False, 12), 2)
    with pytest.raises(RuntimeError, match="replayed 1 of 3"), prefix.replay(qmodel, 2, w.ids, 2, "cpu"):
        perplexity(qmodel, Windows(w.ids[:2], w.targets[:2], 24, 24, False, 12), 2)
    for blk in decoder_layers(qmodel):  # a failed replay restores the blocks
        assert "forward" not in vars(blk)
