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


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups for :class:`MuonAdamW`, each tagged ``use_muon``.

    - Muon (``use_muon=True``, decayed): the weights of the hidden ``nn.Linear`` layers — attention and MLP
      projections, the gates' weights, OSP's embedding projection — i.e. every Linear weight but the LM head's.
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
    groups = [
        {"params": [p for p in params if id(p) in hidden], "weight_decay": weight_decay, "use_muon": True},
        {
            "params": [p for p in params if p.dim() >= 2 and id(p) not in hidden],
            "weight_decay": weight_decay,
            "use_muon": False,
        },
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "use_muon": False},
    ]
    return [g for g in groups if g["params"]]


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
        muon_groups = [g for g in groups if g["use_muon"]]
        adamw_groups = [g for g in groups if not g["use_muon"]]
        self._muon = (
            torch.optim.Muon(muon_groups, lr=lr, weight_decay=weight_decay, **settings)
            if muon_groups
            else None
        )
        self._adamw = (
            torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, weight_decay=weight_decay)
            if adamw_groups
            else None
        )
        # The inner optimisers filled in each group's defaults in place; register those same dicts here.
        super().__init__(muon_groups + adamw_groups, {})
        self._relink()

    def _relink(self) -> None:
        for inner, use_muon in ((self._muon, True), (self._adamw, False)):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if g["use_muon"] == use_muon]
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
        for inner in (self._muon, self._adamw):
            if inner is not None:
                inner.step()
        return loss
