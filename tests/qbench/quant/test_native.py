"""The compiled CPU kernels (``native*.c``) and their dispatch (``paths.py``) equal fake mode and the torch paths.

Integer accumulation is exact, so the W8A8 kernels equal the torch path bit for bit; the weight-only decode
kernels reassociate float sums (equal to fake mode to float rounding) and the weight-only prefill path (C
dequantise + torch GEMM) equals fake mode bit for bit. Shapes are odd on purpose: 63 → 37, 1 row, 17 rows.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from models.errors import UserError
from qbench.quant.fake import FakeQuantLinear
from qbench.quant.granularity import PerAxis, PerGroup
from qbench.quant.kernels import Int4A8Linear, Int4Linear, Int8Linear, make_real_linear, native, paths
from qbench.quant.kernels.int4 import pack_int4
from qbench.quant.kernels.int8 import quantize_activation
from qbench.quant.kernels.lowbit import LowBitLinear
from qbench.quant.kernels.w8 import Int8WeightOnlyLinear
from qbench.quant.primitives import choose_qparams, fake_quantize, qrange, quantize
from qbench.quant.schemes import SCHEMES, QuantScheme, get_scheme

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the torch paths run instead")

SHAPES = [(63, 37), (256, 48)]  # (in, out): odd (scalar tails only), whole int4 steps
ROWS = [(1,), (17,), (2, 5), (1, 1)]  # leading dims: decode, just above DECODE_ROWS, a batch, (B=1, T=1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_build_reports_instruction_set():
    assert native.isa() in native.ISA_NAMES.values()
    assert "rows" in paths.backend_name("w8a8") and "rows" in paths.backend_name("weight-only")


@pytest.mark.parametrize(("m", "k"), [(1, 63), (17, 63), (5, 200), (3, 2048), (2, 31)])
@pytest.mark.parametrize("per_token", [True, False])
def test_quantize_rows_equals_torch(m, k, per_token):
    torch.manual_seed(m * k)
    x = torch.randn(m, k) * 3
    x[0, 1] = 50.0  # an outlier row
    q, s = native.quantize_rows(x, 1 if per_token else m)
    q_ref, s_ref = quantize_activation(x[None], per_token)
    assert torch.equal(q, q_ref[0]) and torch.equal(s, s_ref.reshape(-1).expand(m))


# decode loop (≤ 16 rows: 1-4 row passes, K tails) and panel GEMM (> 16 rows: 1-3 row tiles, odd K, N tails)
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 63, 37),
        (1, 384, 9),  # batch 1 up to 384-byte rows: four weight rows per pass, one left over
        (1, 1000, 9),  # longer rows: one weight row per pass, a K tail
        (2, 2048, 9),
        (7, 96, 5),
        (16, 96, 5),
        (17, 63, 37),
        (40, 65, 70),
        (18, 1024, 64),
    ],
)
def test_w8a8_kernel_is_exact(m, k, n):
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    sx, sw, bias = torch.rand(m) + 0.1, torch.rand(n) + 0.1, torch.randn(n)
    q[0, :3] = -127  # the extremes: |x| |w| = 127 · 127 in every pair stays exact
    w[0, :3] = -127
    acc = q.int() @ w.int().T  # exact int32
    expected = acc.float() * sx[:, None] * sw + bias  # int8.py's epilogue, same order
    assert torch.equal(native.w8a8_linear(q, sx, w, sw, bias), expected)
    assert torch.equal(native.scale_output(acc, sx, sw, bias), expected)
    one = torch.tensor(0.3)  # a per-tensor weight scale, no bias
    assert torch.equal(native.w8a8_linear(q, sx, w, one, None), acc.float() * sx[:, None] * one)


@pytest.mark.parametrize("scheme", ["absmax-fine", "absmax-moderate", "absmax-coarse"])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_linear_native_equals_fake_and_torch_path(scheme, shape):
    torch.manual_seed(1)
    k, n = shape
    weight, bias = torch.randn(n, k) * 0.1, torch.randn(n)
    real = make_real_linear(weight, bias, SCHEMES.get(scheme))
    fake = FakeQuantLinear(weight, bias, SCHEMES.get(scheme))
    assert isinstance(real, Int8Linear) and real.qweight_t.t().is_contiguous()
    for lead in ROWS:
        x = torch.randn(*lead, k)
        with native.enabled(False):
            torch_path = real(x)
        fast = real(x)
        with torch.inference_mode():
            assert rel_err(fast, fake(x)) < 1e-5
        assert torch.equal(fast, torch_path)  # exact int32 accumulation, same epilogue order


def test_int8_many_rows_through_int_mm_equal_the_c_kernel(monkeypatch):
    torch.manual_seed(2)
    real = Int8Linear.from_float(torch.randn(37, 63), torch.randn(37))
    x = torch.randn(3, 11, 63)  # 33 rows: the prefill branch
    monkeypatch.setattr(paths, "int_mm_preferred", lambda: False)
    c_kernel = real(x)
    monkeypatch.setattr(paths, "int_mm_preferred", lambda: True)
    assert torch.equal(real(x), c_kernel)


def test_epilogue_in_place_equals_the_allocating_one():
    """The eager int-mm path writes its floats over _int_mm's int32 output: the same bits as a fresh output."""
    torch.manual_seed(8)
    acc = torch.randint(-(2**20), 2**20, (33, 37), dtype=torch.int32)
    sx, sw, bias = torch.rand(33), torch.rand(37), torch.randn(37)
    want = native.scale_output(acc, sx, sw, bias)
    got = native.scale_output(acc, sx, sw, bias, in_place=True)
    assert got.data_ptr() == acc.data_ptr() and torch.equal(got, want)


