"""qbench's model zoo: one transformer with the paper's switches, presets, checkpoints and transformers interop.

A leaf package: it imports nothing else of qbench.
"""

from models.config import PRESETS, ModelConfig, Preset, family_config, get_preset, preset_config
from models.errors import UserError
from models.observe import Observation, observe
from models.transformer import Transformer, build

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
