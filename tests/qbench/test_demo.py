import pytest

from qbench.cli import main


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
    assert {p.name for p in out.glob("*.png")} == {"emergence.png", "per_layer.png"}
    table = (out / "table.md").read_text()
    assert "Made by `qbench demo --steps 2" in table and "| vanilla" in table and "| paper" in table
    assert len(list(out.rglob("*__*.json"))) == 2 * 4 * 2  # models x paper schemes x fake/real
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().out.count("(reused)") == 16
