"""Optimisers: OrthoAdam (the paper's), its fixed random rotations, and the ablation optimisers by name."""

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
