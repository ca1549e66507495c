"""The contract every real layer keeps (``kernels.base.RealLinear``), checked on every class and configuration.

- a cast (``.to(torch.bfloat16)``, ``.half()``, ``.float()``) keeps what the kernels read in the dtype they read:
  a cast model given float32 input computes exactly what the uncast one does (a bf16 bias read as float32 by a
  C kernel gave NaN), and low-precision input gives output of that dtype, equal to fake mode to its rounding;
- saving a state dict leaves the layer as it was, and the state (through safetensors) loaded into a layer built
  from another weight reproduces it;
- non-contiguous input, an empty batch, 1 and 17 rows: equal to fake mode; never NaN;
- a C kernel is called only with tensors in the dtype it reads (a bf16 bias set behind the layer's back: the
  torch path runs).

The bitsandbytes layers quantise with their own formats (NF4, LLM.int8 outlier columns), which fake mode does
not model; their reference is the uncast layer on float32 input, at bitsandbytes' compute dtype.
"""

from __future__ import annotations

import pytest
import torch

from models.errors import UserError
from qbench.quant.kernels import paths
from qbench.quant.kernels.base import RealLinear
from qbench.quant.kernels.bnb import bnb_available
from qbench.quant.kernels.int4 import Int4Linear, int4pack_available
from qbench.quant.kernels.int8 import Int8Linear
from tests.qbench.quant.real_cases import BNB_CASES, CASES, build, inputs, rel_err

ALL = CASES + (BNB_CASES if bnb_available() else [])
IDS = [c.id for c in ALL]
# output of a low-precision input: rounded to that dtype (unit roundoff 2⁻⁹ bf16, 2⁻¹² fp16), and where a path
# computes in it (LowBitLinear's F.linear, the int4 bf16 kernel's bf16 scales) a few more such roundings
LOW_PRECISION = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
FLOAT32 = 5e-6  # fake mode's float32 dot products against the kernels' exact or reassociated sums


