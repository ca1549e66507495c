"""The evaluation grid shared among ranks: ``qbench grid ... --nproc-per-node K`` or ``torchrun ... -m qbench grid``.

``--nproc-per-node K`` relaunches the same command under ``torch.distributed.run`` (K local processes; on a
GPU node one GPU each: ``--device cuda`` becomes ``cuda:<local rank>``). Under torchrun (``WORLD_SIZE`` > 1)
every rank runs :func:`run_grid_ranks`:

1. the float baselines: model i is evaluated by rank i mod K (its ``fp.json``, which every cell needs);
2. barrier; the quantised cells, listed model-major as ``run_grid`` visits them ((model, scheme, mode) for each
   model, ``harness.cells`` order): cell j is evaluated by rank j mod K — a deterministic round-robin, so a
   K-GPU node evaluates K cells at once;
3. barrier; rank 0 walks the grid with ``run_grid``, which now finds every record on disk and reuses it, and
   returns the records (for the table). Other ranks return None.

Each rank writes its own records atomically (``cell_record``), so no two ranks ever write one file, and a
re-run — with any number of ranks — reuses every finished cell. Each rank logs ``rank r/K wrote PATH`` for
the records it evaluated. The process group (gloo: only barriers travel over it) gets a long timeout, since a
rank may evaluate for hours while the others wait.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from qbench.eval.harness import GridSpec, ModelEvaluation, cell_record, cells, run_grid

BARRIER_TIMEOUT = datetime.timedelta(hours=48)


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, 0
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def rank_device(device: str, local_rank: int) -> str:
    """``cuda`` → this rank's GPU ``cuda:<local rank>``; anything else unchanged."""
    return f"cuda:{local_rank}" if device == "cuda" else device


def share(items: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """Rank ``rank``'s items of a deterministic round-robin: indices rank, rank + K, rank + 2K, ..."""
    return list(items[rank::world_size])


def grid_cells(spec: GridSpec) -> list[tuple[int, str, str]]:
    """Every quantised cell as (model index, scheme, mode), in run_grid's order."""
    return [(i, scheme, mode) for i in range(len(spec.models)) for scheme, mode in cells(spec)]


def run_grid_ranks(
    spec: GridSpec,
    on_record: Callable[[dict[str, Any], bool], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict] | None:
    """This rank's share of the grid (see the module docstring); all records on rank 0, None elsewhere."""
    rank, world_size, local_rank = world()
    if world_size == 1:
        return run_grid(spec, on_record=on_record)
    import torch.distributed as dist

    say = log or _log_line
    spec = replace(spec, device=rank_device(spec.device, local_rank))
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    try:
        evaluations: dict[int, ModelEvaluation] = {}

        def evaluation(i: int) -> ModelEvaluation:
            if i not in evaluations:
                evaluations[i] = ModelEvaluation(spec, spec.models[i])
            return evaluations[i]

        tag = f"rank {rank}/{world_size}"
        for i in share(range(len(spec.models)), rank, world_size):
            ev = evaluation(i)
            ev.fp_record()
            if not ev.fp_reused:
                say(f"{tag} wrote {ev.fp_path()}")
        dist.barrier()
        for i, scheme, mode in share(grid_cells(spec), rank, world_size):
            ev = evaluation(i)
            record, reused = cell_record(spec, ev, scheme, mode)
            if not reused:
                done = "refused" if record.get("status") == "unsupported" else "wrote"
                say(f"{tag} {done} {ev.cell_path(scheme, mode)}")
        evaluations.clear()  # free the models before rank 0 loads them all for the summary
        dist.barrier()
        records = run_grid(spec, on_record=on_record) if rank == 0 else None
        dist.barrier()  # the others wait, so the launcher sees every rank end together
        return records
    finally:
        if owns:
            dist.destroy_process_group()


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc-per-node K`` / ``--nproc-per-node=K`` (what each launched rank runs)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def launch(qbench_argv: Sequence[str], nproc: int, env: dict[str, str] | None = None) -> int:
    """Run ``qbench <qbench_argv>`` under ``torch.distributed.run --standalone`` with ``nproc`` local ranks."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "qbench",
        *strip_nproc(qbench_argv),
    ]
    return subprocess.run(command, env=env).returncode


def _log_line(msg: str) -> None:
    """One whole line per write: ranks share stderr, and ``print`` writes the text and its newline separately, so
    two ranks' lines could interleave mid-line (a pipe keeps writes of up to 4 KiB whole)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
