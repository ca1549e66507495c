"""``qbench.studies.sensitivity``: ranks and Spearman by hand, units, the map on a planted outlier, resuming."""

import json
import math

import pytest

from models.checkpoint import save_checkpoint
from qbench.eval.harness import GridSpec
from qbench.eval.metrics import Protocol
from qbench.studies import sensitivity as sens
from qbench.studies.sensitivity import (
    heatmap_grid,
    ranks,
    repair,
    sensitivity,
    spearman,
    units_of,
    write_sensitivity,
)
from tests.qbench.conftest import micro_config, planted_model, trained_like

PLANTED = "transformer.h.1.mlp.down_proj"  # where planted_model puts the outlier
# per-channel weights, one activation scale per sequence: only an activation outlier can hurt
SCHEME = "absmax-fine:agran=tensor"


@pytest.fixture(scope="module")
def planted_ckpt(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("sens") / "planted"
    save_checkpoint(path, planted_model(), tokenizer, provenance={"training": None})
    return path


def _spec(ckpt, out, scheme=SCHEME):
    # the first windows: on them the planted down_proj ranks first; on other text its partner up_proj (whose row 7
    # is 1000× the rest, so a per-tensor scale crushes the others) can outrank it — both real, one fixed text here
    protocol = Protocol(tokens=4 * 31, sample="first")
    return GridSpec(models=[str(ckpt)], schemes=[scheme], protocol=protocol, output_path=out, attention=False)


def test_ranks_average_ties_and_spearman_by_hand():
    assert ranks([10, 20, 20, 30]) == [1, 2.5, 2.5, 4]
    assert ranks([3, 1, 2]) == [3, 1, 2]
    # no ties: rho = 1 - 6 Σd² / (n (n² - 1)) = 1 - 6·4 / 120
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # ties in y: ranks 1, 2, 3.5, 5, 3.5 -> Σ dx dy = 8, Σ dx² = 10, Σ dy² = 9.5
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [4, 4, 4]) is None  # a constant side has no ranks to correlate
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 2, math.inf], [0.1, 0.2, 0.3]) == pytest.approx(1.0)  # a NaN cell ranks worst


class _TableStudy(sens._Study):
    """A study whose cells are looked up in a table {frozenset(kept units): ppl change}, not evaluated."""

    def __init__(self, changes, on_cell):
        super().__init__(spec=None, lm=None, targets=[], on_cell=on_cell)
        self.changes = changes

    def cell(self, key, exclude, phase):
        change = self.changes[frozenset(exclude)]
        metrics = {"perplexity": 100 + change, "ppl_change_pct": change, "ppl_change_ci95": [change, change]}
        record = {"status": "ok", "metrics": metrics}
        self.on_cell(phase, record, False)
        return record


def test_the_repair_measures_each_set_once_and_counts_only_those(monkeypatch):
    monkeypatch.setattr(sens, "_weight_share", lambda study, kept: 0.0)
    exact = (101.0 / 100.0 - 1) * 100  # +1 % as the harness computes it: 1.0000000000000009
    a, b, c = "h.0.*", "h.1.*", "h.2.*"
    changes = {
        frozenset(): 9.0,
        frozenset({a}): 3.0,
        frozenset({a, b}): 0.5,  # forward pass stops here: within 1 %
        frozenset({b}): exact,  # backward: dropping a keeps it within (exactly at the tolerance)
    }
    calls = []
    study = _TableStudy(changes, lambda phase, record, reused: calls.append(phase))
    ranked = [{"name": n, "ppl_change_pct": d} for n, d in ((a, 5.0), (b, 2.0), (c, 0.1))]
    result = repair(study, ranked, 1.0)
    assert result["exclude"] == [b] and result["reached"] and result["ppl_change_pct"] == exact
    # {a} (the backward pass dropping b) was measured by the forward pass: not evaluated or counted again
    assert [step["exclude"] for step in result["steps"]] == [[], [a], [a, b], [b]]
    assert calls == ["repair"] * 4


