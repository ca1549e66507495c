"""A record's identity: two different cells never share a file, the same cell always finds its file again, and
a cell that cannot run is refused before anything is evaluated."""

from __future__ import annotations

import json

import pytest

from models.checkpoint import save_checkpoint
from models.errors import UserError
from qbench.cli import main
from qbench.eval.harness import GridSpec, cell_identity, run_grid
from qbench.eval.metrics import Protocol
from qbench.quant.kv import KVConfig
from tests.qbench.conftest import micro_config, trained_like

SMALL = Protocol(tokens=32 * 4, batch_size=2, outlier_windows=2)


def spec(models, out, **kw):
    return GridSpec(
        models=[str(m) for m in models],
        schemes=kw.pop("schemes", ["absmax-coarse"]),
        protocol=kw.pop("protocol", SMALL),
        output_path=out,
        attention=False,
        **kw,
    )


def snapshot(out):
    return {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.rglob("*.json"))}


@pytest.mark.parametrize(
    "change",
    [
        {"exclude": ("transformer.h.0.*",)},
        {"protocol": Protocol(tokens=32 * 2, batch_size=2, outlier_windows=2)},
        {"protocol": Protocol(tokens=32 * 4, window=16, batch_size=2, outlier_windows=2)},
        {"seed": 1},
    ],
    ids=["exclude", "tokens", "window", "seed"],
)
def test_a_different_cell_never_replaces_a_record(ckpt_dir, tmp_path, change):
    out = tmp_path / "results"
    first = run_grid(spec([ckpt_dir], out))
    before = snapshot(out)
    second = run_grid(spec([ckpt_dir], out, **change))
    after = snapshot(out)
    assert all(after[name] == text for name, text in before.items())  # nothing written is lost or changed
    assert len(after) > len(before)
    assert second[-1]["cell_id"] != first[-1]["cell_id"]
    seen = []
    again = run_grid(spec([ckpt_dir], out, **change), on_record=lambda r, reused: seen.append(reused))
    assert seen == [True, True] and again[-1] == second[-1]  # the same cell finds its own file again
    assert snapshot(out) == after


def test_two_models_with_one_folder_name_keep_their_own_records(tokenizer, tmp_path):
    a, b = tmp_path / "a" / "ck", tmp_path / "b" / "ck"
    save_checkpoint(a, trained_like(micro_config(), seed=0), tokenizer, provenance={"training": None})
    save_checkpoint(b, trained_like(micro_config(), seed=1), tokenizer, provenance={"training": None})
    out = tmp_path / "results"
    ra = run_grid(spec([a], out))
    rb = run_grid(spec([b], out))
    assert ra[-1]["metrics"]["perplexity"] != rb[-1]["metrics"]["perplexity"]
    stored = [json.loads(p.read_text()) for p in out.rglob("*.json")]
    assert sorted(r["model"]["path"] for r in stored) == sorted([str(a)] * 2 + [str(b)] * 2)


def test_the_identity_is_computed_from_the_record_itself(ckpt_dir, tmp_path):
    record = run_grid(spec([ckpt_dir], tmp_path / "r"))[-1]
    assert cell_identity(record) == record["cell_id"]
    record["kv"] = KVConfig(4).to_dict()
    assert cell_identity(record) != record["cell_id"]


def test_an_exclude_pattern_that_matches_nothing_is_refused_before_evaluating(ckpt_dir, tmp_path):
    out = tmp_path / "results"
    run_grid(spec([ckpt_dir], out))
    before = snapshot(out)
    with pytest.raises(
        UserError, match=r"exclude pattern 'nosuchlayer\*' matches no layer the scheme quantises"
    ):
        run_grid(spec([ckpt_dir], out, exclude=("nosuchlayer*",)))
    assert snapshot(out) == before


def test_kv_keep_first_must_leave_part_of_the_window(ckpt_dir, tmp_path):
    with pytest.raises(UserError, match=r"--kv-keep-first 1000 .* below 32"):
        run_grid(
            spec([ckpt_dir], tmp_path / "r", schemes=["fp"], kv=KVConfig(4, "per-token", keep_first=1000))
        )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("scheme", ["fp8-e4m3", "mxfp4", "absmax-fine-perchannel", "absmax-coarse:a=4"])
def test_run_real_without_a_kernel_is_a_one_line_error(ckpt_dir, tmp_path, capsys, scheme):
    out = tmp_path / "results"
    code = main(
        ["run", "--ckpt", str(ckpt_dir), "--scheme", scheme, "--mode", "real", "--output-path", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "no real kernel" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()  # refused before anything was loaded or written


def test_grid_records_unsupported_cells_lists_them_and_fails_unless_allowed(ckpt_dir, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["grid", "--ckpt", str(ckpt_dir), "--scheme", "absmax-fine", "--scheme", "fp8-e4m3"]
    argv += ["--mode", "fake", "--mode", "real", "--tokens", "128", "--batch-size", "2", "--no-attention"]
    argv += ["--output-path", str(out)]
    assert main(argv) == 1
    text = capsys.readouterr().out
    assert "1 cell(s) cannot run here" in text and "fp8-e4m3/real" in text
    record = json.loads(next(out.rglob("fp8-e4m3__real.json")).read_text())
    assert record["status"] == "unsupported" and "no real kernel" in record["error"]
    assert main([*argv, "--allow-unsupported"]) == 0


def test_a_dtype_change_is_another_cell(ckpt_dir, tmp_path):
    out = tmp_path / "results"
    run_grid(spec([ckpt_dir], out))
    before = snapshot(out)
    run_grid(spec([ckpt_dir], out, dtype="bfloat16"))
    assert all(snapshot(out)[name] == text for name, text in before.items())


def test_a_cell_beside_a_torn_plain_file_is_found_again(ckpt_dir, tmp_path):
    out = tmp_path / "results"
    run_grid(spec([ckpt_dir], out))
    run_grid(spec([ckpt_dir], out, seed=1))  # goes beside the seed-0 file
    plain = next(out.rglob("absmax-coarse__fake.json"))
    plain.write_text("[1, 2]")  # JSON that is not a record: kept as it is, never read as one
    seen = []
    run_grid(spec([ckpt_dir], out, seed=1), on_record=lambda r, reused: seen.append(reused))
    assert seen == [True, True] and plain.read_text() == "[1, 2]"


def test_an_exclude_that_keeps_every_layer_float_or_only_names_the_head_is_refused(ckpt_dir, tmp_path):
    with pytest.raises(UserError, match="nothing would be quantised"):
        run_grid(spec([ckpt_dir], tmp_path / "a", exclude=("*",)))
    with pytest.raises(UserError, match="the LM head stays float under this scheme anyway"):
        run_grid(spec([ckpt_dir], tmp_path / "b", exclude=("lm_head",)))
