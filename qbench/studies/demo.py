"""``qbench demo``: the paper's claim, end to end, on a 2-core CPU in about a quarter of an hour.

1. Train (or reuse) two ``tiny`` checkpoints on the embedded corpus (``--data``: another), side by side (one thread
   each):
   ``vanilla`` (softmax + AdamW) and ``paper`` (softmax-1 + OrthoAdam + RMSNorm-S), at the learning rate and with
   the start token at which outlier activations emerge within ~1 M tokens (lr 4e-3, BOS opening every window).
   An interrupted demo resumes both runs where their last checkpoint left them.
2. Evaluate both with ``qbench grid``: the float baseline, the paper's four schemes in fake and real mode,
   outlier and attention statistics. Finished cells are reused on a re-run.
3. Sweep both below 8 bits (``qbench sweep``, :func:`sweep`): the paper's absmax family at its coarsest
   (``absmax-coarse``) with weights, activations, outputs and all three as separate axes from 8 to 2 bits, and the
   float model's KV cache (8/6/4/3/2 bits) with and without the first position kept in float; each curve's
   breaking point (the lowest width within 1 %, at that width and every wider one). Records and
   ``sweep.json``/``.md``/``.png`` under ``results/demo/sweep/``; the float baselines are the grid's.
4. Write ``results/demo/``: one JSON record per cell, ``table.md`` (with the command, machine and wall time, the
   8-bit table and the sweep's), and PNG plots (the emergence curves from the training probes, per-layer
   statistics, and the sweep).

What it shows at this scale, honestly: the outliers (kurtosis, max |activation|) that grow in the vanilla model
and stay small in the paper's recipe; *not* quantisation damage, which needs larger or longer-trained models
(see README).

``qbench demo --long`` (:data:`LONG`) is the smallest CPU budget at which the emergence study
(``results/emergence/``) saw the vanilla model's *quantised* perplexity degrade while the paper's did not: the
same size in Llama style (RMSNorm, SwiGLU, rotary positions, no biases, untied embeddings), trained for the first
``steps`` of the study's 5000-step schedule (so its models are the study's snapshots at that step).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.io import atomic_write_text
from qbench.eval.harness import PAPER_SCHEMES, GridSpec, run_grid
from qbench.eval.metrics import Protocol
from qbench.studies.emergence import read_curves
from qbench.studies.runs import DEFAULT_DATA, TrainRun, check_data, data_description, train_runs

RECIPES = ("vanilla", "paper")


@dataclass(frozen=True)
class DemoConfig:
    preset: str = "tiny"
    # x 16 windows x 128 tokens = 0.61 M training tokens (why 300: qbench.cli.budgets.DEMO_STEPS)
    steps: int = 300
    lr: float = 4e-3
    seed: int = 0
    seeds: int = 1  # training seeds per recipe: seed, seed + 1, … (qbench.studies.seeds)
    ckpt_root: Path = Path("ckpts/demo")
    output_path: Path = Path("results/demo")
    eval_tokens: int = 16384
    modes: tuple[str, ...] = ("fake", "real")
    probe_every: int = 25
    extra_args: tuple[str, ...] = field(default_factory=tuple)  # trainer options for every recipe
    recipe_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # ... and for one recipe
    schedule_steps: int | None = None  # a longer schedule of which only the first ``steps`` are trained
    sweep_axes: tuple[str, ...] = ("w", "a", "o", "all", "kv")  # () skips the bit-width sweep
    sweep_keep_first: tuple[int, ...] = (1,)  # KV-cache curves with these leading positions kept in float
    # KIVI with G = R = 32: the default residual (128) would keep the demo's whole 128-token windows in float
    sweep_kv_scheme: str = "kivi:group=32,residual=32"
    # the corpus the models train on (its train split) and are scored on (its validation split), and which of its
    # windows are scored (qbench.eval.sampling; None: the Protocol's default, documents). ``embedded-whole`` with
    # sample "first" is what every result before corpus pieces and sampling was made with (results/demo)
    data: str = DEFAULT_DATA
    sample: str | None = None
    sample_seed: int = 0

    @property
    def description(self) -> str:
        schedule = f" of a {self.schedule_steps}-step schedule" if self.schedule_steps else ""
        style = ", Llama style" if "family=llama" in self.extra_args else ""
        seeds = f", seeds {self.seed}–{self.seed + self.seeds - 1}" if self.seeds > 1 else ""
        data = data_description(self)
        return f"{self.preset}{style}, {self.steps} steps{schedule}, lr {self.lr}{seeds}{data}"

    def runs(self) -> list[Any]:
        """The two recipes' training runs, once per seed (``qbench.studies.seeds.seeded_runs``)."""
        from qbench.studies.seeds import seeded_runs

        return seeded_runs(RECIPES, self.seed, self.seeds)


