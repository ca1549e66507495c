"""The decode fast path (``paths.run_fast``): a real layer keeps its bound C call after a decode forward and
later calls go straight to it — bit for bit the generic forward's result, and never where anything it froze
changed (a forced path, the kernels switched off, other threads, a cast, new weights, autograd, another dtype)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from qbench.quant.granularity import PerTensor
from qbench.quant.kernels import native, paths
from tests.qbench.quant.real_cases import CASES, build, inputs

pytestmark = pytest.mark.skipif(not native.available(), reason="the C kernels are not built here")


@pytest.fixture(autouse=True)
def _gemv():
    """The decode GEMV, forced: the measured dispatch may pick another path on some CPU (c-dequant, _int_mm),
    and only a bound C call is kept. Kinds without a GEMV in this build keep their default."""
    with paths.force("c-gemv"):
        yield


# the shared cases, and the padded ones again at a width of whole groups (K = 256), where they keep a call
DIRECT = [c for c in CASES if c.kind != "bnb" and c.transform is None and c.scheme.out_bits is None]
KEEPING = [
    *(c for c in DIRECT if build(c)[0].fast_direct()),
    *(c._replace(id=c.id + "-256", in_features=256) for c in DIRECT if not build(c)[0].fast_direct()),
]
NEVER = [c for c in CASES if c.transform is not None or c.scheme.out_bits is not None]
NEVER += [c for c in DIRECT if not build(c)[0].fast_direct()]  # x padded to whole groups per call


def test_every_layer_kind_has_a_kept_call_under_test():
    assert {c.kind for c in KEEPING} == set(paths.KINDS)
    assert all(build(c)[0].fast_direct() for c in KEEPING)


def _generic(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    saved = layer.__dict__.pop("_fast", None)
    try:
        return layer(x)
    finally:
        if saved is not None:
            layer.__dict__["_fast"] = saved


def _kept(layer: torch.nn.Module) -> dict:
    table = layer.__dict__.get("_fast")
    return {} if table is None else table.entries


@pytest.mark.parametrize("case", KEEPING, ids=lambda c: c.id)
@pytest.mark.parametrize("shape", [(1, 1), (1,), (3, 5), (1, 16), (2, 4)], ids=str)
def test_kept_call_equals_the_generic_forward(case, shape):
    if "c-gemv" not in paths.offered(case.kind):
        pytest.skip(f"no {case.kind} GEMV in this build (the portable one dequantises)")
    layer, _ = build(case)
    x = inputs(int(torch.tensor(shape).prod()), case.in_features).reshape(*shape, case.in_features)
    with torch.inference_mode():
        first = layer(x)  # generic, keeps the call
        path = layer.last_path
        assert _kept(layer), f"{case.id}: no call kept after a {path} decode forward"
        layer.__dict__.pop("last_path")
        again = layer(x)
        assert layer.last_path == path
        assert torch.equal(again, first) and again.shape == (*shape, case.out_features)
        assert torch.equal(_generic(layer, x), first)


@pytest.mark.parametrize("case", NEVER, ids=lambda c: c.id)
def test_a_layer_with_an_input_transform_padding_or_output_quantisation_keeps_nothing(case):
    layer, _ = build(case)
    with torch.inference_mode():
        layer(inputs(1, case.in_features))
    assert not _kept(layer)


def test_prefill_rows_keep_nothing_and_do_not_use_a_decode_call():
    layer, _ = build(CASES[0])
    with torch.inference_mode():
        layer(inputs(17, CASES[0].in_features))
        assert not _kept(layer)
        layer(inputs(1, CASES[0].in_features))
        assert set(_kept(layer)) == {1}
        big = inputs(64, CASES[0].in_features)
        assert torch.equal(layer(big), _generic(layer, big))


def test_what_it_froze_changing_sends_the_call_the_generic_way():
    case = CASES[0]
    layer, _ = build(case)
    x = inputs(1, case.in_features)
    with torch.inference_mode():
        y = layer(x)
        with paths.force("torch"):
            layer(x)
            assert layer.last_path == "torch"
        with native.enabled(False):
            layer(x)
            assert layer.last_path == "torch"
        threads = torch.get_num_threads()
        token = _kept(layer)[1].token
        torch.set_num_threads(max(1, threads % 2 + 1) if threads == 1 else 1)
        try:
            assert torch.equal(layer(x), y)
            assert _kept(layer)[1].token != token  # kept again under the new thread count
        finally:
            torch.set_num_threads(threads)
        paths.reset_measured()
        assert torch.equal(layer(x), y)


def test_autograd_other_dtypes_and_strided_inputs_take_the_generic_forward():
    case = next(c for c in KEEPING if c.kind == "lowbit")
    layer, _ = build(case)
    x = inputs(1, case.in_features)
    with torch.inference_mode():
        layer(x)
    entry = _kept(layer)[1]
    layer(x.clone().requires_grad_())  # autograd: the torch path (the C kernels have no backward)
    assert layer.last_path == "torch"
    with torch.inference_mode():
        layer(x.double())
        assert layer.last_path == "torch"
        assert _kept(layer)[1] is entry
        layer(x)  # the kept call: nothing rebuilt
        assert _kept(layer)[1] is entry
        layer(torch.cat([x, x], -1)[..., ::2])  # non-contiguous: the generic forward, which keeps a new call
        assert _kept(layer)[1] is not entry


def _two_layers(kind: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """Two layers of one ``kind`` with different weights, and one decode row for them."""
    case = next(c for c in KEEPING if c.kind == kind)
    return build(case)[0], build(case, seed=5)[0], inputs(1, case.in_features)


def test_new_weights_a_cast_and_an_attribute_drop_the_kept_call():
    layer, other, x = _two_layers("w8a8")
    with torch.inference_mode():
        layer(x)
        layer.load_state_dict(other.state_dict())
        assert not _kept(layer)
        assert torch.equal(layer(x), other(x))
        layer.float()
        assert not _kept(layer)
        layer(x)
        layer.act = PerTensor()  # an option changed: what the forward must do may have changed
        assert not _kept(layer)
        assert torch.equal(layer(x), _generic(layer, x))


def test_a_swapped_storage_is_caught_by_its_pointer():
    layer, other, x = _two_layers("lowbit")
    with torch.inference_mode():
        layer(x)
        layer.scales.data = other.scales.clone()  # not a setattr on the layer: only the pointer shows it
        layer.qweight.data = other.qweight.clone()
        layer.bias.data = other.bias.clone()
        if layer.zeros is not None:
            layer.zeros.data = other.zeros.clone()
        assert torch.equal(layer(x), other(x))


def test_copies_and_pickles_build_their_own():
    case = next(c for c in KEEPING if c.kind == "w4a8")
    layer, _ = build(case)
    x = inputs(1, case.in_features)
    with torch.inference_mode():
        y = layer(x)
        clone = copy.deepcopy(layer)
        restored = pickle.loads(pickle.dumps(layer))
        assert not _kept(clone) and not _kept(restored)
        assert torch.equal(clone(x), y) and torch.equal(restored(x), y)
        assert _kept(clone)