def _weight_only(kind: str, weight: torch.Tensor, bias: torch.Tensor, group: int | None, symmetric: bool):
    if kind == "int4":
        return Int4Linear.from_float(weight, bias, group)
    return Int8WeightOnlyLinear.from_float(weight, bias, group, symmetric)


@pytest.mark.parametrize(
    ("kind", "symmetric"),
    [("int4", False), ("int8", True), ("int8", False)],
    ids=["w4-zp", "w8-absmax", "w8-zp"],
)
@pytest.mark.parametrize("group", [None, 32, 64, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_weight_only_native_equals_fake(kind, symmetric, group, shape):
    k, n = shape
    if group is not None and k % group:
        pytest.skip("group does not tile the row")
    torch.manual_seed(3)
    weight, bias = torch.randn(n, k) * 0.1, torch.randn(n)
    granularity = PerAxis(0) if group is None else PerGroup(group)
    bits = 4 if kind == "int4" else 8
    scheme = QuantScheme("t", weight_bits=bits, weight_granularity=granularity, weight_symmetric=symmetric)
    real = _weight_only(kind, weight, bias, group, symmetric)
    assert torch.equal(real.dequantized_weight(), fake_quantize(weight, bits, granularity, symmetric))
    fake = FakeQuantLinear(weight, bias, scheme)
    for lead in ROWS:
        x = torch.randn(*lead, k)
        with torch.inference_mode():
            expected = fake(x)
        got = real(x)
        if x.numel() // k > paths.DECODE_ROWS:
            assert torch.equal(got, expected)  # C dequantise + the same F.linear
        else:
            assert rel_err(got, expected) < 1e-5  # reassociated float sums


# (bits, symmetric, group): the int2-g64 / int3-g128, absmax int4, ragged groups (40 and 48 do not divide
# 203: a shorter last group; 40 starts groups off a vector step), per output channel
LOWBIT = [(2, False, 64), (3, False, 128), (4, True, None), (3, True, 40), (2, False, 48), (2, True, None),
          (3, False, None), (4, False, 32)]  # fmt: skip


@pytest.mark.parametrize(("bits", "symmetric", "group"), LOWBIT)
@pytest.mark.parametrize("k", [203, 256])
def test_lowbit_native_equals_fake(bits, symmetric, group, k):
    """LowBitLinear's C paths: the loop reading the packed codes (≤ 16 rows) equals fake mode to float rounding
    (rtol 1e-5 of the output scale), the C dequantisation + F.linear (more rows) bit for bit."""
    torch.manual_seed(11)
    n = 37
    weight, bias = torch.randn(n, k) * 0.1, torch.randn(n)
    granularity = PerAxis(0) if group is None else PerGroup(group)
    scheme = QuantScheme("t", weight_bits=bits, weight_granularity=granularity, weight_symmetric=symmetric)
    real = LowBitLinear.from_float(weight, bias, bits, granularity, symmetric)
    fake = FakeQuantLinear(weight, bias, scheme)
    zconst = -qrange(bits, True)[0]
    padded = real.scales.shape[1] * real.group
    w_hat = native.lowbit_dequantize(real.qweight, bits, real.scales, real.zeros, zconst, padded, k)
    assert torch.equal(w_hat, real.dequantized_weight())
    for lead in [*ROWS, (4,), (16,), (3, 7)]:
        x = torch.randn(*lead, k)
        with torch.inference_mode():
            expected = fake(x)
        got = real(x)
        rows = x.numel() // k
        assert real.last_path == ("c-gemv" if rows <= paths.DECODE_ROWS else "c-dequant")
        if rows > paths.DECODE_ROWS:
            assert torch.equal(got, expected)
        else:
            assert rel_err(got, expected) < 1e-5, lead


def test_lowbit_portable_loop_equals_the_vector_loop():
    """native_ref.c's scalar loop (what a CPU without AVX2 runs) and this build's, on the same packed codes:
    both reassociate float sums, so they agree to float rounding; the dequantisers agree bit for bit."""
    portable = _portable()
    torch.manual_seed(12)
    for bits, symmetric, group in LOWBIT:
        for m in (1, 5, 17):
            real = LowBitLinear.from_float(
                torch.randn(9, 203), None, bits, PerAxis(0) if group is None else PerGroup(group), symmetric
            )
            padded = real.scales.shape[1] * real.group
            x = torch.nn.functional.pad(torch.randn(m, 203), (0, padded - 203))
            zconst = -qrange(bits, True)[0]
            want = native.lowbit_linear(x, real.qweight, bits, real.scales, real.zeros, zconst, None)
            y = torch.empty(m, 9)
            _call(portable, "qk_lowbit_linear", x, m, padded, real.qweight, bits, real.scales, real.zeros,
                  zconst, real.scales.shape[1], None, y, 9, 1)  # fmt: skip
            assert rel_err(y, want) < 1e-5
            assert rel_err(y, x[:, :203] @ real.dequantized_weight().T) < 1e-5
            w_hat = torch.empty(9, 203)  # the dequantisers: the same float operations, bit for bit
            _call(portable, "qk_lowbit_dequantize", real.qweight, bits, real.scales, real.zeros, zconst, 9,
                  padded, real.scales.shape[1], 203, w_hat, 1)  # fmt: skip
            assert torch.equal(w_hat, real.dequantized_weight())


@pytest.mark.parametrize(("k", "group"), [(2048, 128), (63, 63), (96, 32)])
def test_dequantize_kernel_equals_primitives(k, group):
    torch.manual_seed(4)
    w = torch.randn(7, k)
    granularity = PerGroup(group)
    for bits, symmetric in ((4, False), (8, True), (8, False)):
        qp = choose_qparams(w, bits, granularity, symmetric)
        codes = quantize(w, qp, bits, granularity, symmetric)
        zero = None if symmetric else qp.zero_point.reshape(7, -1).to(torch.uint8).contiguous()
        stored = pack_int4(codes) if bits == 4 else codes.contiguous()
        out = native.dequantize(stored, bits == 4, qp.scale.reshape(7, -1).contiguous(), zero, k)
        assert torch.equal(out, fake_quantize(w, bits, granularity, symmetric))


def test_switched_off_layers_take_the_torch_path(monkeypatch):
    torch.manual_seed(5)
    weight, bias = torch.randn(37, 63), torch.randn(37)
    layers = [Int8Linear.from_float(weight, bias), Int4Linear.from_float(weight, bias)]
    x = torch.randn(1, 63)
    fast = [m(x) for m in layers]
    calls = []
    monkeypatch.setattr(native, "_library", lambda: calls.append(1))  # any use of the library would show here
    with native.enabled(False):
        assert not native.available()
        slow = [m(x) for m in layers]
    assert calls == []
    assert torch.equal(fast[0], slow[0]) and rel_err(fast[1], slow[1]) < 1e-5


def test_no_compiler_means_torch_path(monkeypatch):
    from qbench.quant.kernels import build

    monkeypatch.setattr(build, "compiler", lambda: None)
    native._library.cache_clear()
    try:
        assert not native.available() and native.isa() is None
        m = Int8Linear.from_float(torch.randn(5, 8), None)
        assert m(torch.randn(2, 8)).shape == (2, 5)
    finally:
        native._library.cache_clear()  # the next use rebuilds with the real compiler


def test_the_library_is_built_once_per_cpu_and_source_then_loaded_from_the_cache(monkeypatch, tmp_path):
    """A second build of the same sources on the same CPU loads the cached library without the compiler; another
    CPU (its model and flags are part of the key) builds its own; a compile that times out gives None."""
    import subprocess

    from qbench.quant.kernels import build

    monkeypatch.setenv("QBENCH_CACHE", str(tmp_path))
    assert build.compile_source("fake_quant.c", []) is not None
    (cached,) = (tmp_path / "kernels").glob("fake_quant-*.so")

    def no_compiler(*args, **kwargs):
        raise AssertionError("the compiler ran although the library is cached")

    monkeypatch.setattr(build.subprocess, "run", no_compiler)
    assert build.compile_source("fake_quant.c", []) is not None
    monkeypatch.setattr(build, "cpu_identity", lambda: "another CPU")

    def too_slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], build.COMPILE_TIMEOUT_S)

    monkeypatch.setattr(build.subprocess, "run", too_slow)
    with pytest.warns(RuntimeWarning, match="torch paths run instead"):
        assert build.compile_source("fake_quant.c", []) is None
    assert list((tmp_path / "kernels").glob("*.so")) == [cached]


