"""The real-kernel registry is the dispatch: make_real_linear, ls schemes, env, speed and the docs read it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qbench.quant.kernels import (
    NATIVE_LAYERS,
    PATH_LAYERS,
    REAL_KERNELS,
    kernels_table,
    make_real_linear,
    real_kernel_for,
)
from qbench.quant.schemes import SCHEMES, get_scheme


def test_the_registry_entry_builds_the_layer_make_real_linear_returns():
    weight = torch.randn(32, 256)
    for name in SCHEMES.names():
        scheme = get_scheme(name)
        kernel = real_kernel_for(scheme)
        if kernel is None or scheme.method in ("smoothquant", "hadamard") or scheme.static:
            continue  # those need calibration / a rotation: test_real_contract covers them
        layer = make_real_linear(weight, None, scheme)
        assert type(layer).__name__ in kernel.layer.split(" / "), name


def test_no_real_kernel_for_float_formats_and_a_one_line_error_names_the_registry():
    import pytest

    from models.errors import UserError

    assert real_kernel_for(get_scheme("fp8-e4m3")) is None
    with pytest.raises(UserError, match="has no real kernel; real kernels exist for: llm-int8 and bnb-nf4"):
        make_real_linear(torch.randn(8, 64), None, get_scheme("absmax-fine-perchannel"))


@pytest.mark.parametrize("kernel", REAL_KERNELS, ids=lambda k: k.layer)
def test_every_registry_entry_has_one_builder_beside_its_layer(kernel, monkeypatch):
    """The registry names layers without torch; dispatch.build calls each one's builder — exactly one, defined in
    the file of the layer it builds."""
    import sys

    from qbench.quant.kernels import dispatch

    names = ["build_bnb", "build_w8a8", "build_w4a8", "build_w8_weight_only", "build_weight_only"]
    originals = {name: getattr(dispatch, name) for name in names}
    called = []
    for name in names:
        monkeypatch.setattr(dispatch, name, lambda *a, name=name: called.append(name))
    dispatch.build(kernel.layer, None, None, None, None)
    (name,) = called
    module = sys.modules[originals[name].__module__]
    assert any(hasattr(module, cls.strip()) for cls in kernel.layer.split("/")), (kernel.layer, module)


def test_a_layer_without_a_builder_is_a_bug_said_as_such():
    from qbench.quant.kernels import dispatch

    with pytest.raises(AssertionError, match="no builder"):
        dispatch.build("NoSuchLinear", None, None, None, None)


def test_env_and_speed_lists_come_from_the_registry():
    assert [kind for _, kind in PATH_LAYERS] == ["w8a8", "w4a8", "w8", "w4", "lowbit"]
    assert set(NATIVE_LAYERS) == {
        "Int8Linear",
        "Int4A8Linear",
        "Int8WeightOnlyLinear",
        "Int4Linear",
        "LowBitLinear",
    }
    assert len({k.layer for k in REAL_KERNELS}) == len(REAL_KERNELS)


def test_docs_schemes_page_holds_the_registry_table():
    page = (Path(__file__).parents[3] / "docs" / "schemes.md").read_text()
    start, end = "<!-- real-kernels:start -->\n", "<!-- real-kernels:end -->"
    assert page[page.index(start) + len(start) : page.index(end)] == kernels_table()
