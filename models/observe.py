"""Observe a forward pass: each block's output (the residual stream) and attention probabilities.

    with observe(model, attention=True) as obs:
        model(input_ids)
    obs.hidden[l]     # (B, T, C): output of block l (after its residual add; not the embeddings, not ln_f)
    obs.attention[l]  # (B, nh, T, T): weights on the real keys (rows sum to < 1 under softmax-1 / sink)

When no observation is active nothing is hooked and attention takes its fused fast path, so it costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor, nn

from models.transformer import Transformer


@dataclass
class Observation:
    hidden: list[Tensor] = field(default_factory=list)
    attention: list[Tensor] = field(default_factory=list)


@contextmanager
def observe(
    model: Transformer, hidden: bool = True, attention: bool = False, to_cpu: bool = False
) -> Iterator[Observation]:
    """Record block outputs and/or attention probabilities of every forward pass run inside the block.

    Tensors are detached (and moved to the CPU with ``to_cpu``); several forward passes append in order.
    Attention probabilities force the explicit reference path, which is slower and O(T^2) in memory.
    """
    obs = Observation()
    blocks: list[nn.Module] = list(model.transformer.h)
    move = (lambda t: t.detach().cpu()) if to_cpu else (lambda t: t.detach())
    handles = []
    if hidden:
        for block in blocks:
            handles.append(block.register_forward_hook(lambda _m, _i, out: obs.hidden.append(move(out))))
    try:
        if attention:
            for block in blocks:
                block.attn.probs_hook = lambda probs: obs.attention.append(move(probs))
        yield obs
    finally:
        for handle in handles:
            handle.remove()
        for block in blocks:
            block.attn.probs_hook = None