def test_native_isa_builds_a_lower_target_or_refuses_in_one_line(monkeypatch, tmp_path):
    """QBENCH_NATIVE_ISA=avx2 builds what an AVX2-only CPU runs (x86-64-v3, no AVX-512: on this CPU too, to time
    that build), portable the reference loops; a misspelt target is a did-you-mean error, and a target the
    compiler refuses is an error rather than a quiet fallback to the torch paths. The measured dispatch keys its
    choices on the target."""
    from qbench.quant.kernels import build

    monkeypatch.setenv("QBENCH_CACHE", str(tmp_path))
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    assert build.flag_cascade() == build.FLAG_CASCADE
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    assert build.flag_cascade() == (("-march=x86-64-v3", "-fopenmp"), ("-march=x86-64-v3",))
    monkeypatch.setenv(build.ISA_ENV, "portable")
    assert build.flag_cascade() == (("-fopenmp",), ())
    monkeypatch.setenv(build.ISA_ENV, "avx-2")
    with pytest.raises(UserError, match="did you mean 'avx2'"):
        build.flag_cascade()
    monkeypatch.setitem(build.ISA_TARGETS, "avx2", ("-march=no-such-cpu",))
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    with pytest.raises(
        UserError, match=r"QBENCH_NATIVE_ISA=avx2: the C compiler .* refuses -march=no-such-cpu"
    ):
        build.load("fake_quant.c")
    native._library.cache_clear()  # the layers' library follows the same target, and refuses the same way
    try:
        with pytest.raises(UserError, match="refuses -march=no-such-cpu"):
            native.available()
        from qbench.cli import main

        assert main(["ls", "presets"]) == 2  # checked before any command runs, not per grid cell
        monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx", "sse4_2"}))
        with pytest.raises(UserError, match="lacks: avx2, bmi2, f16c, fma, movbe"):
            build.isa_target()
        monkeypatch.undo()
        if {"avx2", "fma", "bmi2", "f16c", "movbe"} <= paths.cpu_flags():  # an AVX2 CPU builds and runs it
            monkeypatch.setenv("QBENCH_CACHE", str(tmp_path))
            monkeypatch.setenv(build.ISA_ENV, "avx2")
            native._library.cache_clear()
            assert native.isa() == "AVX2" and not native.vnni()
    finally:
        native._library.cache_clear()  # the next use builds this CPU's library again


