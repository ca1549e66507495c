"""``qbench.studies.recipes`` on a micro preset and a handful of steps: the cost estimate, a resumable panel
trained two at a time, every recipe evaluated into one table."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import pytest

from models.errors import UserError
from qbench.studies import recipes as study

EMBEDDED = Path(__file__).resolve().parents[3] / "trainers" / "corpus" / "embedded.jsonl.gz"
MICRO = ("--set", "n_layer=2", "--set", "d_model=32", "--set", "n_head=2", "--set", "d_ff=64")


@pytest.fixture(scope="module")
def micro_panel(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    corpus = root / "micro.jsonl"
    with gzip.open(EMBEDDED, "rt", encoding="utf-8") as f, open(corpus, "w", encoding="utf-8") as out:
        for _, line in zip(range(20), f):
            doc = json.loads(line)
            out.write(json.dumps({"id": doc["id"], "text": doc["text"][:4000]}) + "\n")
    extra = (*MICRO, "--context", "16", "--batch-size", "2", "--eval-tokens", "64", "--probe-batch", "2")
    return study.RecipesConfig(
        recipes=("vanilla", "osp"),
        steps=2,
        ckpt_root=root / "ckpts",
        output_path=root / "results",
        eval_tokens=64,
        schemes=("absmax-coarse",),
        probe_every=1,
        extra_args=(*extra, "--data", str(corpus)),
        sweep_axes=("kv",),  # the demo's sweep, one axis: its breaking points reach the table
        sweep_keep_first=(),
        sweep_kv_scheme="per-token",  # KIVI's residual would cover the 16-token windows
    )


def cli_args(panel: study.RecipesConfig) -> list[str]:
    """The micro panel as ``qbench recipes`` options: its corpus as ``--data`` (the panel's own option: a
    ``--train-arg --data`` is refused), every other trainer option as ``--train-arg``."""
    extra = list(panel.extra_args)
    at = extra.index("--data")
    corpus = extra[at + 1]
    del extra[at : at + 2]
    return ["--data", corpus, *(f"--train-arg={a}" for a in extra)]


def test_estimate_counts_tokens_and_flops_before_anything_runs(micro_panel):
    est = study.estimate(micro_panel, step_s=0.5)
    assert [r["recipe"] for r in est["runs"]] == ["vanilla", "osp"]
    assert all(r["tokens"] == 2 * 2 * 16 and r["steps_left"] == 2 for r in est["runs"])
    assert est["runs"][1]["optimizer"] == "muon"
    # OSP's embedding projection is a d x d matmul: more FLOPs per token than the baseline
    assert est["runs"][1]["flops"] > est["runs"][0]["flops"] > 0
    assert est["wall_s"] == pytest.approx(4 * 0.5 / 2)  # 4 steps, two runs at a time
    assert "2 runs x 2 steps" in study.describe_estimate(est)
    # Each recipe's own step (OSP: Muon and the projection), scheduled as train_runs does: one slot each here.
    steps = study.time_steps(micro_panel)
    assert set(steps) == {"vanilla", "osp"} and all(s > 0 for s in steps.values())
    est = study.estimate(micro_panel, {"vanilla": 0.5, "osp": 2.0})
    assert est["wall_s"] == pytest.approx(2 * 2.0)  # side by side: the slower run sets the time
    assert "0.50–2.00 s per step" in study.describe_estimate(est)
    assert (
        study.estimate(dataclasses.replace(micro_panel, parallel=1), {"vanilla": 0.5, "osp": 2.0})["wall_s"]
        == 5.0
    )
    assert study._list_schedule([3, 1, 1, 1], 2) == 3  # a slot frees, the next run starts
    with pytest.raises(UserError, match="did you mean 'softpick'"):
        study.RecipesConfig(recipes=("softpik",))


def test_panel_trains_resumes_and_writes_one_table(micro_panel, tmp_path):
    from rich.console import Console

    console = Console(file=open(tmp_path / "log", "w"))  # noqa: SIM115
    table = study.run_panel(micro_panel, console, "qbench recipes --test")
    text = table.read_text()
    assert "| vanilla" in text and "| osp" in text
    assert "`osp`: Outlier-Safe Pre-Training" in text and "FLOP" in text
    assert "## Breaking points" in text and "| osp" in text.split("## Breaking points")[1]
    # the post-training algorithms on the baseline beside the remedies (qbench algorithms on the panel's grid)
    section = text.split("## Post-training algorithms beside the training-time remedies")[1]
    assert "| vanilla | int4 per channel |" in section and "against vanilla's best post-training" in section
    result = json.loads((micro_panel.output_path / "algorithms" / "algorithms.json").read_text())
    assert result["models"] == ["vanilla", "osp"] and result["formats"] == [
        "int4 per channel",
        "W4A8 per channel/token",
        "W4A4 per channel/token",
    ]
    quarot = result["rows"][0]["cells"]["quarot"]  # the micro panel is GPT-2 style: QuaRot refused, said so
    assert quarot["status"] == "unsupported" and "LayerNorm" in quarot["error"]
    # each run's own training figures, from its checkpoint's provenance
    training = text.split("## Training runs")[1].split("\n\n")[1]
    osp_row = training.split("| osp ")[1].split("\n")[0]
    assert "| vanilla " in training and "muon" in osp_row and "adamw" in training.split("| vanilla ")[1]
    cfg = json.loads((micro_panel.ckpt_root / "osp" / "config.json").read_text())
    assert cfg["model"]["emb_proj"] and cfg["model"]["head_proj"]  # trained with both, evaluated merged
    records = [json.loads(p.read_text()) for p in micro_panel.output_path.glob("*/*.json")]
    records = [r for r in records if "model" in r]  # sweep/sweep.json is the sweep's summary
    osp = [r for r in records if r["model"]["name"] == "osp"]
    assert osp and all(r["model"]["merged_projections"] == ["emb_proj", "head_proj"] for r in osp)
    assert study.estimate(micro_panel)["steps_left"] == 0  # a rerun resumes to nothing
    assert "nothing left to train" in study.describe_estimate(
        study.estimate(micro_panel, study.time_steps(micro_panel))
    )


def test_cli_module_prints_the_estimate_and_refuses_bad_input(micro_panel, capsys):
    import argparse

    from qbench.cli import recipes as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cli.run(
        parser.parse_args(
            ["--estimate", "--recipes", "vanilla", "sink-logit", "--steps", "3", *cli_args(micro_panel)]
        )
    )
    assert "2 runs x 3 steps" in capsys.readouterr().out
    with pytest.raises(UserError, match="--steps"):
        cli.run(parser.parse_args(["--steps", "0"]))


def test_long_panel_is_the_long_demos_runs():
    """``--long``: every recipe at the long demo's budget; its vanilla and paper runs are the long demo's own
    (same trainer arguments), so the demo's checkpoints serve the panel."""
    from qbench.studies import demo

    cfg = study.long_config(recipes=("vanilla", "paper", "muon", "osp"))
    runs = {r.name: r for r in study.panel_runs(cfg)}
    demo_runs = {r.name: r for r in demo.demo_runs(demo.LONG)}
    for name in ("vanilla", "paper"):
        assert runs[name].args == demo_runs[name].args
        assert (runs[name].steps, runs[name].stop_at) == (demo_runs[name].steps, demo_runs[name].stop_at)
    assert (
        "--norm" in runs["muon"].args
    )  # Llama style: RMSNorm where the recipe leaves the norm to the preset
    assert "--norm" not in runs["osp"].args  # OSP brings its own single-scale RMSNorm
    est = study.estimate(cfg)
    assert all(r["steps"] == 2000 for r in est["runs"])
    # every run ends annealed: the schedule is the run's length
    assert all(r.stop_at is None and r.steps == 2000 for r in runs.values())


