import json

import torch

from qbench.cli import main
from qbench.studies.emergence import read_curves


def _run(folder, kurtosis):
    folder.mkdir()
    rows = [
        {
            "step": s,
            "tokens": 2048 * s,
            "loss": 5.0,
            **({"val_loss": 5.0} if s == 20 else {}),
            "probe": {
                "kurtosis_first": k,
                "kurtosis_other": k,
                "max_abs": 10 * k,
                "first_token_top1_share": 0.1,
            },
        }
        for s, k in zip((0, 10, 20), kurtosis, strict=True)
    ]
    rows.insert(1, {"step": 5, "tokens": 10240, "loss": 6.0})  # a step without a probe is skipped
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_emergence_reads_probes_and_writes_json_png_and_table(tmp_path, capsys):
    a, b = _run(tmp_path / "vanilla", (3.0, 12.0, 25.0)), _run(tmp_path / "paper", (3.0, 3.1, 2.9))
    curves = read_curves([a, b])
    assert [r["step"] for r in curves["vanilla"]] == [0, 10, 20] and curves["paper"][-1][
        "kurtosis_other"
    ] == 2.9
    assert main(["emergence", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "emergence.md").read_text()
    assert "Made by `qbench emergence" in table and "| vanilla" in table and "148.4" in table  # exp(5.0)
    assert (tmp_path / "out" / "emergence.png").stat().st_size > 10_000
    assert main(["emergence", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    (tmp_path / "other").mkdir()
    twin = _run(tmp_path / "other" / "vanilla", (3.0, 3.0, 3.0))
    assert main(["emergence", str(a), str(twin), "--out", str(tmp_path / "o")]) == 2
    assert "both named 'vanilla'" in capsys.readouterr().err


def _snapshot(path, tokenizer, step, outlier=None):
    """A micro checkpoint recorded as step ``step`` of a run; ``outlier`` plants one huge c_fc weight."""
    from models.checkpoint import save_checkpoint
    from tests.qbench.conftest import micro_config, trained_like

    model = trained_like(micro_config())
    with torch.no_grad():
        # Peaky logits and an MLP that dominates the residual stream: a damaged c_fc shows in perplexity.
        model.transformer.wte.weight.mul_(30)
        model.transformer.h[0].mlp.c_proj.weight.mul_(300)
        if outlier is not None:
            model.transformer.h[0].mlp.c_fc.weight[0, 0] = outlier
    provenance = {"training": {"summary": {"step": step, "tokens": 1000 * step}}}
    save_checkpoint(path, model, tokenizer, provenance=provenance)


def test_quantisation_curve_scores_every_snapshot_in_step_order_and_reuses_cells(tmp_path, tokenizer):
    from qbench.eval.harness import GridSpec
    from qbench.eval.metrics import Protocol
    from qbench.studies.emergence import first_damage, quantisation_curve, quantisation_keys

    root = tmp_path / "snapshots"
    _snapshot(root / "vanilla" / "late", tokenizer, 20, outlier=500.0)
    _snapshot(root / "vanilla" / "early", tokenizer, 10)
    _snapshot(root / "paper" / "a", tokenizer, 10)
    spec = GridSpec(
        models=[],
        schemes=["absmax-moderate"],
        protocol=Protocol(tokens=256),
        output_path=tmp_path / "q",
        attention=False,
    )
    seen = []
    curves = quantisation_curve(["vanilla", "paper"], root, spec, lambda r, reused: seen.append(reused))
    vanilla = curves["vanilla"]
    assert [(r["snapshot"], r["step"], r["tokens"]) for r in vanilla] == [
        ("early", 10, 10_000),
        ("late", 20, 20_000),
    ]
    record = json.loads((tmp_path / "q" / "vanilla" / "late" / "absmax-moderate__fake.json").read_text())
    assert vanilla[1]["absmax-moderate"] == record["metrics"]["ppl_change_pct"]
    assert vanilla[1]["fp_perplexity"] == record["metrics"]["fp_perplexity"]
    # The planted weight sets the per-tensor scale: every other c_fc weight rounds to zero.
    assert vanilla[1]["absmax-moderate"] > 1.0 > abs(vanilla[0]["absmax-moderate"])
    assert quantisation_keys(curves) == ["absmax-moderate"]
    assert first_damage(vanilla, ["absmax-moderate"]).endswith("at 0.02 M tokens")
    assert first_damage(curves["paper"], ["absmax-moderate"]) == "none ≥ 1 %"
    assert seen.count(True) == 0
    broken = [{"snapshot": "s", "step": 1, "tokens": 10, "int4": None, "nonfinite": ["int4"]}]
    assert first_damage(broken, ["int4"]) == "int4 +inf % at 0.00 M tokens"  # NaN perplexity is damage
    seen.clear()
    assert (
        quantisation_curve(["vanilla", "paper"], root, spec, lambda r, reused: seen.append(reused)) == curves
    )
    assert seen == [True] * 6  # fp records and cells are all read back


def test_emergence_cli_adds_the_quantisation_curve(tmp_path, tokenizer, capsys):
    run = _run(tmp_path / "vanilla", (3.0, 12.0, 25.0))
    _snapshot(tmp_path / "snaps" / "vanilla" / "step-10", tokenizer, 10)
    args = ["emergence", str(run), "--out", str(tmp_path / "out"), "--snapshots", str(tmp_path / "snaps")]
    assert main([*args, "--scheme", "absmax-coarse", "--tokens", "256", "--no-attention"]) == 0
    table = (tmp_path / "out" / "emergence.md").read_text()
    assert "## Quantisation along training" in table and "absmax-coarse" in table and "first damage" in table
    assert (tmp_path / "out" / "quantisation-curve.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "quantisation-curve.json").read_text())["vanilla"][0]["step"] == 10
    assert main([*args[:-1], str(tmp_path / "nothing")]) == 2
    assert "no snapshots of run 'vanilla'" in capsys.readouterr().err
