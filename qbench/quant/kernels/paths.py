"""Which kernel a real layer runs, by layer kind and row count — the dispatch of the compiled CPU kernels (``native``).

Rows = the tokens of one forward call (batch × sequence). :func:`choose` is the one place that decides; the
layers call it, and ``qbench env`` lists what it answers (:func:`describe`), so the listing cannot drift from
what runs. Paths (:data:`PATHS`):

- ``c-gemv``: C streaming GEMV (W8A8, W4A8: int8 dot products; weight-only, including LowBitLinear's packed
  2/3/4-bit codes: reads the codes, never builds Ŵ — equal to fake mode to float rounding);
- ``c-gemm``: C GEMM (W8A8, W4A8): int16 panels in AVX2 builds; vpdpbusd tiles with the quantiser before and the
  epilogue on each tile where the build targets AVX-512 VNNI (``native_avx512.c``);
- ``int-mm``: the C quantiser, ``torch._int_mm`` (oneDNN's int8 GEMM), the C epilogue written over
  ``_int_mm``'s int32 output (W8A8; eager: within ~8 % of ``_int_mm`` alone at 512 × 1024 → 4096); W4A8: the
  nibbles unpacked to an int8 panel once per call, one ``_int_mm`` per channel or per group (bit for bit the
  C GEMM);
- ``c-dequant``: Ŵ dequantised in one C pass, then torch's float32 GEMM (weight-only int4 / int8 and the packed
  2/3/4-bit codes of LowBitLinear; equal to fake mode bit for bit — the same Ŵ and the same ``F.linear``);
- ``torch``: the layer's torch path (any device and dtype).

Default choice on CPU with float32 input and the kernels built: measured, per shape class, at a layer's first
forward (:func:`_measure`; cached on disk per machine), each timed call starting with the CPU caches flushed
(weights come from memory, as in a model's step). ``QBENCH_DISPATCH=rule`` (and a class not measured
yet, e.g. while tracing) takes the fixed rule (:func:`rule`): ≤ ``DECODE_ROWS`` rows the GEMV; more rows the
GEMM (weight-only: ``c-dequant``), except W8A8 and per-channel W4A8 on CPUs with AVX-512 VNNI or AMX, where
``torch._int_mm`` is faster (AVX2-only CPUs have no fast ``_int_mm``: 0.01–0.07× float32 measured on AMD EPYC
Zen 3).

Everything else returns None from the ``*_forward`` functions and the layer runs its torch path: CUDA, input
other than float32, autograd, a stored tensor in a dtype the C kernel does not read (a float32 pointer must
point at float32: a bf16 bias read as float32 gave NaN), the kernels switched off with ``QBENCH_NATIVE=0``.

How a kernel is called: through the ``torch.ops.qbench`` custom ops of ``_ops.py`` wherever ``torch.compile``
may trace (inside a compiled region every kernel is one of those ops, so a quantised model compiles with
``fullgraph=True`` and keeps the C kernels), and for the quantiser, epilogue and dequantiser of the prefill
paths. Eager decode calls (``c-gemv``/``c-gemm``) go straight to the ctypes function bound once per layer
(:class:`_Bound`): the dispatcher round trip of a custom op costs ~12 µs a call (measured, one thread, a
384 → 384 layer at one row: 26 µs through the op against 14 µs bound), a third of a small layer's decode step.
Both call the same C function with the same arguments, so they give the same bits.

Forcing a path (tests, measurements): ``with paths.force("c-gemm"): …`` or ``QBENCH_FORCE_PATH=c-gemm`` in the
environment. A layer kind that has no such path (weight-only has no ``int-mm``, low-bit layers only ``torch``)
keeps its default choice, so one setting can run a whole model. Each forward records the path it took in the
layer's ``last_path`` attribute (a plain attribute, never saved), which the tests read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from models.errors import UserError, unknown_choice
from qbench.quant.kernels import _ops, native
from qbench.quant.kernels.build import compiler, compiler_version, cpu_flags, isa_target, source_digest

DECODE_ROWS = 16
FORCE_ENV = "QBENCH_FORCE_PATH"
DISPATCH_ENV = "QBENCH_DISPATCH"  # "rule": the fixed rule below; anything else (default): measured per class
MEASURE_BUDGET_S = 0.005  # per shape class: repeat a candidate only while the class has spent less than this
MEASURE_RUNS = 5  # at most, per candidate
# How a class is timed, part of the cache key: a change of protocol measures again instead of trusting old choices.
# "cold": the caches are flushed before every timed call. A decode step streams each layer's weights from memory
# once, so a candidate timed on weights already in cache is judged on the wrong thing: on Zen 4 hot timing chose
# torch._int_mm for gpt2-130m's W8A8 layers (2-3x faster than the C GEMV hot), while in the model's step, weights
# cold, the C GEMV made a token 1.4x faster (10.2 against 14.9 ms).
# A candidate replaces the rule's path only when at least this much faster (its time < rule's / (1 + margin)). A
# handful of cold calls per path is noisy: on Zen 4 the W8A8 768 x 768 decode class flipped between the C GEMV and
# torch._int_mm from run to run (0.142 against 0.160 ms one time, the reverse another), and the int-mm pick made
# gpt2-130m's W8A8 generation 14 % slower (98.7 against 114.6 tokens/s): a near tie keeps the rule's choice.
MEASURE_MARGIN = 0.15
# "+margin": the rule's path stays unless another is faster by MEASURE_MARGIN (its value is part of the key).
MEASURE_PROTOCOL = f"cold+margin{MEASURE_MARGIN}"
Shape = tuple[int, int, int]  # a layer's (in_features, out_features, weight groups)
PATHS = ("c-gemv", "c-gemm", "int-mm", "c-dequant", "torch")
KINDS = ("w8a8", "w4a8", "w4", "w8", "lowbit")
# the dtypes the C kernels read through their pointers: float32 scales / bias / input, int8 or uint8 codes
KERNEL_DTYPES = (torch.float32, torch.int8, torch.uint8)
_FORCED: dict[str, str | None] = {"path": None}


@functools.cache
def int_mm_preferred() -> bool:
    """Whether ``torch._int_mm`` beats the C kernel for many rows: CPUs with AVX-512 VNNI or AMX (oneDNN)."""
    return bool({"avx512_vnni", "amx_int8"} & cpu_flags())


@functools.cache
def _check_path(path: str) -> str:
    if path not in PATHS:
        raise unknown_choice("kernel path", path, PATHS)
    return path


@contextlib.contextmanager
def force(path: str | None) -> Iterator[None]:
    """Run every real layer on ``path`` (one of :data:`PATHS`) inside the block where its kind has it; None: default."""
    previous = _FORCED["path"]
    _FORCED["path"] = None if path is None else _check_path(path)
    try:
        yield
    finally:
        _FORCED["path"] = previous


def forced() -> str | None:
    """The forced path: :func:`force`, else ``QBENCH_FORCE_PATH``, else None."""
    return _FORCED["path"] or env_forced()


@functools.cache
def env_forced() -> str | None:
    """``QBENCH_FORCE_PATH``, read once (every forward asks; ``env_forced.cache_clear()`` reads it again)."""
    env = os.environ.get(FORCE_ENV)
    if not env:
        return None
    if env not in PATHS:
        raise UserError(f"{FORCE_ENV}={env!r} is not a kernel path; choose one of: {', '.join(PATHS)}")
    return env


def offered(kind: str) -> tuple[str, ...]:
    """The paths a layer kind can take here (CPU, float32 input), default ones first."""
    available = native.available()
    return _offered(kind, native.isa() if available else None)


@functools.cache
def _offered(kind: str, isa: str | None) -> tuple[str, ...]:
    if kind not in KINDS:
        raise unknown_choice("real layer kind", kind, KINDS)
    if isa is None:
        return ("torch",)
    if kind == "lowbit":  # packed 2/3/4-bit: a loop reading the codes in every build (portable: scalar)
        return ("c-gemv", "c-dequant", "torch")
    avx2 = isa == "AVX2"
    if kind == "w8a8":
        return ("c-gemv", *(("c-gemm",) if avx2 else ()), "int-mm", "torch")
    if kind == "w4a8":
        return ("c-gemv", *(("c-gemm",) if avx2 else ()), "int-mm", "torch")
    # weight-only: the GEMV that reads codes exists in AVX2 builds only (the portable build dequantises)
    return (*(("c-gemv",) if avx2 else ()), "c-dequant", "torch")


def choose(kind: str, rows: int, shape: Shape | None = None) -> str:
    """The path a layer of ``kind`` (:data:`KINDS`) takes for ``rows`` rows of float32 CPU input — what it runs.

    Order: a forced path (:func:`force`, ``QBENCH_FORCE_PATH``); the measured choice for the layer's ``shape``
    class (:func:`measured`; not with ``QBENCH_DISPATCH=rule``); else the fixed rule (:func:`rule`). A kernel may
    still decline at run time (a group size without a loop: the layer records the path it took)."""
    paths = offered(kind)
    want = forced()
    if want in paths:
        return want
    if shape is not None and dispatch_mode() == "measure":
        got = measured(kind, rows, shape)
        if got in paths:
            return got
    return rule(kind, rows, shape)


def rule(kind: str, rows: int, shape: Shape | None = None) -> str:
    """The fixed dispatch (``QBENCH_DISPATCH=rule``, and every class not measured yet): ≤ 16 rows the GEMV; more
    rows the GEMM (weight-only: ``c-dequant``), except on CPUs with AVX-512 VNNI or AMX, where W8A8 and per-channel
    W4A8 take ``torch._int_mm`` — W4A8 only when its GEMM was not built for AVX-512 VNNI."""
    paths = offered(kind)
    if rows <= DECODE_ROWS:
        return paths[0]
    per_channel = shape is None or shape[2] == 1  # per-group W4A8 needs one _int_mm per group: the C GEMM
    # W4A8 with the AVX-512 VNNI GEMM: as fast as _int_mm per channel at one thread, and its dynamic schedule
    # held up where oneDNN's static split halved on a busy second core
    vnni_w4a8 = kind == "w4a8" and native.available() and native.vnni() and "c-gemm" in paths
    if (
        kind in ("w8a8", "w4a8")
        and int_mm_preferred()
        and per_channel
        and "int-mm" in paths
        and not vnni_w4a8
    ):
        return "int-mm"
    big = "c-gemm" if kind in ("w8a8", "w4a8") else "c-dequant"
    return big if big in paths else paths[0]  # the portable build: its one loop takes every row count


# ------------------------------------------------------------------------- dispatch by measurement
# Which path is fastest depends on the CPU (VNNI, AMX, AVX2 only), the thread count and the layer's size, and a
# fixed rule got it wrong by up to 20× (measured on an AMX Xeon). So at a layer's first forward per process, for its shape class
# (kind, rows 1 / ≤ 16 / > 16, the weight's size rounded up to a power of two, per channel or per group, threads)
# every C path it offers is run on that very input and timed (a warm-up run, repeats while the class has spent
# under MEASURE_BUDGET_S), and the fastest is kept — in memory and in a JSON file under the cache folder
# ($QBENCH_CACHE, else ~/.cache/qbench: dispatch/<machine>.json, <machine> a hash of the CPU model, its flags,
# the torch version and the C kernels' sources), so later processes on the same machine read it instead of timing. Every candidate
# meets the layer's contract (the integer paths are bit-identical), so the choice changes speed, not results.


def dispatch_mode() -> str:
    """ "rule" when ``QBENCH_DISPATCH=rule``, else "measure"."""
    return "rule" if os.environ.get(DISPATCH_ENV, "").lower() == "rule" else "measure"


@functools.cache
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        line = ""
    return line.partition(":")[2].strip() or "unknown"


@functools.cache
def machine_key() -> str:
    """The measured choices' cache key: CPU model, its flags, the torch version, the C kernels' sources, the
    compiler's version and the build target (a changed kernel, compiler or ``QBENCH_NATIVE_ISA`` is measured
    again, not judged by its predecessor's times)."""
    cc = compiler()
    sources = source_digest(native.NATIVE_SOURCES) + (compiler_version(cc) if cc else "no compiler")
    sources += isa_target()
    text = "|".join(
        (cpu_model(), " ".join(sorted(cpu_flags())), torch.__version__, sources, MEASURE_PROTOCOL)
    )
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_file() -> Path:
    """Where the measured choices of this machine live."""
    from trainers.documents import cache_root

    return cache_root() / "dispatch" / f"{machine_key()}.json"


