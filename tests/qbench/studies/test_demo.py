import dataclasses
import json
import re

import pytest

from qbench.cli import main
from qbench.studies import demo, layerspeed

# Trainer options added after the demo's own on every run here: a 2-layer, d 128 model (the tiny preset's
# vocabulary, context and 64-dim heads; the long demo's d_ff 688 and Llama switches stay), 512 validation tokens (not
# 16,384), batches of 4 windows (not 16) and 2 probe windows (not 8). A 2-step run then costs little beyond its
# start-up, and each evaluated cell a third of the tiny model's; what the tests check (the runs' step and
# schedule, the model family and switches, seeds, probes, resumption, the records, sweep and card the demo writes)
# does not depend on them.
QUICK_TRAINING = (
    *("--set", "n_layer=2", "--set", "d_model=128", "--set", "n_head=2"),
    *("--eval-tokens", "512", "--batch-size", "4", "--probe-batch", "2"),
)


@pytest.fixture(autouse=True)
def _quick_training_and_card(monkeypatch):
    real_runs = demo.demo_runs
    monkeypatch.setattr(
        demo,
        "demo_runs",
        lambda cfg: [dataclasses.replace(r, args=(*r.args, *QUICK_TRAINING)) for r in real_runs(cfg)],
    )
    # the card's per-layer kernel timings (qbench.studies.layerspeed): one copy, one timed call per shape (the
    # demo's card is checked here for its models and protocol, not for its speed-ups)
    for name in ("MAX_COPIES", "DECODE_REPEATS", "PREFILL_REPEATS"):
        monkeypatch.setattr(layerspeed, name, 1)


@pytest.fixture
def one_paper_scheme(monkeypatch):
    """The evaluation grid with one of the paper's schemes (fake and real) instead of all four, for the tests about
    training and seeds: the whole grid, its records and their reuse are the first test's."""
    monkeypatch.setattr(demo, "PAPER_SCHEMES", ("absmax-coarse",))


@pytest.mark.slow
def test_demo_end_to_end_on_a_tiny_budget_and_rerun_reuses_everything(tmp_path, capsys):
    argv = [
        "demo",
        "--steps",
        "2",
        "--tokens",
        "254",
        "--ckpt-root",
        str(tmp_path / "ckpts"),
        "--output-path",
        str(tmp_path / "results"),
    ]
    assert main(argv) == 0
    out = tmp_path / "results"
    assert {"emergence.png", "per_layer.png"} <= {p.name for p in out.glob("*.png")}  # + the card's figures
    table = (out / "table.md").read_text()
    assert "Made by `qbench demo --steps 2" in table and "| vanilla" in table and "| paper" in table
    paper = ("absmax-fine", "absmax-moderate", "absmax-coarse", "zeropoint-int4")
    grid = [
        out / m / f"{s}__{mode}.json"
        for m in ("vanilla", "paper")
        for s in paper
        for mode in ("fake", "real")
    ]
    assert all(
        p.exists() for p in grid
    )  # models x paper schemes x fake/real (the card adds its own cells beside)
    sweep = json.loads((out / "sweep" / "sweep.json").read_text())  # the bit-width sweep, below 8 bits
    curves = {(p["model"], p["family"], p["axis"]) for p in sweep["breaking_points"]}
    assert len(curves) == 2 * 6  # models x (absmax-coarse w, a, o, all; fp kv, kv-keep1)
    assert len(sweep["cells"]) == 2 * (4 * 7 + 2 * 5)  # bits 8-2; the KV cache offers 8, 6, 4, 3, 2
    assert "## Below 8 bits" in table and re.search(r"\| paper +\| fp +\| kv-keep1 +\|", table)
    assert (out / "sweep" / "sweep.png").exists()
    # the demo ends with the card of its two models, built on the grid's own records
    card = json.loads((out / "card.json").read_text())
    assert [m["name"] for m in card["models"]] == ["vanilla", "paper"]
    assert (out / "card.html").exists() and "[card.html](card.html)" in table
    fp = json.loads(next((out / "paper").glob("fp*.json")).read_text())
    assert card["models"][1]["protocol"]["tokens_scored"] == fp["protocol"]["tokens_scored"]
    capsys.readouterr()
    assert main(argv) == 0
    out_text = capsys.readouterr().out
    assert out_text.count("(reused)") == 2 + 16  # the float baselines, then every cell
    assert "0 cells evaluated, 70 reused" in out_text  # the sweep: 2 x (25 absmax-coarse + 10 KV) cells
    assert out_text.count("0 cells evaluated") == 2  # ... and the card


