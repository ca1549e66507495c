"""The qbench::fake_quantize custom op: equal to the primitive on every path, opcheck, STE, compile, Triton."""

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.errors import UserError
from qbench.quant import ops
from qbench.quant.granularity import PerAxis, PerBlock, PerGroup, PerTensor, PerToken, per_sequence
from qbench.quant.kernels import fake_cpu as cpu_kernel
from qbench.quant.primitives import fake_quantize as reference

GRANULARITIES = [PerTensor(), PerAxis(0), PerAxis(-1), PerToken(), PerGroup(4), PerBlock((1, -1, -1))]


@settings(max_examples=50, deadline=None)
@given(
    st.sampled_from(GRANULARITIES),
    st.integers(2, 8),
    st.booleans(),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_op_equals_primitive(granularity, bits, symmetric, dtype, transposed, seed):
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if transposed:  # a non-contiguous input takes the generic path
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    # min_numel=1: these small inputs take the fused C kernel too (its default threshold would skip it and
    # compare the primitive with itself).
    with ops.cpu_fast_path(True, min_numel=1):
        y = ops.fake_quantize(x, bits, granularity, symmetric)
    assert y.dtype == x.dtype and y.is_contiguous()
    assert torch.equal(y, reference(x, bits, granularity, symmetric))


def test_small_inputs_reach_the_c_kernel_when_asked(monkeypatch):
    """Guards the test above: with min_numel=1 a small fp32 row layout is computed by the C kernel."""
    calls = []
    real = cpu_kernel.fake_quantize_rows
    monkeypatch.setattr(cpu_kernel, "fake_quantize_rows", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 4, 8)
    with ops.cpu_fast_path(True, min_numel=1):
        y = ops.fake_quantize(x, 8, PerToken(), True)
    assert calls and torch.equal(y, reference(x, 8, PerToken(), True))


def test_rows_view_recognises_contiguous_blocks():
    x = torch.zeros(2, 3, 8)
    assert ops.rows_view(x, (2, 3, 8)).shape == (1, 48)  # per tensor
    assert ops.rows_view(x, (1, 3, 8)).shape == (2, 24)  # per sequence
    assert ops.rows_view(x, (1, 1, 8)).shape == (6, 8)  # per token
    assert ops.rows_view(x, (1, 1, 4)).shape == (12, 4)  # per group
    assert ops.rows_view(x, (2, 3, 1)) is None  # per channel: strided blocks
    assert ops.rows_view(x.transpose(0, 1), (1, 1, 8)) is None  # not contiguous


@pytest.mark.parametrize("shape", [(6, 8), (64, 128)], ids=["torch-path", "c-kernel-path"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block", [[-1, -1], [1, -1], [1, 4]])
def test_opcheck(block, symmetric, shape):
    x = torch.randn(*shape, requires_grad=True)
    torch.library.opcheck(torch.ops.qbench.fake_quantize.default, (x, 8, symmetric, block))


def test_straight_through_gradient():
    x = torch.randn(4, 8, requires_grad=True)
    grad = torch.randn(4, 8)
    ops.fake_quantize(x, 4, PerToken(), False).backward(grad)
    assert torch.equal(x.grad, grad)


def test_activation_scales_are_per_sequence():
    """A batch of two sequences quantises exactly as the two run separately (per-tensor = per sequence)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.stack([torch.randn(5, 8, generator=gen), 100 * torch.randn(5, 8, generator=gen)])  # (B=2, T, C)
    for g in (PerTensor(), PerAxis(-1), PerToken()):
        batched = ops.fake_quantize_activation(x, 8, g, True)
        separate = torch.cat([ops.fake_quantize_activation(x[b : b + 1], 8, g, True) for b in range(2)])
        assert torch.equal(batched, separate)
    # whereas one scale over the whole batch would crush the small sequence
    assert not torch.equal(
        ops.fake_quantize(x, 8, PerTensor(), True)[0],
        ops.fake_quantize_activation(x, 8, PerTensor(), True)[0],
    )
    assert per_sequence(PerTensor(), x.ndim) == PerBlock((1, -1, -1))


def test_errors_surface_from_the_op():
    with pytest.raises(UserError, match="bits"):
        ops.fake_quantize(torch.randn(3), 1, PerTensor(), True)
    with pytest.raises(ValueError, match="NaN"):
        ops.fake_quantize(torch.tensor([1.0, float("nan")]), 8, PerTensor(), True)


@pytest.mark.slow
def test_op_inside_torch_compile_fullgraph():
    """The one compile test: the op traces under torch.compile(fullgraph=True), forward and STE backward."""
    x = torch.randn(2, 6, 16, requires_grad=True)

    def f(t):
        return ops.fake_quantize_activation(t * 2, 8, PerTensor(), True) + 1

    y = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(y, f(x))
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


@contextlib.contextmanager
def c_kernel_for_every_size():
    saved = dict(ops._FAST_CPU)
    ops.set_cpu_fast_path(True, min_numel=1)
    try:
        yield
    finally:
        ops._FAST_CPU.update(saved)


needs_c_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler for the CPU kernel")


@needs_c_kernel
@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=3),
    st.sampled_from(["tensor", "channel", "token", "group", "sequence"]),
    st.integers(2, 8),
    st.booleans(),
    st.integers(0, 2**16),
    st.sampled_from(["gauss", "zeros", "outlier", "positive"]),
)
def test_c_kernel_equals_primitive(shape, kind, bits, symmetric, seed, values):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed % 7 - 3)
    if values == "zeros":
        x.zero_()
    elif values == "outlier":
        x.view(-1)[seed % x.numel()] = 1e6
    elif values == "positive":
        x = x.abs() + 0.5
    g = {
        "tensor": PerTensor(),
        "channel": PerAxis(0),
        "token": PerToken(),
        "sequence": PerBlock((1,) + (-1,) * (len(shape) - 1)),
        "group": PerGroup(max(d for d in (1, 2, 4, 5) if shape[-1] % d == 0)),
    }[kind]
    with c_kernel_for_every_size():
        y = ops.fake_quantize(x, bits, g, symmetric)
    assert torch.equal(y, reference(x, bits, g, symmetric))


@needs_c_kernel
def test_c_kernel_is_used_threads_and_errors(monkeypatch):
    calls = []
    real = cpu_kernel.fake_quantize_rows
    monkeypatch.setattr(cpu_kernel, "fake_quantize_rows", lambda *a: calls.append(a[0].shape) or real(*a))
    w = torch.randn(256, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 256 rows split over two threads
    try:
        for symmetric in (True, False):
            assert torch.equal(
                ops.fake_quantize(w, 4, PerAxis(0), symmetric), reference(w, 4, PerAxis(0), symmetric)
            )
    finally:
        torch.set_num_threads(threads)
    assert calls == [(256, 96), (256, 96)]
    for bad in (float("nan"), float("inf")):
        x = torch.randn(64, 128)
        x[40, 3] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            ops.fake_quantize(x, 8, PerToken(), True)
    with pytest.raises(ValueError, match="overflows"):  # finite values whose range overflows float32
        ops.fake_quantize(torch.tensor([[-3e38, 3e38] * 4096]), 8, PerTensor(), False)


TRITON_CHECK = textwrap.dedent(
    """
    import itertools, torch
    from qbench.quant.kernels import triton_fake
    from qbench.quant.granularity import PerToken
    from qbench.quant.primitives import fake_quantize
    gen = torch.Generator().manual_seed(0)
    for (R, L, split), bits, sym, dt in itertools.product(
            [(3, 7, 1 << 16), (4, 300, 1 << 16), (2, 300, 64)], (2, 4, 8), (True, False),
            (torch.float32, torch.bfloat16, torch.float16)):
        x = (torch.randn(R, L, generator=gen) * 3 + 0.5).to(dt)
        x[0, 0] = 40
        y = triton_fake.fake_quantize_rows(x, bits, sym, split_len=split)
        assert torch.equal(y, fake_quantize(x, bits, PerToken(), sym)), (R, L, split, bits, sym, dt)
    print("triton kernels exact")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not ops.triton_available(), reason="triton is not installed (optional, ~1 GB)")
def test_triton_kernels_under_the_interpreter():
    """The CUDA path's kernels, run on CPU by TRITON_INTERPRET=1 (in a subprocess: the flag is read at import)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton kernels exact" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_equals_primitive(symmetric, dtype):
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.randn(64, 1024, generator=gen), g) for g in (PerAxis(0), PerGroup(128), PerToken())]
    cases.append((torch.randn(2, 256, 512, generator=gen), PerBlock((1, -1, -1))))  # long rows: split path
    for x, g in cases:
        x = x.to(dtype)
        y = ops.fake_quantize(x.cuda(), 8, g, symmetric).cpu()
        assert torch.equal(y, reference(x, 8, g, symmetric)), g
