"""Optimisers: OrthoAdam (the paper's), its fixed random rotations, and the ablation optimisers by name."""

from trainers.optim.orthoadam import OrthoAdam, optimizer_extra_memory_bytes
from trainers.optim.registry import OPTIMIZERS, build_optimizer, param_groups
from trainers.optim.rotations import ROTATIONS, ParamRotation, param_rotation

__all__ = [
    "OPTIMIZERS",
    "ROTATIONS",
    "OrthoAdam",
    "ParamRotation",
    "build_optimizer",
    "optimizer_extra_memory_bytes",
    "param_groups",
    "param_rotation",
]
