"""One way to build the compiled CPU kernels: one compiler lookup, one set of flags, one switch.

Every C kernel of qbench is a ``.c`` file in this folder, shipped as package data with its headers
(``fake_quant.c``: the fused fake-quantisation rows of ``qbench::fake_quantize``; ``native.c`` + ``native_ref.c``
+ ``native_avx2.c``, sharing ``native.h``: the real layers' int8/int4 GEMV and GEMM, one library).
:func:`load` compiles a library on first use with the system C compiler (``$CC``, else ``cc``/``gcc``) — ``-O3
-march=native -fopenmp``, then without ``-march=native``, then without OpenMP, when a flag is refused. The
library is cached on disk (``$QBENCH_CACHE/kernels/``, else ``~/.cache/qbench/kernels/``; written atomically)
under a hash of the sources, headers, flags, the compiler's version **and this CPU's model and flags**, so every
later process loads it in milliseconds, and a binary built for one CPU never runs on another
(``-march=native`` decides the instruction set on the machine that runs it). A compile that fails or takes longer
than :data:`COMPILE_TIMEOUT_S` gives None — the callers' torch paths, which compute the same results — with a
warning. Threads: OpenMP in every kernel, with ``torch.get_num_threads()`` threads passed by the caller.

``QBENCH_NATIVE=0`` in the environment switches every compiled kernel off (the torch paths run); the older
``QBENCH_NATIVE_KERNELS=0`` (real layers) and ``QBENCH_FAST_FAKE_QUANT=0`` (fake quantisation) still work.
``QBENCH_NATIVE_ISA`` builds for a lower target than this CPU (:data:`ISA_TARGETS`: ``avx2`` is what an AVX2-only
CPU such as AMD Zen 3 runs, ``portable`` the scalar reference), so a machine with AVX-512 can time the loops another
CPU class takes: ``QBENCH_NATIVE_ISA=avx2 qbench speed …``. A target the compiler refuses is an error, not a quiet
fallback to the torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

ENV = "QBENCH_NATIVE"
COMPILE_TIMEOUT_S = (
    600  # a loaded 2-core machine needs minutes for the native library; then the torch paths run
)
# Flags every kernel needs: IEEE arithmetic in the written order (no FMA contraction, no errno), a shared object.
BASE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-shared", "-fPIC")
# Tried in order until one compiles: some compilers or CPUs refuse -march=native, some lack OpenMP.
FLAG_CASCADE = (("-march=native", "-fopenmp"), ("-march=native",), ("-fopenmp",), ())
ISA_ENV = "QBENCH_NATIVE_ISA"
# QBENCH_NATIVE_ISA's targets and their -march: x86-64-v3 is AVX2 + FMA + F16C + BMI1/2 (the psABI level of AVX2
# CPUs; GCC ≥ 11, clang ≥ 12), the loops native.c takes on a CPU without AVX-512
ISA_TARGETS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "avx2": ("-march=x86-64-v3",),
    "portable": (),
}

# x86-64-v3's features as /proc/cpuinfo names them: without them an avx2 build would die on an illegal instruction
TARGET_NEEDS = {"avx2": {"avx2", "fma", "f16c", "bmi2", "movbe"}}


def isa_target() -> str:
    """The build target ``QBENCH_NATIVE_ISA`` names (default ``native``); a one-line error for another word."""
    from models.errors import UserError, unknown_choice

    target = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if target not in ISA_TARGETS:
        raise unknown_choice(f"{ISA_ENV} target", target, ISA_TARGETS)
    missing = sorted(TARGET_NEEDS.get(target, set()) - cpu_flags()) if platform.machine() == "x86_64" else []
    if missing:  # the library would build and then die on an illegal instruction
        raise UserError(f"{ISA_ENV}={target} needs CPU features this CPU lacks: {', '.join(missing)}")
    return target


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``'s first core; empty where it is not readable)."""
    for line in cpu_identity().splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def flag_cascade() -> tuple[tuple[str, ...], ...]:
    """The flag sets a kernel library is built with, first that compiles: :data:`FLAG_CASCADE` for this CPU; for
    an explicit lower target only that target (with and without OpenMP), so it is built as asked or not at all."""
    target = isa_target()
    if target == "native":
        return FLAG_CASCADE
    march = ISA_TARGETS[target]
    return ((*march, "-fopenmp"), march)


def switched_on(*legacy: str) -> bool:
    """Whether compiled kernels may run: ``QBENCH_NATIVE`` (and the ``legacy`` variable names) not set to 0."""
    return all(os.environ.get(name, "1") != "0" for name in (ENV, *legacy))


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc``, else ``gcc`` — the first one on the PATH (None: no compiler)."""
    return next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)


@functools.cache
def cpu_identity() -> str:
    """This CPU's model name and feature flags (Linux ``/proc/cpuinfo``; elsewhere the platform's words)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))  # the first core's lines: every core repeats them