def test_a_repair_that_is_not_minimised_stops_after_its_forward_pass(monkeypatch):
    monkeypatch.setattr(sens, "_weight_share", lambda study, kept: 0.0)
    a, b, c = "h.0.*", "h.1.*", "h.2.*"
    changes = {frozenset(): 9.0, frozenset({a}): 3.0, frozenset({a, b}): 0.5, frozenset({b}): 0.6}
    ranked = [{"name": n, "ppl_change_pct": d} for n, d in ((a, 5.0), (b, 2.0), (c, 0.1))]
    result = repair(_TableStudy(changes, lambda *c: None), ranked, 1.0, minimise=False)
    # within after {a, b}; the backward pass would have found {b} alone, and is not run
    assert result["exclude"] == [a, b] and result["reached"] and not result["minimised"]
    assert [step["exclude"] for step in result["steps"]] == [[], [a], [a, b]]
    assert repair(_TableStudy(changes, lambda *c: None), ranked, 1.0)["minimised"]


def test_a_repair_that_is_not_minimised_bisects_for_the_shortest_within_prefix(monkeypatch):
    monkeypatch.setattr(sens, "_weight_share", lambda study, kept: 0.0)
    names = [f"h.{i}.*" for i in range(7)]
    ranked = [{"name": n, "ppl_change_pct": 7.0 - i} for i, n in enumerate(names)]

    def table(shortest):  # prefixes of at least `shortest` units are within 1 %, shorter ones are not
        return {frozenset(names[:k]): (0.5 if k >= shortest else 5.0 - k * 0.5) for k in range(8)}

    result = repair(_TableStudy(table(6), lambda *c: None), ranked, 1.0, minimise=False)
    assert result["exclude"] == names[:6] and result["reached"] and not result["minimised"]
    # 3 cells besides the fully quantised one (lengths 3, 5, 6), where adding one unit at a time takes 6
    assert [len(step["exclude"]) for step in result["steps"]] == [0, 3, 5, 6]
    for shortest in range(1, 8):  # the bisection finds the same set as the one-at-a-time forward pass
        found = repair(_TableStudy(table(shortest), lambda *c: None), ranked, 1.0, minimise=False)
        assert found["exclude"] == names[:shortest] and found["reached"]
        assert len(found["steps"]) <= 1 + 3 + (shortest == 7)  # the whole list: measured last
    unreachable = {frozenset(names[:k]): 5.0 for k in range(8)}
    result = repair(_TableStudy(unreachable, lambda *c: None), ranked, 1.0, minimise=False)
    assert not result["reached"] and result["exclude"] == names  # the whole list measured, still beyond


def test_the_fully_quantised_record_of_the_caller_is_not_evaluated_again(planted_ckpt, tmp_path):
    """A card has the format's record already: the repair starts from it (no ``all`` cell), and a record of
    another scheme is refused."""
    from dataclasses import replace

    from qbench.eval.harness import run_grid

    spec = _spec(planted_ckpt, tmp_path / "cells")
    full = run_grid(replace(spec, output_path=tmp_path / "format"))[-1]
    cells = []
    result = sensitivity(
        spec, tolerance=0.1, quantised=full, minimise=False, on_cell=lambda *c: cells.append(c)
    )
    assert not (tmp_path / "cells" / "all").exists()
    assert result["repair"]["quantised_ppl_change_pct"] == full["metrics"]["ppl_change_pct"]
    assert next(reused for phase, _, reused in cells if phase == "repair") is True
    other = run_grid(replace(spec, schemes=["absmax-coarse"], output_path=tmp_path / "other"))[-1]
    with pytest.raises(ValueError, match="the study's scheme"):
        sensitivity(spec, tolerance=0.1, quantised=other)


def test_units_by_layer_block_and_type():
    model = trained_like(micro_config("llama"))
    targets = [f"transformer.h.{b}.{k}" for b in (0, 1) for k in ("attn.q_proj", "mlp.down_proj")]
    layers = units_of(model, targets, "layer")
    assert [(u.name, u.block, u.kind) for u in layers][1] == (
        "transformer.h.0.mlp.down_proj",
        0,
        "mlp.down_proj",
    )
    blocks = units_of(model, targets, "block")
    assert [u.name for u in blocks] == ["transformer.h.0.*", "transformer.h.1.*"]
    assert blocks[1].layers == ("transformer.h.1.attn.q_proj", "transformer.h.1.mlp.down_proj")
    types = units_of(model, targets, "type")
    assert [u.name for u in types] == ["*.attn.q_proj", "*.mlp.down_proj"]
    assert types[1].layers == ("transformer.h.0.mlp.down_proj", "transformer.h.1.mlp.down_proj")