def class_key(kind: str, rows: int, shape: Shape) -> str:
    """The shape class of a call: what one measurement stands for."""
    k, n, groups = shape
    row_class = "1" if rows <= 1 else ("le16" if rows <= DECODE_ROWS else "gt16")
    size = max(1, k * n - 1).bit_length()  # weight elements, rounded up to a power of two
    gran = "group" if groups > 1 else "channel"
    return f"{kind}/rows-{row_class}/w-2^{size}/{gran}/threads-{native.threads()}"


_CHOICES: dict[str, dict[str, dict]] = {}  # cache file -> class key -> {"path", "ms"}
_GENERATION = [0]  # bumped by reset_measured: the layers' remembered answers are stale


def reset_measured() -> None:
    """Forget every measured choice this process knows (the cache file stays): the next call reads it again."""
    _CHOICES.clear()
    _GENERATION[0] += 1


def _read(file: Path) -> dict[str, dict]:
    try:
        data = json.loads(file.read_text())
        return dict(data.get("choices", {})) if data.get("machine") == machine_key() else {}
    except (OSError, ValueError, AttributeError):
        return {}


def measured_choices() -> dict[str, dict]:
    """Every measured choice known here (this process's and the cache file's): class key -> {path, ms}."""
    file = str(cache_file())
    if file not in _CHOICES:
        _CHOICES[file] = _read(Path(file))
    return _CHOICES[file]