def test_seeds_train_every_recipe_per_seed_and_summarise_mean_sd_and_flips(
    micro_panel, monkeypatch, tmp_path
):
    """``--seeds 2``: the first seed's runs keep the recipe's folder (a one-seed panel is reused), the second
    trains into ``<recipe>-seed1``; seeds.json's mean ± sd are the records' own, and the table says whether each
    ranking and breaking point holds on both seeds."""
    import math

    from rich.console import Console

    from qbench.studies.seeds import mean_sd

    cfg = dataclasses.replace(
        micro_panel,
        recipes=("vanilla", "sink-logit"),
        seeds=2,
        ckpt_root=tmp_path / "ckpts",
        output_path=tmp_path / "results",
    )
    assert [r.name for r in cfg.runs()] == ["vanilla", "sink-logit", "vanilla-seed1", "sink-logit-seed1"]
    runs = {r.name: r.args for r in study.panel_runs(cfg)}
    assert runs["vanilla-seed1"][runs["vanilla-seed1"].index("--seed") + 1] == "1"
    timed = []
    monkeypatch.setattr(study, "time_one_step", lambda c, r=None: timed.append(r) or 0.1)
    assert set(study.time_steps(cfg)) == {r.name for r in cfg.runs()} and sorted(timed) == [
        "sink-logit",
        "vanilla",
    ]
    assert "4 runs x 2 steps" in study.describe_estimate(study.estimate(cfg, 0.1))
    console = Console(file=open(tmp_path / "log", "w"))  # noqa: SIM115
    text = study.run_panel(cfg, console, "qbench recipes --seeds 2").read_text()
    assert "## Across seeds" in text and "seeds 0–1" in text
    summary = json.loads((cfg.output_path / "seeds.json").read_text())
    assert summary["command"] == "qbench recipes --seeds 2" and summary["seeds"] == [0, 1]
    records = [json.loads(p.read_text()) for p in cfg.output_path.glob("*/*.json")]
    fp = {r["model"]["name"]: r["metrics"]["perplexity"] for r in records if r.get("mode") == "float"}
    got = summary["recipes"]["vanilla"]["fp_perplexity"]
    mean, sd = mean_sd([fp["vanilla"], fp["vanilla-seed1"]])
    assert (
        math.isclose(got["mean"], mean)
        and math.isclose(got["sd"], sd)
        and got["values"]
        == [
            fp["vanilla"],
            fp["vanilla-seed1"],
        ]
    )
    column = "absmax-coarse/fake"
    ranking = summary["rankings"][column]
    assert len(ranking["per_seed"]) == 2 and ranking["stable"] == (
        ranking["per_seed"][0] == ranking["per_seed"][1]
    )
    assert ("same order on every seed" in text) if ranking["stable"] else ("flips between seeds" in text)
    points = summary["breaking_points"]
    assert {p["recipe"] for p in points} == {"vanilla", "sink-logit"} and all(
        len(p["per_seed"]) == 2 for p in points
    )
    assert f"{column} Δppl %" in text


