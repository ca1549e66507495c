"""``qbench algorithms``: the (format, algorithm) grid, its paired comparisons and its table, end to end."""

import dataclasses
import json

import pytest

from models.errors import UserError
from qbench.cli import main
from qbench.quant.schemes import get_scheme
from qbench.studies.algorithms import ALGORITHMS, FORMATS, AlgorithmsConfig, render, scheme_for

FAST = ["--tokens", "256", "--batch-size", "4"]


def test_each_rotated_scheme_is_its_format_plus_the_rotation():
    ignore = {"name", "description", "method", "params"}
    for i, (_, rtn, rotated) in enumerate(FORMATS):
        a, b = get_scheme(rtn), get_scheme(rotated)
        assert b.method == "hadamard" and a.method == "rtn"
        fields = {f.name for f in dataclasses.fields(a)} - ignore
        assert {k: getattr(a, k) for k in fields} == {k: getattr(b, k) for k in fields}, rtn
        names = {scheme_for(i, algo) for algo in ALGORITHMS}
        assert len(names) == len(ALGORITHMS) and all(get_scheme(n).name == n for n in names)
        assert get_scheme(scheme_for(i, "awq")).algo == "awq"
        assert get_scheme(scheme_for(i, "hadamard+gptq")).method == "hadamard"


def test_bad_choices_are_one_line_errors():
    with pytest.raises(UserError, match="did you mean 'int4'"):
        AlgorithmsConfig(models=("m",), formats=("int5",)).check()
    with pytest.raises(UserError, match="must include rtn"):
        AlgorithmsConfig(models=("m",), algorithms=("gptq",)).check()


def test_the_command_writes_the_table_from_its_json(ckpt_dir, tmp_path, capsys):
    out = tmp_path / "alg"
    argv = ["algorithms", "--ckpt", ckpt_dir, "--formats", "int4,w4a8", "--algorithms", "rtn,gptq,awq"]
    code = main([str(a) for a in [*argv, "--output-path", out, *FAST]])
    assert code in (0, None), capsys.readouterr()
    result = json.loads((out / "algorithms.json").read_text())
    assert (out / "table.md").read_text() == render(result)  # the table is generated from the JSON
    assert result["command"].startswith("qbench algorithms")
    assert [r["format"] for r in result["rows"]] == ["int4 per channel", "W4A8 per channel/token"]
    for row in result["rows"]:
        assert set(row["cells"]) == {"rtn", "gptq", "awq"}
        assert row["best"] in row["cells"]
        for algo, cell in row["cells"].items():
            assert cell["status"] == "ok" and cell["ppl_change_ci95"] is not None
            assert cell["quantize_seconds"] is not None and cell["kld_mean"] is not None
            assert (cell["vs_rtn_ci95"] is None) == (algo == "rtn")
            assert cell["vs_rtn"] in (None, "better", "worse", "undecided")
    assert "AWQ" in (out / "table.md").read_text() and result["machine"]