def eval_protocol(cfg: Any) -> Protocol:
    """The protocol of every evaluation of a training study (the grid, the sweep, the card, the post-training
    algorithms): the validation split of the corpus its models trained on — named, since a local file's default
    split is all of it, training pieces included — at ``eval_tokens``, with its ``sample``."""
    return Protocol(
        corpus=cfg.data,
        split="validation",
        tokens=cfg.eval_tokens,
        sample=cfg.sample,
        sample_seed=cfg.sample_seed,
    )


# The tiny preset's size in Llama style: SwiGLU with d_ff 688 (~2/3 of 4d, so the MLP keeps GELU's parameter
# count), rotary positions, no biases, untied embeddings. The vanilla model keeps per-channel RMSNorm gains; the
# paper's recipe replaces them with RMSNorm-S as always.
LLAMA_STYLE = (
    *("--set", "family=llama", "--set", "mlp=swiglu", "--set", "pos=rope"),
    *("--set", "bias=false", "--set", "tie_embeddings=false", "--set", "d_ff=688"),
)
# 4.1 M tokens, the whole cosine schedule (warmup, decay to lr_min): every run ends annealed, so optimisers are
# compared at their end points, not mid-schedule. Until this schedule the long demo trained the first 2000 steps of
# the emergence study's 5000-step schedule (lr still ~73 % of its peak there): results/recipes-long was measured so.
LONG = DemoConfig(
    steps=2000,
    extra_args=LLAMA_STYLE,
    recipe_args={"vanilla": ("--norm", "rmsnorm")},
    ckpt_root=Path("ckpts/demo-long"),
    output_path=Path("results/demo-long"),
)


def demo_runs(cfg: DemoConfig) -> list[TrainRun]:
    def args(seed: int) -> tuple[str, ...]:
        return (
            *("--preset", cfg.preset, "--lr", str(cfg.lr), "--seed", str(seed), "--data", cfg.data),
            *("--probe-every", str(cfg.probe_every), "--ckpt-every", "50"),
            *cfg.extra_args,
        )

    return [
        TrainRun(
            run.name,
            cfg.ckpt_root / run.name,
            cfg.schedule_steps or cfg.steps,
            ("--recipe", run.recipe, *args(run.seed), *cfg.recipe_args.get(run.recipe, ())),
            stop_at=cfg.steps if cfg.schedule_steps else None,
        )
        for run in cfg.runs()
    ]


def train_both(cfg: DemoConfig, console: Any) -> float:
    """Train the runs (both recipes, each seed) two at a time, one thread each (small matmuls scale poorly across
    threads)."""
    check_data(cfg.data)
    return train_runs(demo_runs(cfg), console, parallel=2, threads=1)


def evaluate(cfg: DemoConfig, on_record: Any = None) -> list[dict]:
    spec = GridSpec(
        models=[str(cfg.ckpt_root / run.name) for run in cfg.runs()],
        schemes=list(PAPER_SCHEMES),
        modes=list(cfg.modes),
        protocol=eval_protocol(cfg),
        output_path=cfg.output_path,
    )
    return run_grid(spec, on_record=on_record)


