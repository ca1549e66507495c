"""``scripts/gpu-check``: everything qbench wants to know the first time it meets a GPU, in one prepared run.

Run on a CUDA machine (≤ 8 minutes on one GPU; no downloads — it builds its own models and uses the embedded
corpus), it checks, each as a named entry of one JSON summary:

- ``pytest-gpu``: the test suite's ``gpu``-marked tests;
- ``softmax1-flash``: softmax-1 on the CUDA flash (bf16) and memory-efficient (fp32) kernels against the
  float64 reference, values and gradients, and its speed against plain causal SDPA (forward, forward+backward);
- ``triton-fake-quant``: the Triton fake-quantisation kernel against the CPU reference
  (``qbench.quant.primitives.fake_quantize``), bit-exact, per-row scales, 2/4/8 bits, both symmetries, fp32 and
  bf16, short rows and the long-row (split) path;
- ``int-mm``: the CUDA integer GEMM (padded cuBLAS, exact float fallback) against an int64 reference, odd shapes;
- ``real-vs-fake``: every real CUDA layer of W8A8 (absmax-fine, -coarse), int4, packed int3 and W4A8 against its
  fake layer on the same input, and whole-model perplexity real vs fake;
- ``qbench-speed``: ``qbench speed --device cuda`` (its table is kept in the summary);
- ``train-gpt2-130m`` / ``train-gpt2-130m-compiled``: 300 steps of ``gpt2-130m`` with the ``paper`` recipe
  (batch 16 × 1024, bf16 autocast): steady tokens/s (median over steps 11–300), MFU (``trainers.throughput``)
  and OrthoAdam's share of a step;
- ``ddp-2gpu``: a 2-process DDP run (torchrun) when two GPUs are present.

It exits 0 only if every check passed. Without CUDA (or with ``--dry-run``) it says so in one line and runs the
CPU-side self-test instead — softmax-1's fused path against the reference, the FLOPs formula, a few training
steps reporting tokens/s and MFU — and exits 0 when that passes. The summary goes to
``results/gpu/<gpu name>.json`` (``--out`` to change it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
TRAIN_STEPS = 300


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


class Checks:
    """Runs named checks, records each as {name, ok, seconds, details | error}."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        start = time.perf_counter()
        try:
            details, ok, error = fn(), True, None
        except Exception as e:  # a failed check is a result, not the end of the run
            details, ok = {}, False
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        seconds = round(time.perf_counter() - start, 2)
        self.results.append({"name": name, "ok": ok, "seconds": seconds, "details": details, "error": error})
        print(
            f"{'PASS' if ok else 'FAIL'} {name} ({seconds:.1f} s){'' if ok else ': ' + error.splitlines()[0]}"
        )

    @property
    def passed(self) -> bool:
        return all(r["ok"] for r in self.results)


def _assert(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


# ------------------------------------------------------------------------------------------------------------
# Checks shared by CPU and GPU


def _softmax1_check(device: str, shape=(2, 4, 128, 64)) -> dict[str, Any]:
    """Fused softmax-1 vs the float64 reference: max |error| of values and gradients per dtype."""
    from models.attention import attention_reference
    from models.flash_softmax1 import kernel_for, softmax1_flash

    out = {}
    dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
    for dtype in dtypes:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*shape, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
        y = softmax1_flash(q, k, v)
        _assert(y is not None, f"no fused kernel served {device}/{dtype}")
        ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_reference(*ref_in, "softmax1")
        grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        fast_grads = torch.autograd.grad(y, (q, k, v), grad.to(device, dtype))
        ref_grads = torch.autograd.grad(ref, ref_in, grad)
        value_err = (y.double().cpu() - ref).abs().max().item()
        grad_err = max((a.double().cpu() - b).abs().max().item() for a, b in zip(fast_grads, ref_grads))
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
        _assert(
            value_err < tol and grad_err < 10 * tol, f"{dtype}: value {value_err:.2e}, grad {grad_err:.2e}"
        )
        out[str(dtype)] = {"kernel": kernel_for(q), "max_value_error": value_err, "max_grad_error": grad_err}
    return out


def _attention_speed(device: str, dtype: torch.dtype, shape=(16, 12, 1024, 64), repeats: int = 20) -> dict:
    """softmax-1 (fused + lse) and softmax-1 (extra key, explicit mask) over plain causal SDPA, as time ratios."""
    import torch.nn.functional as F

    from models.attention import attention_extra_key
    from models.flash_softmax1 import softmax1_flash

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    paths = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "softmax1_fused": lambda: softmax1_flash(q, k, v),
        "softmax1_extra_key": lambda: attention_extra_key(q, k, v, "softmax1"),
    }

    def timed(fn, backward: bool) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        y = fn()
        if backward:
            y.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    result = {}
    for backward in (False, True):
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(repeats):  # interleaved, so drifts hit every path alike
            for name, fn in paths.items():
                with torch.set_grad_enabled(backward):
                    times[name].append(timed(fn, backward))
        base = statistics.median(times["sdpa"][2:])
        key = "forward_backward" if backward else "forward"
        result[key] = {n: round(statistics.median(t[2:]) / base, 3) for n, t in times.items() if n != "sdpa"}
    return {"shape": list(shape), "dtype": str(dtype), "ratio_to_sdpa": result}


