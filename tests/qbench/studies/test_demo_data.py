"""``qbench demo`` and ``qbench recipes`` with ``--data``, ``--sample`` and ``--sample-seed``: the corpus reaches
the trainer and every protocol the studies build, ``--data embedded-whole --sample first`` is what the committed
results/demo was made with, and bad input is a one-line error before anything trains. Config -> argv / Protocol
plumbing and parsing only: nothing is trained or evaluated here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.errors import UserError
from qbench.cli import main
from qbench.studies import demo
from qbench.studies import recipes as study

ROOT = Path(__file__).resolve().parents[3]
# what the committed demo's vanilla absmax-coarse real-mode record said when it was made, before pieces and sampling (the demo's
# regeneration replaced that record; this file keeps its training provenance and protocol)
COMMITTED = Path(__file__).parent / "data" / "demo_vanilla_before_pieces.json"
WHOLE_FIRST = {"data": "embedded-whole", "sample": "first"}


def trainer_config(run):
    """The TrainConfig the trainer builds from a study's run: its own parser on the run's command line."""
    from trainers.__main__ import build_parser, config_from_args

    argv = run.command()
    argv = argv[argv.index("trainers") + 1 :]  # after ``python -m trainers``
    return config_from_args(vars(build_parser().parse_args(argv)))


def protocols(cfg, monkeypatch) -> dict:
    """Every protocol a study config evaluates with: grid, sweep, card (demo) or post-training algorithms
    (recipes), captured instead of run."""
    from qbench.eval import harness
    from qbench.studies import algorithms

    seen = {}
    if isinstance(cfg, demo.DemoConfig):
        monkeypatch.setattr(
            demo, "run_grid", lambda spec, on_record=None: seen.update(grid=spec.protocol) or []
        )
        demo.evaluate(cfg)
        seen["sweep"] = demo.sweep_config(cfg).protocol
        seen["card"] = demo.card_config(cfg).protocol()
    else:
        monkeypatch.setattr(
            harness, "run_grid", lambda spec, on_record=None: seen.update(grid=spec.protocol) or []
        )
        study.evaluate(cfg)
        seen["sweep"] = study.sweep_config(cfg).protocol
        monkeypatch.setattr(
            algorithms,
            "run_algorithms",
            lambda acfg, spec_for, on_record=None: seen.update(algorithms=spec_for(["rtn"]).protocol) or {},
        )
        study.run_panel_algorithms(cfg, "qbench recipes")
    return seen


@pytest.mark.parametrize("make", [demo.DemoConfig, study.RecipesConfig], ids=["demo", "recipes"])
def test_the_corpus_and_sample_reach_the_trainer_and_every_protocol(make, tmp_path, monkeypatch):
    cfg = make(ckpt_root=tmp_path / "ckpts", output_path=tmp_path / "out", sample_seed=3, **WHOLE_FIRST)
    runs = demo.demo_runs(cfg) if isinstance(cfg, demo.DemoConfig) else study.panel_runs(cfg)
    assert runs
    for run in runs:
        argv = run.command()
        assert argv[argv.index("--data") + 1] == "embedded-whole"
        assert trainer_config(run).data == "embedded-whole"
    seen = protocols(cfg, monkeypatch)
    assert set(seen) == (
        {"grid", "sweep", "card"} if make is demo.DemoConfig else {"grid", "sweep", "algorithms"}
    )
    for where, protocol in seen.items():
        assert (protocol.corpus, protocol.split, protocol.sample) == (
            "embedded-whole",
            "validation",
            "first",
        ), where
        assert (protocol.tokens, protocol.sample_seed) == (16384, 3), where
    # the output says how it was made; the seed of a documents sample only where it draws something
    assert cfg.description.endswith(", data embedded-whole, sample first")
    assert make(sample_seed=3).description.endswith(", sample seed 3")


@pytest.mark.parametrize("make", [demo.DemoConfig, study.RecipesConfig], ids=["demo", "recipes"])
def test_the_defaults_train_on_embedded_and_score_a_documents_sample(make, tmp_path, monkeypatch):
    cfg = make(ckpt_root=tmp_path / "ckpts", output_path=tmp_path / "out")
    runs = demo.demo_runs(cfg) if isinstance(cfg, demo.DemoConfig) else study.panel_runs(cfg)
    assert all(trainer_config(run).data == "embedded" for run in runs)
    for where, protocol in protocols(cfg, monkeypatch).items():
        assert (protocol.corpus, protocol.sample, protocol.sample_seed) == ("embedded", "documents", 0), where
    assert "data" not in cfg.description and "sample" not in cfg.description


def test_embedded_whole_first_is_what_the_committed_demo_was_made_with(tmp_path):
    """The committed records were made before pieces and sampling: their training configuration is the demo's with
    ``--data embedded-whole`` in place of the corpus then named ``embedded``, their training text has
    ``embedded-whole``'s fingerprint, and their protocol is ``--sample first``'s."""
    from trainers.data import get_corpus

    record = json.loads(COMMITTED.read_text())
    training = record["model"]["provenance"]["training"]
    cfg = demo.DemoConfig(ckpt_root=tmp_path, **WHOLE_FIRST)
    (vanilla,) = [r for r in demo.demo_runs(cfg) if r.name == "vanilla"]
    ours = trainer_config(vanilla).to_dict()
    assert ours.pop("data") == "embedded-whole" and training["config"].pop("data") == "embedded"
    assert json.loads(json.dumps(ours)) == training["config"]  # tuples as JSON lists
    assert get_corpus("embedded-whole").fingerprint() == training["data"]["train"]["corpus_fingerprint"]
    protocol = demo.eval_protocol(cfg).to_dict()
    assert (
        "sample" not in record["protocol"] and protocol["sample"] == "first"
    )  # no sample: the first windows
    for key in ("split", "tokens", "bos", "batch_size", "outlier_windows"):
        assert protocol[key] == record["protocol"][key], key


def test_recipes_refuses_the_corpus_as_a_trainer_argument():
    with pytest.raises(UserError, match="give qbench recipes --data c4 instead"):
        study.check_train_args(study.RecipesConfig(), ["--data", "c4"])


# ------------------------------------------------------------------------------------------------ command line


@pytest.mark.parametrize("command", ["demo", "recipes"])
def test_help_lists_the_options_with_their_defaults(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--data CORPUS", "embedded-whole", "(default: embedded)", "--sample {documents,first}"):
        assert text in out, text
    assert "--sample-seed SAMPLE_SEED" in out and "(default: 0)" in out and "(default: documents)" in out


@pytest.fixture
def captured(monkeypatch, tmp_path):
    """The config ``qbench demo`` / ``qbench recipes`` would train, caught where training would start."""
    monkeypatch.chdir(tmp_path)
    seen = []

    def stop(cfg, *args, **kwargs):
        seen.append(cfg)
        raise UserError("stopped before training")

    monkeypatch.setattr(demo, "train_both", stop)
    monkeypatch.setattr(study, "run_panel", stop)
    return seen


@pytest.mark.parametrize("command", ["demo", "recipes"])
def test_the_options_reach_the_config_and_its_description(command, captured, capsys):
    argv = [command, "--data", "embedded-whole", "--sample", "first", "--sample-seed", "2"]
    assert main(argv) == 2 and "stopped before training" in capsys.readouterr().err
    (cfg,) = captured
    assert (cfg.data, cfg.sample, cfg.sample_seed) == ("embedded-whole", "first", 2)
    assert "data embedded-whole, sample first" in cfg.description
    captured.clear()
    assert main([command]) == 2
    assert (captured[0].data, captured[0].sample, captured[0].sample_seed) == ("embedded", None, 0)


@pytest.mark.parametrize("command", ["demo", "recipes"])
@pytest.mark.parametrize(
    "options,message",
    [
        (["--data", "embeded"], "unknown corpus 'embeded' (did you mean 'embedded'?)"),
        (["--data", "embedded-hole"], "did you mean 'embedded-whole'"),
        (["--sample", "firts"], "argument --sample: invalid choice: 'firts'"),
        (["--sample-seed", "-1"], "--sample-seed must be ≥ 0"),
    ],
)
def test_bad_input_is_one_line_before_anything_trains(command, options, message, captured, capsys):
    assert main([command, *options]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # one message (rich may wrap a long line once)
    assert captured == []  # nothing reached training