def test_the_planted_layer_ranks_first_and_the_repair_keeps_it(planted_ckpt, tmp_path):
    cells = []
    result = sensitivity(
        _spec(planted_ckpt, tmp_path / "cells"), tolerance=0.1, on_cell=lambda *c: cells.append(c)
    )
    first = result["units"][0]
    assert first["name"] == PLANTED and first["ppl_change_pct"] > 0.2
    assert all(u["ppl_change_pct"] < 0.1 for u in result["units"][1:])
    # the statistics see the outlier in that layer's input: largest kurtosis of all the units
    assert first["input_kurtosis"] == max(u["input_kurtosis"] for u in result["units"])
    repair = result["repair"]
    assert repair["exclude"] == [PLANTED] and repair["reached"] and repair["ppl_change_pct"] <= 0.1
    assert repair["quantised_ppl_change_pct"] > 0.1 and 0 < repair["weight_share_float"] < 0.2
    assert len(cells) == 14 + len(repair["steps"]) and not any(reused for _, _, reused in cells)
    assert set(result["correlation"]) == {"input_crest", "input_kurtosis", "max_abs", "weight_crest"}
    # a second run reuses every cell and gives the same map
    again = []
    second = sensitivity(
        _spec(planted_ckpt, tmp_path / "cells"), tolerance=0.1, on_cell=lambda *c: again.append(c)
    )
    assert all(reused for _, _, reused in again) and second["units"] == result["units"]
    paths = write_sensitivity(result, tmp_path, "qbench sensitivity ...", top=3)
    written = json.loads(paths["json"].read_text())
    assert written["units"][0]["name"] == PLANTED and written["repair"]["exclude"] == [PLANTED]
    assert paths["heatmap"].stat().st_size > 0 and f"`{PLANTED}`" in paths["markdown"].read_text()
    rows, cols, grid = heatmap_grid(result)
    assert rows == ["block 0", "block 1"] and cols[-1] == "mlp.down_proj"
    assert grid[1][-1] == pytest.approx(first["ppl_change_pct"])


def test_replaying_the_float_prefix_changes_no_number(planted_ckpt, tmp_path):
    """Block 1's units start from block 0's stored float output: the same perplexities as a full pass each."""
    replayed = sensitivity(_spec(planted_ckpt, tmp_path / "a"), tolerance=0.1)
    plain = sensitivity(_spec(planted_ckpt, tmp_path / "b"), tolerance=0.1, replay=False)
    key = lambda r: {u["name"]: (u["ppl"], u["ppl_change_pct"]) for u in r["units"]}  # noqa: E731
    assert key(replayed) == key(plain) and replayed["repair"] == plain["repair"]
    # 7 layers in block 1 replayed block 0; the repair's sets start in block 0 or 1
    stats = replayed["timing"]["replay"]
    assert stats["replayed"] >= 7 and stats["captures"] >= 1 and plain["timing"]["replay"] is None
    cell = json.loads(next((tmp_path / "a").glob("unit-transformer.h.1.mlp.down_proj/**/*.json")).read_text())
    assert cell["replayed_blocks"] == 1


def test_a_cache_that_keeps_its_sinks_runs_whole_models(planted_ckpt, tmp_path):
    """The sink finder runs a float pass of its own through the blocks: no replay, and the study completes."""
    from dataclasses import replace

    from qbench.quant.kv import KVConfig

    spec = replace(_spec(planted_ckpt, tmp_path / "cells"), kv=KVConfig(4, "kivi:group=8,residual=8", 0, 1))
    result = sensitivity(spec, by="block", tolerance=100.0)
    assert result["timing"]["replay"] is None and len(result["units"]) == 2


def test_by_type_finds_the_module_type(planted_ckpt, tmp_path):
    result = sensitivity(_spec(planted_ckpt, tmp_path / "cells"), by="type", tolerance=0.1)
    assert len(result["units"]) == 7 and result["units"][0]["name"] == "*.mlp.down_proj"
    assert result["repair"]["exclude"] == ["*.mlp.down_proj"]
    assert heatmap_grid(result)[0] == ["all blocks"]


