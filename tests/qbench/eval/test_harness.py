import json
from dataclasses import replace

import pytest
import torch

from qbench.eval.harness import GridSpec, ModelEvaluation, run_grid
from qbench.eval.metrics import Protocol

REQUIRED = {
    "model",
    "scheme",
    "mode",
    "backend",
    "protocol",
    "metrics",
    "outliers",
    "env",
    "seed",
    "wall_seconds",
    "tokens_per_second",
    "model_bytes",
}
OUTLIER_KEYS = {
    "kurtosis_first",
    "kurtosis_other",
    "kurtosis_max",
    "max_abs_first",
    "max_abs_other",
    "max_abs",
    "first_token_top1_share",
    "first_token_mass",
}
SMALL = Protocol(tokens=32 * 4, batch_size=2, outlier_windows=2)


def spec(tmp_path, models, schemes=("absmax-coarse", "zeropoint-int4"), modes=("fake",)):
    return GridSpec(
        models=[str(m) for m in models],
        schemes=list(schemes),
        modes=list(modes),
        protocol=SMALL,
        output_path=tmp_path / "results",
    )


@pytest.mark.parametrize("fixture", ["ckpt_dir", "hf_gpt2_dir", "hf_llama_dir"])
def test_records_are_self_describing_for_every_kind_of_model(fixture, request, tmp_path):
    records = run_grid(spec(tmp_path, [request.getfixturevalue(fixture)], modes=("fake", "real")))
    assert [r["scheme"]["name"] for r in records] == [
        "fp",
        "absmax-coarse",
        "absmax-coarse",
        "zeropoint-int4",
        "zeropoint-int4",
    ]
    for r in records:
        assert REQUIRED <= r.keys() and OUTLIER_KEYS <= r["outliers"].keys()
        assert r["status"] == "ok", r["error"]
        assert r["metrics"]["fp_perplexity"] == records[0]["metrics"]["perplexity"]
        assert r["protocol"]["tokens_scored"] == 128 and r["protocol"]["window"] == 32
        assert r["env"]["software"]["torch"] and "git_commit" in r["env"]
    coarse = records[1]
    assert (
        coarse["scheme"]["out_bits"] == 8 and coarse["scheme"]["act_bits"] == 8
    )  # the full config is recorded
    assert coarse["metrics"]["ppl_ratio"] == pytest.approx(
        coarse["metrics"]["perplexity"] / coarse["metrics"]["fp_perplexity"]
    )
    assert records[2]["model_bytes"] < records[0]["model_bytes"]  # real int8 holds fewer bytes
    files = sorted(p.name for p in (tmp_path / "results").rglob("*.json"))
    assert files == [
        "absmax-coarse__fake.json",
        "absmax-coarse__real.json",
        "fp.json",
        "zeropoint-int4__fake.json",
        "zeropoint-int4__real.json",
    ]


def test_interrupted_grid_resumes_without_recomputing(ckpt_dir, tmp_path, monkeypatch):
    s = spec(tmp_path, [ckpt_dir], schemes=("absmax-fine", "absmax-coarse", "zeropoint-int4"))
    seen = []

    def interrupt_after_two(record, reused):
        seen.append(record["scheme"]["name"])
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_grid(s, on_record=interrupt_after_two)
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "results").rglob("*.json")}
    assert set(written) == {"fp.json", "absmax-fine__fake.json", "absmax-coarse__fake.json"}

    computed = []
    original = ModelEvaluation.quantised_record
    monkeypatch.setattr(
        ModelEvaluation,
        "quantised_record",
        lambda self, scheme, mode: computed.append(scheme) or original(self, scheme, mode),
    )
    reused = []
    run_grid(s, on_record=lambda r, was_reused: reused.append(was_reused))
    assert computed == ["zeropoint-int4"]
    assert reused == [True, True, True, False]  # the float baseline is reused too
    for name, mtime in written.items():  # nothing already finished was rewritten
        assert next((tmp_path / "results").rglob(name)).stat().st_mtime_ns == mtime


def test_changed_protocol_recomputes_instead_of_reusing(ckpt_dir, tmp_path):
    run_grid(spec(tmp_path, [ckpt_dir], schemes=("absmax-coarse",)))
    s = spec(tmp_path, [ckpt_dir], schemes=("absmax-coarse",))
    s.protocol = Protocol(tokens=32 * 2, batch_size=2, outlier_windows=2)
    reused = []
    records = run_grid(s, on_record=lambda r, was_reused: reused.append(was_reused))
    assert reused == [False, False] and records[1]["protocol"]["tokens_scored"] == 64