def measured(kind: str, rows: int, shape: Shape) -> str | None:
    """The measured path for this call's class, None when it was not measured yet."""
    entry = measured_choices().get(class_key(kind, rows, shape))
    return None if entry is None else entry.get("path")


def _save(key: str, entry: dict) -> None:
    """Add one choice to memory and to the cache file (merged with what other processes wrote; atomic rename)."""
    measured_choices()[key] = entry
    file = cache_file()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        choices = {**_read(file), key: entry}
        data = {"machine": machine_key(), "cpu": cpu_model(), "torch": torch.__version__, "choices": choices}
        with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, file)
    except OSError:
        pass  # a read-only cache folder: the choice holds for this process


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs; 32 MiB where it cannot be read)."""
    sizes = []
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = size.read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * 2**20)


@functools.cache
def _eviction_buffer() -> Tensor:
    # twice the last-level cache (at most 512 MiB): writing it all pushes every earlier line out
    return torch.zeros(min(2 * last_level_cache_bytes(), 512 * 2**20), dtype=torch.uint8)


def flush_caches() -> None:
    """Push the CPU caches' contents out (read and write a buffer twice their size), so that the next call
    finds its weights in memory, as a layer of a model's decode step does."""
    _eviction_buffer().add_(1)


def _measure(owner: object, kind: str, rows: int, shape: Shape, run: Callable[[], Tensor | None]) -> None:
    """Time every C path ``kind`` offers on this call (``run`` is the layer's forward, run under :func:`force`)
    and save the fastest for the class (the rule's path where none beats it by :data:`MEASURE_MARGIN`). A path that declines or falls back is not a candidate. Every timed
    call starts with the caches flushed (:data:`MEASURE_PROTOCOL`)."""
    times: dict[str, float] = {}
    spent = 0.0
    for path in (p for p in offered(kind) if p != "torch"):
        best = float("inf")
        with force(path):
            for i in range(MEASURE_RUNS):
                owner.__dict__.pop("last_path", None)
                flush_caches()
                start = time.perf_counter()
                try:
                    y = run()
                except (RuntimeError, ValueError):  # a path that cannot run this call is no candidate
                    y = None
                took = time.perf_counter() - start
                spent += took
                if y is None or owner.__dict__.get("last_path") != path:
                    break
                best = min(best, took) if i else took  # the warm-up counts only when nothing follows it
                if i and spent > MEASURE_BUDGET_S:
                    break
        if best < float("inf"):
            times[path] = best
    _eviction_buffer.cache_clear()  # 2x the last-level cache: not held between measurements
    if times:
        _save(
            class_key(kind, rows, shape),
            {
                "path": measured_choice(times, rule(kind, rows, shape)),
                "ms": {p: round(t * 1e3, 4) for p, t in times.items()},
            },
        )