def test_seeds_below_one_are_refused(micro_panel):
    import argparse

    from qbench.cli import recipes as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(UserError, match="--seeds"):
        cli.run(parser.parse_args(["--seeds", "0"]))


def test_the_lr_sweep_keeps_each_recipes_best_validation_loss(micro_panel, tmp_path):
    """``--lr-sweep``: every recipe at every candidate lr (the panel's lr keeps the plain folder), the lowest final
    validation loss chosen per recipe, the other seeds at that lr; lr_sweep.json and table.md say so."""
    from rich.console import Console

    cfg = dataclasses.replace(
        micro_panel,
        recipes=("vanilla",),
        lrs=(4e-3, 2e-2),
        seeds=2,
        ckpt_root=tmp_path / "ckpts",
        output_path=tmp_path / "results",
        sweep_axes=(),
        algorithms=False,
    )
    assert [r.name for r in cfg.sweep_runs()] == ["vanilla", "vanilla-lr0.02"]
    assert {r.lr for r in cfg.sweep_runs()} == {4e-3, 2e-2}
    console = Console(file=open("/dev/null", "w"))  # noqa: SIM115 - the console's file lives as long as it
    study.run_panel(cfg, console, "qbench recipes --lr-sweep 0.004 0.02 --seeds 2")
    choice = json.loads((cfg.output_path / "lr_sweep.json").read_text())
    losses = {float(k): v for k, v in choice["recipes"]["vanilla"]["val_loss"].items()}
    assert set(losses) == {4e-3, 2e-2} and all(v is not None for v in losses.values())
    best = min(losses, key=lambda lr: (losses[lr], lr))
    assert choice["recipes"]["vanilla"]["chosen"] == best
    assert choice["recipes"]["vanilla"]["at_edge"]  # two candidates: either choice is an edge of the grid
    # the loss read back is the run's own: its checkpoint's provenance
    for lr in losses:
        name = "vanilla" if lr == 4e-3 else "vanilla-lr0.02"
        meta = json.loads((cfg.ckpt_root / name / "config.json").read_text())
        training = meta["provenance"]["training"]
        assert training["config"]["lr"] == lr and training["summary"]["val_loss"] == losses[lr]
    # the second seed trained at the chosen lr only
    seed1 = "vanilla-seed1" if best == 4e-3 else "vanilla-lr0.02-seed1"
    assert (cfg.ckpt_root / seed1 / "config.json").exists()
    assert not (cfg.ckpt_root / ("vanilla-lr0.02-seed1" if best == 4e-3 else "vanilla-seed1")).exists()
    table = (cfg.output_path / "table.md").read_text()
    assert "## Learning rate per recipe" in table and "lowest final validation loss" in table
    section = table.split("## Learning rate per recipe")[1].split("## Across seeds")[0]
    assert "peak lr" in table and re.search(rf"\| vanilla .*\| +{best:g} \(grid edge\) \|", section), section
    assert "1 of 1 choices lie at the grid's smallest or largest lr" in section


