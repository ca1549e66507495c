"""Optimisers: OrthoAdam (the paper's), its fixed random rotations, and the ablation optimisers by name.

Names resolve lazily (PEP 562) so that ``from trainers.optim.registry import OPTIMIZERS`` — what ``qbench ls
optimizers`` and argument checking need — does not import torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "MUON_SETTINGS": "trainers.optim.muon",
    "MuonAdamW": "trainers.optim.muon",
    "muon_param_groups": "trainers.optim.muon",
    "OrthoAdam": "trainers.optim.orthoadam",
    "optimizer_extra_memory_bytes": "trainers.optim.orthoadam",
    "OPTIMIZERS": "trainers.optim.registry",
    "build_optimizer": "trainers.optim.registry",
    "optimizer_param_groups": "trainers.optim.registry",
    "optimizer_settings": "trainers.optim.registry",
    "param_groups": "trainers.optim.registry",
    "ROTATIONS": "trainers.optim.rotations",
    "ParamRotation": "trainers.optim.rotations",
    "param_rotation": "trainers.optim.rotations",
}
__all__ = [
    "MUON_SETTINGS",
    "OPTIMIZERS",
    "ROTATIONS",
    "MuonAdamW",
    "OrthoAdam",
    "ParamRotation",
    "build_optimizer",
    "muon_param_groups",
    "optimizer_extra_memory_bytes",
    "optimizer_param_groups",
    "optimizer_settings",
    "param_groups",
    "param_rotation",
]

if TYPE_CHECKING:
    from trainers.optim.muon import MUON_SETTINGS, MuonAdamW, muon_param_groups
    from trainers.optim.orthoadam import OrthoAdam, optimizer_extra_memory_bytes
    from trainers.optim.registry import (
        OPTIMIZERS,
        build_optimizer,
        optimizer_param_groups,
        optimizer_settings,
        param_groups,
    )
    from trainers.optim.rotations import ROTATIONS, ParamRotation, param_rotation


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainers.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
