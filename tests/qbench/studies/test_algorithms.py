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


# ----------------------------------------------------------------------------- llama.cpp's file types


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory, tokenizer):
    from models.checkpoint import save_checkpoint
    from tests.qbench.conftest import micro_config, trained_like

    path = tmp_path_factory.mktemp("alg-llama") / "micro-llama"
    save_checkpoint(path, trained_like(micro_config("llama")), tokenizer, provenance={"training": None})
    return path


def test_llama_cpp_types_are_rows_beside_the_algorithms(llama_ckpt, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    out = tmp_path / "alg"
    argv = ["algorithms", "--ckpt", llama_ckpt, "--formats", "int4-g128", "--algorithms", "rtn,awq"]
    argv += ["--llama-cpp", "q8_0,Q4_0,Q2_K", "--output-path", out, *FAST]
    assert main([str(a) for a in argv]) in (0, None), capsys.readouterr()
    result = json.loads((out / "algorithms.json").read_text())
    section = result["llama_cpp"]
    assert section["types"] == ["Q8_0", "Q4_0", "Q2_K"] and section["skipped"] is None
    rows = {r["type"]: r for r in section["rows"]}
    assert list(rows) == ["Q8_0", "Q4_0", "Q2_K"]
    for r in rows.values():
        assert r["cell"]["status"] == "ok" and r["bytes"] > 0 and r["bits_per_weight"] > 0
        assert r["against"].endswith("at int4 g128") and r["vs_against"] in ("better", "worse", "undecided")
        assert r["tokens_per_second"] > 0 and r["tensor_types"]
    # rows of 32 are no multiple of the k-quants' 256: llama.cpp falls back to a legacy type, and says which
    assert rows["Q8_0"]["bytes"] > rows["Q4_0"]["bytes"] >= rows["Q2_K"]["bytes"]
    assert "Q2_K" not in rows["Q2_K"]["tensor_types"]
    table = (out / "table.md").read_text()
    assert table == render(result) and "## llama.cpp's file types on the same tokens" in table
    assert "smallest llama.cpp type within 1 % of float:" in table


def test_llama_cpp_rows_are_refused_or_left_out_as_asked(llama_ckpt, tmp_path, monkeypatch):
    from qbench.cli.args import llama_cpp_types
    from qbench.studies.algorithms import LLAMA_CPP_DEFAULT

    def _llama_cpp_types(text):
        return llama_cpp_types(text, LLAMA_CPP_DEFAULT)

    assert _llama_cpp_types("none") == ((), None)
    with pytest.raises(UserError, match="did you mean 'Q4_K_M'"):
        _llama_cpp_types("q4_km")
    with pytest.raises(UserError, match="did you mean 'Q4_K_M'"):
        AlgorithmsConfig(models=("m",), llama_cpp=("Q4_KM",)).check()
    import qbench.quant.llamacpp as llamacpp

    def missing():
        raise UserError("llama.cpp's formats need llama-cpp-python: pip install 'qbench[llama-cpp]'")

    monkeypatch.setattr(llamacpp, "require_llama_cpp", missing)
    types, skipped = _llama_cpp_types("default")
    assert types == () and "not installed" in skipped  # the default rows are left out, and the table says so
    with pytest.raises(UserError, match="need llama-cpp-python"):
        _llama_cpp_types("Q4_0")  # asked for by name: refused
    out = tmp_path / "alg"
    argv = ["algorithms", "--ckpt", llama_ckpt, "--formats", "int4", "--algorithms", "rtn"]
    assert main([str(a) for a in [*argv, "--output-path", out, *FAST]]) in (0, None)
    assert (
        "llama.cpp's file types: not scored (llama-cpp-python is not installed"
        in (out / "table.md").read_text()
    )