def test_lr_from_trains_each_recipe_at_an_earlier_sweeps_choice(micro_panel, tmp_path, capsys, monkeypatch):
    """``--lr-from``: the lr each recipe trains at is the one an earlier sweep's lr_sweep.json chose (the --long
    panel at the demo sweep's choice), named in each run's folder and the table's description; a recipe the file
    chose nothing for, a missing or foreign file, and --lr-from with --lr-sweep are one-line errors."""
    import argparse

    from qbench.cli import recipes as cli

    sweep = tmp_path / "lr_sweep.json"
    sweep.write_text(
        json.dumps(
            {"recipes": {"vanilla": {"chosen": 0.002}, "osp": {"chosen": 0.004}, "muon": {"chosen": None}}}
        )
    )
    chosen = study.read_lr_choice(sweep, ("vanilla", "osp"))
    assert chosen == (("vanilla", 0.002), ("osp", 0.004))
    cfg = dataclasses.replace(micro_panel, chosen_lr=chosen, lr_source=str(sweep))
    assert [(r.name, r.lr) for r in cfg.runs()] == [("vanilla-lr0.002", 0.002), ("osp", 0.004)]
    assert f"as {sweep} chose it" in cfg.description
    assert "0.002" in study.panel_runs(cfg)[0].args  # the trainer gets the chosen lr
    with pytest.raises(UserError, match="chose no learning rate for muon"):
        study.read_lr_choice(sweep, ("vanilla", "muon"))
    (tmp_path / "other.json").write_text("[1, 2]")
    for bad in (tmp_path / "none.json", tmp_path / "other.json"):
        with pytest.raises(UserError, match="--lr-from"):
            study.read_lr_choice(bad, ("vanilla",))

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    seen = []
    real_estimate = study.estimate
    monkeypatch.setattr(study, "estimate", lambda c, s=None: seen.append(c) or real_estimate(c, s))
    args = ["--estimate", "--recipes", "vanilla", "osp", "--steps", "3", "--lr-from", str(sweep)]
    cli.run(parser.parse_args([*args, "--ckpt-root", str(tmp_path / "ckpts"), *cli_args(micro_panel)]))
    assert "2 runs x 3 steps" in capsys.readouterr().out
    assert [(r.name, r.lr) for r in seen[0].runs()] == [("vanilla-lr0.002", 0.002), ("osp", 0.004)]
    with pytest.raises(UserError, match="one of --lr-sweep"):
        cli.run(parser.parse_args(["--estimate", "--lr-sweep", "--lr-from", str(sweep)]))


def test_lr_choice_marks_a_choice_at_the_grids_edge(micro_panel, tmp_path):
    """A chosen lr at the smallest or largest candidate is flagged (the grid does not bracket an optimum there); one
    inside the grid is not; a diverged run is never chosen."""
    cfg = dataclasses.replace(
        micro_panel, recipes=("vanilla", "osp"), lrs=(1e-3, 2e-3, 4e-3), ckpt_root=tmp_path / "ckpts"
    )
    losses = {"vanilla": (5.0, 4.0, 4.5), "osp": (6.0, 5.5, float("nan"))}
    for run in cfg.sweep_runs():
        out = cfg.ckpt_root / run.name
        out.mkdir(parents=True)
        loss = losses[run.recipe][cfg.lrs.index(run.lr)]
        (out / "metrics.jsonl").write_text(json.dumps({"step": 2, "val_loss": loss}) + "\n")
    choice = study.choose_lrs(cfg)["recipes"]
    assert (choice["vanilla"]["chosen"], choice["vanilla"]["at_edge"]) == (2e-3, False)
    assert (choice["osp"]["chosen"], choice["osp"]["at_edge"]) == (2e-3, False)  # 4e-3 diverged: not chosen
    losses["vanilla"] = (3.0, 4.0, 4.5)
    (cfg.ckpt_root / cfg.run_name("vanilla", 1e-3, cfg.seed) / "metrics.jsonl").write_text(
        json.dumps({"step": 2, "val_loss": 3.0}) + "\n"
    )
    choice = study.choose_lrs(cfg)["recipes"]
    assert (choice["vanilla"]["chosen"], choice["vanilla"]["at_edge"]) == (1e-3, True)