def sweep_config(cfg: Any, recipes: tuple[str, ...] | None = None) -> Any:
    """The demo's bit-width sweep (module docstring, step 3) of the runs ``recipes`` (default: every run of
    ``cfg``, each seed's) on the evaluation grid's windows and baselines; ``cfg`` is a :class:`DemoConfig` or
    anything with its sweep and data fields (``qbench recipes``' config)."""
    from qbench.studies.sweep import SweepConfig

    return SweepConfig(
        models=[str(cfg.ckpt_root / r) for r in (recipes or tuple(run.name for run in cfg.runs()))],
        axes=list(cfg.sweep_axes),
        kv_keep_first=list(cfg.sweep_keep_first),
        kv_granularity=cfg.sweep_kv_scheme,
        protocol=eval_protocol(cfg),
        output_path=cfg.output_path / "sweep",
        baseline_path=cfg.output_path,
        seed=cfg.seed,
    )


def card_config(cfg: DemoConfig, command: str | None = None) -> Any:
    """The card of the two models (``qbench card --budget quick``) on the demo's own protocol and folder, so it
    reuses the grid's cells (the float models and the paper's four) and adds only the formats and KV rows."""
    from qbench.studies.card.config import CardConfig

    return CardConfig(
        models=[str(cfg.ckpt_root / r) for r in RECIPES],
        budget="quick",
        output_path=cfg.output_path,
        tokens=cfg.eval_tokens,
        corpus=cfg.data,
        split="validation",
        sample=cfg.sample,
        sample_seed=cfg.sample_seed,
        kv_scheme=cfg.sweep_kv_scheme,
        seed=cfg.seed,
        command=command,
        overwrite=True,  # the demo owns its folder: a rerun refreshes its own card
    )


def write_report(
    cfg: DemoConfig,
    records: list[dict],
    timings: dict[str, float],
    command: str,
    sweep: dict[str, Any] | None = None,
    card: bool = False,
) -> Path:
    """table.md (the comparison, the command that made it, machine and timings, the sweep's breaking points),
    curves JSON and PNGs."""
    from models.io import atomic_write_json
    from qbench.eval.report import render
    from qbench.studies import plots

    out = cfg.output_path
    curves = read_curves([cfg.ckpt_root / r for r in RECIPES])
    atomic_write_json(out / "emergence.json", curves)
    plots.emergence_plot(curves, out / "emergence.png")
    fp = {
        r["model"]["name"]: r
        for r in records
        if r["scheme"]["name"] == "fp" and r["model"]["name"] in RECIPES
    }
    plots.compare_layers_plot(
        {name: r["outliers_per_layer"] for name, r in fp.items()}, out / "per_layer.png"
    )
    from models.io import cpu_model

    machine = f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}"
    sweep_time = f", bit-width sweep {timings['sweep']:.0f} s" if "sweep" in timings else ""
    sweep_time += f", card {timings['card']:.0f} s" if "card" in timings else ""
    text = (
        f"# qbench demo\n\nMade by `{command}` ({cfg.description}) on {machine} "
        f"({time.strftime('%Y-%m-%d', time.gmtime())}); this call took: training {timings['train']:.0f} s, "
        f"evaluation {timings['eval']:.0f} s{sweep_time} (finished training runs and cells are reused, so a "
        f"re-run's times are not the cost from scratch).\n\n{render(records, 'md')}\n"
        "![emergence](emergence.png)\n\n![per layer](per_layer.png)\n"
    )
    if sweep is not None:
        from qbench.studies.sweep import sweep_caption, sweep_table

        text += (
            "\n## Below 8 bits: the bit-width sweep\n\n"
            f"{sweep_table(sweep)}\n\n{sweep_caption(sweep)} Records, `sweep.json` and `sweep.md` in `sweep/`."
            "\n\n![sweep](sweep/sweep.png)\n"
        )
    if card:
        text += (
            "\n## The card\n\nThe two models' robustness profile, one page: [card.md](card.md), "
            "[card.html](card.html) (self-contained), every number in `card.json`.\n"
        )
    if cfg.seeds > 1:
        from qbench.studies.seeds import seeds_section

        text += seeds_section(cfg.runs(), records, sweep, out, command)
    atomic_write_text(out / "table.md", text)
    return out / "table.md"