def test_a_model_that_breaks_under_a_scheme_is_recorded_and_the_grid_goes_on(ckpt_dir, tmp_path, monkeypatch):
    import qbench.quant as quant

    real_quantize = quant.quantize

    def poisoned(model, scheme, **kw):
        q = real_quantize(model, scheme, **kw)
        if scheme.name == "absmax-coarse":  # a NaN bias of the copy's own (its float tensors are shared)
            fc = q.transformer.h[0].mlp.c_fc
            fc.bias = torch.nn.Parameter(torch.full_like(fc.bias, float("nan")), requires_grad=False)
        return q

    monkeypatch.setattr(quant, "quantize", poisoned)
    records = run_grid(spec(tmp_path, [ckpt_dir]))
    coarse, int4 = records[1], records[2]
    assert coarse["status"] == "nonfinite" and coarse["metrics"]["perplexity"] is None
    assert int4["status"] == "ok"
    on_disk = json.loads(next((tmp_path / "results").rglob("absmax-coarse__fake.json")).read_text())
    assert on_disk["status"] == "nonfinite"


def test_budget_larger_than_the_text_is_clamped_and_recorded(ckpt_dir, tmp_path):
    # a text of a few hundred tokens, scored whole (the default, the embedded validation split's 122 k, took ~25 s)
    text = tmp_path / "short.txt"
    text.write_text(
        "\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    )
    s = spec(tmp_path, [ckpt_dir], schemes=())
    s.protocol = Protocol(corpus=str(text), tokens=10**9, batch_size=64, outlier_windows=1)
    (fp,) = run_grid(s)
    assert fp["protocol"]["tokens_clamped"] is True
    assert fp["protocol"]["tokens_scored"] <= fp["protocol"]["tokens_available"]


def test_records_of_other_weights_are_not_reused(tokenizer, tmp_path):
    from models.checkpoint import save_checkpoint
    from tests.qbench.conftest import micro_config, trained_like

    ckpt = tmp_path / "ckpts" / "m"
    save_checkpoint(ckpt, trained_like(micro_config(), seed=0), tokenizer)
    s = spec(tmp_path, [ckpt], schemes=("absmax-coarse",))
    first = run_grid(s)
    save_checkpoint(ckpt, trained_like(micro_config(), seed=1), tokenizer)  # same name, new weights
    reused = []
    second = run_grid(s, on_record=lambda r, was_reused: reused.append(was_reused))
    assert reused == [False, False]
    assert second[0]["model"]["fingerprint"] != first[0]["model"]["fingerprint"]


def test_exclude_and_lm_head_switch_are_part_of_the_cell(ckpt_dir, tmp_path):
    s = spec(tmp_path, [ckpt_dir], schemes=("absmax-coarse",))
    run_grid(s)
    s.exclude = ("*.mlp.*",)
    reused = []
    records = run_grid(s, on_record=lambda r, was_reused: reused.append(was_reused))
    assert reused[1] is False and records[1]["scheme"]["exclude"] == ["*.mlp.*"]
    s.exclude, s.quantize_lm_head = (), True
    records = run_grid(s)
    assert records[1]["scheme"]["name"] == "absmax-coarse+head" and records[1]["scheme"]["quantize_lm_head"]
    assert next((tmp_path / "results").rglob("absmax-coarse+head__fake.json"))


def test_two_models_with_one_name_are_refused(ckpt_dir, tmp_path):
    import shutil

    from models import UserError

    other = tmp_path / "elsewhere" / ckpt_dir.name
    shutil.copytree(ckpt_dir, other)
    with pytest.raises(UserError, match="both named"):
        run_grid(spec(tmp_path, [ckpt_dir, other], schemes=()))


def test_compare_keeps_two_models_of_one_name_from_different_grids_apart(ckpt_dir, tmp_path):
    import shutil

    from qbench.eval.report import comparison

    other = tmp_path / "elsewhere" / ckpt_dir.name
    shutil.copytree(ckpt_dir, other)
    records = run_grid(spec(tmp_path / "a", [ckpt_dir], schemes=()))
    records += run_grid(spec(tmp_path / "b", [other], schemes=()))
    _, rows, _ = comparison(records)
    assert sorted(row[0] for row in rows) == sorted([str(ckpt_dir), str(other)])
    _, rows, text = comparison(records[:1])
    assert [row[0] for row in rows] == [ckpt_dir.name]  # a unique name stays short
    assert "kept in float" not in text
    cells = run_grid(
        replace(spec(tmp_path / "c", [ckpt_dir], schemes=("absmax-coarse",)), exclude=("*c_fc",))
    )
    assert comparison(cells)[2].endswith("Layers kept in float (--exclude): *c_fc.")


# ------------------------------------------------------------------------------------ cache invalidation


def _reuse_flags(s):
    flags = []
    run_grid(s, on_record=lambda r, was_reused: flags.append(was_reused))
    return flags


def test_a_transformers_folder_whose_files_change_is_recomputed(hf_gpt2_dir, tmp_path):
    import shutil

    folder = tmp_path / "gpt2-copy"
    shutil.copytree(hf_gpt2_dir, folder)
    s = spec(tmp_path, [folder], schemes=("absmax-coarse",))
    assert _reuse_flags(s) == [False, False]
    assert _reuse_flags(s) == [True, True]
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if k.endswith("c_fc.weight"))
    weights[name] = weights[name] * 1.01
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert _reuse_flags(s) == [False, False]


