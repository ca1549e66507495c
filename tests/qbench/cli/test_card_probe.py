"""``qbench card`` on hostile or unusual inputs: an output folder holding another card, a model beside itself,
models with different tokenizers, a transformers export of a softpick model, an FP8 KV scheme on a budget without
8-bit KV rows, and the KV caption per scheme. Micro models, one format and one KV width: seconds each."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from models import build, family_config
from models.checkpoint import save_checkpoint
from qbench.cli import main
from tests.qbench.conftest import micro_config, planted_model

TOKENS = "64"  # two windows of the micro models' 32 tokens


@pytest.fixture(autouse=True)
def _one_format_one_kv_width(monkeypatch):
    from qbench.studies import card

    rows = (card.KVRow("kivi", 2), card.KVRow("kivi", 2, 1))
    small = replace(card.BUDGETS["quick"], formats=("absmax-fine",), kv_rows=rows)
    monkeypatch.setitem(card.BUDGETS, "quick", small)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tokenizer):
    """Two micro qbench checkpoints with the same tokenizer: ``planted`` and ``other``."""
    root = tmp_path_factory.mktemp("card-probe")
    save_checkpoint(root / "planted", planted_model(), tokenizer, provenance={"training": None})
    other = build(micro_config("llama"), seed=1).eval()
    save_checkpoint(root / "other", other, tokenizer, provenance={"training": None})
    return root


def card(*models: Path | str, out: Path, tokens: str = TOKENS, extra: tuple[str, ...] = ()) -> int:
    argv = ["card", *(a for m in models for a in ("--ckpt", str(m)))]
    return main([*argv, "--tokens", tokens, "--tolerance", "50", "--output-path", str(out), *extra])


def names(out: Path) -> list[str]:
    return [m["name"] for m in json.loads((out / "card.json").read_text())["models"]]


@pytest.fixture(scope="module")
def two_model_card(models_dir, tmp_path_factory):
    """A card of planted and other (with the autouse fixture's budget); tests copy it: its cells are reused."""
    from qbench.studies import card as study

    out = tmp_path_factory.mktemp("two-model-card") / "card"
    rows = (study.KVRow("kivi", 2), study.KVRow("kivi", 2, 1))
    small = replace(study.BUDGETS["quick"], formats=("absmax-fine",), kv_rows=rows)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "qbench-cache"))
        mp.setitem(study.BUDGETS, "quick", small)
        assert card(models_dir / "planted", models_dir / "other", out=out) == 0
    return out


