"""Observe a forward pass: each block's output (the residual stream) and attention probabilities.

    with observe(model, attention=True) as obs:
        model(input_ids)
    obs.hidden[l]     # (B, T, C): output of block l (after its residual add; not the embeddings, not ln_f)
    obs.attention[l]  # (B, nh, T, T): weights on the real keys (rows sum to < 1 under softmax-1 / sink)

When no observation is active nothing is hooked and attention takes its fused fast path, so it costs nothing.

No silent gaps: every observed forward pass is checked, when it ends, to have recorded every block it claims
(:class:`EveryLayer`); a block whose hook did not run (a layout the hooks do not fit) raises a one-line
``UserError`` instead of handing back statistics with layers missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from models.errors import UserError
from models.transformer import Transformer


@dataclass
class Observation:
    hidden: list[Tensor] = field(default_factory=list)
    attention: list[Tensor] = field(default_factory=list)


class EveryLayer:
    """Checks, at the end of each forward pass of a model, that a per-layer hook ran in every layer it claims.

    Hooks call :meth:`hit` with their layer's index; :meth:`attach` adds a pre-hook on the whole model that
    resets the counts and a hook that raises :class:`UserError` naming the model class and the layers that
    were missed. This is the probe: the first forward pass after attaching (or a short one run on purpose)."""

    def __init__(self, model: nn.Module, layers: list[int], what: str, supported: str) -> None:
        self.model_name = type(model).__name__
        self.layers, self.what, self.supported = layers, what, supported
        self.counts: dict[int, int] = dict.fromkeys(layers, 0)

    def hit(self, layer: int) -> None:
        self.counts[layer] = self.counts.get(layer, 0) + 1

    def check(self) -> None:
        missed = [layer for layer in self.layers if not self.counts.get(layer)]
        if missed:
            raise UserError(
                f"{self.what} did not run in layer(s) {', '.join(map(str, missed))} of {self.model_name}: "
                f"supported are {self.supported}"
            )

    def attach(self, model: nn.Module) -> list[RemovableHandle]:
        def start(_module: nn.Module, _args: tuple) -> None:
            self.counts = dict.fromkeys(self.layers, 0)

        def end(_module: nn.Module, _args: tuple, _output: object) -> None:
            self.check()

        return [model.register_forward_pre_hook(start), model.register_forward_hook(end)]


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
    handles: list[RemovableHandle] = []
    supported = "qbench models whose blocks run in model.transformer.h"
    checks = []
    if hidden:
        ran_hidden = EveryLayer(model, list(range(len(blocks))), "recording block outputs", supported)
        checks.append(ran_hidden)
        for index, block in enumerate(blocks):
            handles.append(block.register_forward_hook(_record(obs, "hidden", move, ran_hidden, index)))
    try:
        if attention:
            ran_attention = EveryLayer(
                model, list(range(len(blocks))), "recording attention probabilities", supported
            )
            checks.append(ran_attention)
            for index, block in enumerate(blocks):
                block.attn.probs_hook = _record(obs, "attention", move, ran_attention, index, probs=True)
        for check in checks:
            handles.extend(check.attach(model))
        yield obs
    finally:
        for handle in handles:
            handle.remove()
        for block in blocks:
            block.attn.probs_hook = None


def _record(obs: Observation, field_name: str, move, ran: EveryLayer, index: int, probs: bool = False):
    """A hook appending what it sees (a block's output, or attention probabilities) to ``obs.<field_name>`` —
    looked up at each call, so a caller may swap in its own accumulator — and counting the call."""
    if probs:

        def record_probs(tensor: Tensor) -> None:
            ran.hit(index)
            getattr(obs, field_name).append(move(tensor))

        return record_probs

    def record(_module: nn.Module, _args: tuple, output: Tensor) -> None:
        ran.hit(index)
        getattr(obs, field_name).append(move(output))

    return record