def test_unknown_weights_never_match_not_even_other_unknown_weights(ckpt_dir, tmp_path, monkeypatch):
    """A hub model whose commit is unknown has fingerprint None: None must never equal None."""
    from qbench.eval import harness

    s = spec(tmp_path, [ckpt_dir], schemes=("absmax-coarse",))
    assert _reuse_flags(s) == [False, False]
    assert _reuse_flags(s) == [True, True]
    original = harness.load_model

    def unknown(*args, **kwargs):
        lm = original(*args, **kwargs)
        lm.description["fingerprint"] = None
        return lm

    monkeypatch.setattr(harness, "load_model", unknown)
    assert _reuse_flags(s) == [False, False]  # the records on disk (with a fingerprint) are not reused
    assert _reuse_flags(s) == [False, False]  # nor the ones just written with fingerprint None


def test_a_scheme_changed_under_the_same_name_is_recomputed(ckpt_dir, tmp_path, monkeypatch):
    from qbench.quant.schemes import SCHEMES

    s = spec(tmp_path, [ckpt_dir], schemes=("absmax-coarse",))
    first = run_grid(s)
    changed = replace(SCHEMES.get("absmax-coarse"), out_bits=6)
    monkeypatch.setitem(SCHEMES._entries, "absmax-coarse", changed)
    flags = []
    second = run_grid(s, on_record=lambda r, was_reused: flags.append(was_reused))
    assert flags == [True, False]
    assert first[1]["scheme"]["out_bits"] == 8 and second[1]["scheme"]["out_bits"] == 6


def test_an_unsupported_record_is_recomputed_once_the_backend_exists(ckpt_dir, tmp_path):
    s = spec(tmp_path, [ckpt_dir], schemes=("absmax-coarse",), modes=("real",))
    (_fp, cell) = run_grid(s)
    assert cell["status"] == "ok"
    path = next((tmp_path / "results").rglob("absmax-coarse__real.json"))
    stale = dict(cell, status="unsupported", error="no real kernel (written by an older qbench)")
    path.write_text(json.dumps(stale))
    flags = []
    (_, again) = run_grid(s, on_record=lambda r, was_reused: flags.append(was_reused))
    assert flags == [True, False] and again["status"] == "ok"


def test_a_cell_refused_again_for_the_same_reason_is_not_rewritten(ckpt_dir, tmp_path):
    """Unsupported cells are tried again every run; when the refusal is the same, the record on disk stays
    byte for byte (no churn in committed results), and a different refusal is written."""
    s = spec(tmp_path, [ckpt_dir], schemes=("nvfp4",), modes=("real",))
    (_fp, cell) = run_grid(s)
    assert cell["status"] == "unsupported"
    path = next((tmp_path / "results").rglob("nvfp4__real.json"))
    before = path.read_bytes()
    flags = []
    (_, again) = run_grid(s, on_record=lambda r, was_reused: flags.append(was_reused))
    assert flags == [True, False] and again["status"] == "unsupported" and path.read_bytes() == before
    path.write_text(json.dumps(dict(cell, error="refused for another reason")))
    run_grid(s)
    assert json.loads(path.read_text())["error"] == cell["error"]


@pytest.mark.parametrize("missing", ["eval_version", "linear_ranges"])
def test_a_baseline_record_lacking_newer_fields_is_recomputed(ckpt_dir, tmp_path, missing):
    s = spec(tmp_path, [ckpt_dir], schemes=())
    (fp,) = run_grid(s)
    path = next((tmp_path / "results").rglob("fp.json"))
    old = {k: v for k, v in fp.items() if k != missing}
    path.write_text(json.dumps(old))
    assert _reuse_flags(s) == [False]
    assert missing in json.loads(path.read_text())


def test_records_from_older_evaluation_code_are_recomputed(ckpt_dir, tmp_path, monkeypatch):
    from qbench.eval import harness

    s = spec(tmp_path, [ckpt_dir], schemes=("absmax-coarse",))
    run_grid(s)
    monkeypatch.setattr(harness, "EVAL_VERSION", harness.EVAL_VERSION + 1)
    assert _reuse_flags(s) == [False, False]