def copy_of(card_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(card_dir, tmp_path / "card")
    return tmp_path / "card"


def test_a_card_of_other_models_or_settings_is_never_replaced_silently(
    models_dir, two_model_card, tmp_path, capsys
):
    planted, other = models_dir / "planted", models_dir / "other"
    out = copy_of(two_model_card, tmp_path)
    before = (out / "card.json").read_bytes()

    assert card(planted, out=out) == 2  # another set of models
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"holds the card of planted ({planted}), other ({other}), not of planted ({planted})" in err
    assert "--overwrite" in err and "--output-path" in err
    assert (out / "card.json").read_bytes() == before  # the earlier card is still there

    assert card(planted, other, out=out, tokens="96") == 2  # the same models, other settings
    assert "tokens 64 (this one: 96)" in capsys.readouterr().err
    assert (out / "card.json").read_bytes() == before

    assert card(planted, other, out=out) == 0  # the same card: rewritten in place
    assert names(out) == ["planted", "other"]


def test_overwrite_replaces_the_card_and_removes_the_figures_it_no_longer_shows(
    models_dir, two_model_card, tmp_path
):
    out = copy_of(two_model_card, tmp_path)
    assert {"card-outliers-1.png", "card-attention-1.png"} <= {p.name for p in out.iterdir()}
    assert card(models_dir / "planted", out=out, extra=("--overwrite",)) == 0
    assert names(out) == ["planted"]
    figures = {p.name for p in out.glob("card-*.png")}
    # one KV width per curve: no breaking-point curve to draw
    assert figures == {"card-outliers-0.png", "card-attention-0.png"}
    page = (out / "card.md").read_text()
    assert all(f in page for f in figures)
    assert (out / "other" / "fp.json").exists()  # the replaced card's records stay


def test_a_file_named_card_json_that_is_no_card_is_kept(models_dir, tmp_path, capsys):
    out = tmp_path / "card"
    out.mkdir()
    (out / "card.json").write_text('{"mine": 1}')
    assert card(models_dir / "planted", out=out) == 2
    assert "is not a qbench card" in capsys.readouterr().err
    assert (out / "card.json").read_text() == '{"mine": 1}'


def test_a_model_beside_itself_is_refused(models_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(models_dir)
    link = tmp_path / "link"
    link.symlink_to(models_dir / "planted")
    for pair in (("planted", "./planted"), ("planted", str(link)), ("planted", "planted")):
        assert card(*pair, out=tmp_path / "card") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("same model" in err or "given twice" in err), err
        assert str((models_dir / "planted").resolve()) in err
    assert not (tmp_path / "card").exists()  # refused before anything ran


def test_models_with_different_tokenizers_are_refused_before_any_work(models_dir, tmp_path, capsys):
    from models.tokenizer import load_tokenizer

    config = family_config("llama", n_layer=2, n_head=4, d_model=32, d_ff=64, context=32, vocab_size=50304)
    gpt2 = tmp_path / "gpt2tok"
    save_checkpoint(gpt2, build(config).eval(), load_tokenizer("gpt2"), provenance={"training": None})
    out = tmp_path / "card"
    assert card(models_dir / "planted", gpt2, out=out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different tokenizers" in err, err
    assert "bpe8192, 8,192 tokens" in err and "gpt2, 50,257 tokens" in err
    assert not out.exists()  # refused before any model was evaluated


def test_an_exported_softpick_model_skips_the_kv_rows_it_cannot_measure(tmp_path, tokenizer, capsys):
    ckpt = tmp_path / "softpick"
    model = build(micro_config("llama", attn="softpick"), seed=0).eval()
    save_checkpoint(ckpt, model, tokenizer, provenance={"training": None})
    assert main(["export", str(ckpt), str(tmp_path / "softpick-hf")]) == 0
    out = tmp_path / "card"
    capsys.readouterr()
    assert card(tmp_path / "softpick-hf", out=out) == 0
    printed = capsys.readouterr().out
    assert "not measured" in printed and "kv2-tok" in printed and "skipped" in printed
    (m,) = json.loads((out / "card.json").read_text())["models"]
    rows = m["kv"]["rows"]
    assert [r["status"] for r in rows] == ["ok", "skipped"]  # per-token (window 32) without sinks runs
    assert m["kv"]["skipped"][0]["label"] == "kv2-tok-sinks1"
    assert m["formats"][0]["status"] == "ok"
    page = (out / "card.md").read_text()
    assert "Not measured (kv2-tok-sinks1)" in page and "softpick" in page


def test_an_fp8_kv_scheme_on_a_budget_without_8_bit_rows_names_the_budget(
    models_dir, tmp_path, monkeypatch, capsys
):
    from qbench.studies import card as study
    from qbench.studies.card import config as card_config

    rows = (study.KVRow("kivi", 4), study.KVRow("kivi", 2))
    monkeypatch.setitem(study.BUDGETS, "quick", replace(study.BUDGETS["quick"], kv_rows=rows))
    out = tmp_path / "card"
    assert card(models_dir / "planted", out=out, extra=("--kv-scheme", "fp8-e4m3")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "quick budget's KV rows are at 4/2 bits" in err and "--budget standard or full" in err
    assert "give bits 8" not in err and not out.exists()
    # a budget with 8-bit rows measures those only, and says so
    assert card_config.kv_widths(study.BUDGETS["standard"], "fp8-e4m3") == (8,)
    cfg = study.CardConfig(models=["m"], budget="standard", kv_scheme="fp8-e4m3")
    standard_rows = len(study.BUDGETS["standard"].kv_rows)
    assert (
        card_config.planned_cells(cfg)
        == card_config.planned_cells(replace(cfg, kv_scheme=None)) - standard_rows + 2
    )
    # the unpatched quick budget has an FP8 row: --kv-scheme fp8-e4m3 measures 8 bits there, plain and with a sink
    assert card_config.kv_widths(study.budget("standard"), "fp8-e4m3") == (8,)


def test_the_kv_caption_says_how_each_scheme_takes_its_statistics():
    from qbench.quant.kv import KVConfig
    from qbench.studies.card.build import kv_section as _kv_rows
    from qbench.studies.card.render.kv import kv_caption as _kv_caption

    def caption(scheme: str, widths: tuple[int, ...] = (4, 2)) -> str:
        records = [
            {
                "kv": KVConfig(bits, scheme, 0, keep).to_dict(),
                "status": "ok",
                "metrics": {"perplexity": 10.0, "ppl_change_pct": 0.5},
            }
            for bits in widths
            for keep in (0, 1)
        ]
        return _kv_caption(_kv_rows(records, 1.0, None))

    for causal in ("kivi", "per-token"):
        text = caption(causal)
        assert "causal, each cached position" in text and "tokens seen so far" in text, text
        assert "over the scored window" not in text and "not causal, the statistics" not in text
    text = caption("fp8-e4m3", (8,))
    assert (
        "causal, each cached" in text
        and "fixed scale per layer" in text
        and "over the scored window" not in text
    )
    text = caption("window")
    assert "not causal" in text and "scored window" in text and "tokens seen so far" not in text