@pytest.mark.parametrize("variable", ["QBENCH_NATIVE", "QBENCH_NATIVE_KERNELS"])
def test_environment_variable_switches_off(variable):
    """One switch for every compiled kernel (QBENCH_NATIVE=0); the older name still works for the real layers."""
    code = (
        "import torch\n"
        "from qbench.quant import ops\n"
        "from qbench.quant.granularity import PerTensor\n"
        "from qbench.quant.kernels import native\n"
        "ops.fake_quantize(torch.randn(64, 128), 8, PerTensor(), True)\n"
        "print(native.available(), ops._FAST_CPU['enabled'])"
    )
    env = {**os.environ, variable: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = "False False" if variable == "QBENCH_NATIVE" else "False True"
    assert out.stdout.strip() == expected


def test_two_threads_equal_one():
    torch.manual_seed(6)
    real = Int8Linear.from_float(torch.randn(37, 2048), torch.randn(37))
    w4 = Int4Linear.from_float(torch.randn(37, 2048), None, 64)
    x = torch.randn(3, 2048)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (real(x), w4(x))
        torch.set_num_threads(2)
        two = (real(x), w4(x))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])  # rows never split across threads


def test_a_weight_stored_in_another_layout_takes_the_torch_path():
    """A contiguous (K, N) qweight_t (e.g. rebuilt from a safetensors file) is not the C kernels' (N, K) layout:
    the layer must notice and compute the same output through torch, not read the bytes as (N, K)."""
    torch.manual_seed(8)
    layer = Int8Linear.from_float(torch.randn(37, 96), torch.randn(37))
    x = torch.randn(2, 96)
    expected = layer(x)
    layer.qweight_t = layer.qweight_t.contiguous()
    assert torch.equal(layer(x), expected)


