"""Replay the float model's hidden states in front of the first quantised block.

A per-unit study (``qbench sensitivity --by layer|block``, the card's repair map) quantises one unit at a time and
evaluates the whole model each time. When the unit sits in decoder block ``b``, blocks ``0 .. b-1`` of the
quantised copy compute exactly what the float model computes: same weights, same inputs, same kernels, same
batches. :class:`BlockPrefix` computes the float model's output of block ``b-1`` once per evaluation batch, keeps
it, and makes the copy's blocks ``0 .. b-1`` hand it over instead of recomputing it, so a unit in block ``b`` costs
the blocks ``≥ b`` and the head. The perplexity is the same number to the last bit (tests compare it with the
plain evaluation on our models and on transformers' GPT-2 and Llama).

Nothing is assumed about where a scheme changes the model: :meth:`BlockPrefix.first_changed_block` compares the
copy with the reference module by module (types, parameters, buffers, hooks, plain attributes) and returns the
first block that differs; anything outside the blocks that differs (a quantised head, a rotated embedding) means
no replay at all. Units are studied in model order, so the stored states advance block by block: over a whole
study the reference costs about one float forward pass, and memory holds one block's input for the windows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.eval.adapters import decoder_layers, logits

# Attributes every module has that are compared structurally (or not at all) rather than by value.
_STRUCTURAL = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_is_full_backward_hook",
        # a label quantize() puts on the copy it returns (what was applied); no forward pass reads it
        "qbench_scheme",
    }
)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class ReplayMismatch(RuntimeError):
    """A replayed forward pass did not meet the batches that were stored (another batching, order or count): the
    caller evaluates the whole model instead, never a number from the wrong hidden states."""


class _Stop(BaseException):  # not an Exception: no ``except Exception`` in model code may swallow it
    """Raised from a hook once the wanted block output is captured: the rest of the forward pass is not needed."""


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if a is b:
        return True
    if isinstance(a, nn.Module) and isinstance(b, nn.Module):
        # a module held outside ``_modules`` (transformers keeps hub-kernel function wrappers in a plain dict,
        # ``_kernel_funcs``): compared as a module, since deepcopy makes a new one without value equality
        return _same_held_module(a, b)
    key = getattr(type(a), "computation_key", None)
    if callable(key) and type(a) is type(b):  # a stateful helper that names what decides its output
        return _same_value(a.computation_key(), b.computation_key())
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # deepcopy makes a new one
        return (
            _same_value(a.func, b.func)
            and _same_value(a.args, b.args)
            and _same_value(a.keywords, b.keywords)
        )
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object without a usable equality: a difference (no replay, never a wrong one)
        return False


_COMPARING: set[tuple[int, int]] = set()  # module pairs under comparison through plain attributes


def _same_held_module(a: nn.Module, b: nn.Module) -> bool:
    """``same_module`` for a module reached through a plain attribute; a pair met again while it is being compared
    (an attribute pointing back up the tree) counts as a difference: no replay, never a wrong one."""
    pair = (id(a), id(b))
    if pair in _COMPARING:
        return False
    _COMPARING.add(pair)
    try:
        return same_module(a, b)
    finally:
        _COMPARING.discard(pair)


def _same_node(a: nn.Module, b: nn.Module) -> bool:
    """One module against another, not descending into its children (only their names): type, hook counts,
    parameters and buffers by value, no per-instance ``forward``, plain attributes by value (a transformers
    config compares by value)."""
    if type(a) is not type(b) or a._modules.keys() != b._modules.keys():
        return False
    if any(len(getattr(a, h, {})) != len(getattr(b, h, {})) for h in _HOOKS):
        return False
    if a._parameters.keys() != b._parameters.keys() or a._buffers.keys() != b._buffers.keys():
        return False
    if not all(_same_value(a._parameters[k], b._parameters[k]) for k in a._parameters):
        return False
    if not all(_same_value(a._buffers[k], b._buffers[k]) for k in a._buffers):
        return False
    attrs_a = {k: v for k, v in vars(a).items() if k not in _STRUCTURAL}
    attrs_b = {k: v for k, v in vars(b).items() if k not in _STRUCTURAL}
    if attrs_a.keys() != attrs_b.keys() or "forward" in attrs_a:
        return False
    return all(_same_value(attrs_a[k], attrs_b[k]) for k in attrs_a)


def same_module(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``a`` and ``b`` compute the same function: the same module tree (names and types), equal parameters
    and buffers, the same number of hooks, no per-instance ``forward``, and equal plain attributes. Conservative:
    an attribute it cannot compare counts as a difference."""
    mods_a, mods_b = dict(a.named_modules()), dict(b.named_modules())
    return mods_a.keys() == mods_b.keys() and all(_same_node(m, mods_b[name]) for name, m in mods_a.items())