def _flops_check() -> dict[str, Any]:
    """The MFU formula on gpt2-130m against a hand count (the model built on 'meta': no memory)."""
    from models import build, preset_config
    from trainers.throughput import flops_per_token, matmul_parameters

    cfg = preset_config("gpt2-130m")
    with torch.device("meta"):
        model = build(cfg)
    d, f, L, V, T = cfg.d_model, cfg.d_ff, cfg.n_layer, cfg.vocab_size, cfg.context
    by_hand = L * (3 * d * d + d * d + 2 * d * f) + V * d  # q/k/v, attention out, MLP in/out; the (tied) head
    _assert(matmul_parameters(model) == by_hand, f"{matmul_parameters(model)} != {by_hand}")
    expected = 6 * by_hand + 12 * L * d * T
    _assert(flops_per_token(model, L, d, T) == expected, "flops_per_token differs from 6N + 12LdT")
    return {"matmul_parameters": by_hand, "flops_per_token": expected}


def _micro_corpus(folder: Path) -> Path:
    """The first 40 documents of the embedded corpus cut to 8 KB: tokenised in under a second."""
    import gzip

    path = folder / "micro.jsonl"
    with (
        gzip.open(REPO / "trainers/corpus/embedded.jsonl.gz", "rt", encoding="utf-8") as f,
        open(path, "w") as out,
    ):
        for _, line in zip(range(40), f):
            doc = json.loads(line)
            out.write(json.dumps({"id": doc["id"], "text": doc["text"][:8000]}) + "\n")
    return path


