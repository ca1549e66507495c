"""Declared dependency floors match what the code uses, and the dev extra can test the CUDA kernels."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# transformers API -> first release that has it; found by `pip download --no-deps transformers==V` for
# 4.52.4 ... 4.57.6 and 5.0.0 and grepping each wheel (masking_utils.py, `def set_attn_implementation`,
# `rope_parameters` in LlamaConfig)
TRANSFORMERS_APIS = {
    "masking_utils": "4.53.0",
    "set_attn_implementation": "4.54.0",
    "rope_parameters": "5.0.0",
}


def _requirement(name: str, group: list[str]) -> Requirement:
    return next(r for r in map(Requirement, group) if r.name == name)


def _floor(req: Requirement) -> Version:
    return max(Version(s.version) for s in req.specifier if s.operator in (">=", "=="))


def test_transformers_floor_covers_every_api_the_code_uses():
    sources = "".join(
        p.read_text() for d in ("models", "trainers", "qbench") for p in (ROOT / d).rglob("*.py")
    )
    used = {api: v for api, v in TRANSFORMERS_APIS.items() if api in sources}
    assert used, "the table above lists APIs the code no longer uses"
    floor = _floor(_requirement("transformers", PYPROJECT["project"]["dependencies"]))
    assert floor >= max(Version(v) for v in used.values()), (floor, used)


def test_dev_extra_installs_triton_on_linux_and_gguf_is_an_extra():
    extras = PYPROJECT["project"]["optional-dependencies"]
    triton = _requirement("triton", extras["dev"])
    assert triton.marker is not None and triton.marker.evaluate({"platform_system": "Linux"})
    assert not triton.marker.evaluate({"platform_system": "Darwin"})
    assert _requirement("gguf", extras["gguf"]) and "gguf" in extras["all"][0]
