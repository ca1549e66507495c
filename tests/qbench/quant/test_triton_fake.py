"""The CUDA fake-quant kernels' logic (``qbench.quant.triton_fake``), run on CPU by the Triton interpreter.

NaN must propagate as in the torch primitive (Triton's max/min drop NaN by default), and a launch must
fit CUDA's grid limits for any row length (the second grid dimension stops at 65,535 blocks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qbench.quant import ops

pytestmark = pytest.mark.skipif(
    not ops.triton_available(), reason="triton is not installed (the dev extra has it)"
)

CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)

NAN_CHECK = textwrap.dedent(
    """
    import itertools, torch
    from qbench.quant.kernels import triton_fake
    from qbench.quant.granularity import PerToken
    from qbench.quant.primitives import fake_quantize
    for (R, L, split), bad, sym, dt in itertools.product(
            [(3, 40, 1 << 16), (3, 5000, 64)], (float("nan"), float("inf")), (True, False),
            (torch.float32, torch.bfloat16)):
        x = (torch.randn(R, L, generator=torch.Generator().manual_seed(R * L)) * 3 + 0.5).to(dt)
        x[1, L // 2] = bad
        y = triton_fake.fake_quantize_rows(x, 4, sym, split_len=split)
        case = (R, L, split, bad, sym, dt)
        # the torch primitive refuses a non-finite row (the cell is reported non-finite); the kernel, which must
        # not synchronise to check, makes that row NaN and leaves the other rows exact
        assert y[1].isnan().all(), case
        assert torch.equal(y[[0, 2]], fake_quantize(x[[0, 2]], 4, PerToken(), sym)), case
    print("non-finite rows match")
    """
)


def _interpret(script: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"
    )  # the flag is read when triton is imported
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_nan_and_inf_rows_propagate_like_the_cpu_reference():
    """Short rows (the one-pass kernel) and long rows (scales from torch, a piece per program), exact."""
    result = _interpret(NAN_CHECK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "non-finite rows match" in result.stdout


def test_long_rows_launch_within_cuda_grid_limits(monkeypatch):
    """A per-tensor scale over 300 M elements needs 73,243 pieces of 4096: more than a grid's 2nd dimension holds."""
    from qbench.quant.kernels import triton_fake

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return lambda *args, **kwargs: None

    monkeypatch.setattr(triton_fake, "_apply_kernel", Recorder())
    rows = torch.empty(2, 300_000_000, device="meta")  # no memory: only the launch is computed
    triton_fake.fake_quantize_rows(rows, 8, True)
    (grid,) = grids
    assert all(1 <= g <= limit for g, limit in zip(grid, CUDA_GRID_LIMITS)), grid
    assert grid[0] == 2 * -(-300_000_000 // 4096)  # every piece of every row gets a program
