import json

from qbench.cli import main
from qbench.emergence import read_curves


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
