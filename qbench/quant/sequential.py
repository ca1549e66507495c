"""Sequential calibration: each decoder block's statistics from the outputs of the blocks already quantised before
it, as GPTQ's reference code (``opt.py``'s ``opt_sequential``), GPTQModel and llm-compressor's sequential
pipeline run GPTQ and AWQ.

The float-input variant (``calibrate.input_statistics``) runs the calibration windows through the float model once
and gives every layer the Hessian of its *float* inputs; the quantisation error of earlier layers is then invisible
to later ones. Here instead:

1. The windows run through the model up to the first decoder block, whose inputs (hidden states, and the keyword
   arguments the model passes every block: positions, rotary tables, masks) are kept — one set of arguments per
   batch shape, as the windows carry no padding and the arguments depend on nothing else.
2. For each block in turn: the float block runs on the kept hidden states with hooks on its target layers
   (``calibrate.StatisticsCollector``); the caller solves those layers (GPTQ, AWQ) and builds their quantised
   replacements; a copy of the block with the replacements (the float block is never modified) runs on the same
   hidden states, and its outputs become the next block's inputs. So block i is calibrated on what the quantised
   blocks 0 … i−1 produce, activation quantisers included.
3. Held-out windows, when given, travel the same way through the quantised blocks; their statistics feed no solve
   and say how the solution does on tokens it did not see (``qbench.quant.solve``).

Cost: each block runs twice per window (float with hooks, quantised to propagate) — about two forward passes of
the model without its output head — and the hidden states of all windows are held at once (windows × tokens ×
width floats: 128 × 2,048 × 576 × 4 B = 604 MB for SmolLM2-135M).

Target layers outside the decoder blocks (an LM head quantised with ``head=true``) are calibrated on the float
model's inputs; the solve says which (``float_input``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.calibrate import (
    StatisticsCollector,
    calibration_batches,
    check_statistics_finite,
    stop_before_head,
)
from qbench.quant.offload import execution_device


class _Captured(Exception):
    """Raised at the first block's input while capturing: nothing after it is needed."""


@dataclass
class Stream:
    """The hidden states entering the current block, batch by batch, and the other arguments every block takes
    (per batch shape)."""

    hidden: list[Tensor] = field(default_factory=list)
    args: dict[tuple[int, ...], tuple[tuple, dict[str, Any]]] = field(default_factory=dict)

    def call(self, block: nn.Module, i: int) -> Tensor:
        h = self.hidden[i]
        args, kwargs = self.args[tuple(h.shape)]
        out = block(h, *args, **kwargs)
        return out[0] if isinstance(out, tuple | list) else out


def decoder_blocks(model: nn.Module, layers: dict[str, nn.Module]) -> tuple[str, nn.ModuleList]:
    """(name, blocks): the ``nn.ModuleList`` holding the most target layers — the decoder blocks of any model
    qbench loads (``transformer.h`` of ours and GPT-2, ``model.layers`` of Llama-family models). A one-line error
    where no list holds a target layer."""
    owner = {id(m): n for n, m in layers.items()}
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            held = sum(1 for m in module.modules() if id(m) in owner)
            if held and (best is None or held > best[0]):
                best = (held, name, module)
    if best is None:
        raise UserError(
            f"sequential calibration: {type(model).__name__} keeps none of its quantised layers in a list of "
            "blocks; calibrate on the float model's inputs (sequential=false)"
        )
    return best[1], best[2]