def measured_choice(times: dict[str, float], default: str) -> str:
    """The path kept from measured ``times``: the fastest, unless the rule's ``default`` was timed and the fastest
    beats it by less than :data:`MEASURE_MARGIN` (a near tie keeps the rule's path)."""
    fastest = min(times, key=times.__getitem__)
    if default in times and times[fastest] * (1 + MEASURE_MARGIN) > times[default]:
        return default
    return fastest


def describe(kind: str, rows: int) -> str:
    """Words for ``choose(kind, rows)``, for ``qbench env`` and benchmark tables."""
    path = choose(kind, rows)
    c = "portable C" if native.isa() == "C" else f"C {native.isa()}"
    if kind == "lowbit" and native.vnni():  # native_avx512.c's 16-lane loop for 2/3-bit codes
        reading = "C AVX-512 kernel reading the codes (no Ŵ; 4-bit codes AVX2)"
    else:
        reading = f"{c} kernel reading the codes (no Ŵ)"
    return {
        "c-gemv": f"{c} GEMV" if kind in ("w8a8", "w4a8") else reading,
        "c-gemm": "C AVX-512 VNNI GEMM" if kind in ("w8a8", "w4a8") and native.vnni() else f"{c} int16 GEMM",
        "int-mm": "C quantiser + torch._int_mm + C epilogue"
        if kind == "w8a8"
        else "int4 unpacked to int8 + torch._int_mm (per channel; per group the C GEMM)",
        "c-dequant": "C dequantise + torch sgemm",
        "torch": "torch (dequantise + F.linear)" if kind != "w8a8" else "torch._int_mm (torch quantiser)",
    }[path]


ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_int8",
    "amx_bf16",
)


def instruction_set() -> str:
    """The CPU's vector extensions that decide a path here, and what the C kernels were built for."""
    have = [f for f in ISA_FLAGS if f in cpu_flags()]
    built = f"C kernels built for {native.isa()}" if native.available() else "C kernels off"
    if native.available() and native.vnni():
        built += " (the W8A8 and W4A8 GEMMs and the 2/3-bit GEMV for AVX-512 VNNI)"
    return f"{' '.join(have) or 'no AVX2'}; {built}"


def _run_path(
    owner: object,
    path: str,
    stored: tuple[Tensor | None, ...],
    traced: Callable[[], Tensor | None],
    eager: Callable[[], Tensor | None],
) -> Tensor | None:
    """Run ``path`` the one way that applies; None (the layer's torch path) where it declines.

    Traced (inside torch.compile): ``traced``, built from the ``torch.ops.qbench`` custom ops — all of the C
    library a graph can hold —, once the C kernels can read ``stored``; nothing is bound or recorded, because a
    graph keeps no Python side effects. Eager: ``eager``, through the ctypes calls (no op dispatch), and the
    path recorded in the layer's ``last_path`` when it answered. ``eager`` checks the stored tensors itself:
    through ``_bound``, once per set of stored pointers, as a per-call ``stored_ok`` costs microseconds."""
    if torch.compiler.is_compiling():
        return traced() if stored_ok(*stored) else None
    y = eager()
    if y is not None:
        owner.__dict__["last_path"] = path
    return y


def stored_ok(*stored: Tensor | None) -> bool:
    """The C kernels can read these stored tensors: contiguous, on the CPU, in a dtype a kernel reads."""
    return all(
        t is None or (t.device.type == "cpu" and t.is_contiguous() and t.dtype in KERNEL_DTYPES)
        for t in stored
    )


def native_ok(x: Tensor, *stored: Tensor | None) -> bool:
    """The compiled kernels apply: float32 CPU input outside autograd, readable stored tensors."""
    return input_ok(x) and stored_ok(*stored)