def test_int8_codes_outside_absmax_range_are_refused():
    codes = torch.full((8, 4), -128, dtype=torch.int8)  # (K, N): −128 is not an absmax code
    with pytest.raises(UserError, match=r"int8 weight codes in \[−127, 127\]"):
        Int8Linear(codes, torch.ones(4), None)


@functools.cache
def _portable():
    """The library built from native_ref.c alone (no -march=native: what a CPU without AVX2 runs)."""
    return native.build(["-fopenmp"]) or native.build([])


@functools.cache
def _avx2():
    """The library built for AVX2 + FMA only (what an AVX2 CPU without AVX-512 runs), or None."""
    lib = native.build(["-mavx2", "-mfma", "-fopenmp"]) or native.build(["-mavx2", "-mfma"])
    return lib if lib is not None and lib.qk_isa() == 1 else None


def _call(lib, name, *args):
    return getattr(lib, name)(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))


def test_portable_loops_equal_the_vector_loops():
    """The plain-C build (native_ref.c) against this machine's build, exactly: the quantiser, the epilogue,
    W8A8 and W4A8 (per channel and per group) through both the GEMV and the GEMM entry, dequantisation —
    except W4A8's g = 32 AVX2 decode loop, whose float sum runs in another order (then to float rounding)."""
    portable = _portable()
    assert portable is not None and portable.qk_isa() == 0
    torch.manual_seed(9)
    for m, k, n, group in [(1, 63, 37, None), (3, 256, 20, 32), (20, 130, 9, None), (17, 256, 40, 64)]:
        x = torch.randn(m, k) * 3
        for rows_per_scale in (1, m):
            q, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m)
            _call(portable, "qk_quantize_rows", x, m, k, rows_per_scale, q, s)
            assert all(map(torch.equal, (q, s), native.quantize_rows(x, rows_per_scale)))
        q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        sx, sw, bias = torch.rand(m), torch.rand(n), torch.randn(n)
        y = torch.empty(m, n)
        _call(portable, "qk_w8a8_linear", q, sx, m, w, sw, 1, bias, y, n, k, 1)
        assert torch.equal(y, native.w8a8_linear(q, sx, w, sw, bias))
        acc = q.int() @ w.int().T
        _call(portable, "qk_scale_output", acc, m, n, sx, sw, 1, bias, y, 1)
        assert torch.equal(y, native.scale_output(acc, sx, sw, bias))
        layer = Int4A8Linear.from_float(torch.randn(n, k), bias, group)
        groups = layer.scales.shape[1]
        for gemv in (1, 0):  # each entry of the vector build, whatever the row count
            want = torch.empty(m, n)
            _call(native.library(), "qk_w8a8_forward_path", x, m, k, 1, w, sw, 1, bias, want, n, 1, gemv)
            _call(portable, "qk_w8a8_forward_path", x, m, k, 1, w, sw, 1, bias, y, n, 1, gemv)
            assert torch.equal(y, want)
            args = (x, m, k, 1, layer.qweight, layer.scales, groups, bias)
            assert _call(native.library(), "qk_w4a8_forward_path", *args, want, n, 1, gemv)
            assert _call(portable, "qk_w4a8_forward_path", *args, y, n, 1, gemv)
            if group == 32 and gemv and not native.vnni():  # AVX2's decode loop: another float order
                assert rel_err(y, want) < 1e-6
            else:
                assert torch.equal(y, want)
        codes, scale = layer.qweight, torch.rand(n, groups)
        zero = torch.randint(0, 16, (n, groups), dtype=torch.uint8)
        out = torch.empty(n, k)
        _call(portable, "qk_dequantize", codes, 1, 0, scale, zero, n, k, groups, out, 1)
        assert torch.equal(out, native.dequantize(codes, True, scale, zero, k))


