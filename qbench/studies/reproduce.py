"""``qbench reproduce``: the paper's Tables 2–4 for one preset, for users with GPUs (and tiny budgets on a CPU).

1. Train the Table-2 variants — ``vanilla``, ``softmax1``, ``orthoadam``, ``softmax1-orthoadam`` — and with
   ``--ablations`` the Table-4 ones (``paper``, ``no-bias``, ``rmsnorm-m``, ``rope``, ``no-pos``, ``rmsprop``,
   ``sgd``, ``sgd-momentum``, ``attn-bias``, ``postnorm``), one after another (``--nproc-per-node K`` trains each
   with torchrun/DDP on K devices), resuming any run that was interrupted.
2. Evaluate the float model and the paper's four schemes (fake quantisation, ``--mode real`` adds the kernels)
   with ``qbench grid``; finished cells are reused.
3. Write tables in the paper's layout under ``results/reproduce/<preset>/``:
   ``table2.md`` — PPL, first-token attention (top-1 share), kurtosis first/other token, max |activation|
   first/other token; ``table3.md`` — perplexity of the float model and under each quantisation scheme (change in %).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.io import atomic_write_text
from qbench.eval.harness import PAPER_SCHEMES, GridSpec, run_grid
from qbench.eval.metrics import Protocol
from qbench.studies.runs import TrainRun

TABLE2_RECIPES = ("vanilla", "softmax1", "orthoadam", "softmax1-orthoadam")
ABLATION_RECIPES = (
    "paper",
    "no-bias",
    "rmsnorm-m",
    "rope",
    "no-pos",
    "rmsprop",
    "sgd",
    "sgd-momentum",
    "attn-bias",
    "postnorm",
)


@dataclass(frozen=True)
class ReproduceConfig:
    preset: str
    recipes: tuple[str, ...] = TABLE2_RECIPES
    steps: int | None = None
    tokens: int | None = None
    data: str = "embedded"
    lr: float | None = None
    seed: int = 0
    ckpt_root: Path | None = None
    output_path: Path | None = None
    eval_tokens: int = 262144
    modes: tuple[str, ...] = ("fake",)
    nproc_per_node: int = 1
    batch_size: int | None = None  # windows per optimiser step (None: the trainer's default, 16)
    compile: bool = False  # train through torch.compile
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ckpts(self) -> Path:
        return self.ckpt_root or Path("ckpts") / "reproduce" / self.preset

    @property
    def results(self) -> Path:
        return self.output_path or Path("results") / "reproduce" / self.preset


def check_recipes(names: list[str]) -> tuple[str, ...]:
    from trainers.recipes import RECIPES

    return tuple(RECIPES.canonical(n) for n in names)


def runs(cfg: ReproduceConfig) -> list[TrainRun]:
    from trainers.loop import TrainConfig

    steps = cfg.steps
    batch = {} if cfg.batch_size is None else {"batch_size": cfg.batch_size}
    if steps is None:  # the trainer's own rounding of --tokens into whole steps
        probe = (
            TrainConfig(preset=cfg.preset, tokens=cfg.tokens, **batch)
            if cfg.tokens
            else TrainConfig(preset=cfg.preset, **batch)
        )
        steps = probe.total_steps
    args = ["--preset", cfg.preset, "--data", cfg.data, "--seed", str(cfg.seed), *cfg.extra_args]
    if cfg.lr is not None:
        args += ["--lr", str(cfg.lr)]
    if cfg.batch_size is not None:
        args += ["--batch-size", str(cfg.batch_size)]
    if cfg.compile:
        args += ["--compile"]
    return [TrainRun(r, cfg.ckpts / r, steps, ("--recipe", r, *args)) for r in cfg.recipes]


def grid_argv(cfg: ReproduceConfig, device: str) -> list[str]:
    """The ``qbench grid`` command line of :func:`evaluate`'s grid (the same protocol, so the same records)."""
    argv = ["grid", *(a for r in cfg.recipes for a in ("--ckpt", str(cfg.ckpts / r)))]
    argv += [a for s in PAPER_SCHEMES for a in ("--scheme", s)] + [
        a for m in cfg.modes for a in ("--mode", m)
    ]
    return [*argv, "--data", cfg.data, "--tokens", str(cfg.eval_tokens), "--output-path", str(cfg.results),
            "--device", device]  # fmt: skip


def evaluate(cfg: ReproduceConfig, on_record: Any = None) -> list[dict]:
    """The grid of the trained variants; with ``nproc_per_node`` > 1 its cells are first shared among that many
    ranks (``qbench grid --nproc-per-node``, one GPU each where there are GPUs), then read back here."""
    if cfg.nproc_per_node > 1:
        import torch

        from models.errors import UserError
        from qbench.eval.ranks import launch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if launch(grid_argv(cfg, device), cfg.nproc_per_node) != 0:
            raise UserError(f"the {cfg.nproc_per_node}-rank evaluation grid failed (see its output above)")
    spec = GridSpec(
        models=[str(cfg.ckpts / r) for r in cfg.recipes],
        schemes=list(PAPER_SCHEMES),
        modes=list(cfg.modes),
        protocol=Protocol(corpus=cfg.data, tokens=cfg.eval_tokens),
        output_path=cfg.results,
    )
    return run_grid(spec, on_record=on_record)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table2(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The paper's Table 2 layout from the float records."""
    headers = [
        "model",
        "PPL",
        "first-token top-1 (%)",
        "κ first",
        "κ other",
        "max |act| first",
        "max |act| other",
    ]
    rows = []
    for r in (r for r in records if r["scheme"]["name"] == "fp"):
        o = r["outliers"]
        rows.append(
            [
                r["model"]["name"],
                _num(r["metrics"]["perplexity"], ".2f"),
                _num(100 * o["first_token_top1_share"] if "first_token_top1_share" in o else None, ".1f"),
                _num(o["kurtosis_first"], ".2f"),
                _num(o["kurtosis_other"], ".2f"),
                _num(o["max_abs_first"], ".1f"),
                _num(o["max_abs_other"], ".1f"),
            ]
        )
    return headers, rows


def table3(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The paper's Table 3 layout: perplexity in float and under each scheme × mode, change vs float in %."""
    columns = [
        f"{s}/{m}"
        for s in PAPER_SCHEMES
        for m in ("fake", "real")
        if any(r["scheme"]["name"] == s and r["mode"] == m for r in records)
    ]
    from qbench.eval.report import cells_by_model

    rows = []
    for name, cells in cells_by_model(records).items():
        row = [name, _num(cells["fp"]["metrics"]["perplexity"], ".2f") if "fp" in cells else "-"]
        for c in columns:
            m = cells[c]["metrics"] if c in cells else {}
            row.append(
                "-" if m.get("perplexity") is None else f"{m['perplexity']:.2f} ({m['ppl_change_pct']:+.2f}%)"
            )
        rows.append(row)
    return ["model", "fp", *columns], rows


def write_tables(cfg: ReproduceConfig, records: list[dict], command: str) -> list[Path]:
    from tabulate import tabulate

    from qbench.eval.report import caption

    written = []
    for name, (headers, rows) in (("table2", table2(records)), ("table3", table3(records))):
        path = cfg.results / f"{name}.md"
        atomic_write_text(
            path,
            f"Made by `{command}`.\n\n{tabulate(rows, headers, tablefmt='github')}\n\n{caption(records)}\n",
        )
        written.append(path)
    return written