@pytest.mark.slow
def test_demo_long_trains_the_llama_style_models_to_the_end_of_their_schedule(
    tmp_path, capsys, one_paper_scheme
):
    import json

    argv = [
        "demo",
        "--long",
        "--steps",
        "2",
        "--tokens",
        "254",
        "--ckpt-root",
        str(tmp_path / "ckpts"),
        "--no-card",
        "--no-sweep",  # the demo's sweep and its reuse are the first test's
    ]
    assert main([*argv, "--output-path", str(tmp_path / "results")]) == 0
    for recipe, norm in (("vanilla", "rmsnorm"), ("paper", "rmsnorm_single")):
        state = json.loads((tmp_path / "ckpts" / recipe / "trainer_state.json").read_text())
        assert (state["step"], state["total_steps"]) == (2, 2)  # --steps sets the schedule too: ends annealed
        model = json.loads((tmp_path / "ckpts" / recipe / "config.json").read_text())["model"]
        assert (model["family"], model["mlp"], model["pos"], model["norm"]) == (
            "llama",
            "swiglu",
            "rope",
            norm,
        )
        assert not model["bias"] and not model["tie_embeddings"] and model["d_ff"] == 688
    table = (tmp_path / "results" / "table.md").read_text()
    assert "(tiny, Llama style, 2 steps, lr 0.004)" in table
    capsys.readouterr()
    short = [*argv[:3], "1", *argv[4:], "--output-path", str(tmp_path / "r1")]
    assert (
        main(short) == 2
    )  # the folder's runs are at step 2 of a 2-step schedule: not resumed as 1-step runs
    assert "with a different configuration (steps: 2 -> 1)" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_seeds_train_both_recipes_per_seed_and_summarise_them(tmp_path, capsys, one_paper_scheme):
    argv = ["demo", "--steps", "2", "--tokens", "254", "--seeds", "2", "--no-sweep", "--no-card"]
    argv += ["--ckpt-root", str(tmp_path / "ckpts"), "--output-path", str(tmp_path / "results")]
    assert main(argv) == 0
    assert sorted(p.parent.name for p in (tmp_path / "ckpts").glob("*/config.json")) == [
        "paper",
        "paper-seed1",
        "vanilla",
        "vanilla-seed1",
    ]
    state = json.loads((tmp_path / "ckpts" / "paper-seed1" / "trainer_state.json").read_text())
    assert state["step"] == 2
    table = (tmp_path / "results" / "table.md").read_text()
    assert "seeds 0–1" in table and "## Across seeds" in table and "| paper-seed1" in table
    summary = json.loads((tmp_path / "results" / "seeds.json").read_text())
    assert summary["seeds"] == [0, 1] and set(summary["recipes"]) == {"vanilla", "paper"}
    values = summary["recipes"]["paper"]["fp_perplexity"]["values"]
    seed1 = json.loads(next((tmp_path / "results" / "paper-seed1").glob("fp*.json")).read_text())
    assert (
        values[1] == seed1["metrics"]["perplexity"] and values[0] != values[1]
    )  # another seed, another model
    capsys.readouterr()
    assert main([*argv[:-4], "--seeds", "0"]) == 2
    assert "--seeds" in capsys.readouterr().err
