"""The Python cost of one real layer call at decode, for ``qbench speed`` (records of kind ``overhead``).

For each real layer kind at one decode row, three calls are interleaved ``calls`` times (so drift in the CPU's
clock hits all three alike) and their medians kept:

- ``generic_us``: the layer's generic forward (``paths.run_fast`` switched off for that call): input checks,
  the dispatch key, the bound-call lookup, reshapes — what every call paid before the fast path;
- ``fast_us``: the layer as it runs (its kept decode call, ``paths.run_fast``);
- ``kernel_us``: the bound C call alone on the same row (the ctypes call and its output allocation included).

All on the decode GEMV (``paths.force("c-gemv")``), the path a bound call serves at one row.

``overhead_generic_us`` and ``overhead_fast_us`` are the first two minus ``kernel_us``: the per-call work that
is not the kernel. Only CPU float32 with the C kernels built has such a path; elsewhere there is no record.
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

# one scheme per layer kind (paths.KINDS): W8A8, W4A8, packed int2 and int3, int4 and int8 weight-only
OVERHEAD_SCHEMES = (
    "absmax-fine",
    "absmax-w4a8",
    "zeropoint-int2-g64",
    "zeropoint-int3-g128",
    "zeropoint-int4",
    "absmax-fine:a=none",
)
OVERHEAD_SHAPE = (384, 1152)  # the `small` preset's MLP up-projection: a layer where Python was half the call
OVERHEAD_CALLS = 2000


def _kernel_call(layer: nn.Module, x2: torch.Tensor) -> Callable[[], Any] | None:
    bound = layer.__dict__.get("_native_call")
    call = None if bound is None else bound.call
    if call is None:
        return None
    if len(inspect.signature(call).parameters) == 3:  # (x, rows per scale, gemv): the W8A8 / W4A8 GEMV
        return lambda: call(x2, 1, True)
    return lambda: call(x2)


def call_overhead_records(
    common: dict[str, Any],
    shape: tuple[int, int] = OVERHEAD_SHAPE,
    calls: int = OVERHEAD_CALLS,
    schemes: tuple[str, ...] = OVERHEAD_SCHEMES,
) -> list[dict[str, Any]]:
    """One record per scheme (module docstring); none when the C kernels are not available here."""
    from qbench.quant import quantize
    from qbench.quant.kernels import native, paths

    if not native.available() or common.get("device", "cpu") != "cpu":
        return []
    k, n = shape
    linear = nn.Sequential(nn.Linear(k, n))
    x = torch.randn(1, 1, k)
    warm = max(10, calls // 10)
    records = []
    run_fast = paths.run_fast
    for scheme in schemes:
        layer = quantize(linear, scheme, mode="real")[0]
        rec = {**common, "kind": "overhead", "name": scheme, "shape": [k, n], "rows": 1, "calls": calls}
        # the decode GEMV, forced: what a measured dispatch picks at one row differs by CPU, and only a bound C
        # call has a fast path to compare (a kind without a GEMV in this build records why)
        with torch.inference_mode(), paths.force("c-gemv"):
            layer(x)
            kernel = _kernel_call(layer, x.view(1, k))
            kept = layer.__dict__.get("_fast") is not None
            rec.update(backend=f"{type(layer).__name__} {layer.__dict__.get('last_path')}", kept=kept)
            if kernel is None:
                records.append({**rec, "error": "no bound C call on this build"})
                continue
            times: dict[str, list[int]] = {"generic": [], "fast": [], "kernel": []}
            try:
                for i in range(warm + calls):
                    paths.run_fast = _off
                    a = time.perf_counter_ns()
                    layer(x)
                    b = time.perf_counter_ns()
                    paths.run_fast = run_fast
                    c = time.perf_counter_ns()
                    layer(x)
                    d = time.perf_counter_ns()
                    kernel()
                    e = time.perf_counter_ns()
                    if i >= warm:
                        times["generic"].append(b - a)
                        times["fast"].append(d - c)
                        times["kernel"].append(e - d)
            finally:
                paths.run_fast = run_fast
        us = {name: statistics.median(t) / 1e3 for name, t in times.items()}
        records.append(
            {
                **rec,
                "generic_us": us["generic"],
                "fast_us": us["fast"],
                "kernel_us": us["kernel"],
                "overhead_generic_us": us["generic"] - us["kernel"],
                "overhead_fast_us": us["fast"] - us["kernel"],
                "error": None,
            }
        )
    return records


def _off(owner: object, x: torch.Tensor) -> None:
    return None


def overhead_table(rows: list[dict[str, Any]], tablefmt: str) -> str:
    from tabulate import tabulate

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    table = [
        [
            r["name"],
            r["backend"],
            f(r.get("generic_us")),
            f(r.get("fast_us")),
            f(r.get("kernel_us")),
            f(r.get("overhead_generic_us")),
            f(r.get("overhead_fast_us")),
            r.get("error") or "",
        ]
        for r in rows
    ]
    headers = [
        "scheme",
        "layer, path",
        "generic µs",
        "fast µs",
        "C call µs",
        "overhead before",
        "after",
        "note",
    ]
    return tabulate(table, headers, tablefmt=tablefmt)


def linear_kernel_ms(model: nn.Module, repeats: int = 20) -> float | None:
    """The time one CPU decode step spends in the model's linear layers' kernels alone, in ms: the sum over layers
    of each one's median on one row — a real layer's bound C call (the layer must have run a decode forward,
    which binds it), a float ``nn.Linear`` through ``F.linear``, a real layer without a bound call through its own
    forward. The layers are timed in model order, one pass over all of them per repeat, so that — as in a decode
    step — each layer's weight has been pushed out of cache by the others when its turn comes (timing one layer
    repeatedly measures it cache-hot: ~4× faster than in the step for ``small``'s fp32 layers). None when the
    model holds no linear layer. Attention, norms, embeddings and the Python between layers are the rest."""
    import torch.nn.functional as F

    from qbench.quant.kernels.base import RealLinear

    fns: list[Callable[[], Any]] = []
    for module in model.modules():
        if isinstance(module, RealLinear):
            x2 = torch.randn(1, module.in_features)  # CPU only (the caller's rule): C kernels or torch
            fns.append(_kernel_call(module, x2) or partial(module, x2))
        elif isinstance(module, nn.Linear):
            w = module.weight
            if w.dtype.is_floating_point:
                x2 = torch.randn(1, module.in_features, device=w.device, dtype=w.dtype)
                fns.append(partial(F.linear, x2, w, module.bias))
            else:  # a library's quantised nn.Linear subclass (bitsandbytes): its own forward
                fns.append(partial(module, torch.randn(1, module.in_features, device=w.device)))
    if not fns:
        return None
    times: list[list[int]] = [[] for _ in fns]
    with torch.inference_mode():
        for r in range(repeats + 1):
            for i, fn in enumerate(fns):
                a = time.perf_counter_ns()
                fn()
                took = time.perf_counter_ns() - a
                if r:  # the first pass binds and warms up
                    times[i].append(took)
    return sum(statistics.median(t) for t in times) / 1e6