def _steady(out: Path, skip: int = 10) -> dict[str, Any]:
    """Median tokens/s and MFU over the steps after the first ``skip`` (compilation and warm-up left out)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > skip and "tokens_per_s" in r]
    steps = steps or [r for r in records if "tokens_per_s" in r]
    mfus = [r["mfu"] for r in steps if r.get("mfu") is not None]
    return {
        "steady_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "steady_mfu": statistics.median(mfus) if mfus else None,
        "optim_share": sum(r["optim_s"] for r in steps) / sum(r["step_s"] for r in steps),
        "final_loss": records[-1].get("loss"),
    }


def _train(work: Path, name: str, **changes: Any) -> dict[str, Any]:
    from trainers.loop import TrainConfig, train

    cfg = TrainConfig(**{"eval_every": 10**6, "probe_every": 10**6, "ckpt_every": 10**6, **changes})
    summary = train(cfg, work / name, overwrite=True, progress=False)
    keep = ("tokens_per_s", "mfu", "optim_share", "train_s", "compiled", "throughput", "val_loss")
    return {**{k: summary.get(k) for k in keep}, **_steady(work / name)}


# ------------------------------------------------------------------------------------------------------------
# GPU-only checks


def _pytest_gpu() -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    tail = result.stdout.strip().splitlines()[-1:] or [""]
    _assert(result.returncode in (0, 5), f"pytest -m gpu exited {result.returncode}: {result.stdout[-1500:]}")
    return {"summary": tail[0]}


def _triton_check() -> dict[str, Any]:
    from qbench.quant.granularity import PerToken
    from qbench.quant.kernels import triton_fake
    from qbench.quant.primitives import fake_quantize

    cases = 0
    for (R, L, split), bits, sym, dtype in (
        (shape, b, s, dt)
        for shape in ((64, 4096, 1 << 16), (8, 20000, 4096), (3, 70000, 1 << 16))
        for b in (2, 4, 8)
        for s in (True, False)
        for dt in (torch.float32, torch.bfloat16)
    ):
        x = (torch.randn(R, L, generator=torch.Generator().manual_seed(R + L + bits)) * 3 + 0.25).to(dtype)
        got = triton_fake.fake_quantize_rows(x.cuda(), bits, sym, split_len=split).cpu()
        want = fake_quantize(x, bits, PerToken(), sym)
        _assert(
            torch.equal(got, want), f"mismatch at R={R} L={L} split={split} bits={bits} sym={sym} {dtype}"
        )
        cases += 1
    return {"cases_bit_exact": cases}


INT_MM_SHAPES = [
    (m, k, n)
    for m in (1, 3, 16, 17, 31, 32, 33, 80, 1024)
    for k in (64, 72, 768, 3072)
    for n in (48, 64, 768)
]


def _int_mm_check() -> dict[str, Any]:
    """qbench's CUDA integer GEMM (``int8.int_mm``: padded cuBLAS, else exact float chunks) against an int64
    reference on the CPU, over small, odd and refused shapes; reports which shapes cuBLAS refused."""
    from qbench.quant.kernels import int8

    gen = torch.Generator().manual_seed(0)
    for m, k, n in INT_MM_SHAPES:
        a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).t()  # a layer's (in, out) view
        want = (a.long() @ b.long()).int()
        got = int8.int_mm(a.cuda(), b.cuda()).cpu()
        _assert(torch.equal(got, want), f"int_mm wrong at M={m} K={k} N={n}")
    refused = sorted({key[1:] for key in int8._cublas_refused})
    return {"shapes_exact": len(INT_MM_SHAPES), "cublas_refused_padded_mkn": refused}


def _real_vs_fake() -> dict[str, Any]:
    """Every real CUDA layer against its fake layer on the *same* input (each fake layer's recorded input),
    ≤ 1e-5 of the output's range; then whole-model perplexity, real vs fake, within 1e-3 relative.

    The fake layer runs on the CPU (its quantiser is bit-exact with CUDA's, ``test_primitives``): a CUDA float32
    matmul may be TF32 (``models.io.cuda_fp32_matmul``: torch's flag or an environment override), and on the first
    H200 run fake-on-CUDA differed from the exact integer layers by 9.25e-4 of the range — TF32's size of error.

    Whole-model logits are not compared elementwise: on an untrained model one activation code landing a step
    apart (the fake path rounds its float32 dot products, the real path is exact) grows through the layers —
    measured on the CPU kernels, ``small`` preset, 4 × 256 tokens: per-layer difference ≤ 5e-7, logits 2 % of
    their range, perplexity 7e-5 relative — so that comparison measures chaos, not the kernels."""
    import math

    import torch.nn.functional as F

    from models import build, preset_config
    from models.io import cuda_fp32_matmul
    from qbench.quant import quantize
    from qbench.quant.apply import real_kernels

    model = build(preset_config("small"), seed=0).cuda().eval()
    x = torch.randint(0, model.config.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0)).cuda()

    def nll(logits: torch.Tensor) -> float:
        flat = logits[:, :-1].reshape(-1, logits.size(-1)).float()
        return F.cross_entropy(flat, x[:, 1:].reshape(-1)).item()

    out = {}
    for scheme in ("absmax-fine", "absmax-coarse", "zeropoint-int4", "zeropoint-int3-g128", "absmax-w4a8"):
        fake_model = quantize(model, scheme, mode="fake")
        real_model = quantize(model, scheme, mode="real")
        kernels = list(real_kernels(real_model))
        _assert(kernels, f"{scheme}: no real kernel was used on CUDA")
        inputs: dict[str, torch.Tensor] = {}
        real_layers = {n: m for n, m in real_model.named_modules() if callable(getattr(m, "nbytes", None))}
        fake_layers = dict(fake_model.named_modules())
        hooks = [
            fake_layers[n].register_forward_hook(
                lambda mod, args, _o, n=n, store=inputs: store.__setitem__(n, args[0])
            )
            for n in real_layers
        ]
        with torch.no_grad():
            fake_logits = fake_model(x)
            for h in hooks:
                h.remove()
            worst = 0.0
            for n, layer in real_layers.items():
                want = copy.deepcopy(fake_layers[n]).cpu()(inputs[n].cpu())
                got = layer(inputs[n]).cpu()
                worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
            real_logits = real_model(x)
        ppl_ratio = math.exp(nll(real_logits) - nll(fake_logits))
        out[scheme] = {
            "layers": len(real_layers),
            "max_rel_layer_diff": worst,
            "ppl_ratio": ppl_ratio,
            "kernels": kernels,
            "fp32_matmul": cuda_fp32_matmul(),
        }
        # absmax-coarse also quantises each output per sequence: a dot product the fake path rounds across a
        # code boundary lands one output step (1/127 of the range) apart
        tolerance = 1.001 / 127 if scheme == "absmax-coarse" else 1e-5
        _assert(
            worst <= tolerance,
            f"{scheme}: a real CUDA layer differs from fake by {worst:.2e} of its output range",
        )
        _assert(abs(ppl_ratio - 1) < 1e-3, f"{scheme}: real/fake perplexity ratio {ppl_ratio:.6f}")
    return out


def _speed(work: Path) -> dict[str, Any]:
    path = work / "speed.json"
    cmd = [sys.executable, "-m", "qbench", "speed", "--device", "cuda", "--repeats", "5", "--json", str(path)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    _assert(
        result.returncode == 0,
        f"qbench speed --device cuda exited {result.returncode}: {result.stderr[-800:]}",
    )
    return {"table": result.stdout[-4000:], "records": json.loads(path.read_text()).get("records")}


def _ddp(work: Path) -> dict[str, Any]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args = ["-m", "trainers", "--preset", "small", "--recipe", "paper", "--steps", "5", "--device", "cuda"]
    args += ["--data", str(_micro_corpus(work)), "--out", str(work / "ddp"), "--eval-every", "5", "--json"]
    result = subprocess.run([*launcher, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    _assert(result.returncode == 0, f"2-process DDP exited {result.returncode}: {result.stderr[-1500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def gpu_checks(checks: Checks, work: Path, ngpu: int) -> None:
    checks.run("pytest-gpu", _pytest_gpu)
    checks.run("softmax1-flash", lambda: _softmax1_check("cuda"))
    checks.run(
        "softmax1-speed",
        lambda: {dt: _attention_speed("cuda", getattr(torch, dt)) for dt in ("bfloat16", "float32")},
    )
    checks.run("triton-fake-quant", _triton_check)
    checks.run("int-mm", _int_mm_check)
    checks.run("real-vs-fake", _real_vs_fake)
    checks.run("qbench-speed", lambda: _speed(work))
    paper = dict(preset="gpt2-130m", recipe="paper", steps=TRAIN_STEPS, batch_size=16)
    checks.run("train-gpt2-130m", lambda: _train(work, "eager", **paper))
    checks.run("train-gpt2-130m-compiled", lambda: _train(work, "compiled", compile=True, **paper))
    if ngpu >= 2:
        checks.run("ddp-2gpu", lambda: _ddp(work))


def cpu_checks(checks: Checks, work: Path) -> None:
    checks.run("softmax1-fused-cpu", lambda: _softmax1_check("cpu", shape=(2, 3, 33, 16)))
    checks.run("flops-formula", _flops_check)
    micro = {"n_layer": 2, "d_model": 64, "n_head": 2, "d_ff": 128}
    checks.run(
        "train-micro-cpu",
        lambda: _train(
            work,
            "micro",
            preset="tiny",
            recipe="paper",
            switches=micro,
            context=32,
            batch_size=4,
            steps=3,
            data=str(_micro_corpus(work)),
            eval_tokens=256,
            probe_batch=2,
        ),
    )


# ------------------------------------------------------------------------------------------------------------
# The command


def summary(checks: Checks, device: str, dry_run: bool, started: float) -> dict[str, Any]:
    from models.io import cuda_fp32_matmul, git_commit, software_versions

    return {
        "device": device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "dry_run": dry_run,
        "all_passed": checks.passed,
        "seconds": round(time.perf_counter() - started, 1),
        "checks": checks.results,
        "software": software_versions(),
        "cuda_fp32_matmul": cuda_fp32_matmul() if torch.cuda.is_available() else None,
        "tf32_environment": {
            k: os.environ.get(k) for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")
        },
        "git_commit": git_commit(),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _result_words(check: dict[str, Any]) -> str:
    """One line for a check: its error's first line, else its headline figures."""
    if not check["ok"]:
        return (check.get("error") or "").splitlines()[0][:160]
    d = check.get("details") or {}
    name = check["name"]
    if name.startswith("train-"):
        return (
            f"steady {d['steady_tokens_per_s']:,.0f} tok/s, MFU {d['steady_mfu']:.3f} "
            f"({d['throughput']['peak_source']}), OrthoAdam {d['optim_share']:.0%} of a step, "
            f"val loss {d['val_loss']:.4f}"
        )
    if name == "softmax1-speed":
        return "; ".join(
            f"{dt} fused/SDPA forward {v['ratio_to_sdpa']['forward']['softmax1_fused']}×, "
            f"fwd+bwd {v['ratio_to_sdpa']['forward_backward']['softmax1_fused']}×"
            for dt, v in d.items()
        )
    if name == "softmax1-flash":
        return "; ".join(f"{dt} {v['kernel']}: value err {v['max_value_error']:.1e}" for dt, v in d.items())
    if name == "int-mm":
        refused = ", ".join("×".join(map(str, s)) for s in d["cublas_refused_padded_mkn"]) or "none"
        return f"{d['shapes_exact']} shapes exact; cuBLAS refused (padded M×K×N, exact fallback): {refused}"
    if name == "triton-fake-quant":
        return f"{d['cases_bit_exact']} cases bit-exact"
    if name == "real-vs-fake":
        return "; ".join(
            f"{k}: layer {v['max_rel_layer_diff']:.1e}, ppl ratio {v['ppl_ratio']:.6f}" for k, v in d.items()
        )
    if name == "qbench-speed":
        return f"{len(d.get('records') or [])} records (tables below)"
    if name == "pytest-gpu":
        return d.get("summary", "")
    return json.dumps(d)[:160]


def render(summary_json: dict[str, Any]) -> str:
    """The summary as Markdown (``--render``): a generated view of the JSON, never edited by hand."""
    from tabulate import tabulate

    from qbench.studies.speed import format_speed_table

    s = summary_json
    passed = sum(c["ok"] for c in s["checks"])
    sw = ", ".join(f"{k} {v}" for k, v in s["software"].items() if v)
    lines = [
        f"# gpu-check on {s['device']}",
        "",
        f"Generated by `scripts/gpu-check --render` from `{_slug(s['device'])}.json`. Run "
        f"{s['created_utc']}, {s['seconds']} s, **{passed}/{len(s['checks'])} checks passed**; "
        f"git {s['git_commit']}; {sw}; CUDA float32 matmul: {s.get('cuda_fp32_matmul') or 'not recorded'}.",
        "",
        tabulate(
            [[c["name"], "pass" if c["ok"] else "FAIL", c["seconds"], _result_words(c)] for c in s["checks"]],
            headers=["check", "result", "s", "figures / error"],
            tablefmt="github",
        ),
    ]
    speed = next((c for c in s["checks"] if c["name"] == "qbench-speed" and c["ok"]), None)
    if speed and speed["details"].get("records"):
        lines += [
            "",
            "## qbench speed --device cuda",
            "",
            format_speed_table(speed["details"]["records"], "github"),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run only the CPU-side self-test")
    parser.add_argument(
        "--output-path", "--out", dest="out", help="summary JSON path (default results/gpu/<gpu name>.json)"
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="write a summary's Markdown view beside it (<name>.md) and exit; runs no check",
    )
    args = parser.parse_args(argv)
    from models.io import atomic_write_bytes, atomic_write_json

    if args.render:
        source = Path(args.render)
        try:
            data = json.loads(source.read_text())
        except (OSError, ValueError) as err:
            print(f"gpu-check: cannot read the summary {source}: {err}", file=sys.stderr)
            return 2
        target = source.with_suffix(".md")
        atomic_write_bytes(target, render(data).encode())
        print(f"gpu-check: {source} -> {target}")
        return 0

    started, checks = time.perf_counter(), Checks()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    if not cuda:
        why = "--dry-run" if args.dry_run else "no CUDA device"
        print(f"gpu-check: {why}: running the CPU-side self-test only")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if cuda:
            gpu_checks(checks, Path(tmp), torch.cuda.device_count())
        else:  # the micro corpus's token cache goes with the temporary folder
            saved = os.environ.get("QBENCH_CACHE")
            os.environ["QBENCH_CACHE"] = str(Path(tmp) / "cache")
            try:
                cpu_checks(checks, Path(tmp))
            finally:
                if saved is None:
                    os.environ.pop("QBENCH_CACHE", None)
                else:
                    os.environ["QBENCH_CACHE"] = saved
    default = REPO / "results" / "gpu" / (f"{_slug(device)}.json" if cuda else "cpu-dry-run.json")
    out = Path(args.out) if args.out else default
    atomic_write_json(out, summary(checks, device, not cuda, started))
    passed = sum(r["ok"] for r in checks.results)
    print(f"gpu-check: {passed}/{len(checks.results)} checks passed on {device} -> {out}")
    return 0 if checks.passed else 1


if __name__ == "__main__":
    sys.exit(main())