def _run(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return layer(x)


def _float32_bound(case) -> float:
    if case.kind == "bnb":
        return 0.0  # against the uncast layer itself
    return 1.01 / 127 if case.scheme.out_bits is not None else FLOAT32


def _reference(case, real, fake, x: torch.Tensor) -> torch.Tensor:
    """Fake mode in float32 on x as given (already rounded to its dtype), or the uncast bnb layer."""
    return _run(real if case.kind == "bnb" else fake, x.float())


def _low_precision_path(layer: torch.nn.Module, dtype: torch.dtype, rows: int) -> str:
    """The C kernels read float32 only: Int8Linear computes in float32 from the start (its C paths then run);
    Int4Linear takes torch's int4pack kernel for bf16 input where its shape fits; all else the torch path."""
    if isinstance(layer, Int8Linear):
        return paths.choose("w8a8", rows)
    fits = isinstance(layer, Int4Linear) and layer.kernel_group() is not None and int4pack_available("cpu")
    return "int4pack" if fits and dtype == torch.bfloat16 else "torch"


def _floating_dtypes(layer: torch.nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in (*layer.parameters(), *layer.buffers()) if t.is_floating_point()}


@pytest.mark.parametrize("case", ALL, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_keeps_kernel_dtypes_and_the_output_follows_the_input(case, dtype):
    real, fake = build(case)
    x1, x17 = inputs(1, case.in_features), inputs(17, case.in_features)
    before = {rows: _run(real, x) for rows, x in ((1, x1), (17, x17))}
    nbytes = real.nbytes()
    cast = real.to(dtype) if dtype == torch.bfloat16 else real.half()
    assert cast is real and _floating_dtypes(real) <= {torch.float32}  # scales, bias, rotation: float32
    assert real.nbytes() == nbytes
    for rows, x in ((1, x1), (17, x17)):
        y = _run(real, x)  # float32 input to a cast model: exactly the uncast layer's numbers
        assert y.dtype == torch.float32 and torch.equal(y, before[rows]), f"{case.id} {rows} rows"
        low = x.to(dtype)
        y = _run(real, low)
        assert y.dtype == dtype and not y.isnan().any()
        assert real.last_path == _low_precision_path(real, dtype, rows)
        err = rel_err(y, _reference(case, real, fake, low))
        assert err < LOW_PRECISION[dtype] + _float32_bound(case), f"{case.id} {dtype} {rows} rows: {err:.3g}"
    real.float()
    assert torch.equal(_run(real, x17), before[17])


@pytest.mark.parametrize("case", ALL, ids=IDS)
def test_state_dict_round_trip_through_safetensors(case):
    safetensors = pytest.importorskip("safetensors.torch")
    real, _ = build(case)
    x = inputs(17, case.in_features)
    expected = _run(real, x)
    state = {k: v.contiguous() for k, v in real.state_dict().items()}  # safetensors stores dense tensors
    # saving must not change the layer (bitsandbytes' CPU-repacked NF4 did: scrambled block scales)
    assert torch.equal(_run(real, x), expected)
    loaded = safetensors.load(safetensors.save(state))
    fresh, _ = build(case, seed=7)
    assert not torch.equal(_run(fresh, x), expected)  # another weight: the load must change it
    fresh.load_state_dict(loaded)
    assert torch.equal(_run(fresh, x), expected)
    assert _floating_dtypes(fresh) <= {torch.float32}


@pytest.mark.parametrize("case", ALL, ids=IDS)
def test_rows_non_contiguous_and_empty_inputs_equal_fake_mode(case):
    real, fake = build(case)
    for rows in (1, 17):
        x = inputs(rows, case.in_features)
        y = _run(real, x)
        assert not y.isnan().any() and y.shape == (rows, case.out_features)
        if case.kind != "bnb":
            assert rel_err(y, _run(fake, x)) <= _float32_bound(case), f"{case.id} {rows} rows"
    # (2, 9, in) viewed from a (9, 2, in) tensor: not contiguous; must equal its contiguous copy
    strided = inputs(18, case.in_features).view(9, 2, -1).transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(_run(real, strided), _run(real, strided.contiguous()))
    for shape in ((0, case.in_features), (2, 0, case.in_features)):
        empty = torch.zeros(shape)
        y = _run(real, empty)
        assert y.shape == (*shape[:-1], case.out_features) and y.dtype == torch.float32
        assert _run(real, empty.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("case", [c for c in CASES if c.kind != "lowbit"], ids=lambda c: c.id)
def test_a_c_kernel_never_reads_a_tensor_in_another_dtype(case):
    """A bias swapped to bf16 behind the layer's back (not through a cast): the C kernels, which read float32,
    are skipped and the torch path computes — no NaN, fake mode's numbers to the bias's rounding."""
    real, fake = build(case)
    x = inputs(17, case.in_features)
    real.bias = real.bias.bfloat16()  # a buffer assignment: no _apply, so nothing converts it back
    y = _run(real, x)
    assert real.last_path == "torch" and not y.isnan().any()
    assert paths.choose(case.kind, 17) != "torch"  # a C path would have run with a float32 bias
    assert rel_err(y, _run(fake, x)) < 1e-2


def test_every_real_layer_class_is_covered_and_stores_codes_as_the_kernels_read_them():
    import qbench.quant.kernels.w8  # noqa: F401  (imported lazily by make_real_linear)

    built = {type(build(case)[0]) for case in ALL}
    expected = {cls for cls in RealLinear.__subclasses__() if cls.__module__.startswith("qbench.")}
    if not bnb_available():
        expected = {cls for cls in expected if cls.__name__ != "BnbLinear"}
    assert expected <= built, f"no contract case for {expected - built}"
    layer, _ = build(CASES[0])
    codes = layer.qweight_t.t().contiguous().to(torch.int32)  # int32 codes: no kernel reads them
    with pytest.raises(UserError, match=r"qweight_t must hold int8 or uint8 codes, got torch\.int32"):
        RealLinear.store(layer, {"qweight_t": codes}, {})