@functools.cache
def compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cache_dir() -> Path:
    from trainers.documents import cache_root  # the project's one cache root ($QBENCH_CACHE, ~/.cache/qbench)

    return cache_root() / "kernels"


def _texts(names: tuple[str, ...]) -> dict[str, str]:
    """The package's C files ``names`` and every header beside them, name -> text (what a build compiles)."""
    package = resources.files("qbench.quant.kernels")
    headers = sorted(p.name for p in package.iterdir() if p.name.endswith(".h"))
    return {file: package.joinpath(file).read_text() for file in (*names, *headers)}


def compile_source(
    name: str | Sequence[str], extra_flags: Sequence[str], flags: Sequence[str] = BASE_FLAGS
) -> ctypes.CDLL | None:
    """The package's C file ``name`` (e.g. ``"fake_quant.c"``), or several compiled into one library (e.g.
    ``native.NATIVE_SOURCES``), built with ``flags`` + ``extra_flags`` and loaded — from the disk cache when this
    CPU, compiler and source already built it (module docstring) — or None when there is no compiler, it refuses
    the flags, or it times out. The package's headers (``*.h``) sit next to the sources."""
    cc = compiler()
    if cc is None:
        return None
    names = (name,) if isinstance(name, str) else tuple(name)
    texts = _texts(names)
    command = [*flags, *extra_flags]
    key = hashlib.sha256(
        "\0".join([*command, cc, compiler_version(cc), cpu_identity(), *texts, *texts.values()]).encode()
    ).hexdigest()[:24]
    cached = cache_dir() / f"{names[0].removesuffix('.c')}-{key}.so"
    if cached.is_file():
        try:
            return ctypes.CDLL(str(cached))
        except OSError:  # a damaged file: build it again below
            pass
    with tempfile.TemporaryDirectory(prefix="qbench-kernel-") as tmp:
        for file, text in texts.items():
            Path(tmp, file).write_text(text)
        lib = os.path.join(tmp, cached.name)
        sources = [os.path.join(tmp, n) for n in names]
        try:
            done = subprocess.run(
                [cc, *command, "-o", lib, *sources], capture_output=True, timeout=COMPILE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            warnings.warn(
                f"compiling {', '.join(names)} took over {COMPILE_TIMEOUT_S} s; the torch paths run instead",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        if done.returncode != 0:
            return None
        try:  # into the cache atomically: a temporary name in the cache folder, then a rename
            cached.parent.mkdir(parents=True, exist_ok=True)
            part = cached.with_name(f".{cached.name}.{os.getpid()}.part")
            shutil.copyfile(lib, part)
            os.replace(part, cached)
            return ctypes.CDLL(str(cached))
        except OSError:  # a read-only home: load the fresh build from the temporary folder
            return ctypes.CDLL(lib)


@functools.cache
def source_digest(names: tuple[str, ...]) -> str:
    """A digest of the C files ``names`` and the package's headers: what changes when a kernel's code does (the
    measured dispatch keys its cached choices on it, so a new kernel is measured again, not judged by the old
    one's times)."""
    texts = _texts(names)
    return hashlib.sha256("\0".join([*texts, *texts.values()]).encode()).hexdigest()[:16]


def load(name: str | Sequence[str], flags: Sequence[str] = BASE_FLAGS) -> ctypes.CDLL | None:
    """``name`` built with the first of :func:`flag_cascade` that compiles (:func:`first_built`)."""
    return first_built(lambda extra: compile_source(name, extra, flags))


def first_built(build: Callable[[tuple[str, ...]], ctypes.CDLL | None]) -> ctypes.CDLL | None:
    """``build(extra_flags)`` for each flag set of :func:`flag_cascade` until one gives a library (None: none
    does — the torch paths run); an explicit ``QBENCH_NATIVE_ISA`` target that does not build is an error."""
    lib = next((lib for extra in flag_cascade() if (lib := build(extra)) is not None), None)
    if lib is None and isa_target() != "native" and compiler() is not None:
        raise refused_target()
    return lib


def refused_target() -> Exception:
    from models.errors import UserError

    target = isa_target()
    return UserError(
        f"{ISA_ENV}={target}: the C compiler ({compiler()}) refuses {' '.join(ISA_TARGETS[target]) or 'the build'}; "
        f"unset it (this CPU's own target) or choose from: {', '.join(ISA_TARGETS)}"
    )
