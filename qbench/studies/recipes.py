"""``qbench recipes``: training-time remedies side by side — one panel of recipes at the same budget, then the
demo's evaluation of each, into one table.

1. Train every recipe of the panel (default :data:`DEFAULT_RECIPES`: the baseline, the paper's recipe, Muon,
   OSP and its two ablations, clipped softmax, gated attention, softpick, the sink logit) on one preset with the same seed, data (``--data``,
   default the embedded corpus), learning rate and number of steps, two runs at a time (one thread each, as ``qbench demo``). Each run resumes from its
   last checkpoint, so an interrupted panel continues where it stopped. Before anything starts,
   :func:`estimate` prints the cost: tokens and training FLOPs (``trainers.throughput``'s 6·N + 12·L·d·T) per
   run and in all, and a wall-time guess from one timed forward/backward step of the baseline on this machine.
2. Evaluate each exactly like the demo, on the validation split of the corpus it trained on
   (:func:`qbench.studies.demo.eval_protocol`; ``--sample`` chooses the windows): ``qbench grid`` (the float model and the paper's four schemes; outlier and
   attention statistics), then the demo's bit-width sweep (weights, activations, outputs, all, the KV cache: the
   breaking points); finished cells are reused.
3. Write ``results/recipes/``: one JSON record per cell, ``table.md`` (the comparison, with the command, machine,
   cost and wall times) and ``emergence.json``/``emergence.png`` from the training probes.

``--long`` (:func:`long_config`) runs the panel at ``qbench demo --long``'s budget, Llama style; its ``vanilla``
and ``paper`` runs are the long demo's (same arguments), so ``--ckpt-root ckpts/demo-long`` reuses them.

OSP's embedding projection is folded into the embedding when the checkpoints are loaded for evaluation
(``qbench.eval.load``), so every row of the table is a plain-architecture model.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import platform
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import UserError
from models.io import atomic_write_text
from qbench.studies.runs import DEFAULT_DATA, TrainRun, check_data, data_description, train_runs

# Light at import (no torch): the command line builds its parser from this module's defaults.

DEFAULT_RECIPES = (
    "vanilla",
    "paper",
    "muon",
    "osp",
    "muon+ssnorm",  # OSP's ablation: Muon + RMSNorm-S without the projections,
    "osp-input-only",  # ... and with the embedding projection alone
    "clipped-softmax",
    "gated-attn",
    "softpick",
    "sink-logit",
)


# --lr-sweep's candidates: AdamW-family recipes and Muon's (whose lr also drives its AdamW half) alike, around the
# demo's 4e-3
LR_SWEEP = (2e-3, 4e-3, 8e-3)


@dataclass(frozen=True)
class RecipesConfig:
    preset: str = "tiny"
    recipes: tuple[str, ...] = DEFAULT_RECIPES
    steps: int = 300  # the demo's budget (DemoConfig.steps): 0.61 M tokens on tiny
    lr: float = 4e-3
    seed: int = 0
    seeds: int = 1  # training seeds per recipe: seed, seed + 1, … (qbench.studies.seeds)
    ckpt_root: Path = Path("ckpts/recipes")
    output_path: Path = Path("results/recipes")
    eval_tokens: int = 16384
    modes: tuple[str, ...] = ("fake",)
    schemes: tuple[str, ...] | None = None  # None: the paper's four (qbench.quant.PAPER_SCHEMES)
    probe_every: int = 25
    parallel: int = 2
    extra_args: tuple[str, ...] = field(default_factory=tuple)  # trainer options for every recipe
    schedule_steps: int | None = None  # a longer schedule of which only the first ``steps`` are trained
    # the norm of recipes that leave it to the preset (None: the preset's); Llama style needs RMSNorm there
    style_norm: str | None = None
    sweep_axes: tuple[str, ...] = ("w", "a", "o", "all", "kv")  # the demo's sweep; () skips it
    sweep_keep_first: tuple[int, ...] = (1,)
    sweep_kv_scheme: str = "kivi:group=32,residual=32"  # the demo's: R = 128 would cover 128-token windows
    # --lr-sweep: candidate peak learning rates, each recipe trained at each (seed ``seed``) and the one with the
    # lowest final validation loss kept (docs/training.md); () trains every recipe at ``lr``
    lrs: tuple[float, ...] = ()
    chosen_lr: tuple[tuple[str, float], ...] = ()  # (recipe, lr) the sweep chose; set by run_panel
    lr_source: str | None = None  # --lr-from: the lr_sweep.json whose choices ``chosen_lr`` holds
    # the post-training algorithms (qbench algorithms) on the first seed's models, the first recipe the baseline:
    # does GPTQ, AWQ or a rotation on the model one already has close the gap a training-time remedy closes?
    algorithms: bool = True
    # the corpus every run trains on and is scored on, and which windows are scored: as DemoConfig's
    data: str = DEFAULT_DATA
    sample: str | None = None
    sample_seed: int = 0

    def __post_init__(self) -> None:
        from trainers.recipes import RECIPES

        object.__setattr__(self, "recipes", tuple(dict.fromkeys(RECIPES.canonical(r) for r in self.recipes)))
        object.__setattr__(self, "lrs", tuple(dict.fromkeys(float(x) for x in self.lrs)))

    @property
    def description(self) -> str:
        schedule = f" of a {self.schedule_steps}-step schedule" if self.schedule_steps else ""
        style = ", Llama style" if "family=llama" in self.extra_args else ""
        seeds = f"seeds {self.seed}–{self.seed + self.seeds - 1}" if self.seeds > 1 else f"seed {self.seed}"
        if self.lrs:
            lr = f"lr per recipe, the best validation loss of {'/'.join(f'{x:g}' for x in self.lrs)}"
        elif self.lr_source:
            lr = f"lr per recipe as {self.lr_source} chose it"
        else:
            lr = f"lr {self.lr}"
        return f"{self.preset}{style}, {self.steps} steps{schedule}, {lr}, {seeds}{data_description(self)}"

    def lr_of(self, recipe: str) -> float:
        """The peak learning rate ``recipe`` trains at: the sweep's choice, else the panel's ``lr``."""
        return dict(self.chosen_lr).get(recipe, self.lr)

    def run_name(self, recipe: str, lr: float, seed: int) -> str:
        """A run's folder and model name: the recipe, ``-lr<lr>`` when it is not the panel's ``lr`` (so a panel
        without a sweep, and the sweep's runs at ``lr``, share folders), ``-seed<k>`` after the first seed."""
        name = recipe if lr == self.lr else f"{recipe}-lr{lr:g}"
        return name if seed == self.seed else f"{name}-seed{seed}"

    def runs(self) -> list[Any]:
        """Every training run of the panel: one per recipe and seed (``qbench.studies.seeds.seeded_runs``), at
        the recipe's learning rate."""
        from qbench.studies.seeds import SeededRun, seeded_runs

        return [
            SeededRun(
                r.recipe, r.seed, self.run_name(r.recipe, self.lr_of(r.recipe), r.seed), self.lr_of(r.recipe)
            )
            for r in seeded_runs(self.recipes, self.seed, self.seeds)
        ]

    def sweep_runs(self) -> list[Any]:
        """The learning-rate sweep's runs: every recipe at every candidate lr, the panel's first seed."""
        from qbench.studies.seeds import SeededRun

        return [
            SeededRun(recipe, self.seed, self.run_name(recipe, lr, self.seed), lr)
            for lr in self.lrs
            for recipe in self.recipes
        ]

    def training_runs(self) -> list[Any]:
        """What this panel trains: the sweep's runs (before the choice) and every seed's, each once."""
        runs = {r.name: r for r in (self.sweep_runs() if self.lrs and not self.chosen_lr else [])}
        runs.update({r.name: r for r in self.runs()})
        return list(runs.values())


def long_config(**changes: Any) -> RecipesConfig:
    """``qbench recipes --long``: ``qbench demo --long``'s budget (Llama style, 2000 steps of a schedule as long
    as the run: every run ends annealed) for every recipe; its vanilla and paper runs are the long demo's."""
    from qbench.studies.demo import LLAMA_STYLE, LONG

    base = {
        "steps": LONG.steps,
        "schedule_steps": LONG.schedule_steps,
        "extra_args": LLAMA_STYLE,
        "style_norm": "rmsnorm",
        "ckpt_root": Path("ckpts/recipes-long"),
        "output_path": Path("results/recipes-long"),
    }
    return RecipesConfig(**{**base, **changes})


def panel_runs(cfg: RecipesConfig, runs: Sequence[Any] | None = None) -> list[TrainRun]:
    """One trainer run per recipe and seed (default: every run the panel trains, :meth:`training_runs`);
    everything but ``--recipe``, ``--lr`` and ``--seed`` is shared (``--data`` too)."""
    shared = (*("--probe-every", str(cfg.probe_every), "--ckpt-every", "50"), *cfg.extra_args)
    from trainers.recipes import RECIPES

    def own(recipe: str) -> tuple[str, ...]:
        keeps_preset_norm = RECIPES.get(recipe).norm is None
        return ("--norm", cfg.style_norm) if cfg.style_norm and keeps_preset_norm else ()

    return [
        TrainRun(
            run.name,
            cfg.ckpt_root / run.name,
            cfg.schedule_steps or cfg.steps,
            # the order of a one-seed panel's arguments, which a run's saved state compares when it resumes
            (
                *("--recipe", run.recipe, "--preset", cfg.preset, "--lr", str(run.lr or cfg.lr)),
                *("--seed", str(run.seed), "--data", cfg.data, *shared, *own(run.recipe)),
            ),
            stop_at=cfg.steps if cfg.schedule_steps else None,
        )
        for run in (cfg.training_runs() if runs is None else runs)
    ]


def final_val_loss(out: Path) -> float | None:
    """A run's validation loss at its last step: its checkpoint's ``training.summary`` (the trainer's final
    evaluation), else the last ``val_loss`` of its metrics.jsonl."""
    try:
        meta = json.loads((out / "config.json").read_text())
        summary = ((meta.get("provenance") or {}).get("training") or {}).get("summary") or {}
        if summary.get("val_loss") is not None:
            return float(summary["val_loss"])
    except (OSError, ValueError):
        pass
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    values = [json.loads(line).get("val_loss") for line in lines if line.strip()]
    values = [v for v in values if v is not None]
    return float(values[-1]) if values else None


def choose_lrs(cfg: RecipesConfig) -> dict[str, Any]:
    """The sweep's outcome: per recipe the final validation loss at each candidate lr and the chosen lr, the one
    with the lowest (ties: the smaller lr). A run that diverged or has no loss is never chosen; a recipe with none
    keeps the panel's ``lr``."""
    table: dict[str, dict[str, Any]] = {}
    for run in cfg.sweep_runs():
        loss = final_val_loss(cfg.ckpt_root / run.name)
        entry = table.setdefault(run.recipe, {"val_loss": {}, "chosen": None})
        entry["val_loss"][f"{run.lr:g}"] = loss if loss is not None and math.isfinite(loss) else None
    for entry in table.values():
        finite = {float(k): v for k, v in entry["val_loss"].items() if v is not None}
        entry["chosen"] = min(finite, key=lambda lr: (finite[lr], lr)) if finite else None
        # a choice at the smallest or largest candidate does not bracket an optimum: a wider grid may move it
        entry["at_edge"] = len(cfg.lrs) > 1 and entry["chosen"] in (min(cfg.lrs), max(cfg.lrs))
    return {
        "rule": "each recipe at the peak learning rate with the lowest final validation loss (seed "
        f"{cfg.seed}), among {', '.join(f'{x:g}' for x in cfg.lrs)} (docs/training.md)",
        "candidates": list(cfg.lrs),
        "seed": cfg.seed,
        "recipes": table,
    }


LR_RULE = "a learning rate must be a finite number > 0, e.g. 0.004"


def valid_lr(value: Any) -> bool:
    """A peak learning rate the trainer can use: inf or a negative rate trains to NaN or climbs the loss, and JSON's
    ``true`` is an int to Python (1), not a rate anyone chose."""
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def read_lr_choice(path: Path, recipes: Sequence[str]) -> tuple[tuple[str, float], ...]:
    """(recipe, lr) for every recipe of ``recipes`` from a sweep's ``lr_sweep.json`` (``--lr-from``: the ``--long``
    panel trains at the lr the demo budget's sweep chose, a sweep at its own budget costing three panels). A
    missing file, another format or a recipe the sweep did not choose for is a one-line error."""
    from models.errors import UserError

    try:
        data = json.loads(Path(path).read_text())
        chosen = {r: e.get("chosen") for r, e in data["recipes"].items()}
    except FileNotFoundError:
        raise UserError(
            f"--lr-from {path}: no such file (a qbench recipes --lr-sweep output's lr_sweep.json)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"--lr-from {path}: not an lr_sweep.json of qbench recipes --lr-sweep ({e})"
        ) from None
    # a value that is there but no rate is a damaged or hand-edited file, not a recipe the sweep left unchosen
    for r in recipes:
        if chosen.get(r) is not None and not valid_lr(chosen[r]):
            raise UserError(
                f"--lr-from {path}: the learning rate chosen for {r} is {json.dumps(chosen[r])}; {LR_RULE} "
                f"(sweep {r} again or drop it from --recipes)"
            )
    missing = [r for r in recipes if chosen.get(r) is None]
    if missing:
        raise UserError(
            f"--lr-from {path} chose no learning rate for {', '.join(missing)} (it has: "
            f"{', '.join(r for r, lr in chosen.items() if valid_lr(lr)) or 'none'}); sweep them or drop them "
            "from --recipes"
        )
    return tuple((r, float(chosen[r])) for r in recipes)


# The trainer options every panel run gets from the panel itself -> the ``qbench recipes`` option to give instead
# (``--preset``: the same value carries over) or why it is the panel's: a --train-arg setting one of them would train
# something else than table.md describes (or fight the panel's resuming), so it is refused.
PANEL_OPTIONS = {
    "preset": "--preset",
    "recipe": "--recipes",
    "lr": "--lr",
    "seed": "--seed",
    "data": "--data",  # the corpus the panel is scored on too
    "steps": "--steps",
    "tokens": "give qbench recipes --steps instead",
    "stop_at": "give qbench recipes --steps instead",
    "out": "--ckpt-root",
    "resume": "the panel resumes every run from its checkpoint itself",
    "overwrite": "remove the run's folder under --ckpt-root to train it again",
    "probe_every": "the panel probes every 25 steps",
    "ckpt_every": "the panel checkpoints every 50 steps",
    "progress": "the panel shows its own progress",
    # what makes a recipe the recipe (qbench ls recipes): a vanilla row trained with softmax-1 is no vanilla row
    "attn": "the recipe sets the attention (qbench ls recipes); choose the recipes with --recipes",
    "gate": "the recipe sets the gate (qbench ls recipes); choose the recipes with --recipes",
    "optim": "the recipe sets the optimiser (qbench ls recipes); choose the recipes with --recipes",
    "emb_proj": "the recipe sets OSP's projections (qbench ls recipes); choose the recipes with --recipes",
    "head_proj": "the recipe sets OSP's projections (qbench ls recipes); choose the recipes with --recipes",
    # the architecture the panel's budget builds every recipe in (GPT-2 style, --long: Llama style)
    "pos": "the panel's style sets the positions for every recipe (--long: Llama style)",
    "bias": "the panel's style sets the biases for every recipe (--long: Llama style)",
    "norm_position": "the panel's style sets the norm position for every recipe",
}


def _trainer_parser(context: str) -> Any:
    """The trainer's own parser, with its errors as one line naming ``context`` (argparse would print its usage)."""
    from trainers.__main__ import build_parser

    parser = build_parser()

    def error(message: str) -> None:
        raise UserError(f"{context}: {message} (python -m trainers --help lists the trainer's options)")

    parser.error = error
    return parser


def check_train_args(cfg: RecipesConfig, train_args: tuple[str, ...] | list[str]) -> None:
    """Refuse, in one line, trainer arguments (``--train-arg``) the trainer does not take, that print and exit, or
    that set what the panel itself sets (:data:`PANEL_OPTIONS`; ``--norm`` too where the panel's style sets it)."""
    if not train_args:
        return
    shown = shlex.join(train_args)
    parser = _trainer_parser(f"qbench recipes: trainer argument(s) {shown}")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            given = vars(parser.parse_args(list(train_args)))
    except SystemExit:  # --help, --list: they print and exit, and train nothing
        raise UserError(
            f"qbench recipes: trainer argument(s) {shown} print and exit; a panel run takes training options only"
        ) from None
    owned = dict(PANEL_OPTIONS)
    if cfg.style_norm:
        owned["norm"] = f"the panel's style sets --norm {cfg.style_norm}"
    # --set FIELD=VALUE reaches the same model fields: refused for the fields the options above own
    trainer_only = ("preset", "recipe", "lr", "seed", "data", "steps", "tokens", "out")  # no model fields
    for item in given.get("set") or []:
        field = str(item).partition("=")[0].strip()
        if field in owned and field not in trainer_only:
            raise UserError(
                f"qbench recipes: --train-arg --set {item} sets what the panel itself sets for every run "
                f"(table.md would describe another run); {owned[field]}"
            )
    for dest, instead in owned.items():
        if dest in given:
            value = given[dest]
            flag = ("--no-" if value is False else "--") + dest.replace("_", "-")  # as typed: --no-bias
            value = "" if isinstance(value, bool) else f" {value}"
            if instead.startswith("--"):
                instead = f"give qbench recipes {instead}{value} instead"
            raise UserError(
                f"qbench recipes: --train-arg {flag}{value} sets what the panel itself sets for every run "
                f"(table.md would describe another run); {instead}"
            )


def check_ckpt_root(cfg: RecipesConfig) -> None:
    """Refuse a ``ckpt_root`` the panel cannot train into, before anything is estimated or trained: a file, a model
    checkpoint itself, or a run folder holding a checkpoint without trainer state (``qbench init``, ``export``),
    which a run can neither resume nor write over."""
    from trainers.state import has_state

    root = cfg.ckpt_root
    if root.exists() and not root.is_dir():
        raise UserError(
            f"qbench recipes: --ckpt-root {root} is a file; give a folder (the panel trains one run per recipe "
            "in its own subfolder)"
        )
    if (root / "config.json").is_file():
        raise UserError(
            f"qbench recipes: --ckpt-root {root} is a model checkpoint itself, not a panel's folder; give a new "
            "folder (or an earlier recipes panel's, to resume it)"
        )
    for run in cfg.training_runs():
        out = root / run.name
        if out.exists() and not out.is_dir():
            raise UserError(f"qbench recipes: {out} is a file; the {run.name} run trains into a folder there")
        if (out / "config.json").is_file() and not has_state(out):
            raise UserError(
                f"qbench recipes: {out} holds a model checkpoint without trainer state (made by qbench init or "
                f"export?): the {run.name} run could neither resume it nor overwrite it; move it away or give "
                "another --ckpt-root"
            )


def _train_config(cfg: RecipesConfig, recipe: str) -> Any:
    """The TrainConfig the trainer will build for run ``recipe`` (a run's name, or a recipe: its first run; its own
    CLI parser, so the two cannot differ)."""
    from trainers.__main__ import config_from_args

    runs = cfg.training_runs()
    own = next((r for r in runs if r.name == recipe), None) or next(r for r in runs if r.recipe == recipe)
    run = next(r for r in panel_runs(cfg, [own]))
    parser = _trainer_parser(f"qbench recipes: the {recipe} run's trainer arguments {shlex.join(run.args)}")
    return config_from_args(vars(parser.parse_args(["--steps", str(run.steps), *run.args])))


def time_one_step(cfg: RecipesConfig, recipe: str | None = None) -> float:
    """Seconds of one training step of ``recipe`` (default: the panel's first) on this machine: its own model
    and optimiser with the trainer's options (Muon, OrthoAdam, explicit attention cost more than the baseline),
    one thread as the panel trains; the faster of two steps after one warm-up (single steps vary ±20 % on a
    shared VM, and the slow ones are interference, not the run's rate)."""
    import torch
    import torch.nn.functional as F

    from models import build
    from trainers.loop import optimizer_options
    from trainers.optim.registry import build_optimizer, optimizer_param_groups

    tc = _train_config(cfg, recipe or cfg.recipes[0])
    model = build(tc.model_config(), seed=0)
    opt = build_optimizer(
        tc.optimizer,
        optimizer_param_groups(tc.optimizer, model, tc.weight_decay),
        1e-4,
        tc.weight_decay,
        **optimizer_options(tc.optimizer, torch.device("cpu")),
    )
    x = torch.randint(0, tc.model_config().vocab_size, (tc.batch_size, tc.window + 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for _ in range(3):
            start = time.perf_counter()
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return min(times[1:])
    finally:
        torch.set_num_threads(threads)


def _steps(cfg: RecipesConfig, recipe: str, tc: Any) -> tuple[int, int]:
    """(steps ``recipe`` trains in this panel, those left after its checkpoint)."""
    from trainers.state import has_state, read_state

    out = cfg.ckpt_root / recipe
    done = read_state(out, verify=False)["step"] if has_state(out) else 0
    end = min(cfg.steps, tc.total_steps)  # a prefix of a longer schedule trains only ``steps``
    return end, max(0, end - done)


def time_steps(cfg: RecipesConfig) -> dict[str, float]:
    """{run: seconds per step} for every run that has steps left to train; a recipe's step is timed once for all
    its seeds (the seed changes the numbers, not the work)."""
    timed: dict[str, float] = {}
    out = {}
    for run in cfg.training_runs():
        if _steps(cfg, run.name, _train_config(cfg, run.name))[1]:
            if run.recipe not in timed:
                timed[run.recipe] = time_one_step(cfg, run.recipe)
            out[run.name] = timed[run.recipe]
    return out


def _list_schedule(durations: list[float], parallel: int) -> float:
    """Wall time of running ``durations`` in order, ``parallel`` at a time, each starting when a slot frees
    (what ``train_runs`` does)."""
    slots = [0.0] * max(1, parallel)
    for d in durations:
        k = slots.index(min(slots))
        slots[k] += d
    return max(slots)


def estimate(cfg: RecipesConfig, step_s: float | Mapping[str, float] | None = None) -> dict[str, Any]:
    """The panel's cost before it starts: per recipe its steps, tokens and training FLOPs, the totals, and the
    wall time with ``parallel`` runs at once at ``step_s`` seconds per step (one figure for all, or one per
    recipe from :func:`time_steps`). Steps are timed alone and exclude the runs' probes and checkpoints; side by
    side on 2 cores (AMD EPYC Zen 4) the panels took 0.94× (demo budget) and 0.92× (``--long``) of it."""
    import torch

    from models import Transformer
    from trainers.throughput import flops_per_token

    rows = []
    for recipe in (run.name for run in cfg.training_runs()):
        tc = _train_config(cfg, recipe)
        mc = tc.model_config()
        with torch.device("meta"):
            fpt = flops_per_token(Transformer(mc), mc.n_layer, mc.d_model, tc.window)
        end, left = _steps(cfg, recipe, tc)
        own = step_s.get(recipe) if isinstance(step_s, Mapping) else step_s
        rows.append(
            {
                "recipe": recipe,
                "optimizer": tc.optimizer,
                "steps": end,
                "steps_left": left,
                "tokens": end * tc.tokens_per_step,
                "flops": end * tc.tokens_per_step * fpt,
                "step_s": own,
            }
        )
    steps_left = sum(r["steps_left"] for r in rows)
    timed = all(r["step_s"] is not None for r in rows if r["steps_left"])
    return {
        "runs": rows,
        "tokens": sum(r["tokens"] for r in rows),
        "flops": sum(r["flops"] for r in rows),
        "steps_left": steps_left,
        "wall_s": _list_schedule(
            [r["steps_left"] * r["step_s"] for r in rows if r["steps_left"]], min(cfg.parallel, len(rows))
        )
        if timed and step_s is not None
        else None,
    }


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
    if 0 < est["steps_left"] != runs * est["runs"][0]["steps"]:
        text += f"; {est['steps_left']} steps left to train (the rest resumes from checkpoints)"
    if not est["steps_left"]:
        text += "; nothing left to train"
    elif est["wall_s"] is not None:  # every run with steps left is timed
        times = [r["step_s"] for r in est["runs"] if r["steps_left"]]
        lo, hi = min(times), max(times)
        rate = f"{lo:.2f}–{hi:.2f} s per step" if hi > lo * 1.005 else f"{lo:.2f} s per step"
        text += (
            f"; about {_duration(est['wall_s'])} of training at {rate} (each recipe's step timed here alone)"
        )
    return text


def train_panel(cfg: RecipesConfig, console: Any) -> tuple[RecipesConfig, float]:
    """Train the panel; with a learning-rate sweep, first every recipe at every candidate lr (``lr_sweep.json``
    says which each keeps), then the other seeds at the chosen lr. Returns the panel at its chosen lrs and the
    seconds spent training."""
    from dataclasses import replace

    from models.io import atomic_write_json

    seconds = 0.0
    if cfg.lrs and not cfg.chosen_lr:
        seconds += train_runs(panel_runs(cfg, cfg.sweep_runs()), console, parallel=cfg.parallel, threads=1)
        choice = choose_lrs(cfg)
        atomic_write_json(cfg.output_path / "lr_sweep.json", choice)
        chosen = tuple((r, e["chosen"]) for r, e in choice["recipes"].items() if e["chosen"] is not None)
        cfg = replace(cfg, chosen_lr=chosen)
        edge = {r for r, e in choice["recipes"].items() if e.get("at_edge")}
        console.print(
            "learning rate per recipe (lowest final validation loss): "
            + ", ".join(f"{r} {lr:g}{' (grid edge)' if r in edge else ''}" for r, lr in chosen),
            highlight=False,
        )
    seconds += train_runs(panel_runs(cfg, cfg.runs()), console, parallel=cfg.parallel, threads=1)
    return cfg, seconds


def evaluate(cfg: RecipesConfig, on_record: Any = None) -> list[dict]:
    from qbench.eval.harness import GridSpec, run_grid
    from qbench.quant import PAPER_SCHEMES
    from qbench.studies.demo import eval_protocol

    spec = GridSpec(
        models=[str(cfg.ckpt_root / run.name) for run in cfg.runs()],
        schemes=list(cfg.schemes or PAPER_SCHEMES),
        modes=list(cfg.modes),
        protocol=eval_protocol(cfg),
        output_path=cfg.output_path,
    )
    return run_grid(spec, on_record=on_record)


def sweep_config(cfg: RecipesConfig) -> Any:
    """The demo's bit-width sweep (weights, activations, outputs, all, the KV cache) over the panel, on the grid's
    windows and float baselines: the breaking points of every recipe."""
    from qbench.studies import demo

    return demo.sweep_config(cfg, tuple(run.name for run in cfg.runs()))


def training_table(records: list[dict]) -> str:
    """One row per model of the float records: optimiser, tokens, wall time, tokens/s and final validation loss of
    its training run (``model.provenance.training``); '-' where a checkpoint carries no training record."""
    from tabulate import tabulate

    rows = []
    for r in records:
        if r.get("mode") != "float":
            continue
        training = ((r.get("model") or {}).get("provenance") or {}).get("training") or {}
        summary = training.get("summary") or {}
        lr = (training.get("config") or {}).get("lr")
        rows.append(
            [
                r["model"]["name"],
                training.get("optimizer", "-"),
                f"{lr:g}" if lr is not None else "-",
                f"{summary['tokens']:,}" if summary.get("tokens") else "-",
                f"{summary['wall_s']:.0f}" if summary.get("wall_s") else "-",
                f"{summary['tokens_per_s']:,.0f}" if summary.get("tokens_per_s") else "-",
                f"{summary['val_loss']:.4f}" if summary.get("val_loss") is not None else "-",
            ]
        )
    headers = ["model", "optimiser", "peak lr", "training tokens", "wall s", "tokens/s", "val loss"]
    return tabulate(rows, headers, tablefmt="github")


ALGORITHM_FORMATS = ("int4", "w4a8", "w4a4")  # int4 weights, W4A8 and W4A4: where outliers decide


def algorithms_config(cfg: RecipesConfig, command: str) -> Any:
    """``qbench algorithms`` over the panel's first-seed models (the first recipe, vanilla by default, is the
    baseline the remedies are compared with), at int4 per channel, W4A8 and W4A4, every algorithm."""
    from qbench.studies.algorithms import AlgorithmsConfig

    first = [r for r in cfg.runs() if r.seed == cfg.seed]
    return AlgorithmsConfig(
        models=tuple(str(cfg.ckpt_root / r.name) for r in first),
        formats=ALGORITHM_FORMATS,
        output_path=cfg.output_path / "algorithms",
        command=command,
    )


def run_panel_algorithms(cfg: RecipesConfig, command: str, on_record: Any = None) -> dict[str, Any]:
    """The algorithms table on the panel's own grid: its records beside the panel's (the round-to-nearest int4 cell
    is the panel's own ``zeropoint-int4``), ``algorithms/algorithms.json`` and ``algorithms/table.md``."""
    from dataclasses import replace

    from qbench.eval.harness import GridSpec
    from qbench.studies.algorithms import run_algorithms
    from qbench.studies.demo import eval_protocol

    acfg = algorithms_config(cfg, command)
    base = GridSpec(
        models=list(acfg.models),
        schemes=[],
        modes=["fake"],
        protocol=eval_protocol(cfg),
        output_path=cfg.output_path,
    )
    return run_algorithms(acfg, lambda schemes: replace(base, schemes=schemes), on_record=on_record)


def algorithms_section(result: Mapping[str, Any]) -> str:
    """table.md's post-training section: the algorithms table of the panel's models, one heading level down."""
    from qbench.studies.algorithms import render

    body = render(result).replace("\n## ", "\n### ").split("\n", 1)[1]  # its own title dropped
    return (
        "\n## Post-training algorithms beside the training-time remedies\n\nThe first recipe's model (the one a "
        "practitioner already has) with round-to-nearest, GPTQ, AWQ, the in-layer Hadamard rotation and QuaRot "
        "(refused on GPT-2-style models: LayerNorm), and every other recipe with round-to-nearest against its best "
        "— the panel's first seed, its own tokens. Records and `algorithms.json` in `algorithms/`.\n" + body
    )


def lr_section(cfg: RecipesConfig) -> str:
    """The learning-rate sweep as table.md shows it: each recipe's final validation loss at each candidate, the
    chosen one in bold (``lr_sweep.json`` holds the same)."""
    from tabulate import tabulate

    choice = choose_lrs(cfg)
    rows = []
    for recipe, entry in choice["recipes"].items():
        cells = []
        for lr in cfg.lrs:
            loss = entry["val_loss"].get(f"{lr:g}")
            text = "-" if loss is None else f"{loss:.4f}"
            cells.append(f"**{text}**" if entry["chosen"] == lr else text)
        chosen = "-" if entry["chosen"] is None else f"{entry['chosen']:g}"
        rows.append([recipe, *cells, f"{chosen} (grid edge)" if entry.get("at_edge") else chosen])
    headers = ["recipe", *(f"val loss @ {lr:g}" for lr in cfg.lrs), "chosen lr"]
    edges = [r for r, e in choice["recipes"].items() if e.get("at_edge")]
    edge_note = (
        f" {len(edges)} of {len(choice['recipes'])} choices lie at the grid's smallest or largest lr (grid edge): "
        "the grid does not bracket their optimum, and a wider one may choose differently."
        if edges
        else ""
    )
    return (
        f"\n## Learning rate per recipe\n\nRule: {choice['rule']}; the other seeds train at the chosen lr. "
        f"Each run's lr is in its checkpoint's provenance (`training.config.lr`) and the table above.{edge_note}\n\n"
        f"{tabulate(rows, headers, tablefmt='github')}\n"
    )


def write_report(
    cfg: RecipesConfig,
    records: list[dict],
    timings: dict[str, float],
    command: str,
    est: dict[str, Any],
    sweep: dict[str, Any] | None = None,
    algorithms: Mapping[str, Any] | None = None,
) -> Path:
    """table.md (the comparison, the command, machine, cost and timings) and the emergence curves."""
    from models.io import atomic_write_json, cpu_model
    from qbench.eval.report import render
    from qbench.studies import plots
    from qbench.studies.emergence import read_curves
    from trainers.recipes import RECIPES

    out = cfg.output_path
    curves = read_curves(
        [cfg.ckpt_root / r.name for r in cfg.runs() if r.seed == cfg.seed]
    )  # the first seed's
    atomic_write_json(out / "emergence.json", curves)
    plots.emergence_plot(curves, out / "emergence.png")
    machine = f"{cpu_model()}, {os.cpu_count()} cores, {platform.system()}"
    legend = "\n".join(f"- `{r}`: {RECIPES.describe(r)}" for r in cfg.recipes)
    sweep_time = f", bit-width sweep {timings['sweep']:.0f} s" if "sweep" in timings else ""
    sweep_time += (
        f", post-training algorithms {timings['algorithms']:.0f} s" if "algorithms" in timings else ""
    )
    text = (
        f"# qbench recipes: training-time remedies\n\nMade by `{command}` ({cfg.description}) on {machine} "
        f"({time.strftime('%Y-%m-%d', time.gmtime())}); {describe_estimate(est)}. This call took: training "
        f"{timings['train']:.0f} s, evaluation {timings['eval']:.0f} s{sweep_time} (finished runs and cells are "
        f"reused; each run's own training time is in the table below).\n\n{legend}\n\n"
        f"{render(records, 'md')}\n## Training runs\n\n{training_table(records)}\n\n"
        "Each run's own figures, from its checkpoint's provenance (`training.summary`): runs train two at a time, one "
        "thread each, so a run's wall time depends on what shared the cores with it.\n\n![emergence](emergence.png)\n"
    )
    if cfg.lrs:
        text += lr_section(cfg)
    elif cfg.lr_source:
        text += (
            f"\n## Learning rate per recipe\n\nFrom `{cfg.lr_source}` (`--lr-from`: the sweep of another budget; "
            "each run's lr is in the table above): "
            + ", ".join(f"{r} {lr:g}" for r, lr in cfg.chosen_lr)
            + ".\n"
        )
    if sweep is not None:
        from qbench.studies.sweep import sweep_caption, sweep_table

        text += (
            "\n## Breaking points: the bit-width sweep\n\n"
            f"{sweep_table(sweep)}\n\n{sweep_caption(sweep)} Records, `sweep.json` and `sweep.md` in `sweep/`."
            "\n\n![sweep](sweep/sweep.png)\n"
        )
    if algorithms is not None:
        text += algorithms_section(algorithms)
    if cfg.seeds > 1:
        from qbench.studies.seeds import seeds_section

        text += seeds_section(cfg.runs(), records, sweep, out, command)
    atomic_write_text(out / "table.md", text)
    return out / "table.md"


def run_panel(
    cfg: RecipesConfig, console: Any, command: str, on_record: Any = None, sweep_runner: Any = None
) -> Path:
    """The whole study: estimate (printed), train, evaluate, sweep, write the table. ``sweep_runner(config,
    command)`` runs the sweep (the command line passes one with a progress view; default: ``run_sweep``)."""
    check_data(cfg.data)
    check_ckpt_root(cfg)
    est = estimate(cfg, time_steps(cfg))
    console.print(
        f"[bold]qbench recipes[/] {', '.join(cfg.recipes)} ({cfg.description}): {describe_estimate(est)}"
    )
    cfg, train_s = train_panel(cfg, console)
    start = time.perf_counter()
    records = evaluate(cfg, on_record=on_record)
    timings = {"train": train_s, "eval": time.perf_counter() - start}
    sweep = None
    if cfg.sweep_axes:
        from qbench.studies.sweep import run_sweep

        start = time.perf_counter()
        config = sweep_config(cfg)
        sweep = sweep_runner(config, command) if sweep_runner else run_sweep(config, command=command)
        timings["sweep"] = time.perf_counter() - start
    algorithms = None
    if cfg.algorithms:
        start = time.perf_counter()
        algorithms = run_panel_algorithms(cfg, command, on_record=on_record)
        timings["algorithms"] = time.perf_counter() - start
    return write_report(cfg, records, timings, command, est, sweep, algorithms)