def input_ok(x: Tensor) -> bool:
    """The compiled kernels apply to this input: float32 on the CPU, outside autograd, the library built."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not (x.requires_grad and torch.is_grad_enabled())
        and _native_ready()
    )


# Under torch.compile the dispatch below runs once, at trace time: dynamo cannot trace the library's build or
# its ctypes queries, so these answers are constants of the graph (switching the kernels off or forcing a path
# after compiling needs a recompile, torch._dynamo.reset()).
@torch.compiler.assume_constant_result
def _native_ready() -> bool:
    return native.available()


@torch.compiler.assume_constant_result
def _traced_choice(kind: str, many_rows: bool, k: int, n: int, groups: int) -> str:
    # choose reads rows only by class: 1, ≤ DECODE_ROWS or more (a traced graph takes what is measured, else the
    # rule; it never measures)
    return choose(kind, DECODE_ROWS + 1 if many_rows else 1, (k, n, groups))


@torch.compiler.assume_constant_result
def _traced_weight_only_loop(bits4: bool, in_features: int, groups: int) -> bool:
    return _ops.weight_only_loop(bits4, in_features, groups)


def _path(
    kind: str,
    rows: int,
    owner: object = None,
    shape: Shape | None = None,
    run: Callable[[], Tensor | None] | None = None,
) -> str:
    """``choose`` for this call; first measures the call's class when nothing is known for it (``run``: the
    layer's forward on this input, which :func:`_measure` runs once per candidate path)."""
    if not torch.compiler.is_compiling():
        if owner is None or shape is None or forced() is not None or dispatch_mode() != "measure":
            return choose(kind, rows, shape)
        # the answer per layer and class, kept on the layer: looking the class up in the shared table (building
        # its key and the cache file's path) cost ~30 µs a call, as much as a small layer's whole decode step
        memo = owner.__dict__.setdefault("_dispatch_memo", {})
        row_class = 1 if rows <= 1 else (2 if rows <= DECODE_ROWS else 3)
        key = (
            kind,
            row_class,
            native.threads(),
            _GENERATION[0],
            os.environ.get("QBENCH_CACHE"),
            machine_key(),
        )
        path = memo.get(key)
        if path is None:
            if run is not None and measured(kind, rows, shape) is None:
                _measure(owner, kind, rows, shape, run)
            path = memo[key] = choose(kind, rows, shape)
        return path
    k, n, groups = shape if shape is not None else (0, 0, 1)
    # rows may be symbolic (dynamic shapes): the comparison becomes a guard, the choice a constant per branch
    if rows > DECODE_ROWS:
        return _traced_choice(kind, True, k, n, groups)
    return _traced_choice(kind, False, k, n, groups)


class _LayerLocal:
    """State a layer derives from its own stored tensors (raw pointers): never copied or pickled with the layer
    — a copy or an unpickled layer rebuilds its own on first use."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (type(None), ())


class _Bound(_LayerLocal):
    """A layer's kernel call with the layer's constant arguments (pointers, shapes) bound, cached on the layer.

    Why: at decode a small layer's forward is dominated by Python (checks, attribute lookups, argument
    conversion), not by the kernel. ``key`` holds the stored tensors' data pointers, so replacing or moving a
    buffer rebuilds the call."""

    __slots__ = ("call", "key")

    def __init__(self, key: tuple, call: Callable[..., Tensor] | None) -> None:
        self.key, self.call = key, call


def _bound(owner: object, stored: tuple[Tensor | None, ...], make: Callable[[], Callable[..., Tensor]]):
    """The cached call for ``owner`` (None when a stored tensor is not one the C kernels can read)."""
    key = tuple(None if t is None else (t.data_ptr(), t.dtype) for t in stored)
    cached = owner.__dict__.get("_native_call")
    if cached is None or cached.key != key:
        cached = _Bound(key, make() if stored_ok(*stored) else None)
        owner.__dict__["_native_call"] = cached
    return cached.call


# ----------------------------------------------------------------------------------- the decode fast path
# At decode (≤ 16 rows) a small layer's time was mostly Python: the generic forward re-checks the input and the
# stored tensors, rebuilds the dispatch key (two environment reads), looks up the bound call and reshapes, ~15–20
# µs around a 15 µs kernel at 384 → 1152 (Zen 4). After a decode call ran a bound C kernel, the layer keeps that
# call with everything it depends on frozen: the path taken, a dispatch token (the measured-choices generation,
# the kernels switch, a forced path, torch's thread count) and the data pointers of the tensors the call reads.
# ``run_fast`` checks only the input (float32, CPU, contiguous, no autograd, the row class) and that token and
# those pointers, then calls the kernel. Environment variables that steer dispatch (QBENCH_DISPATCH,
# QBENCH_CACHE) are read when a layer first runs a row class, not on every call; every path computes the same
# result, so a later change of them can change speed, never numbers.


def _dispatch_token() -> tuple:
    return (_GENERATION[0], native._STATE["enabled"], _FORCED["path"], env_forced(), torch.get_num_threads())


class _FastEntry:
    __slots__ = ("checks", "path", "run", "token", "versions")

    def __init__(
        self, path: str, run: Callable[[Tensor, int], Tensor], tensors: tuple, derived_from: tuple = ()
    ) -> None:
        self.path, self.run, self.token = path, run, _dispatch_token()
        # (tensor, pointer): a tensor whose storage was swapped (``.data =``) no longer matches its bound pointer
        self.checks = tuple((t, t.data_ptr()) for t in tensors if t is not None)
        # (tensor, version): the stored tensors a bound derived one was computed from (zero-point W4A8's
        # s · (8 − z)); an in-place edit of one makes the derived tensor stale. Inference tensors keep no version.
        self.versions = tuple((t, t._version) for t in derived_from if t is not None and not t.is_inference())

    def current(self) -> bool:
        """Whether the call still computes the layer's output: the same dispatch, the same storages, no in-place
        edit of what a derived tensor came from."""
        return (
            self.token == _dispatch_token()
            and all(t.data_ptr() == ptr for t, ptr in self.checks)
            and all(t._version == version for t, version in self.versions)
        )


class _FastTable(_LayerLocal):
    """A layer's fast calls per row class (1 row; 2–16 rows), for inputs with ``k`` features. Dropped with the
    other derived state (``RealLinear.invalidate``: a cast, a device move, a loaded state dict, a new attribute)."""

    __slots__ = ("entries", "k")

    def __init__(self, k: int) -> None:
        self.k, self.entries = k, {}


def rows_per_scale(x: Tensor, rows: int, per_token: bool) -> int:
    """Rows sharing one activation scale for a layer input ``x`` of ``rows`` rows: 1 per token, else one
    sequence — the rows of one leading batch element of a (B, T, K) input, all rows of a ≤ 2-d one."""
    return 1 if per_token else (rows if x.dim() <= 2 else rows // x.shape[0])


def _scaled_run(call: Callable[..., Tensor | None], k: int, per_token: bool, gemv: bool):
    """A kept decode call for a layer quantising its activations (W8A8, W4A8): the layer's (…, K) input as is."""

    def run(x: Tensor, rows: int) -> Tensor | None:
        out = call(x.view(rows, k), rows_per_scale(x, rows, per_token), gemv)
        return None if out is None else out.view(*x.shape[:-1], -1)

    return run