def test_a_quantised_kv_cache_is_in_every_cell_and_measured_alone(planted_ckpt, tmp_path):
    from dataclasses import replace

    from qbench.quant.kv import KVConfig

    spec = replace(_spec(planted_ckpt, tmp_path / "cells"), kv=KVConfig(4, "kivi:group=8,residual=8"))
    announced, phases = [], []
    result = sensitivity(
        spec,
        by="block",
        tolerance=100.0,
        on_units=announced.append,
        on_cell=lambda phase, record, reused: phases.append(phase),
    )
    # the progress is exact: 2 units announced and 2 unit cells; the KV-only cell and the repair counted apart
    assert announced == [2] and phases.count("unit") == 2 and phases.count("kv") == 1
    assert phases.count("repair") == len(result["repair"]["steps"]) == 1  # all quantised: within 100 %
    assert result["timing"]["cells"] == {"units": 2, "kv": 1, "repair": 1}
    assert result["kv"]["bits"] == 4 and result["scheme"]["name"].endswith("+kv4-g8r8")
    assert result["kv_only_ppl_change_pct"] is not None
    record = json.loads(next((tmp_path / "cells" / "kv-only").rglob("*.json")).read_text())
    assert record["kv"]["bits"] == 4 and len(record["scheme"]["exclude"]) == 14  # every layer float
    assert result["units"][0]["name"] == "transformer.h.1.*"
    # block 1's cell and the KV-only cell start from the float model's stored states (with the cache applied)
    assert result["timing"]["replay"]["replayed"] == 2


@pytest.mark.parametrize("which", ["ours", "transformers-llama"])
def test_replay_follows_the_batches_a_large_vocabulary_makes(
    planted_ckpt, hf_llama_dir, tmp_path, monkeypatch, which
):
    """A large vocabulary's logits shrink perplexity()'s batches below --batch-size (SmolLM2: 49,152 logits a
    token, two windows of 2,048 → one window a pass); the replay stored batches of --batch-size and stopped the
    card's repair with "batch 0 is not the batch whose hidden states were stored". It now replays the batches
    perplexity() makes: the same numbers as the plain evaluation, blocks replayed."""
    from qbench.eval import metrics

    monkeypatch.setattr(metrics, "LOGITS_BUDGET", 1)  # one window a forward pass
    ckpt = planted_ckpt if which == "ours" else hf_llama_dir
    scheme = SCHEME if which == "ours" else "absmax-fine"
    replayed = sensitivity(_spec(ckpt, tmp_path / "a", scheme), tolerance=0.1)
    plain = sensitivity(_spec(ckpt, tmp_path / "b", scheme), tolerance=0.1, replay=False)
    key = lambda r: {u["name"]: (u["ppl"], u["ppl_change_pct"]) for u in r["units"]}  # noqa: E731
    assert key(replayed) == key(plain) and replayed["repair"] == plain["repair"]
    assert replayed["timing"]["replay"]["replayed"] >= 7
    cells = [json.loads(p.read_text()) for p in (tmp_path / "a").glob("unit-*/**/*__fake.json")]
    assert any(c["replayed_blocks"] for c in cells) and not any("replay_fallback" in c for c in cells)


def test_a_replay_that_meets_other_batches_falls_back_to_the_plain_evaluation(
    planted_ckpt, tmp_path, monkeypatch
):
    """Should the replay's batches ever differ from the evaluation's, the cell is evaluated whole and says so —
    never a number from the wrong hidden states, never a crash that loses the study."""
    from qbench.eval import harness

    # the replay stores batches of one window; perplexity() scores the protocol's batches of several
    monkeypatch.setattr(harness, "scoring_rows", lambda *a, **k: 1)
    replayed = sensitivity(_spec(planted_ckpt, tmp_path / "a"), tolerance=0.1)
    plain = sensitivity(_spec(planted_ckpt, tmp_path / "b"), tolerance=0.1, replay=False)
    key = lambda r: {u["name"]: (u["ppl"], u["ppl_change_pct"]) for u in r["units"]}  # noqa: E731
    assert key(replayed) == key(plain)
    cell = json.loads(next((tmp_path / "a").glob("unit-transformer.h.1.mlp.down_proj/**/*.json")).read_text())
    assert cell["replayed_blocks"] == 0 and "not the batch" in cell["replay_fallback"]
