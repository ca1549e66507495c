"""Muon for the hidden matrices, AdamW for everything else: one optimiser object for the training loop.

Muon (Jordan et al. 2024; ``torch.optim.Muon``) replaces each 2-D weight's momentum by its nearest
semi-orthogonal matrix (Newton–Schulz iterations), so no coordinate gets its own step size — the "privileged
basis" that Adam-style per-coordinate scaling creates and that OSP (Park et al. 2025) links to outlier channels.
It is defined for hidden matrices only: as in the Muon and OSP recipes, embeddings, the LM head, norm gains,
biases (the gates' included) and other non-matrix parameters take AdamW.

One learning rate serves both: Muon's ``adjust_lr_fn="match_rms_adamw"`` scales each matrix's orthogonalised
update to the RMS of a typical AdamW update (lr · 0.2 · sqrt(max(rows, cols)), Moonlight's rule), so the
schedule's lr means the same for both halves and nothing else needs tuning. The setting is recorded in every
parameter group of the trainer state and in the run's provenance (:data:`MUON_SETTINGS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError

# Muon's hyper-parameters here: torch's defaults (Keller Jordan's: momentum 0.95, Nesterov, 5 Newton–Schulz
# steps) plus the AdamW-matching learning-rate adjustment.
MUON_SETTINGS: dict[str, Any] = {
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "adjust_lr_fn": "match_rms_adamw",
}


def fused_blocks(model: nn.Module) -> dict[int, int]:
    """{id(weight): k} of the linear layers that hold k projections stacked along their output rows: GPT-2's
    fused ``c_attn`` (q, k, v: 3 blocks of d × d), found as an attention module's ``c_attn`` whose outputs are
    3 × its inputs."""
    out = {}
    for module in model.modules():
        fused = getattr(module, "c_attn", None)
        if isinstance(fused, nn.Linear) and fused.out_features == 3 * fused.in_features:
            out[id(fused.weight)] = 3
    return out


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups for :class:`MuonAdamW`, each tagged ``use_muon``.

    - Muon (``use_muon=True``, decayed): the weights of the hidden ``nn.Linear`` layers — attention and MLP
      projections, the gates' weights, OSP's projections — i.e. every Linear weight but the LM head's. A fused
      projection (GPT-2's ``c_attn``, :func:`fused_blocks`) is its own group with ``blocks`` = 3: its update is
      orthogonalised per projection (q, k and v separately, as Moonlight and modded-nanogpt do, and as the Llama
      layout's separate ``q_proj``/``k_proj``/``v_proj`` are), not as one 3d × d matrix.
    - AdamW, decayed: the embedding tables and the LM head (tied or not) and any other ≥ 2-D parameter (the
      learned sink's key/value vectors: per-head vectors, not maps).
    - AdamW, not decayed: biases, norm gains, sink logits and other parameters with < 2 dims.

    Frozen parameters are left out, a tied weight appears once, empty groups are dropped.
    """
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    # The LM head as trainers.optim.registry.output_embedding finds it (not imported: registry imports this module).
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(model, "lm_head", None)
    excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if isinstance(getattr(head, "weight", None), nn.Parameter):
        excluded.add(id(head.weight))
    hidden = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) not in excluded
    }
    fused = fused_blocks(model)
    groups = [
        {
            "params": [p for p in params if id(p) in hidden and id(p) not in fused],
            "weight_decay": weight_decay,
            "use_muon": True,
        },
        {
            "params": [p for p in params if id(p) in fused],
            "weight_decay": weight_decay,
            "use_muon": True,
            "blocks": 3,
        },
        {
            "params": [p for p in params if p.dim() >= 2 and id(p) not in hidden],
            "weight_decay": weight_decay,
            "use_muon": False,
        },
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "use_muon": False},
    ]
    return [g for g in groups if g["params"]]


class BlockMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose groups' ``blocks`` = k split each (k·n, m) parameter into k (n, m) row blocks for
    the orthogonalisation: the momentum (per element) and the weight decay as Muon's, then each block's update
    orthogonalised by Newton–Schulz and applied at the learning rate adjusted for an (n, m) matrix — exactly what
    ``torch.optim.Muon`` does to k separate (n, m) parameters (tested against that)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        # torch's own Newton–Schulz and lr adjustment (private in torch 2.13: the same functions its Muon calls)
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, k = group["lr"], group["momentum"], group.get("blocks", 1)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                p.mul_(1 - lr * group["weight_decay"])
                for block, u in zip(p.chunk(k, dim=0), update.chunk(k, dim=0), strict=True):
                    ortho = _zeropower_via_newtonschulz(
                        u, group["ns_coefficients"], group["ns_steps"], group["eps"]
                    )
                    block.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], block.shape))
        return loss


def _kind(group: dict[str, Any]) -> str:
    return "adamw" if not group["use_muon"] else "blocks" if group.get("blocks", 1) > 1 else "muon"


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the groups tagged ``use_muon`` and ``torch.optim.AdamW`` over the rest, exposed
    as one optimiser: one ``param_groups`` list (the loop sets every group's lr) and one ``state`` (saved and
    resumed by ``trainers.state`` like any optimiser's). The two inner optimisers hold the very same group dicts
    and state mapping, so whatever the loop or ``load_state_dict`` changes, both see."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        **muon: Any,
    ) -> None:
        if not groups or any(not isinstance(g, dict) or "use_muon" not in g for g in groups):
            raise UserError(
                "optimizer muon needs parameter groups tagged use_muon (trainers.optim.muon_param_groups)"
            )
        groups = [dict(g) for g in groups]
        settings = {**MUON_SETTINGS, **muon}
        by_kind = {kind: [g for g in groups if _kind(g) == kind] for kind in ("muon", "blocks", "adamw")}
        self._inner = {
            kind: factory(by_kind[kind])
            for kind, factory in (
                ("muon", lambda g: torch.optim.Muon(g, lr=lr, weight_decay=weight_decay, **settings)),
                ("blocks", lambda g: BlockMuon(g, lr=lr, weight_decay=weight_decay, **settings)),
                ("adamw", lambda g: torch.optim.AdamW(g, lr=lr, betas=betas, weight_decay=weight_decay)),
            )
            if by_kind[kind]
        }
        # The inner optimisers filled in each group's defaults in place; register those same dicts here.
        super().__init__(by_kind["muon"] + by_kind["blocks"] + by_kind["adamw"], {})
        self._relink()

    def _relink(self) -> None:
        for kind, inner in self._inner.items():
            inner.param_groups = [g for g in self.param_groups if _kind(g) == kind]
            inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # JSON round trips turn tuples into lists
            for key in ("ns_coefficients", "betas"):
                if key in group:
                    group[key] = tuple(group[key])
        self._relink()

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inner.values():
            inner.step()
        return loss
