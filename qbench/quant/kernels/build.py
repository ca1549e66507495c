"""One way to build the compiled CPU kernels: one compiler lookup, one set of flags, one switch.

Every C kernel of qbench is a ``.c`` file in this folder, shipped as package data with its headers
(``fake_quant.c``: the fused fake-quantisation rows of ``qbench::fake_quantize``; ``native.c`` + ``native_ref.c``
+ ``native_avx2.c``, sharing ``native.h``: the real layers' int8/int4 GEMV and GEMM, one library).
:func:`load` compiles a library on first use with the system C compiler (``$CC``, else ``cc``/``gcc``) — ``-O3
-march=native -fopenmp``, then without ``-march=native``, then without OpenMP, when a flag is refused — into a
temporary file that is deleted once loaded. Never cached on disk, so a binary built for one CPU never runs on
another; ``-march=native`` decides the instruction set on the machine that runs it. Threads: OpenMP in every
kernel, with ``torch.get_num_threads()`` threads passed by the caller.

``QBENCH_NATIVE=0`` in the environment switches every compiled kernel off (the torch paths run); the older
``QBENCH_NATIVE_KERNELS=0`` (real layers) and ``QBENCH_FAST_FAKE_QUANT=0`` (fake quantisation) still work.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from importlib import resources

ENV = "QBENCH_NATIVE"
# Flags every kernel needs: IEEE arithmetic in the written order (no FMA contraction, no errno), a shared object.
BASE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-shared", "-fPIC")
# Tried in order until one compiles: some compilers or CPUs refuse -march=native, some lack OpenMP.
FLAG_CASCADE = (("-march=native", "-fopenmp"), ("-march=native",), ("-fopenmp",), ())


def switched_on(*legacy: str) -> bool:
    """Whether compiled kernels may run: ``QBENCH_NATIVE`` (and the ``legacy`` variable names) not set to 0."""
    return all(os.environ.get(name, "1") != "0" for name in (ENV, *legacy))


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc``, else ``gcc`` — the first one on the PATH (None: no compiler)."""
    return next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)


def compile_source(
    name: str | Sequence[str], extra_flags: Sequence[str], flags: Sequence[str] = BASE_FLAGS
) -> ctypes.CDLL | None:
    """The package's C file ``name`` (e.g. ``"fake_quant.c"``), or several compiled into one library (e.g.
    ``native.NATIVE_SOURCES``), built with ``flags`` + ``extra_flags`` and loaded, or None when there is no
    compiler or it refuses the flags. The package's headers (``*.h``) sit next to the sources."""
    cc = compiler()
    if cc is None:
        return None
    names = (name,) if isinstance(name, str) else tuple(name)
    package = resources.files("qbench.quant.kernels")
    headers = [p.name for p in package.iterdir() if p.name.endswith(".h")]
    with tempfile.TemporaryDirectory(prefix="qbench-kernel-") as tmp:
        for file in (*names, *headers):
            with open(os.path.join(tmp, file), "w") as f:
                f.write(package.joinpath(file).read_text())
        lib = os.path.join(tmp, names[0].replace(".c", ".so"))
        sources = [os.path.join(tmp, n) for n in names]
        done = subprocess.run(
            [cc, *flags, *extra_flags, "-o", lib, *sources], capture_output=True, timeout=120
        )
        if done.returncode != 0:
            return None
        return ctypes.CDLL(lib)  # loaded: the file may go


def load(name: str | Sequence[str], flags: Sequence[str] = BASE_FLAGS) -> ctypes.CDLL | None:
    """``name`` built with the first of :data:`FLAG_CASCADE` that compiles (None: none does)."""
    return next(
        (lib for extra in FLAG_CASCADE if (lib := compile_source(name, extra, flags)) is not None), None
    )
