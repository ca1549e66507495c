"""OrthoAdam (Kaul et al., ICLR 2025): Adam run in a fixed, randomly rotated basis per parameter.

For each parameter θ with gradient g and fixed orthogonal Q (``rotations.py``), at step t:

    g' = Q g
    m  = β1·m + (1 − β1)·g'                 v = β2·v + (1 − β2)·g'⊙g'
    u' = (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε)
    θ  = θ·(1 − lr·wd) − lr·Qᵀ u'          (decoupled weight decay: a scalar, it commutes with Q)

Adam's per-coordinate normalisation is what lets a few channels grow outlier values; doing it in a dense random
basis spreads every channel's update over all coordinates. m and v live in the rotated basis and have the
parameter's shape, dtype and device, exactly like AdamW's (so a bf16 parameter has bf16 moments, as in AdamW;
its transforms are then cast to bf16 too and orthogonal only to bf16 precision).

The transforms are never stored: each is re-derived from (seed, parameter index, shape, rotation, block_size),
where the index is the parameter's position in the flattened ``param_groups`` — the same numbering torch's
``state_dict()`` uses. ``load_state_dict`` into an optimiser built over the same parameters in the same order
therefore resumes bit-exactly; a different order would silently pair moments with other rotations, which is why
the state also records each parameter's index and shape and loading checks them.

With ``rotation="identity"`` (and for 0-D or single-element parameters) the update runs the very operations of
``torch.optim.AdamW``'s single-tensor path, so it reproduces AdamW to the last bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from models.errors import UserError
from trainers.optim.rotations import (
    DEFAULT_BLOCK_SIZE,
    ROTATIONS,
    ParamRotation,
    param_rotation,
    scratch_pair,
)


class OrthoAdam(torch.optim.Optimizer):
    """A drop-in for ``torch.optim.AdamW`` that applies Adam to Q·g (see the module docstring).

    Extra keyword-only arguments (per param group, like lr): ``seed`` (the rotations' seed), ``rotation`` (a name
    in ``rotations.ROTATIONS``: hadamard, dense, identity, signed-permutation) and ``block_size`` (the longest
    axis given one dense block by the ``dense`` rotation) and ``fixed_axes`` (axes left unrotated, e.g. (0,) for
    an embedding's token axis). Sparse and complex gradients are not supported.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        seed: int = 0,
        rotation: str = "hadamard",
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay, rotation, block_size)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            seed=seed,
            rotation=ROTATIONS.canonical(rotation),
            block_size=block_size,
        )
        self._rotations: dict[Tensor, tuple[tuple, ParamRotation | None]] = {}
        self._indices: dict[Tensor, int] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "rotation" in param_group:
            param_group["rotation"] = ROTATIONS.canonical(param_group["rotation"])
        super().add_param_group(param_group)
        self._indices.clear()

    def rotation_for(self, p: Tensor, group: dict[str, Any]) -> ParamRotation | None:
        """The parameter's fixed rotation on its device and dtype (built once, cached, never saved)."""
        fixed = tuple(group.get("fixed_axes", ()))
        key = (
            group["rotation"],
            group["seed"],
            group["block_size"],
            self.param_index(p),
            tuple(p.shape),
            fixed,
        )
        key += (p.device, p.dtype)
        cached = self._rotations.get(p)
        if cached is None or cached[0] != key:
            rot = param_rotation(
                p.shape, group["rotation"], group["seed"], key[3], group["block_size"], fixed
            )
            cached = (key, None if rot is None else rot.to(p.device, p.dtype))
            self._rotations[p] = cached
        return cached[1]

    def param_index(self, p: Tensor) -> int:
        """p's position in the flattened param_groups (torch's state_dict numbering)."""
        if not self._indices:
            flat = (q for group in self.param_groups for q in group["params"])
            self._indices.update((q, i) for i, q in enumerate(flat))
        return self._indices[p]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._group_step(group, params)
        return loss

    def _state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            if p.grad.is_sparse or torch.is_complex(p):
                raise UserError("OrthoAdam supports dense real parameters and gradients only")
            state["step"] = 0
            state["index"], state["shape"] = self.param_index(p), list(p.shape)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _group_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """One step for every parameter of a group.

        One parameter at a time rather than torch._foreach over the group: a rotated parameter gets two scratch
        tensors of its shape (the rotated gradient and a spare) that every transform, the denominator and the
        update then reuse, so a step allocates two parameters' worth at a time instead of a whole group's
        (foreach Adam allocates every denominator at once; on CPU each fresh multi-MB tensor costs page faults).
        """
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in params:
            state = self._state(p)
            state["step"] += 1
            bias1, bias2_sqrt = 1 - beta1 ** state["step"], (1 - beta2 ** state["step"]) ** 0.5
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            rot = self.rotation_for(p, group)
            grad, spare = (p.grad, None) if rot is None else rot.apply_(*scratch_pair(p.grad))
            if wd != 0:
                p.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if rot is None:  # exactly AdamW's single-tensor update
                denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / bias1)
            else:  # grad and spare are scratch tensors of ours: the update reuses them, no allocation
                update = torch.sqrt(exp_avg_sq, out=grad).div_(bias2_sqrt).add_(eps)
                torch.div(exp_avg, update, out=update)
                p.add_(rot.apply_(update, spare, transpose=True)[0], alpha=-lr / bias1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._rotations.clear()
        self._indices.clear()
        for p, state in self.state.items():
            saved = (state.get("index"), state.get("shape"))
            if saved != (None, None) and saved != (self.param_index(p), list(p.shape)):
                raise UserError(
                    f"OrthoAdam state for parameter #{saved[0]} {saved[1]} was loaded onto parameter "
                    f"#{self.param_index(p)} {list(p.shape)}: build the optimiser over the same parameters in "
                    "the same order"
                )


def _check_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, rotation: str, block_size: int
) -> None:
    ROTATIONS.canonical(rotation)  # did-you-mean UserError for an unknown name
    if not 0.0 <= lr:
        raise UserError(f"OrthoAdam learning rate must be >= 0, got {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise UserError(f"OrthoAdam betas must lie in [0, 1), got {tuple(betas)}")
    if not 0.0 <= eps:
        raise UserError(f"OrthoAdam eps must be >= 0, got {eps}")
    if not 0.0 <= weight_decay:
        raise UserError(f"OrthoAdam weight_decay must be >= 0, got {weight_decay}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise UserError(f"OrthoAdam block_size must be a positive integer, got {block_size!r}")


def optimizer_extra_memory_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Optimiser memory in bytes, split by what holds it, against what AdamW would hold for the same parameters.

    - ``moment_bytes``: the per-parameter state tensors (exp_avg + exp_avg_sq for the Adams, momentum or
      square averages for SGD/RMSprop); before the first step, what AdamW/OrthoAdam will allocate (2 × params);
    - ``transform_bytes``: the rotations' tensors (OrthoAdam only; built here if no step ran yet);
    - ``adamw_moment_bytes``: 2 × the parameters' bytes, AdamW's moments;
    - ``extra_bytes``: moment_bytes + transform_bytes − adamw_moment_bytes;
    - ``step_workspace_bytes``: transient buffers during one OrthoAdam step: parameters are updated one at a
      time, each rotated one with two scratch tensors of its shape, so 2 × the largest rotated parameter's bytes
      (the windowed/block-diagonal/signed-permutation transforms allocate a little more).
    """
    params = [p for group in opt.param_groups for p in group["params"]]
    adamw = 2 * sum(p.numel() * p.element_size() for p in params)
    moments = sum(
        t.numel() * t.element_size()
        for p in params
        for key, t in opt.state.get(p, {}).items()
        if isinstance(t, Tensor) and t.shape == p.shape and key != "step"
    )
    if not opt.state and isinstance(opt, (OrthoAdam, torch.optim.AdamW)):
        moments = adamw
    transforms, workspace = 0, 0
    if isinstance(opt, OrthoAdam):
        for group in opt.param_groups:
            for p in group["params"]:
                if (rot := opt.rotation_for(p, group)) is not None:
                    transforms += rot.nbytes()
                    workspace = max(workspace, 2 * p.numel() * p.element_size())
    return dict(
        moment_bytes=moments,
        transform_bytes=transforms,
        adamw_moment_bytes=adamw,
        extra_bytes=moments + transforms - adamw,
        step_workspace_bytes=workspace,
    )