def _plain_run(call: Callable[[Tensor], Tensor | None], k: int):
    """A kept decode call for a weight-only layer (float activations)."""

    def run(x: Tensor, rows: int) -> Tensor | None:
        out = call(x.view(rows, k))
        return None if out is None else out.view(*x.shape[:-1], -1)

    return run


def run_fast(owner: object, x: Tensor) -> Tensor | None:
    """The layer's output through its kept decode call, or None when that does not apply to ``x`` (then the
    generic forward runs, and may keep a call for next time)."""
    table = owner.__dict__.get("_fast")
    if (
        table is None
        or x.dtype is not torch.float32
        or not x.is_cpu
        or (x.requires_grad and torch.is_grad_enabled())
        or not x.is_contiguous()
        or x.dim() == 0
        or x.shape[-1] != table.k
        or torch.compiler.is_compiling()
    ):
        return None
    rows = x.numel() // table.k
    entry = table.entries.get(1 if rows == 1 else (2 if 1 < rows <= DECODE_ROWS else 0))
    if entry is None or not entry.current():
        return None
    owner.__dict__["last_path"] = entry.path
    return entry.run(x, rows)


def kept_decode_call(owner: object) -> Callable[[Tensor], Tensor] | None:
    """The layer's kept one-row call (a decode forward already ran through it), its token and pointers checked
    now, once: for a caller that runs many one-row steps with nothing in between that could change the layer or
    the dispatch — ``qbench.eval.decode``'s runtime within one generation, which binds every linear after the
    first step and so pays :func:`run_fast`'s per-call checks once per layer instead of once per token. The
    caller guarantees each input is what ``run_fast`` would have accepted (float32, CPU, contiguous, no autograd,
    one row of ``k`` features). None when the layer keeps no such call or it is stale."""
    table = owner.__dict__.get("_fast")
    entry = None if table is None else table.entries.get(1)
    if entry is None or not entry.current():
        return None
    owner.__dict__["last_path"] = entry.path
    run = entry.run
    return lambda x: run(x, 1)


