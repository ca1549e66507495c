"""``models`` exports its torch-bound names lazily: the configs and presets import without torch, and the lazy names
are the same objects as before, ``models.observe`` the function even after its module has been imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import models

ROOT = Path(models.__file__).resolve().parents[1]


def test_configs_and_presets_import_without_torch():
    script = (
        "import sys\n"
        "from models import PRESETS, ModelConfig, Preset, UserError, family_config, get_preset, preset_config\n"
        "assert get_preset('tiny').config.n_layer == 4\n"
        "assert 'torch' not in sys.modules\n"
        "import models.observe\n"  # binds the submodule on the package: the name must stay the function
        "from models import Observation, Transformer, build, observe\n"
        "import types\n"
        "assert isinstance(observe, types.FunctionType) and models.observe is observe, observe\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_lazy_names_are_the_modules_objects():
    from models.observe import Observation, observe
    from models.transformer import Transformer, build

    assert (models.Observation, models.observe, models.Transformer, models.build) == (
        Observation,
        observe,
        Transformer,
        build,
    )
    assert set(models.__all__) <= set(dir(models)) | set(models._LAZY)
