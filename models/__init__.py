"""qbench's model zoo: one transformer with the paper's switches, presets, checkpoints and transformers interop.

A leaf package: it imports nothing else of qbench.

The configs and presets import eagerly (no torch); the model and its observation hooks import torch, so they load on
first use (PEP 562) and ``qbench --help`` or ``from models import PRESETS`` stays fast.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from models.config import PRESETS, ModelConfig, Preset, family_config, get_preset, preset_config
from models.errors import UserError

if TYPE_CHECKING:  # type checkers see the lazy names as ordinary imports
    from models.observe import Observation, observe
    from models.transformer import Transformer, build

# lazy name -> the module that defines it
_LAZY = {
    "Observation": "models.observe",
    "observe": "models.observe",
    "Transformer": "models.transformer",
    "build": "models.transformer",
}

__all__ = [
    "PRESETS",
    "ModelConfig",
    "Observation",
    "Preset",
    "Transformer",
    "UserError",
    "build",
    "family_config",
    "get_preset",
    "observe",
    "preset_config",
]


class _Package(types.ModuleType):
    """Keeps ``models.observe`` the function. The import system binds every loaded submodule on its package, so once
    anything imports the module ``models.observe`` the lazy name would turn into that module; the eager import of
    old bound the function over it, and this keeps doing so."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "observe" and isinstance(value, types.ModuleType):
            value = value.observe
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'models' has no attribute {name!r}")