def _keep_fast(
    owner: object,
    k: int,
    rows: int,
    path: str,
    run: Callable[[Tensor, int], Tensor],
    tensors: tuple,
    derived_from: tuple = (),
) -> None:
    """After a call of ``rows`` rows took ``path`` through a bound C kernel: keep ``run`` (x, rows) -> output
    for this row class when the layer's output is that kernel's output (``owner.fast_direct()``)."""
    direct = getattr(owner, "fast_direct", None)
    if rows < 1 or rows > DECODE_ROWS or direct is None or torch.compiler.is_compiling() or not direct():
        return
    table = owner.__dict__.get("_fast")
    if table is None or table.k != k:
        table = owner.__dict__["_fast"] = _FastTable(k)
    table.entries[1 if rows == 1 else 2] = _FastEntry(path, run, tensors, derived_from)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _int8_call(w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Callable[[Tensor, int, bool], Tensor]:
    fn = native.library().qk_w8a8_forward_path
    sw = w_scale.reshape(-1).contiguous()
    n, k = w.shape
    args = (w.data_ptr(), sw.data_ptr(), int(sw.numel() > 1), _ptr(bias))

    def call(x2: Tensor, rows_per_scale: int, gemv: bool) -> Tensor:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        fn(x2.data_ptr(), x2.shape[0], k, rows_per_scale, *args, y.data_ptr(), n, native.threads(), int(gemv))
        return y

    call.keep = (w, sw, bias)  # the bound pointers stay valid while the call lives
    return call


def int8_forward(
    owner: object,
    x3: Tensor,
    w_t: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    per_token: bool,
    input_scale: Tensor | None,
) -> Tensor | None:
    """float32 (B, T, N) of the W8A8 linear before any output quantisation, or None (use the torch path).

    ``w_t`` is the (K, N) int8 weight, the transpose of a contiguous (N, K) tensor; ``owner`` is the layer,
    which caches the bound kernel call and records the path taken.
    """
    if not input_ok(x3):
        return None
    B, T, K = x3.shape
    path = _path(
        "w8a8", B * T, owner, (K, w_t.shape[1], 1),
        lambda: int8_forward(owner, x3, w_t, w_scale, bias, per_token, input_scale),
    )  # fmt: skip
    if path == "torch":
        return None
    if input_scale is not None:
        x3 = x3 / input_scale
    x2 = x3.reshape(B * T, K).contiguous()
    per_scale = 1 if per_token else T
    if path == "int-mm":
        stored = (w_t.t(), w_scale, bias)

        def traced() -> Tensor:
            q, sx = torch.ops.qbench.quantize_rows(x2, per_scale)
            return torch.ops.qbench.scale_output(torch._int_mm(q, w_t), sx, w_scale.reshape(-1), bias)

        def eager() -> Tensor | None:
            if not stored_ok(*stored):
                return None
            # the ctypes wrappers, the epilogue written over _int_mm's own int32 output
            q, sx = native.quantize_rows(x2, per_scale)
            acc = torch._int_mm(q, w_t)
            return native.scale_output(acc, sx, w_scale.reshape(-1).contiguous(), bias, in_place=True)

    else:
        # (N, K): the C kernels' row-major layout — a contiguous (K, N) w_t is not (torch path then)
        w = w_t.t()
        stored, gemv = (w, w_scale, bias), path == "c-gemv"

        def traced() -> Tensor:
            return torch.ops.qbench.w8a8_forward(x2, per_scale, w, w_scale.reshape(-1), bias, gemv)

        def eager() -> Tensor | None:
            call = _bound(owner, stored, lambda: _int8_call(w, w_scale, bias))
            if call is None:
                return None
            if input_scale is None:  # x3 is then the layer's own input: the call alone is its output
                _keep_fast(owner, K, B * T, path, _scaled_run(call, K, per_token, gemv), stored)
            return call(x2, per_scale, gemv)

    y = _run_path(owner, path, stored, traced, eager)
    return None if y is None else y.reshape(B, T, -1)


def _w4a8_call(
    w4: Tensor, scales: Tensor, bias: Tensor | None, zero_term: Tensor | None
) -> Callable[[Tensor, int, bool], Tensor | None]:
    fn = native.library().qk_w4a8_forward_zp
    n, groups = scales.shape
    args = (w4.data_ptr(), scales.data_ptr(), _ptr(zero_term), groups, _ptr(bias))

    def call(x2: Tensor, rows_per_scale: int, gemv: bool) -> Tensor | None:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        ok = fn(
            x2.data_ptr(), x2.shape[0], x2.shape[1], rows_per_scale, *args, y.data_ptr(), n, native.threads(),
            int(gemv),
        )  # fmt: skip
        return y if ok else None

    call.keep = (w4, scales, bias, zero_term)
    return call


def w4a8_forward(
    owner: object,
    x: Tensor,
    w4: Tensor,
    scales: Tensor,
    bias: Tensor | None,
    per_token: bool,
    zero_term: Tensor | None = None,
) -> Tensor | None:
    """float32 (…, N) of the W4A8 linear (int4 nibbles × int8 activations) from the C kernel, or None (use the
    torch path). Per-tensor activation scales are per leading batch element, as in ``Int8Linear``. ``zero_term``
    (G, N) float32 (``native.zero_term``): zero-point codes (nibble = u, ŵ = s · (u − z)); None: absmax codes."""
    if not input_ok(x) or x.numel() == 0:
        return None
    k = x.shape[-1]
    rows = x.numel() // k
    path = _path(
        "w4a8", rows, owner, (k, *scales.shape),
        lambda: w4a8_forward(owner, x, w4, scales, bias, per_token, zero_term),
    )  # fmt: skip
    if path == "torch":
        return None
    per_scale = rows_per_scale(x, rows, per_token)
    stored = (w4, scales, bias, zero_term)
    if path == "int-mm":  # the nibbles unpacked to int8 once per call, then oneDNN's int8 GEMM (native.py)
        x2 = x.reshape(rows, k).contiguous()

        def traced() -> Tensor:
            return torch.ops.qbench.w4a8_int_mm(x2, per_scale, w4, scales, bias, zero_term)

        def eager() -> Tensor | None:
            if not stored_ok(*stored):
                return None
            return native.w4a8_int_mm(x2, per_scale, w4, scales, bias, zero_term)

    else:
        gemv = path == "c-gemv"

        def traced() -> Tensor:  # the layer checked the group size (w4a8.kernel_group_ok)
            return torch.ops.qbench.w4a8_forward(
                x.reshape(rows, k), per_scale, w4, scales, bias, gemv, zero_term
            )

        def eager() -> Tensor | None:
            call = _bound(owner, stored, lambda: _w4a8_call(w4, scales, bias, zero_term))
            y = None if call is None else call(x.reshape(rows, k).contiguous(), per_scale, gemv)
            if y is not None:
                zeros = None if zero_term is None else getattr(owner, "zeros", None)
                derived_from = () if zero_term is None else (scales, zeros)
                kept = (*stored, zeros)  # zeros too: a swapped .data leaves its version as it was
                _keep_fast(owner, k, rows, path, _scaled_run(call, k, per_token, gemv), kept, derived_from)
            return y

    y = _run_path(owner, path, stored, traced, eager)
    return None if y is None else y.reshape(*x.shape[:-1], -1)


def _weight_only_call(
    codes: Tensor, bits4: bool, scales: Tensor, zeros: Tensor | None, bias: Tensor | None
) -> Callable[[Tensor], Tensor | None]:
    fn = native.library().qk_weight_only_linear
    n, groups = scales.shape
    signed = int(codes.dtype == torch.int8)
    args = (codes.data_ptr(), int(bits4), signed, scales.data_ptr(), _ptr(zeros), groups, _ptr(bias))

    def call(x2: Tensor) -> Tensor | None:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        ok = fn(x2.data_ptr(), x2.shape[0], *args, y.data_ptr(), n, x2.shape[1], native.threads())
        return y if ok else None

    call.keep = (codes, scales, zeros, bias)
    return call


def weight_only_forward(
    owner: object,
    x: Tensor,
    codes: Tensor,
    bits4: bool,
    scales: Tensor,
    zeros: Tensor | None,
    bias: Tensor | None,
) -> Tensor | None:
    """x · Ŵᵀ + b for a float32 x (…, K) from int4 nibbles or int8 codes, or None (use the torch path).

    ``owner`` is the layer, which caches the bound kernel call and records the path taken."""
    if not input_ok(x):
        return None
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    path = _path(
        "w4" if bits4 else "w8", x2.shape[0], owner, (k, *scales.shape),
        lambda: weight_only_forward(owner, x, codes, bits4, scales, zeros, bias),
    )  # fmt: skip
    if path == "torch":
        return None
    stored = (codes, scales, zeros, bias)
    y = None
    if path == "c-gemv":

        def traced() -> Tensor | None:  # None: this group size has no loop (dequantised below)
            if not _traced_weight_only_loop(bits4, k, scales.shape[1]):
                return None
            return torch.ops.qbench.weight_only_linear(x2, codes, bits4, scales, zeros, bias)

        def eager() -> Tensor | None:
            call = _bound(owner, stored, lambda: _weight_only_call(codes, bits4, scales, zeros, bias))
            y = None if call is None else call(x2)  # None also where the kernel has no loop for this group
            if y is not None:
                _keep_fast(owner, k, x2.shape[0], path, _plain_run(call, k), stored)
            return y

        y = _run_path(owner, path, stored, traced, eager)
    if y is None:  # c-dequant, or the loop declined: dequantise once, then torch's GEMM

        def dequantised() -> Tensor:
            return F.linear(x2, torch.ops.qbench.dequantize(codes, bits4, scales, zeros, k), bias)

        y = _run_path(
            owner, "c-dequant", stored, dequantised, lambda: dequantised() if stored_ok(*stored) else None
        )
    return None if y is None else y.reshape(*x.shape[:-1], -1)


def _lowbit_call(
    codes: Tensor, bits: int, scales: Tensor, zeros: Tensor | None, zconst: int, bias: Tensor | None, k: int
) -> Callable[[Tensor], Tensor]:
    fn = native.library().qk_lowbit_linear
    n, groups = scales.shape
    args = (codes.data_ptr(), bits, scales.data_ptr(), _ptr(zeros), zconst, groups, _ptr(bias))

    def call(x2: Tensor) -> Tensor:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        fn(x2.data_ptr(), x2.shape[0], k, *args, y.data_ptr(), n, native.threads())
        return y

    call.keep = (codes, scales, zeros, bias)
    return call


def lowbit_forward(
    owner: object,
    x: Tensor,
    codes: Tensor,
    bits: int,
    scales: Tensor,
    zeros: Tensor | None,
    zconst: int,
    bias: Tensor | None,
    group: int,
) -> Tensor | None:
    """x · Ŵᵀ + b for a float32 x (…, in) from LowBitLinear's packed codes (rows of ``scales.shape[1] · group``
    channels, zero codes past ``in``), or None (use the torch path). ``c-gemv`` reads the codes (x zero-padded to
    whole groups); ``c-dequant`` builds Ŵ once per call, then F.linear — the torch path's very arithmetic."""
    if not input_ok(x):
        return None
    k = x.shape[-1]
    padded = scales.shape[1] * group
    x2 = x.reshape(-1, k)
    path = _path(
        "lowbit", x2.shape[0], owner, (padded, *scales.shape),
        lambda: lowbit_forward(owner, x, codes, bits, scales, zeros, zconst, bias, group),
    )  # fmt: skip
    stored = (codes, scales, zeros, bias)
    if path == "torch" or not stored_ok(*stored):
        return None
    if path == "c-gemv":
        xp = (x2 if padded == k else F.pad(x2, (0, padded - k))).contiguous()

        def traced() -> Tensor:
            return torch.ops.qbench.lowbit_linear(xp, codes, bits, scales, zeros, zconst, bias)

        def eager() -> Tensor:
            call = _bound(
                owner, stored, lambda: _lowbit_call(codes, bits, scales, zeros, zconst, bias, padded)
            )
            if padded == k:  # else x is padded to whole groups per call: no direct call to keep
                _keep_fast(owner, k, x2.shape[0], path, _plain_run(call, k), stored)
            return call(xp)

        y = _run_path(owner, path, stored, traced, eager)
    else:

        def dequantised() -> Tensor:
            w = torch.ops.qbench.lowbit_dequantize(codes, bits, scales, zeros, zconst, padded, k)
            return F.linear(x2, w, bias)

        y = _run_path(owner, path, stored, dequantised, dequantised)  # custom ops either way
    return y.reshape(*x.shape[:-1], -1)


def backend_name(kind: str) -> str:
    """What runs for ``kind`` ("w8a8", "w4a8" or "weight-only") on CPU here, for benchmark tables."""
    if not native.available():
        return "torch"
    kind = "w4" if kind == "weight-only" else kind
    small, big = describe(kind, 1), describe(kind, DECODE_ROWS + 1)
    return f"{small} ≤{DECODE_ROWS} rows, {big} above"
