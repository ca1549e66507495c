"""The grid shared among ranks: 2 CPU processes (gloo) write every cell exactly once; a re-run reuses them all."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from models.checkpoint import save_checkpoint
from qbench.eval.harness import GridSpec, run_grid
from qbench.eval.metrics import Protocol
from qbench.eval.ranks import grid_cells, rank_device, share, strip_nproc

from ..conftest import micro_config, trained_like

REPO = Path(__file__).resolve().parents[3]
SCHEMES = ("absmax-coarse", "zeropoint-int4", "absmax-fine")


def test_round_robin_covers_every_item_once():
    items = list(range(7))
    parts = [share(items, r, 3) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(x for p in parts for x in p) == items


def test_cells_are_model_major_and_devices_follow_local_rank():
    spec = GridSpec(models=["a", "b"], schemes=["s", "t"], modes=["fake", "real"])
    assert grid_cells(spec)[:5] == [
        (0, "s", "fake"),
        (0, "s", "real"),
        (0, "t", "fake"),
        (0, "t", "real"),
        (1, "s", "fake"),
    ]
    assert rank_device("cuda", 3) == "cuda:3" and rank_device("cpu", 3) == "cpu"
    assert strip_nproc(["grid", "--nproc-per-node", "2", "--ckpt", "x", "--nproc-per-node=4"]) == [
        "grid",
        "--ckpt",
        "x",
    ]


@pytest.fixture()
def two_models(tmp_path, tokenizer):
    paths = []
    for seed, attn in ((0, "softmax1"), (1, "softmax")):
        path = tmp_path / f"micro-{attn}"
        save_checkpoint(
            path, trained_like(micro_config(attn=attn), seed=seed), tokenizer, provenance={"training": None}
        )
        paths.append(path)
    corpus = tmp_path / "texts.jsonl"
    with (
        gzip.open(REPO / "trainers/corpus/embedded.jsonl.gz", "rt", encoding="utf-8") as f,
        open(corpus, "w") as out,
    ):
        for _, line in zip(range(30), f):
            doc = json.loads(line)
            out.write(json.dumps({"id": doc["id"], "text": doc["text"][:3000]}) + "\n")
    return paths, corpus


def _grid(models, corpus, out, nproc):
    args = [a for m in models for a in ("--ckpt", str(m))] + [a for s in SCHEMES for a in ("--scheme", s)]
    args += ["--data", str(corpus), "--tokens", "128", "--batch-size", "2", "--output-path", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "qbench", "grid", *args, "--nproc-per-node", str(nproc)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_two_ranks_write_every_cell_exactly_once_and_rerun_reuses(two_models, tmp_path):
    models, corpus = two_models
    out = tmp_path / "results"
    first = _grid(models, corpus, out, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    wrote = re.findall(r"rank (\d)/2 wrote (\S+?\.json)", first.stderr)
    expected = {
        str(out / m.name / f) for m in models for f in ["fp.json", *(f"{s}__fake.json" for s in SCHEMES)]
    }
    assert sorted(p for _, p in wrote) == sorted(expected)  # every cell once, no cell twice
    assert {r for r, _ in wrote} == {"0", "1"}  # both ranks worked
    assert {str(p) for p in out.rglob("*.json")} == expected
    assert first.stdout.count("absmax-coarse") >= 1  # rank 0's table

    # A re-run (here: one process, the same protocol) reuses the 2-rank records as its own and rewrites nothing.
    spec = GridSpec(
        models=[str(m) for m in models],
        schemes=list(SCHEMES),
        protocol=Protocol(corpus=str(corpus), tokens=128, batch_size=2),
        output_path=out,
    )
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.json")}
    reused = []
    run_grid(spec, on_record=lambda r, was_reused: reused.append(was_reused))
    assert all(reused) and len(reused) == len(expected)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.json")} == mtimes  # nothing rewritten