def _hidden_input(args: tuple, kwargs: dict[str, Any]) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _fingerprint(x: Tensor) -> tuple[tuple[int, ...], float]:
    """(shape, position-weighted float64 sum of the per-token sums) of a block's input: a replayed batch must be
    the batch that was stored, in the same order (a plain sum would not see windows swapped within a batch)."""
    per_token = x.detach().sum(-1, dtype=torch.float64)
    weights = torch.arange(1, per_token.numel() + 1, device=x.device, dtype=torch.float64).view_as(per_token)
    return tuple(x.shape), float((per_token * weights).sum())


@dataclass
class _Stored:
    block: int  # the outputs are those of block ``block - 1`` (the input of block ``block``)
    outputs: list[Any]  # per evaluation batch, the block's raw return value
    fingerprints: list[tuple[tuple[int, ...], float]]  # per batch, of block 0's input (the embeddings)


@dataclass
class BlockPrefix:
    """The float reference's block outputs, replayed into quantised copies (module docstring).

    ``reference``: the model every studied copy equals outside the quantised unit — the float model, with the
    study's KV-cache quantisation applied when it has one.
    """

    reference: nn.Module | Callable[[], nn.Module]  # or a factory, called on first use
    stats: dict[str, int] = field(default_factory=lambda: {"replayed": 0, "blocks_skipped": 0, "captures": 0})
    _ids: Tensor | None = None
    _batch_size: int | None = None
    _stored: _Stored | None = None
    _model: nn.Module | None = None

    @property
    def model(self) -> nn.Module:
        """The reference, built on first use from a factory: a study builds it after its float record, whose
        statistics pass may leave hooks on the float model (transformers' output capturing) that copies inherit."""
        if self._model is None:
            self._model = self.reference if isinstance(self.reference, nn.Module) else self.reference()
        return self._model

    def release(self) -> None:
        """Drop the stored block outputs (one block's hidden states for every window)."""
        self._stored = self._ids = None

    def first_changed_block(self, model: nn.Module) -> int:
        """The first decoder block of ``model`` that differs from the reference (``len(blocks)`` when none does);
        0 when anything outside the blocks differs, the two do not have the same blocks, or a layout's blocks cannot
        be found (it is evaluated whole, as without a prefix)."""
        try:
            ref_blocks, blocks = decoder_layers(self.model), decoder_layers(model)
        except UserError:
            return 0
        if len(ref_blocks) != len(blocks):
            return 0
        inside = {id(m) for blk in blocks for m in blk.modules()}
        ref_inside = {id(m) for blk in ref_blocks for m in blk.modules()}
        outside = {n: m for n, m in model.named_modules() if id(m) not in inside}
        ref_outside = {n: m for n, m in self.model.named_modules() if id(m) not in ref_inside}
        if outside.keys() != ref_outside.keys():
            return 0
        # a hook outside the blocks may run passes of its own (the KV sink finder's float pre-pass): those would go
        # through the replayed blocks, so such a model always runs whole
        if any(len(getattr(m, h, {})) for d in (outside, ref_outside) for m in d.values() for h in _HOOKS):
            return 0
        for name, module in outside.items():  # the module itself only: its blocks are compared below
            if not _same_node(module, ref_outside[name]):
                return 0
        for i, (blk, ref) in enumerate(zip(blocks, ref_blocks, strict=True)):
            if not same_module(blk, ref):
                return i
        return len(blocks)

    @torch.no_grad()
    def _advance(self, block: int, ids: Tensor, batch_size: int, device: str) -> _Stored:
        """The reference's outputs of block ``block - 1`` for every batch: from the stored block when it lies
        before ``block`` (only the blocks in between run), else from the embeddings."""
        same_windows = (
            self._ids is not None and self._batch_size == batch_size and torch.equal(self._ids, ids)
        )
        if not same_windows:
            self._ids, self._batch_size, self._stored = ids, batch_size, None
        stored = self._stored
        if stored is not None and stored.block == block:
            return stored
        start = stored if stored is not None and stored.block < block else None
        target = decoder_layers(self.model)[block - 1]
        outputs: list[Any] = []
        fingerprints: list[tuple[tuple[int, ...], float]] = []
        captured: list[Any] = []

        def capture(_m: nn.Module, _args: tuple, output: Any) -> None:
            captured.append(_map_tensors(Tensor.detach, output))
            raise _Stop

        def first(_m: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            if start is None:
                fingerprints.append(_fingerprint(_hidden_input(args, kwargs)))

        hooks = [
            target.register_forward_hook(capture),
            decoder_layers(self.model)[0].register_forward_pre_hook(first, with_kwargs=True),
        ]
        try:
            for n, begin in enumerate(range(0, len(ids), batch_size)):
                captured.clear()
                try:
                    with _replaying(self.model, start, batch=n) if start is not None else nullcontext():
                        logits(self.model, ids[begin : begin + batch_size].to(device))
                except _Stop:
                    pass
                if not captured:
                    raise RuntimeError(f"block {block - 1} did not run in the reference forward pass")
                outputs.append(captured[0])
        finally:
            for h in hooks:
                h.remove()
        self.stats["captures"] += 1
        self._stored = _Stored(block, outputs, start.fingerprints if start is not None else fingerprints)
        return self._stored

    @contextmanager
    def replay(
        self, model: nn.Module, block: int, ids: Tensor, batch_size: int, device: str
    ) -> Iterator[None]:
        """Within the block, ``model``'s forward passes over ``ids`` in batches of ``batch_size`` (in order, as
        ``qbench.eval.metrics.perplexity`` makes them) skip blocks ``0 .. block-1`` and start from the stored
        float states. Every batch is checked against the stored one, and all must be consumed."""
        if block <= 0:
            yield
            return
        stored = self._advance(block, ids, batch_size, device)
        with _replaying(model, stored) as calls:
            yield
        if calls["n"] != len(stored.outputs):
            raise ReplayMismatch(f"replayed {calls['n']} of {len(stored.outputs)} stored batches")
        self.stats["replayed"] += 1
        self.stats["blocks_skipped"] += block


def _map_tensors(fn: Callable[[Tensor], Tensor], output: Any) -> Any:
    """``fn`` on a block's return value: a tensor, or a tuple of tensors and other things."""
    if isinstance(output, Tensor):
        return fn(output)
    if isinstance(output, tuple):
        return tuple(_map_tensors(fn, o) for o in output)
    return output


@contextmanager
def _replaying(model: nn.Module, stored: _Stored, batch: int | None = None) -> Iterator[dict[str, Any]]:
    """Blocks ``0 .. stored.block-1`` of ``model`` return the stored output of the current batch. The batch is
    ``batch`` when given, else counted by the calls of block 0 (one per forward pass)."""
    blocks = decoder_layers(model)[: stored.block]
    calls: dict[str, Any] = {"n": 0 if batch is None else batch, "output": None}

    def head(*args: Any, **kwargs: Any) -> Any:  # block 0: find this batch, check it is the stored one
        index = calls["n"]
        if index >= len(stored.outputs):
            raise ReplayMismatch(f"more forward passes than the {len(stored.outputs)} stored batches")
        if _fingerprint(_hidden_input(args, kwargs)) != stored.fingerprints[index]:
            raise ReplayMismatch(f"batch {index} is not the batch whose hidden states were stored")
        if batch is None:
            calls["n"] += 1
        # a copy per pass: a block that wrote into its input in place must not change what later cells read
        calls["output"] = _map_tensors(Tensor.clone, stored.outputs[index])
        return calls["output"]

    def rest(*_args: Any, **_kwargs: Any) -> Any:  # blocks 1 .. b-1: their work is in the stored output
        return calls["output"]

    for i, blk in enumerate(blocks):
        blk.forward = head if i == 0 else rest
    try:
        yield calls
    finally:
        for blk in blocks:
            del blk.forward
