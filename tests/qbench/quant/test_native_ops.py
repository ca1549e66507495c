"""The compiled CPU kernels as ``torch.ops.qbench`` custom ops: each passes ``opcheck``, and a quantised model
with real kernels compiles whole (``torch.compile(fullgraph=True)``) and keeps them.

The C kernels are ``torch.ops.qbench`` custom ops (``kernels/_ops.py``), so dynamo traces each real layer into
one graph with the ops in it, and the compiled model computes exactly what the eager one does: the same C
functions on the same tensors. Backend: a recording one that runs the traced graph as is (``eager``'s cost),
so the test checks tracing and the kernels, not inductor's code generation.
"""

from __future__ import annotations

import pytest
import torch

from qbench.quant import quantize
from qbench.quant.apply import real_kernels
from qbench.quant.kernels import native, paths
from tests.qbench.conftest import micro_config, trained_like

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not native.available(), reason="no C compiler: the real layers run their torch paths"),
]

# scheme, its layers' kind in paths.choose
CASES = [
    ("absmax-fine", "w8a8"),  # W8A8 per channel × per token
    ("absmax-fine:w=4", "w4a8"),  # W4A8 per channel
    ("absmax-fine:w=4,group=32", "w4a8"),  # W4A8 groups of 32: the g = 32 loops
    ("zeropoint-w4a8-g32", "w4a8"),  # zero-point W4A8 (Q4_1-style): the loops plus the zero correction
    ("absmax-fine:a=none", "w8"),  # W8 weight-only
    ("zeropoint-int4", "w4"),  # W4 zeropoint weight-only (Int4Linear)
    ("zeropoint-int3-g128", "lowbit"),  # packed 3-bit codes (LowBitLinear)
]
# the op each path puts in the graph
OP = {
    "int-mm": "scale_output",
    "c-dequant": "dequantize",
    ("c-gemv", "w8"): "weight_only_linear",
    ("c-gemv", "w4"): "weight_only_linear",
    ("c-gemv", "lowbit"): "lowbit_linear",
    ("c-dequant", "lowbit"): "lowbit_dequantize",
    ("int-mm", "w4a8"): "w4a8_int_mm",
}


def _recording_backend(seen: set[str]):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    return backend


@pytest.mark.parametrize(("scheme", "kind"), CASES)
def test_real_model_compiles_fullgraph_and_equals_eager(scheme, kind):
    """Decode and prefill row counts through one compiled model: the second shape recompiles with dynamic
    shapes (symbolic rows), which the path choice must survive without a graph break."""
    torch._dynamo.reset()
    model = quantize(trained_like(micro_config("gpt2")), scheme, mode="real")
    assert real_kernels(model)
    seen: set[str] = set()
    compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(seen))
    expected = set()
    for shape in [(1, 5), (1, 7), (2, 20), (3, 17)]:
        ids = torch.randint(0, 8192, shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            eager, out = (getattr(t, "logits", t) for t in (model(ids), compiled(ids)))
        assert torch.equal(out, eager), shape
        path = paths.choose(kind, shape[0] * shape[1])
        expected.add("qbench." + (OP.get((path, kind)) or OP.get(path) or f"{kind}_forward"))
    assert expected <= seen, (expected, sorted(t for t in seen if t.startswith("qbench.")))


def _op_samples():
    torch.manual_seed(0)
    m, k, n = 3, 128, 5
    x = torch.randn(m, k)
    q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    sx, sw, bias = torch.rand(m), torch.rand(n), torch.randn(n)
    w4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    w3 = torch.randint(0, 256, (n, k * 3 // 8), dtype=torch.uint8)
    scale, zero = torch.rand(n, 2), torch.randint(0, 16, (n, 2), dtype=torch.uint8)
    zero_term = native.zero_term(scale, zero)  # zero-point W4A8: (groups, n)
    return {
        "quantize_rows": (x, 1),
        "w8a8_linear": (q, sx, w, sw, bias),
        "w8a8_forward": (x, m, w, sw, None, False),
        "w4a8_forward": (x, 1, w4, scale, bias, True, zero_term),
        "scale_output": (q.int()[:, :n].contiguous(), sx, sw, bias),
        "weight_only_linear": (x, w4, True, scale, zero, bias),
        "dequantize": (w4, True, scale, zero, k),
        # 3-bit codes: 8 in 3 bytes, rows of k = 2 groups of 64
        "lowbit_linear": (x, w3, 3, scale, zero, 3, bias),
        "lowbit_dequantize": (w3, 3, scale, None, 3, k, k - 5),
        "w4a8_int_mm": (x, 1, w4, scale, bias, zero_term),
    }


@pytest.mark.parametrize("name", list(_op_samples()))
def test_each_op_passes_opcheck(name):
    """Schema, fake kernel (shapes, dtypes) and the CPU kernel agree: what torch.compile relies on."""
    from qbench.quant.kernels import _ops

    assert set(_ops.OPS) == set(_op_samples())
    if name == "weight_only_linear" and not _ops.weight_only_loop(True, 128, 2):
        pytest.skip("this build has no weight-only loop (portable C)")
    torch.library.opcheck(getattr(torch.ops.qbench, name).default, _op_samples()[name])


def test_registration_is_idempotent_and_cheap():
    """Importing the ops twice (a reload) keeps the first registration; importing them pulls in no transformers."""
    import importlib
    import subprocess
    import sys

    from qbench.quant.kernels import _ops

    before = torch.ops.qbench.w8a8_linear
    importlib.reload(_ops)
    assert torch.ops.qbench.w8a8_linear is before
    code = "import sys, qbench.quant.kernels._ops; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
