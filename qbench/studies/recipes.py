"""``qbench recipes``: training-time remedies side by side — one panel of recipes at the same budget, then the
demo's evaluation of each, into one table.

1. Train every recipe of the panel (default :data:`DEFAULT_RECIPES`: the baseline, the paper's recipe, Muon,
   OSP, clipped softmax, gated attention, softpick, the sink logit) on one preset with the same seed, data, learning
   rate and number of steps, two runs at a time (one thread each, as ``qbench demo``). Each run resumes from its
   last checkpoint, so an interrupted panel continues where it stopped. Before anything starts,
   :func:`estimate` prints the cost: tokens and training FLOPs (``trainers.throughput``'s 6·N + 12·L·d·T) per
   run and in all, and a wall-time guess from one timed forward/backward step of the baseline on this machine.
2. Evaluate each with ``qbench grid`` like the demo (the float model and the paper's four schemes; outlier and
   attention statistics); finished cells are reused.
3. Write ``results/recipes/``: one JSON record per cell, ``table.md`` (the comparison, with the command, machine,
   cost and wall times) and ``emergence.json``/``emergence.png`` from the training probes.

OSP's embedding projection is folded into the embedding when the checkpoints are loaded for evaluation
(``qbench.eval.load``), so every row of the table is a plain-architecture model.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.io import atomic_write_text
from qbench.studies.runs import TrainRun, train_runs

# Light at import (no torch): the command line builds its parser from this module's defaults.

DEFAULT_RECIPES = (
    "vanilla",
    "paper",
    "muon",
    "osp",
    "clipped-softmax",
    "gated-attn",
    "softpick",
    "sink-logit",
)


@dataclass(frozen=True)
class RecipesConfig:
    preset: str = "tiny"
    recipes: tuple[str, ...] = DEFAULT_RECIPES
    steps: int = 500  # the demo's budget: x 16 windows x 128 tokens = 1.02 M training tokens on tiny
    lr: float = 4e-3
    seed: int = 0
    ckpt_root: Path = Path("ckpts/recipes")
    output_path: Path = Path("results/recipes")
    eval_tokens: int = 16384
    modes: tuple[str, ...] = ("fake",)
    schemes: tuple[str, ...] | None = None  # None: the paper's four (qbench.quant.PAPER_SCHEMES)
    probe_every: int = 25
    parallel: int = 2
    extra_args: tuple[str, ...] = field(default_factory=tuple)  # trainer options for every recipe

    def __post_init__(self) -> None:
        from trainers.recipes import RECIPES

        object.__setattr__(self, "recipes", tuple(dict.fromkeys(RECIPES.canonical(r) for r in self.recipes)))

    @property
    def description(self) -> str:
        return f"{self.preset}, {self.steps} steps, lr {self.lr}, seed {self.seed}"


def panel_runs(cfg: RecipesConfig) -> list[TrainRun]:
    """One trainer run per recipe; everything but ``--recipe`` is shared."""
    shared = (
        *("--preset", cfg.preset, "--lr", str(cfg.lr), "--seed", str(cfg.seed)),
        *("--probe-every", str(cfg.probe_every), "--ckpt-every", "50"),
        *cfg.extra_args,
    )
    return [TrainRun(r, cfg.ckpt_root / r, cfg.steps, ("--recipe", r, *shared)) for r in cfg.recipes]


def _train_config(cfg: RecipesConfig, recipe: str) -> Any:
    """The TrainConfig the trainer will build for ``recipe`` (its own CLI parser, so the two cannot differ)."""
    from trainers.__main__ import build_parser, config_from_args

    run = next(r for r in panel_runs(cfg) if r.name == recipe)
    return config_from_args(vars(build_parser().parse_args(["--steps", str(cfg.steps), *run.args])))


def time_one_step(cfg: RecipesConfig) -> float:
    """Seconds of one forward/backward/AdamW step of the panel's baseline on this machine (one thread, as the
    panel trains), after one warm-up step."""
    import torch
    import torch.nn.functional as F

    from models import build

    tc = _train_config(cfg, cfg.recipes[0])
    model = build(tc.model_config(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, tc.model_config().vocab_size, (tc.batch_size, tc.window + 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(2):
            if i == 1:
                start = time.perf_counter()
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def estimate(cfg: RecipesConfig, step_s: float | None = None) -> dict[str, Any]:
    """The panel's cost before it starts: per recipe its steps, tokens and training FLOPs, the totals, and the
    wall time at ``step_s`` seconds per step with ``parallel`` runs at once (a guess: Muon, OrthoAdam and the
    explicit attention paths cost more per step than the baseline that was timed)."""
    import torch

    from models import Transformer
    from trainers.state import has_state, read_state
    from trainers.throughput import flops_per_token

    rows = []
    for recipe in cfg.recipes:
        tc = _train_config(cfg, recipe)
        mc = tc.model_config()
        with torch.device("meta"):
            fpt = flops_per_token(Transformer(mc), mc.n_layer, mc.d_model, tc.window)
        out = cfg.ckpt_root / recipe
        done = read_state(out, verify=False)["step"] if has_state(out) else 0
        left = max(0, tc.total_steps - done)
        rows.append(
            {
                "recipe": recipe,
                "optimizer": tc.optimizer,
                "steps": tc.total_steps,
                "steps_left": left,
                "tokens": tc.total_steps * tc.tokens_per_step,
                "flops": tc.total_steps * tc.tokens_per_step * fpt,
            }
        )
    steps_left = sum(r["steps_left"] for r in rows)
    result = {
        "runs": rows,
        "tokens": sum(r["tokens"] for r in rows),
        "flops": sum(r["flops"] for r in rows),
        "steps_left": steps_left,
        "step_s": step_s,
        "wall_s": None if step_s is None else steps_left * step_s / max(1, min(cfg.parallel, len(rows))),
    }
    return result


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.3g} FLOP"


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.0f} s"
        if seconds < 120
        else f"{seconds / 60:.0f} min"
        if seconds < 7200
        else f"{seconds / 3600:.1f} h"
    )


def describe_estimate(est: dict[str, Any]) -> str:
    runs = len(est["runs"])
    text = (
        f"{runs} runs x {est['runs'][0]['steps']} steps = {est['tokens']:,} training tokens, "
        f"{_flops(est['flops'])}"
    )
    if est["steps_left"] != runs * est["runs"][0]["steps"]:
        text += f"; {est['steps_left']} steps left to train (the rest resumes from checkpoints)"
    if est["wall_s"] is not None:
        text += (
            f"; about {_duration(est['wall_s'])} of training at {est['step_s']:.2f} s per step "
            "(the baseline's step timed here; Muon, OrthoAdam and explicit attention run slower)"
        )
    return text


def train_panel(cfg: RecipesConfig, console: Any) -> float:
    return train_runs(panel_runs(cfg), console, parallel=cfg.parallel, threads=1)


def evaluate(cfg: RecipesConfig, on_record: Any = None) -> list[dict]:
    from qbench.eval.harness import GridSpec, run_grid
    from qbench.eval.metrics import Protocol
    from qbench.quant import PAPER_SCHEMES

    spec = GridSpec(
        models=[str(cfg.ckpt_root / r) for r in cfg.recipes],
        schemes=list(cfg.schemes or PAPER_SCHEMES),
        modes=list(cfg.modes),
        protocol=Protocol(tokens=cfg.eval_tokens),
        output_path=cfg.output_path,
    )
    return run_grid(spec, on_record=on_record)


def write_report(
    cfg: RecipesConfig, records: list[dict], timings: dict[str, float], command: str, est: dict[str, Any]
) -> Path:
    """table.md (the comparison, the command, machine, cost and timings) and the emergence curves."""
    from models.io import atomic_write_json, cpu_model
    from qbench.eval.report import render
    from qbench.studies import plots
    from qbench.studies.emergence import read_curves
    from trainers.recipes import RECIPES

    out = cfg.output_path
    curves = read_curves([cfg.ckpt_root / r for r in cfg.recipes])
    atomic_write_json(out / "emergence.json", curves)
    plots.emergence_plot(curves, out / "emergence.png")
    machine = f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}"
    legend = "\n".join(f"- `{r}`: {RECIPES.describe(r)}" for r in cfg.recipes)
    text = (
        f"# qbench recipes: training-time remedies\n\nMade by `{command}` ({cfg.description}) on {machine} "
        f"({time.strftime('%Y-%m-%d', time.gmtime())}); {describe_estimate(est)}. Training "
        f"{timings['train']:.0f} s, evaluation {timings['eval']:.0f} s.\n\n{legend}\n\n"
        f"{render(records, 'md')}\n![emergence](emergence.png)\n"
    )
    atomic_write_text(out / "table.md", text)
    return out / "table.md"


def run_panel(cfg: RecipesConfig, console: Any, command: str, on_record: Any = None) -> Path:
    """The whole study: estimate (printed), train, evaluate, write the table."""
    est = estimate(cfg, time_one_step(cfg))
    console.print(
        f"[bold]qbench recipes[/] {', '.join(cfg.recipes)} ({cfg.description}): {describe_estimate(est)}"
    )
    train_s = train_panel(cfg, console)
    start = time.perf_counter()
    records = evaluate(cfg, on_record=on_record)
    return write_report(cfg, records, {"train": train_s, "eval": time.perf_counter() - start}, command, est)