def _model_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments for a calibration forward: no KV cache for a transformers model (a cache object would
    otherwise travel with the blocks' arguments and grow with every replay)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return {}
    return {"use_cache": False} if isinstance(model, PreTrainedModel) else {}


def check_shared_arguments(model: nn.Module, blocks: nn.ModuleList, probe: Tensor) -> None:
    """Refuse models whose blocks take different arguments (sliding-window layers beside full-attention ones get
    different masks): replaying block i with block 0's arguments would compute another function. Checked on a
    short probe — every block must receive the very objects block 0 receives."""
    seen: list[tuple[tuple, dict[str, Any]]] = []

    def pre(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        seen.append((args[1:], kwargs))

    handles = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad(), stop_before_head(model, ()) as run:
            run(probe, **_model_kwargs(model))
    finally:
        for h in handles:
            h.remove()
    first = seen[0] if seen else None
    for i, other in enumerate(seen[1:], start=1):
        if not _same_arguments(first, other):
            raise UserError(
                f"sequential calibration: block {i} of {type(model).__name__} takes other arguments than block 0 "
                "(per-layer attention masks or positions); calibrate on the float model's inputs (sequential=false)"
            )


def _same_arguments(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_arguments(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_arguments(a[k], b[k]) for k in a)
    return a is b or a == b


def capture(model: nn.Module, first_block: nn.Module, windows: Tensor, device: torch.device) -> Stream:
    """The first block's inputs for every batch of ``windows`` (:class:`Stream`)."""
    stream = Stream()

    def pre(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        h = args[0].detach()
        stream.hidden.append(h)
        stream.args.setdefault(tuple(h.shape), (tuple(args[1:]), dict(kwargs)))
        raise _Captured

    handle = first_block.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in calibration_batches(windows.to(device)):
                with suppress(_Captured):
                    model(batch, **_model_kwargs(model))
    finally:
        handle.remove()
    return stream


# (names and modules of one block's target layers, their statistics) -> {layer name: its quantised replacement}
SolveBlock = Callable[[dict[str, nn.Module], dict[str, Any]], dict[str, nn.Module]]


def run_sequential(
    model: nn.Module,
    layers: dict[str, nn.Module],
    calibration: Tensor,
    held_out: Tensor | None,
    solve_block: SolveBlock,
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Calibrate block by block (module docstring). ``solve_block(block_layers, statistics)`` solves one block's
    layers and returns their replacements, used to propagate the windows. Returns (calibration statistics,
    held-out statistics — {} without held-out windows, the names of target layers outside the blocks, which
    the caller calibrates on float inputs). The model's train/eval flags come back as they were; the model itself
    is never modified."""
    _, blocks = decoder_blocks(model, layers)
    device = execution_device(model)
    where = {id(m): n for n, m in layers.items()}
    per_block = [{where[id(m)]: m for m in b.modules() if id(m) in where} for b in blocks]
    inside = {n for group in per_block for n in group}
    outside = [n for n in layers if n not in inside]
    modes = {m: m.training for m in model.modules()}
    stats: dict[str, Any] = {}
    held: dict[str, Any] = {}
    try:
        model.eval()
        check_shared_arguments(model, blocks, calibration[:1, : min(8, calibration.shape[1])].to(device))
        streams = [capture(model, blocks[0], calibration, device)]
        if held_out is not None and len(held_out):
            streams.append(capture(model, blocks[0], held_out, device))
        for index, block in enumerate(blocks):
            mine = per_block[index]
            quantised = block
            if mine:
                found = [_collect(block, mine, s) for s in streams]
                stats.update(found[0])
                if len(found) > 1:
                    held.update(found[1])
                replacements = solve_block(mine, found[0])
                memo = {id(mine[n]): replacements[n] for n in mine}
                quantised = copy.deepcopy(block, memo)
            if index + 1 < len(blocks):
                with torch.no_grad():
                    for s in streams:
                        s.hidden = [s.call(quantised, i) for i in range(len(s.hidden))]
    finally:
        for m, training in modes.items():
            m.training = training
    return stats, held, outside


def _collect(block: nn.Module, layers: dict[str, nn.Module], stream: Stream) -> dict[str, Any]:
    collector = StatisticsCollector(layers)
    with torch.no_grad(), collector.attached():
        for i in range(len(stream.hidden)):
            stream.call(block, i)
            collector.end_batch()
    found = collector.result()
    missing = sorted(set(layers) - set(found))
    if missing:
        raise UserError(f"sequential calibration: layer {missing[0]!r} never ran in its block; exclude it")
    check_statistics_finite(
        found, layers
    )  # NaN/inf inputs: a NonFiniteError naming the layer, as float-input
    return found