@pytest.mark.parametrize(
    "m, k, group",
    [
        (1, 768, 32),  # whole 128-channel steps, four groups each
        (1, 576, 32),  # a last step of two groups (K % 128 = 64)
        (2, 96, 32),  # three groups: one partial step
        (5, 224, 32),  # 7 groups: a step of three
        (1, 63, None),  # per channel, odd K: the last byte's high nibble is past K
        (16, 1030, None),  # per channel, 16 rows (the GEMV's largest batch), a partial last step
        (3, 512, 128),  # g = 128: one step a group
        (1, 768, 256),  # g = 256: two steps a group
        (2, 384, 192),  # g = 64·3: the AVX2 loop on every build
    ],
)
@pytest.mark.parametrize(
    "n", [1, 6, 37]
)  # fewer than 4 channels; 4-channel blocks and a 2- or 1-channel rest
def test_w4a8_gemv_entry_equals_the_portable_build(m, k, group, n):
    """The W4A8 GEMV entry (decode, up to 16 rows) of this build against native_ref.c: bit for bit where the CPU has
    AVX-512 VNNI (native_avx512.c's four-row vpdpbusd loop keeps the reference's float order: integer group
    sums, then t = t + s_g · A_g), and to float rounding on the AVX2 loop, whose g = 32 sum runs in another
    order. Shapes cover every tail: partial 128-channel steps, odd K, channel counts off the 4-row blocks, both
    thread counts, and a group size the VNNI loop hands to the AVX2 one. The AVX2-only build runs too, so both
    decode loops are checked on a CPU with VNNI."""
    portable = _portable()
    torch.manual_seed(m * 1000 + k + n)
    layer = Int4A8Linear.from_float(torch.randn(n, k), torch.randn(n) if n != 6 else None, group)
    kp = layer.padded_features
    x = F.pad(torch.randn(m, k) * 3, (0, kp - k))
    x[0, 0] = 40.0  # one large activation: codes at ±127 beside small ones
    args = (x, m, kp, 1, layer.qweight, layer.scales, layer.scales.shape[1], layer.bias)
    want, y = torch.empty(m, n), torch.empty(m, n)
    assert _call(portable, "qk_w4a8_forward_path", *args, want, n, 1, 1)
    for lib in filter(None, (native.library(), _avx2())):  # this build, and the AVX2 loop on every AVX2 CPU
        for threads in (1, 2):
            y.fill_(float("nan"))
            assert _call(lib, "qk_w4a8_forward_path", *args, y, n, threads, 1)
            if lib.qk_avx512_vnni() or group != 32:
                assert torch.equal(y, want), (threads, (y - want).abs().max())
            else:
                assert rel_err(y, want) < 1e-6


@pytest.mark.parametrize(
    "m, k, n, group",
    [
        (1, 64, 5, 32),  # one row: a row tile of zero-padded rows; channel 4 past the 4-channel blocks
        (16, 96, 67, 32),  # 67 channels: 16 whole 4-channel blocks, then 3 scalar ones, a second panel of 3
        (17, 1030, 9, None),  # per channel, K not a multiple of 4 (the panel's tail steps)
        (17, 200, 70, 64),  # the last group completed with zero channels (200 = 3·64 + 8)
        (512, 256, 130, 32),  # prefill rows, 3 panels, rows a multiple of neither the tile (3) nor 6
        (40, 384, 64, 128),
    ],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_w4a8_gemm_entry_equals_the_portable_build_and_fake_mode(m, k, n, group, with_bias):
    """The W4A8 GEMM entry of this build (native_avx512.c's vpdpbusd tiles where the CPU has AVX-512 VNNI) and of
    an AVX2-only build (native_avx2.c's int16 panels) at row counts, widths and groups that exercise every tail of
    their tiling and panel unpacking: bit-identical to native_ref.c, and equal to fake mode to float rounding."""
    portable = _portable()
    torch.manual_seed(m * 7 + n)
    weight, bias = torch.randn(n, k) * 0.05, torch.randn(n) if with_bias else None
    layer = Int4A8Linear.from_float(weight, bias, group)
    kp = layer.padded_features
    x = F.pad(torch.randn(m, k) * 3, (0, kp - k))
    args = (x, m, kp, 1, layer.qweight, layer.scales, layer.scales.shape[1], layer.bias)
    want, y = torch.empty(m, n), torch.empty(m, n)
    assert _call(portable, "qk_w4a8_forward_path", *args, want, n, 1, 0)
    for lib in filter(None, (native.library(), _avx2())):
        for threads in (1, 2):
            assert _call(lib, "qk_w4a8_forward_path", *args, y, n, threads, 0)
            assert torch.equal(y, want)
    scheme = get_scheme("absmax-fine:w=4" + ("" if group is None else f",group={group}"))
    with torch.inference_mode():
        assert rel_err(y, FakeQuantLinear(weight, bias, scheme)(x[:, :k])) < 1e-5


@pytest.mark.parametrize(
    "m, k, n, group",
    [(1, 64, 5, 32), (3, 200, 300, 64), (17, 1030, 9, None), (40, 384, 64, 128), (2, 768, 37, 32)],
)
@pytest.mark.parametrize("gemv", [1, 0])
def test_w4a8_zero_point_entry_equals_the_portable_build(m, k, n, group, gemv):
    """Zero-point W4A8 (qk_w4a8_forward_zp): the loops of each build plus the one correction, at both loops,
    threads and tails — bit-identical to native_ref.c wherever the absmax loops are (the AVX2 g = 32 decode loop:
    to float rounding)."""
    portable = _portable()
    torch.manual_seed(m * 3 + n)
    layer = Int4A8Linear.from_float(torch.randn(n, k) * 0.05 + 0.02, torch.randn(n), group, symmetric=False)
    kp = layer.padded_features
    x = F.pad(torch.randn(m, k) * 3, (0, kp - k))
    zt = layer.zero_term()
    args = (x, m, kp, 1, layer.qweight, layer.scales, zt, layer.scales.shape[1], layer.bias)
    want, y = torch.empty(m, n), torch.empty(m, n)
    assert _call(portable, "qk_w4a8_forward_zp", *args, want, n, 1, gemv)
    for lib in filter(None, (native.library(), _avx2())):
        for threads in (1, 2):
            y.fill_(float("nan"))
            assert _call(lib, "qk_w4a8_forward_zp", *args, y, n, threads, gemv)
            if gemv and group == 32 and not lib.qk_avx512_vnni():
                assert rel_err(y, want) < 1e-6
            else:
                assert torch.equal(y, want), (threads, (y - want).abs().max())
    with torch.inference_mode():
        assert rel_err(y, layer(x[:, :k])) < 1e-5


@pytest.mark.parametrize("m, k, n", [(1, 63, 5), (16, 1030, 67), (17, 256, 64), (512, 200, 130)])
@pytest.mark.parametrize("per_channel", [1, 0])
def test_w8a8_gemm_entry_equals_the_portable_build(m, k, n, per_channel):
    """This build's W8A8 GEMM entry (vpdpbusd on weights stored +128 where the CPU has AVX-512 VNNI, int16 panels
    on AVX2) bit for bit against native_ref.c, with codes at ±127 (the largest sums and the −128·Σq correction)
    and K, N, M off every tile edge."""
    portable = _portable()
    torch.manual_seed(m + k + n)
    q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    q[0], w[0] = 127, -127  # extreme row and channel
    sw, bias = torch.rand(n if per_channel else 1), torch.randn(n)
    x = q.float() * torch.rand(m, 1)  # rows whose absmax is 127 quantise back to q
    want, y = torch.empty(m, n), torch.empty(m, n)
    args = (x, m, k, 1, w, sw, per_channel, bias)
    _call(portable, "qk_w8a8_forward_path", *args, want, n, 1, 0)
    for lib in filter(None, (native.library(), _avx2())):
        for threads in (1, 2):  # the GEMM entry at every row count (1 and 16 rows included)
            _call(lib, "qk_w8a8_forward_path", *args, y, n, threads, 0)
            assert torch.equal(y, want)
    qx, sx = native.quantize_rows(x)
    exact = (qx.double() @ w.double().T) * sx.double()[:, None] * sw.double() + bias.double()
    assert rel_err(y.double(), exact) < 1e-5


def test_the_vnni_loops_are_built_where_the_cpu_has_them():
    """Where the CPU has AVX-512 VNNI this machine's build holds native_avx512.c's GEMMs (so the tests above ran
    them); elsewhere say so, rather than pass without having tested them."""
    if "avx512_vnni" not in paths.cpu_flags() or native.isa() != "AVX2":
        pytest.skip("this CPU or build has no AVX-512 VNNI: native_avx512.c is not exercised here")
    assert native.vnni()


def test_w4a8_gemm_equal_across_avx2_and_vnni_builds():
    """The W4A8 GEMM of an AVX2-only build (native_avx2.c's int16 panels) and of this build (native_avx512.c's
    vpdpbusd where the CPU has AVX-512 VNNI) give the same bits, per channel and per group."""
    avx2 = _avx2()
    if avx2 is None:
        pytest.skip("the compiler does not build AVX2 here")
    torch.manual_seed(13)
    for m, k, n, group in [(20, 130, 9, None), (17, 256, 70, 64), (40, 512, 65, 32), (7, 384, 64, 128)]:
        layer = Int4A8Linear.from_float(torch.randn(n, k), torch.randn(n), group)
        x = torch.randn(m, k) * 3
        args = (x, m, k, 1, layer.qweight, layer.scales, layer.scales.shape[1], layer.bias)
        want, y = torch.empty(m, n), torch.empty(m, n)
        assert _call(native.library(), "qk_w4a8_forward_path", *args, want, n, 1, 0)
        assert _call(avx2, "qk_w4a8_forward_path", *args, y, n, 1, 0)
        assert torch.equal(y, want), (m, k, n, group)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lowbit_gemv_equal_across_avx2_and_this_build(bits):
    """The packed 2/3/4-bit weight-only loop of an AVX2-only build (native_avx2.c, 8 lanes) and of this build
    (native_avx512.c's 16-lane loop for 2 and 3 bits where the CPU has AVX-512 VNNI): the same sums in the same
    order, so the same bits — at rows 1–4 (each row-block width) and 17, groups of 32 / 64 / 128 channels, per
    channel with K off the 32-channel step (the 8-channel steps and the scalar tail), odd groups (all scalar)."""
    avx2 = _avx2()
    if avx2 is None:
        pytest.skip("the compiler does not build AVX2 here")
    torch.manual_seed(bits)
    n = 37
    for k, group, symmetric in [(256, 32, False), (512, 64, True), (384, 128, False), (203, None, False),
                                (88, None, True), (105, 21, False)]:  # fmt: skip
        gran = PerAxis(0) if group is None else PerGroup(group)
        real = LowBitLinear.from_float(torch.randn(n, k), None, bits, gran, symmetric)
        padded = real.scales.shape[1] * real.group
        zconst = -qrange(bits, True)[0]
        bias = torch.randn(n)
        for m in (1, 2, 3, 4, 17):
            x = torch.nn.functional.pad(torch.randn(m, k), (0, padded - k))
            groups = real.scales.shape[1]
            args = (x, m, padded, real.qweight, bits, real.scales, real.zeros, zconst, groups, bias)
            want, y = torch.empty(m, n), torch.empty(m, n)
            _call(avx2, "qk_lowbit_linear", *args, want, n, 1)
            _call(native.library(), "qk_lowbit_linear", *args, y, n, 1)
            assert torch.equal(y, want), (k, group, m)
            assert rel_err(y, x[:, :k] @ real.dequantized_weight().T + bias) < 1e-5


def test_portable_build_declines_weight_only_and_layers_dequantise():
    """native_ref.c has no loop reading weight-only codes: the entry point declines and paths.py dequantises."""
    portable = _portable()
    x, codes = torch.randn(2, 64), torch.randint(0, 256, (5, 32), dtype=torch.uint8)
    ok = _call(portable, "qk_weight_only_linear", x, 2, codes, 1, 0, torch.rand(5, 1), None, 1, None,
               torch.empty(2, 5), 5, 64, 1)  # fmt: skip
    assert ok == 0


# ------------------------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 40])
def test_real_layers_on_cuda_match_cpu(rows):
    torch.manual_seed(7)
    weight, bias = torch.randn(48, 256) * 0.1, torch.randn(48)
    x = torch.randn(rows, 256)
    for layer in (
        Int8Linear.from_float(weight, bias),
        Int4Linear.from_float(weight, bias, 64),
        Int8WeightOnlyLinear.from_float(weight, bias, 64),
        Int4A8Linear.from_float(weight, bias, 64),  # CUDA: the torch path (fake's arithmetic on the codes)
    ):
        y_cpu = layer(x)
        y_gpu = layer.to("cuda")(x.cuda()).cpu()
        assert rel_err(y_gpu, y_cpu) < 1e-5, type(layer).__name__
