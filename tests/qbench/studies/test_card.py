"""The card study: its budgets, the nominal bytes of a format, the verdict from the rows, the whole quick budget on
a micro model, and two models side by side (one of them a transformers folder)."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from qbench.studies import card
from qbench.studies.card import build as card_build
from qbench.studies.card import compare as card_compare
from qbench.studies.card import config as card_config
from qbench.studies.card import decide as card_decide
from qbench.studies.card import plan as card_plan
from qbench.studies.card import profile as card_profile
from qbench.studies.card import repair as card_repair
from qbench.studies.card import rows as card_rows
from qbench.studies.card import sizes as card_sizes
from qbench.studies.card import words as card_words
from qbench.studies.card.config import CardConfig
from qbench.studies.card.measure import run_card
from qbench.studies.card.plan import BUDGETS, FORMATS, budget
from qbench.studies.card.result import ModelResult
from qbench.studies.card.sizes import weight_bytes


def test_the_budgets_use_the_named_token_budgets_and_registered_schemes():
    from qbench.cli.budgets import CARD_QUICK_TOKENS, CARD_STANDARD_TOKENS, EVAL_TOKENS
    from qbench.quant.schemes import get_scheme

    assert [b.tokens for b in BUDGETS.values()] == [CARD_QUICK_TOKENS, CARD_STANDARD_TOKENS, EVAL_TOKENS]
    order = [f.scheme for f in FORMATS]
    for b in BUDGETS.values():
        assert list(b.formats) == [s for s in order if s in b.formats], b.name  # the table's order
    assert BUDGETS["standard"].formats == BUDGETS["full"].formats == tuple(order)
    assert set(BUDGETS["quick"].formats) >= {
        "absmax-fine",
        "absmax-moderate",
        "absmax-coarse",
        "zeropoint-int4",
    }
    assert not BUDGETS["quick"].sweep_families and BUDGETS["full"].speed and not BUDGETS["standard"].speed
    labels = {get_scheme(f.scheme).label for f in FORMATS}
    assert "W4A8-channel/token-hadamard" in labels and len(labels) == len(FORMATS)
    # the KV cache as deployed today, side by side in every budget: KIVI, llama.cpp-style blocks, FP8
    for b in BUDGETS.values():
        assert {r.scheme for r in b.kv_rows} == {"kivi", "per-token", "fp8-e4m3"}, b.name
        assert any(r.keep_sinks for r in b.kv_rows) and b.kv_bits[0] == 8
    # what each row quantised is in its label: W4A4 rows and weight-only rows of the same format
    by_scheme = {f.scheme: f.label for f in FORMATS}
    assert by_scheme["mxfp4"] == "W4A4 MXFP4" and by_scheme["mxfp4:a=none"] == "W4 weight-only MXFP4"
    assert by_scheme["nvfp4"] == "W4A4 NVFP4" and by_scheme["nvfp4:a=none"] == "W4 weight-only NVFP4"
    assert get_scheme("mxfp4:a=none").act_bits is None and "mxfp4:a=none" in BUDGETS["quick"].formats


def test_the_help_states_every_budget():
    from qbench.cli.card import budget_help

    text = budget_help()
    for b in BUDGETS.values():
        assert b.describe() in text
    assert all(f.label in text for f in FORMATS)


def test_nominal_bytes_count_codes_scales_and_zero_points():
    shapes = {"a": [64, 256], "b": [32, 64], "lm_head": [100, 32]}
    fp_bytes = 4 * (64 * 256 + 32 * 64 + 100 * 32) + 1000  # the linears in float32 and 1000 other bytes
    base = {"weight_symmetric": True, "format": "int", "exclude": []}
    per_channel = {**base, "weight_bits": 8, "weight_granularity": {"kind": "per_axis", "axis": 0}}
    head = {"lm_head"}
    expected = 1000 + 4 * 100 * 32 + (64 * 256 + 32 * 64) + 4 * (64 + 32)  # int8 codes + a float32 per row
    assert weight_bytes(per_channel, shapes, head, fp_bytes, 4) == expected
    int4 = {
        **base,
        "weight_bits": 4,
        "weight_symmetric": False,
        "weight_granularity": {"kind": "per_group", "group_size": 128},
    }
    groups = 64 * 2 + 32 * 1
    expected = 1000 + 4 * 100 * 32 + (64 * 256 + 32 * 64) // 2 + groups * (4 + 0.5)
    assert weight_bytes(int4, shapes, head, fp_bytes, 4) == round(expected)
    nvfp4 = {
        **base,
        "format": "nvfp4",
        "weight_bits": 4,
        "weight_granularity": {"kind": "per_group", "group_size": 16},
    }
    expected = 1000 + 4 * 100 * 32 + (64 * 256 + 32 * 64) // 2 + (64 * 16 + 32 * 4) * 1 + 2 * 4
    assert weight_bytes(nvfp4, shapes, head, fp_bytes, 4) == expected
    kept = {**per_channel, "exclude": ["b"]}  # an excluded layer stays float
    assert (
        weight_bytes(kept, shapes, head, fp_bytes, 4) == 1000 + 4 * (100 * 32 + 32 * 64) + 64 * 256 + 4 * 64
    )
    assert weight_bytes({**base, "weight_bits": None}, shapes, head, fp_bytes, 4) is None
    # as deployed: every tensor not quantised in bf16 (the 1000 other float32 bytes are 500 in bf16)
    expected = 500 + 2 * 100 * 32 + (64 * 256 + 32 * 64) + 4 * (64 + 32)
    assert weight_bytes(per_channel, shapes, head, fp_bytes, 4, rest_size=2) == expected


def test_sizes_are_in_decimal_units():
    from qbench.studies.card.units import decimal_bytes as _bytes

    assert [_bytes(n) for n in (None, 999, 1000, 14_750_000, 2_500_000_000)] == [
        "-",
        "999 B",
        "1.00 kB",
        "14.75 MB",
        "2.50 GB",
    ]


def _row(label, scheme, change, nbytes, status="ok", ci=None):
    within = status == "ok" and change <= 1.0
    return {
        "label": label,
        "scheme": scheme,
        "ppl_change_pct": change,
        "ppl_change_ci95": ci,
        "within_tolerance": within,
        "verdict": "within" if within else "beyond",
        "weight_bytes": nbytes,
        "bytes_vs_bf16": nbytes / 400,
        "status": status,
    }


def test_the_verdict_is_generated_from_the_rows():
    """Recommended: the smallest within; avoid: every format decidedly beyond, worst first, each with its measured
    failure, and the units a sensitivity map of it blames where one was measured; one short line each."""
    rows = [
        _row("W8A8", "absmax-fine", 0.2, 200),
        _row("int4", "zeropoint-int4", 0.9, 100),
        _row("coarse", "absmax-coarse", 12.0, 200, ci=[9.0, 15.0]),
        _row("per-tensor", "absmax-moderate", 3.0, 200),
    ]
    avoid_map = {
        "scheme": "absmax-coarse",
        "by": "type",
        "top": [
            {"name": "*.mlp.down_proj", "ppl_change_pct": 9.5},
            {"name": "*.attn.q_proj", "ppl_change_pct": 0.4},
        ],
    }
    verdict = card_build.verdict_section(rows, None, 1.0, avoid_map=avoid_map)
    assert verdict["recommended"]["scheme"] == "zeropoint-int4"  # the fewest bytes within 1 %
    assert verdict["beyond"] == ["coarse", "per-tensor"]  # every failing format, worst first
    assert [a["scheme"] for a in verdict["avoid"]] == ["absmax-coarse", "absmax-moderate"]
    coarse, moderate = verdict["avoid"]
    assert [u["name"] for u in coarse["blamed"]] == ["*.mlp.down_proj", "*.attn.q_proj"]
    assert moderate["blamed"] is None  # no map of it: no layer is named on a guess
    lines = verdict["lines"]
    assert lines[0].startswith("Recommended: int4 (`zeropoint-int4`), +0.90 %")
    # one line lists every failing format; the worst gets its evidence and the units its map blames
    assert "Avoid (decidedly beyond 1 %), worst first: coarse +12.00 %, per-tensor +3.00 %." in lines
    assert (
        "Worst: coarse (`absmax-coarse`), +12.00 % [+9.00, +15.00]; its damage comes most from `*.mlp.down_proj` "
        "+9.50 %, `*.attn.q_proj` +0.40 % (each quantised alone, sensitivity map by type)." in lines
    )
    assert not any("(`absmax-moderate`)" in line for line in lines)  # no map, not the worst: the list says it
    assert len(lines) == 3
    # a unit that lowers perplexity alone carries none of the damage: never blamed
    avoid_map["top"] = [{"name": "*.mlp.c_proj", "ppl_change_pct": -0.14}, *avoid_map["top"]]
    verdict = card_build.verdict_section(rows, None, 1.0, avoid_map=avoid_map)
    assert [u["name"] for u in verdict["avoid"][0]["blamed"]] == ["*.mlp.down_proj", "*.attn.q_proj"]
    # a unit that alone makes the perplexity NaN/inf (no change) is the worst of all: blamed first
    avoid_map["top"] = [
        {"name": "*.mlp.fc", "ppl_change_pct": None},
        {"name": "*.attn", "ppl_change_pct": -0.1},
    ]
    verdict = card_build.verdict_section(rows, None, 1.0, avoid_map=avoid_map)
    assert [u["name"] for u in verdict["avoid"][0]["blamed"]] == ["*.mlp.fc"]
    assert any("comes most from `*.mlp.fc` NaN" in line for line in verdict["lines"])
    avoid_map["top"] = [{"name": "*.mlp.c_proj", "ppl_change_pct": -0.14}]
    verdict = card_build.verdict_section(rows, None, 1.0, avoid_map=avoid_map)
    assert verdict["avoid"][0]["blamed"] == []
    assert any("no single unit quantised alone costs more than float" in line for line in verdict["lines"])
    assert all("qbench run" not in line for line in lines)  # commands are in verdict["commands"]
    rows[2] = _row("coarse", "absmax-coarse", None, 200, status="nonfinite")
    assert (
        card_build.verdict_section(rows, None, 1.0)["avoid"][0]["scheme"] == "absmax-coarse"
    )  # NaN is the worst
    rows = [_row("per-tensor", "absmax-moderate", 3.0, 200)]
    verdict = card_build.verdict_section(rows, None, 1.0)
    assert verdict["recommended"] is None and verdict["lines"][0].startswith("Recommended: none")


def test_the_whole_quick_budget_runs(ckpt_dir, tmp_path):
    cfg = CardConfig(models=[str(ckpt_dir)], budget="quick", output_path=tmp_path, tokens=64, tolerance=5.0)
    counted: list[bool] = []
    result = run_card(cfg, card.Progress(cell=lambda r, reused: counted.append(reused)))
    (model,) = result["models"]
    assert [f["scheme"] for f in model["formats"]] == list(BUDGETS["quick"].formats)
    assert all(f["status"] == "ok" for f in model["formats"]), [f["error"] for f in model["formats"]]
    assert card_config.planned_cells(cfg) == 17 and not any(counted)
    # on the micro model's 32-token windows KIVI is per-token blocks: its rows and the per-token ones coincide
    assert len(counted) == 1 + len(model["formats"]) + len(model["kv"]["rows"]) == 16
    assert model["identity"]["attention"] == "softmax1" and model["identity"]["tied_head"] is True
    assert model["sensitivity"] is None  # nothing over 5 %
    assert (tmp_path / "card.html").exists() and (tmp_path / "card-attention-0.png").exists()
    from models.stats import uniform_first_key_share

    o = model["outliers"]
    assert o["sink_chance"] == uniform_first_key_share(model["protocol"]["window"])
    summary = o["summary"]
    assert o["sink"] == card_decide.sink_verdict(
        summary["first_token_mass"], summary["first_token_top1_share"], o["sink_chance"]
    )
    assert "uniform attention over the window would put" in (tmp_path / "card.md").read_text()
    from qbench.quant.kvschemes import float_read_share

    kv = model["kv"]
    options = {x["scheme"]: x["options"] for x in kv["schemes"]}
    assert set(options) == {"per-token", "fp8-e4m3"}  # side by side (KIVI is per-token at ≤ 32 tokens)
    for row in kv["rows"]:  # each KV row says how many of its reads were float
        block = {"scheme": row["scheme"], **options[row["scheme"]], "keep_first": 0}
        assert row["float_reads"] == float_read_share(block, kv["window"]["window"])
        assert row["cache_bytes"] and row["cache_bytes"] < kv["memory"]["bf16_bytes"]
    # the micro model's context is shorter than a deployed one: its KV rows are read on the whole context, said so
    assert kv["window"]["window"] == kv["window"]["context"] < card.KV_MIN_WINDOW and kv["window"]["short"]
    page = (tmp_path / "card.md").read_text()
    assert "float reads K / V" in page and "the model's whole context" in page
    gaps = model["not_measured"]
    assert any(line.startswith("Algorithms: every format is round-to-nearest") for line in gaps)
    assert any("Formats not in the quick budget" in line for line in gaps)  # standard has more formats
    assert any(line.startswith("Speed: the linear layers' real kernels") for line in gaps)
    assert "### Not measured" in page and "<h3>Not measured</h3>" in (tmp_path / "card.html").read_text()
    # speed in every budget: the real-kernel formats' decode and prefill on the model's own shapes
    rows = {f["scheme"]: f for f in model["formats"]}
    assert rows["absmax-fine"]["decode_speedup"] > 0 and rows["absmax-fine"]["prefill_speedup"] > 0
    assert rows["mxfp4"]["decode_speedup"] is None  # fake quantisation only: no kernel to time
    assert model["kernels"]["schemes"] and (tmp_path / model["name"] / "layer_speed.json").exists()
    assert (
        rows["absmax-fine"]["memory_bytes"]
        == rows["absmax-fine"]["weight_bytes"] + kv["memory"]["bf16_bytes"]
    )
    # the summary comes first, then the model's verdict as bullets; statistics say what they were computed on
    assert page.index("## Summary") < page.index(f"## {model['name']}") and "\n- Recommended:" in page
    assert model["protocol"]["statistics_windows"] == model["outliers"]["windows"]
    assert "κ start token" in page and "the same token each time" in page
    assert model["protocol"]["corpus_description"].startswith("embedded: ")


def test_the_card_decides_on_the_metric_it_is_given(ckpt_dir, tmp_path):
    """``--metric kld``: every row's verdict is the KL divergence's against a tolerance in nats (the cells are the
    perplexity card's, reused), the page says so, and a card on another metric is another card."""
    from qbench.eval.evidence import decide
    from qbench.studies.card.config import card_inputs, planned_inputs

    base = CardConfig(models=[str(ckpt_dir)], budget="quick", output_path=tmp_path, tokens=64, tolerance=5.0)
    run_card(base)
    cfg = replace(base, metric="kld", tolerance=1e-4, overwrite=True)
    counted: list[bool] = []
    result = run_card(cfg, card.Progress(cell=lambda r, reused: counted.append(reused)))
    assert (
        result["metric"] == "kld" and counted and all(counted[: card_config.planned_cells(cfg)])
    )  # reused cells
    (model,) = result["models"]
    for row in model["formats"]:
        assert row["decision"]["metric"] == "kld"
        assert row["decision"]["ci95"] is None or row["decision"]["ci95"][0] <= row["kld_mean"]
    page = (tmp_path / "card.md").read_text()
    assert "KLD 0.0001 nats" in page
    assert card_inputs(result)["metric"] == "kld" and planned_inputs(base)["metric"] == "ppl"
    with pytest.raises(Exception, match="metric"):
        run_card(replace(cfg, metric="ppl", tolerance=5.0, overwrite=False))
    # the verdict is decide()'s on the record itself
    record = next(iter(r for r in (tmp_path).rglob("absmax-fine*.json")))
    import json

    stored = json.loads(record.read_text())
    first = model["formats"][0]
    assert first["verdict"] == decide(stored, 1e-4, "kld").verdict


def test_two_models_side_by_side(ckpt_dir, hf_llama_dir, tmp_path, monkeypatch):
    small = replace(BUDGETS["quick"], formats=("absmax-coarse",), kv_rows=(card.KVRow("kivi", 2),))
    monkeypatch.setitem(BUDGETS, "quick", small)
    cfg = CardConfig(
        models=[str(ckpt_dir), str(hf_llama_dir)], output_path=tmp_path, tokens=64, tolerance=50.0
    )
    result = run_card(cfg)
    vanilla, llama = result["models"]
    assert llama["identity"]["kind"] == "transformers"
    assert (llama["identity"]["positions"], llama["identity"]["norm"]) == ("rope", "rmsnorm")
    assert (vanilla["identity"]["positions"], vanilla["identity"]["norm"]) == ("learned", "layernorm")
    rows = result["comparison"]
    assert [r["row"] for r in rows if r["section"] == "formats"] == [f["label"] for f in vanilla["formats"]]
    for r in rows:
        assert set(r["values"]) == {vanilla["name"], llama["name"]}
        assert r["more_robust"] in (None, vanilla["name"], llama["name"])
    coarse = next(r for r in rows if r["scheme"] == "absmax-coarse")
    changes = {m["name"]: m["formats"][0]["ppl_change_pct"] for m in (vanilla, llama)}
    assert coarse["values"] == changes
    assert coarse["more_robust"] is None  # both within 50 %: nothing to choose
    # absolute quality beside the change: each model's quantised perplexity, and whose float perplexity it is
    # decidedly below — paired over the same windows
    assert coarse["perplexity"] == {m["name"]: m["formats"][0]["perplexity"] for m in (vanilla, llama)}
    windows = {
        m["name"]: (m["window_nll"][m["formats"][0]["cell_id"]], m["window_nll"][m["fp"]["cell_id"]])
        for m in (vanilla, llama)
    }
    assert all(len(q) == len(f) == vanilla["protocol"]["windows"] for q, f in windows.values())
    for name in windows:
        others = [
            o for o in windows if o != name and card_compare._decidedly_below(windows[name][0], windows[o][1])
        ]
        assert coarse["below_others_float"].get(name, []) == others
    assert rows[0]["section"] == "float" and set(rows[0]["values"]) == {vanilla["name"], llama["name"]}
    # the KV row carries each model's quantised perplexity (at the KV window) beside its change, on the page too
    kv = next(r for r in rows if r["section"] == "kv")
    measured = {m["name"]: next(r for r in m["kv"]["rows"] if r["bits"] == 2) for m in (vanilla, llama)}
    assert kv["perplexity"] == {
        n: (None if r["status"] == "skipped" else r["perplexity"]) for n, r in measured.items()
    }
    page = (tmp_path / "card.md").read_text()
    assert "## Side by side" in page and vanilla["name"] in page and llama["name"] in page
    kv_line = next(line for line in page.splitlines() if line.startswith(f"| kv | {kv['row']}"))
    assert any(p is not None for p in kv["perplexity"].values())
    assert all(f"(ppl {p:.2f})" in kv_line for p in kv["perplexity"].values() if p is not None)


@pytest.mark.parametrize("bad", [{"tolerance": -1.0}, {"tokens": 1}, {"budget": "huge"}])
def test_bad_settings_fail_before_a_model_loads(bad):
    from models.errors import UserError

    with pytest.raises(UserError):
        card.validate(CardConfig(models=["does-not-exist"], **bad))


def test_the_more_robust_model_is_the_one_decidedly_damaged_least():
    def row(value, ci, verdict="beyond", status="ok"):
        return {"status": status, "verdict": verdict, "decision": {"value": value, "ci95": ci}}

    pick = card_compare.more_robust_change
    assert pick({"a": row(3.0, [2.5, 3.5]), "b": row(0.5, [0.2, 0.8], "within")}) == "b"
    assert (
        pick({"a": row(0.2, [0.1, 0.3], "within"), "b": row(0.5, [0.2, 0.8], "within")}) is None
    )  # both within
    # overlapping intervals: the points differ, the measurement does not tell them apart
    assert pick({"a": row(3.0, [1.5, 4.5]), "b": row(2.0, [1.0, 3.0])}) is None
    # a decrease is no damage: a and b both reach 0, so neither is below the other
    assert (
        pick(
            {
                "a": row(-4.0, [-5.0, -3.0], "within"),
                "b": row(0.0, [-0.1, 0.1], "within"),
                "c": row(2, [1.5, 2.5]),
            }
        )
        is None
    )
    assert pick({"a": None, "b": row(30.0, [25.0, 35.0])}) == "b"  # NaN/inf or missing is the worst
    assert (
        pick({"a": row(None, None, status="nonfinite"), "b": row(30.0, None, "undecided")}) is None
    )  # b: no interval


def test_the_docs_state_the_cells_of_each_budget():
    from pathlib import Path

    page = (Path(__file__).parents[3] / "docs" / "card.md").read_text()
    rows = {
        line.split("|")[1].strip(" `").split("`")[0]: line
        for line in page.splitlines()
        if line.startswith("| `")
    }
    for name, b in BUDGETS.items():
        cells = card_config.planned_cells(CardConfig(models=["m"], budget=name))
        assert rows[name].rstrip(" |").endswith(f"| {cells}"), (name, cells)
        assert f"{b.tokens:,}" in rows[name]


def test_a_format_row_takes_the_real_kernels_speed_up_from_speed_records():
    from qbench.quant.schemes import get_scheme

    scheme = {**get_scheme(card_plan.HADAMARD_W4A8).to_dict(), "exclude": []}
    record = {"scheme": scheme, "status": "ok", "metrics": {"perplexity": 10.1, "ppl_change_pct": 1.0}}
    fp = {"model_bytes": 1000, "protocol": {"dtype": "float32"}, "linear_ranges": {"per_layer": {}}}
    speed = {
        "records": [  # run_speed names a scheme as it was asked for, overrides in the order given
            {
                "kind": "model",
                "scheme": card_plan.HADAMARD_W4A8,
                "mode": "real",
                "speedup": 1.7,
                "error": None,
            },
            {
                "kind": "model",
                "scheme": card_plan.HADAMARD_W4A8,
                "mode": "fake",
                "speedup": 0.2,
                "error": None,
            },
        ]
    }
    row = card_rows.format_row(record, fp, {"linear_shapes": {}}, 1.0, speed, None)
    assert row["label"] == "Hadamard + W4A8" and row["note"] and row["speedup"] == 1.7
    assert card_rows.format_row(record, fp, {"linear_shapes": {}}, 1.0, None, None)["speedup"] is None


def test_the_budget_in_words_says_the_tokens_actually_scored():
    """A card made with --tokens (the demo's, 16,384) says so in its header instead of the budget's own count."""
    quick = budget("quick")
    assert f"{quick.tokens:,} tokens," in quick.describe() == quick.describe(quick.tokens)
    text = quick.describe(16384)
    assert "16,384 tokens (--tokens; the budget's own: 4,096)" in text and "4,096 tokens," not in text


@pytest.mark.parametrize(
    ("lo", "hi", "labels"),
    [(2.6, 3.0, None), (6.0, 80.0, ["10", "20", "50"])],  # within a decade: linear steps; beyond: 1-2-5
)
def test_log_axes_get_plain_non_overlapping_tick_labels(lo, hi, labels):
    """matplotlib labels minor ticks (2×10⁰, 3×10⁰ …) on a log axis spanning under a decade, and they collide."""
    from qbench.studies.card.render.figures import _readable_log_ticks
    from qbench.studies.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [lo, hi])
    ax.set(yscale="log", ylim=(lo, hi))
    _readable_log_ticks(ax.yaxis)
    fig.canvas.draw()
    axis = ax.yaxis
    shown = [v for v in axis.get_majorticklocs() if lo <= v <= hi]
    major = [axis.get_major_formatter()(v, k) for k, v in enumerate(shown)]
    minor = [t for k, v in enumerate(axis.get_minorticklocs()) if (t := axis.get_minor_formatter()(v, k))]
    plt.close(fig)
    assert not minor and all("times" not in m and "^" not in m for m in major)
    if labels is None:
        assert 2 <= len(major) <= 5 and all(lo <= float(m) <= hi for m in major)
    else:
        assert major == labels


def test_the_verdict_says_when_gptq_rescues_a_format():
    rows = [
        _row("int4", "zeropoint-int4", 8.0, 100),
        _row("int4 + GPTQ", "zeropoint-int4:algo=gptq", 0.5, 100),
        _row("int3", "zeropoint-int3-g128", 30.0, 80),
        _row("int3 + GPTQ", "zeropoint-int3-g128:algo=gptq", 9.0, 80),
        _row("int2 + GPTQ", "zeropoint-int2-g64:algo=gptq", 9.0, 60),  # no round-to-nearest row: no line
    ]
    lines = card_build.verdict_section(rows, None, 1.0)["lines"]
    assert "GPTQ rescues int4: +8.00 % → +0.50 %, within 1 % where round-to-nearest is not." in lines
    assert "GPTQ does not rescue int3: +30.00 % → +9.00 % (still beyond 1 %)." in lines
    assert not any("int2" in line and "GPTQ" in line and "rescue" in line for line in lines)
    gaps = card_words.not_measured(
        rows, {}, False, {"tokens_scored": 10, "window": 5}, {"budget": "standard"}
    )
    assert gaps[0].startswith(
        "Algorithms: GPTQ, AWQ or QuaRot in the rows that say so (int4 + GPTQ, int3 + GPTQ, int2 + GPTQ)"
    )
    rows = [_row("int4", "zeropoint-int4", 8.0, 100), _row("int4 + AWQ", "zeropoint-int4:algo=awq", 0.5, 100)]
    lines = card_build.verdict_section(rows, None, 1.0)["lines"]
    assert "AWQ rescues int4: +8.00 % → +0.50 %, within 1 % where round-to-nearest is not." in lines
    rows = [
        _row("W4A4", "absmax-fine:a=4,w=4", 40.0, 100),
        _row("W4A4 + QuaRot + GPTQ", "absmax-fine:a=4,algo=gptq,rotate=quarot,w=4", 0.7, 100),
    ]
    lines = card_build.verdict_section(rows, None, 1.0)["lines"]
    assert (
        "QuaRot + GPTQ rescues W4A4: +40.00 % → +0.70 %, within 1 % where round-to-nearest is not." in lines
    )


def test_each_format_row_says_what_it_quantised():
    from qbench.quant.schemes import get_scheme
    from qbench.studies.card.words import quantised_text

    def text(name):
        return quantised_text(get_scheme(name).to_dict())

    assert text("mxfp4") == "W4 MXFP4 g32 + A4 MXFP4 g32 (dynamic scales); RTN"  # W4A4, not weight-only
    assert text("zeropoint-int4") == "W4 int per channel asymmetric, weight-only; RTN"
    assert text("absmax-coarse").endswith("+ O8 per tensor; RTN")
    assert text("bnb-nf4").startswith("W4 NF4 g64, weight-only")
    assert text("smoothquant").startswith("SmoothQuant α 0.5 (calibrated), then W8 int per tensor")
    assert text("zeropoint-int4:algo=awq").endswith(
        "; AWQ (128 train windows, α grid 20, clipping searched, sequential)"
    )
    assert text("zeropoint-int4:algo=gptq") == (
        "W4 int per channel asymmetric, weight-only; GPTQ (128 train windows, damp 0.01, sequential)"
    )
    assert text("zeropoint-int4:algo=gptq,sequential=false").endswith("GPTQ (128 train windows, damp 0.01)")


def test_a_sink_is_read_against_uniform_attention_with_a_margin():
    """Three readings of the first-token share: a sink where some head puts more than Gu et al.'s ε = 0.3 of its
    attention on key 0; no sink within twice uniform attention's share (a random model sits at 1.0×: a strict
    "above uniform" called it a sink); weak in between — on either the mean weight or the top-1 share."""
    chance = 0.0064
    assert card_decide.sink_verdict(0.00646, 0.0066, chance, 0.0) == "no sink"  # the random gpt2-130m's 1.0×
    assert (
        card_decide.sink_verdict(0.02, 0.056, 0.0349, 0.0) == "no sink"
    )  # top-1 1.6× uniform: within the margin
    assert card_decide.sink_verdict(0.05, 0.05, 0.0064, 0.0) == "weak"  # 7.8× uniform, no head a sink
    assert (
        card_decide.sink_verdict(0.004, 0.2, 0.0064, 0.0) == "weak"
    )  # the top-1 share alone is clearly above chance
    # SmolLM2: a mean weight of 0.226 over all heads, but 115 of its 270 heads above 0.3
    assert card_decide.sink_verdict(0.226, 0.39, 0.0031, 115 / 270) == "sink"
    assert card_decide.sink_verdict(0.31, None, 0.0064) == "sink"  # no per-head weights: the mean over 0.3
    assert card_decide.sink_verdict(0.2, None, 0.0064) == "weak"
    assert (
        card_decide.sink_verdict(None, 0.5, 0.0064) is None
        and card_decide.sink_verdict(0.5, 0.5, None) is None
    )
    assert card_decide.sink_heads_share([[0.5, 0.1], [0.31, 0.3]]) == 0.5  # strictly above ε
    assert card_decide.sink_heads_share(None) is None and card_decide.sink_heads_share([]) is None


def test_the_repair_targets_the_smallest_failing_format_that_could_pay():
    """Only a format smaller than every format that already passes is worth repairing; the smallest of those."""
    from qbench.quant.schemes import get_scheme

    fp = {
        "model_bytes": 4 * 64 * 256 + 1000,
        "protocol": {"dtype": "float32"},
        "linear_ranges": {"per_layer": {}},
    }
    profile = {"linear_shapes": {"a": [64, 256]}}

    def record(name, change, half=0.1):
        return {
            "status": "ok",
            "scheme": {**get_scheme(name).to_dict(), "exclude": []},
            "metrics": {"ppl_change_pct": change, "ppl_change_ci95": [change - half, change + half]},
        }

    int8, int4, int4_g = (
        record("absmax-fine", 0.3),
        record("zeropoint-int4", 5.0),
        record("zeropoint-int4-g128", 3.0),
    )

    def pick(*args):
        return next(iter(card_decide.repair_targets(*args)), None)

    assert pick([int8, int4, int4_g], fp, profile, 1.0) is int4  # per-channel int4 is the smaller of the two
    assert pick([int8, record("absmax-fine", 0.5)], fp, profile, 1.0) is None  # nothing fails
    big_fail = record("absmax-fine", 4.0)
    assert (
        pick([record("zeropoint-int4", 0.2), big_fail], fp, profile, 1.0) is None
    )  # larger than a passing one
    assert pick([big_fail, int4], fp, profile, 1.0) is int4  # nothing passes: still the smallest
    # undecided (the interval straddles 1 %): more tokens decide it, a repair does not — here one that lowers
    # perplexity, which a repair could only "fix" by keeping every layer in float
    assert pick([big_fail, record("zeropoint-int4", -0.8, half=2.0)], fp, profile, 1.0) is big_fail
    # a block-quantised source file smaller than every failing format: no repair could pay
    int4_bytes = card_sizes.deployed_bytes(int4["scheme"], fp, profile)
    assert pick([big_fail, int4], fp, profile, 1.0, "ppl", int4_bytes) is None
    assert pick([big_fail, int4], fp, profile, 1.0, "ppl", int4_bytes + 1) is int4


def _sized_records():
    from qbench.quant.schemes import get_scheme

    fp = {
        "model_bytes": 4 * 64 * 256 + 1000,
        "protocol": {"dtype": "float32"},
        "linear_ranges": {"per_layer": {}},
        "metrics": {"perplexity": 10.0},
    }
    profile = {"linear_shapes": {"a": [64, 256]}}

    def record(name, change, half=0.1):
        return {
            "status": "ok",
            "scheme": {**get_scheme(name).to_dict(), "exclude": []},
            "metrics": {"ppl_change_pct": change, "ppl_change_ci95": [change - half, change + half]},
        }

    return fp, profile, record


def test_the_repair_tries_its_candidates_smallest_first():
    fp, profile, record = _sized_records()
    int8, int4, int4_g, int3 = (
        record("absmax-fine", 0.3),
        record("zeropoint-int4", 5.0),
        record("zeropoint-int4-g128", 3.0),
        record("zeropoint-int3-g128", 9.0),
    )
    order = card_decide.repair_targets([int8, int4, int4_g, int3], fp, profile, 1.0)
    assert order == [int3, int4, int4_g]  # every failing format smaller than the passing one, smallest first
    # nothing passes: smallest first too, and the size to beat is the whole model in bf16
    assert card_decide.repair_targets([int4, int4_g, int3], fp, profile, 1.0) == [int3, int4, int4_g]
    limit, what = card_decide.size_to_beat([int4, int4_g], fp, profile, 1.0)
    assert (limit, what) == (fp["model_bytes"] // 2, "the model in bf16")
    # a source file already block-quantised (a Q4_1 GGUF) is the reference: smaller than bf16, it is what to beat
    limit, what = card_decide.size_to_beat([int4, int4_g], fp, profile, 1.0, "ppl", 1234)
    assert limit == 1234 and what.startswith("the source file itself")
    assert card_decide.size_to_beat([int8, int4], fp, profile, 1.0, "ppl", 10**9)[1].startswith(
        "`absmax-fine`"
    )
    limit, what = card_decide.size_to_beat([int8, int4], fp, profile, 1.0)
    assert limit == card_sizes.deployed_bytes(int8["scheme"], fp, profile) and "absmax-fine" in what


def _study(scheme, reached, exclude, change=0.5):
    return {
        "scheme": {"name": scheme},
        "by": "type",
        "units": [{"name": n, "ppl_change_pct": 1.0} for n in exclude],
        "correlation": {},
        "repair": {
            "reached": reached,
            "minimised": True,
            "exclude": exclude,
            "count": len(exclude),
            "weight_share_float": 0.5,
            "quantised_ppl_change_pct": 5.0,
            "ppl": 10.05,
            "ppl_change_pct": change,
            "tolerance_pct": 1.0,
        },
    }


def test_the_card_shows_the_first_repair_that_pays_with_its_size():
    """A repair pays when it reaches the tolerance *and* is smaller than what must be beaten (the smallest passing
    format, else the model in bf16); of the tries, the first that pays is shown, every try is listed."""
    fp, profile, record = _sized_records()
    fp["protocol"].update(corpus="embedded", split="validation", tokens=64, window=32)
    int8, int4, int3 = (
        record("absmax-fine", 0.3),
        record("zeropoint-int4", 5.0),
        record("zeropoint-int3-g128", 9.0),
    )
    entry = ModelResult(
        fp=fp,
        profile=profile,
        kv=[],
        formats=[int8, int4, int3],
        source="m",
        # int3 with its only layer kept float is bigger than int8: does not pay; int4 reaches nothing
        repairs=[_study(int3["scheme"]["name"], True, ["a"]), _study(int4["scheme"]["name"], False, [])],
    )
    settings = {"seed": 0, "output_path": "out"}
    sens = card_repair.repair_section(entry, fp, profile, settings, 1.0, "ppl")
    assert [t["pays"] for t in sens["tries"]] == [False, False] and sens["scheme"] == "zeropoint-int3-g128"
    assert sens["repair"]["beat"]["what"].startswith("`absmax-fine`")
    verdict = card_build.verdict_section([_row("int8", "absmax-fine", 0.3, 200)], sens, 1.0)
    assert not verdict["repair"]["pays"] and "that is the better choice" in " ".join(verdict["lines"])
    assert any(
        line.startswith("Repair also tried on `zeropoint-int4`: did not reach") for line in verdict["lines"]
    )
    assert verdict["commands"][0]["command"].startswith("qbench run ")
    entry.repairs.append(_study(int4["scheme"]["name"], True, []))  # int4 reached with nothing kept: pays
    entry.repairs[-1]["repair"].update(ppl_change_ci95=[0.2, 0.8], kld_mean=0.0123)
    sens = card_repair.repair_section(entry, fp, profile, settings, 1.0, "ppl")
    assert [t["pays"] for t in sens["tries"]] == [False, False, True] and sens["scheme"] == "zeropoint-int4"
    assert sens["repair"]["weight_bytes"] < sens["repair"]["beat"]["bytes"]
    bf16 = fp["model_bytes"] // 2
    assert sens["repair"]["bytes_vs_bf16"] == sens["repair"]["weight_bytes"] / bf16
    line = next(x for x in card_build.verdict_section([], sens, 1.0)["lines"] if x.startswith("Repair of"))
    # the repaired cell's interval and KL divergence, its size and its share of the bf16 model
    assert "+5.00 % → +0.50 % [+0.20, +0.80], KLD 0.0123, " in line
    assert f"({sens['repair']['bytes_vs_bf16']:.1%} of the bf16 model)" in line


def test_the_card_says_why_no_repair_was_tried():
    """Nothing failing is smaller than what must be beaten (here a block-quantised source file): no repair is
    tried, and the verdict says so with the size to beat."""
    rows = [
        _row("int4", "zeropoint-int4", 5.0, 110_480_000)
    ]  # SmolLM2: its smallest format, larger than its file
    lines = card_build.verdict_section(rows, None, 1.0, beat=(98_360_000, "the source file itself"))["lines"]
    assert (
        "No repair tried: no format decidedly beyond 1 % is smaller than the source file itself: 98.36 MB; "
        "keeping layers in float only adds bytes." in lines
    )
    rows = [_row("int4", "zeropoint-int4", 0.5, 150)]  # nothing fails: nothing to say
    assert not any(
        "repair" in x for x in card_build.verdict_section(rows, None, 1.0, beat=(10, "x"))["lines"]
    )
    # a NaN format is no repair candidate (repair_targets takes measured changes): the line must not claim a size
    rows = [_row("W2", "absmax-fine:w=2", None, 50, status="nonfinite")]
    assert not any(
        "repair" in x for x in card_build.verdict_section(rows, None, 1.0, beat=(100, "x"))["lines"]
    )
    rows = [
        _row("int4", "zeropoint-int4", 5.0, 50)
    ]  # a candidate smaller than the size to beat: tried, not "not"
    assert not any(
        "No repair" in x for x in card_build.verdict_section(rows, None, 1.0, beat=(100, "x"))["lines"]
    )


def test_absolute_quality_is_decided_on_paired_windows():
    below = card_compare._decidedly_below
    assert below([1.0, 1.1, 1.05], [2.0, 2.2, 2.1]) is True
    assert (
        below([1.0, 3.0, 1.05], [2.0, 2.2, 2.1]) is False
    )  # one window the other way: the interval straddles 0
    assert below([1.0], [2.0]) is None and below([1.0, 1.0], [2.0]) is None  # no interval / other windows
    windows = {"a": ([1.0, 1.1, 1.05], None), "b": ([2.0, 2.2, 2.1], None), "c": ([2.0, 2.3, 2.0], None)}
    assert card_compare.better_to_ship(windows) == "a"
    windows["c"] = ([1.0, 1.2, 1.0], None)
    assert card_compare.better_to_ship(windows) is None
    row = card_compare.ComparisonRow(
        "formats",
        "W8A8",
        "absmax-fine",
        {"vanilla": 0.4, "paper": 0.1},
        more_robust="paper",
        better_to_ship="vanilla",
        perplexity={"vanilla": 100.4, "paper": 108.3},
        below_others_float={"vanilla": ["paper"]},
    )
    lines = card_words.comparison_lines(card_compare.findings([row]))
    assert lines == [
        "W8A8: paper loses less to quantisation, but vanilla quantised is still decidedly better (ppl 100.40 vs "
        "108.30).",
        "vanilla is decidedly better to ship in every format measured (1).",
    ]


def test_a_format_the_model_cannot_take_is_no_failure_and_is_said_so():
    """A row the model could not run (QuaRot on a LayerNorm model: status unsupported) is neither avoided nor
    undecided; "Not measured" names it with its reason."""
    rows = [
        _row("int4", "zeropoint-int4", 0.5, 100),
        {**_row("W4A8 + QuaRot", "absmax-w4a8-g32:rotate=quarot", None, 100, status="unsupported")},
    ]
    rows[1]["error"] = "rotate=quarot: LayerNorm is not invariant to rotation"
    rows[1]["verdict"] = "beyond"  # what decide() says of a record without a number
    verdict = card_build.verdict_section(rows, None, 1.0)
    assert verdict["avoid"] == [] and verdict["beyond"] == [] and not verdict["undecided"]
    gaps = card_words.not_measured(
        rows, {}, False, {"tokens_scored": 10, "window": 5}, {"budget": "standard"}
    )
    assert any(
        line.startswith("Formats this model cannot take: W4A8 + QuaRot (rotate=quarot: LayerNorm")
        for line in gaps
    )
    from qbench.studies.card.render.formats import format_columns

    speed = {"decode_speedup": 4.5, "prefill_speedup": 3.2, "perplexity": float("nan"), "weight_bytes": 10**8}
    row = {**rows[1], **speed, "bytes_vs_bf16": 0.5}
    cells = {c.header: c.text(row) for c in format_columns({"speed_measured": False}, "1 %")}
    # no NaN perplexity, no speed of a row never run
    assert cells["ppl"] == cells["change [95 % CI]"] == cells["decode ×"] == cells["prefill ×"] == "-"
    assert cells["size (MB)"] != "-"  # its nominal size stays


def _md_cells(line: str) -> list[str]:
    """A markdown table row's cells, as GitHub splits it: on every ``|`` not escaped."""
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


def test_a_pipe_in_a_header_is_escaped_as_in_a_cell():
    """ "max |act|" unescaped is three header cells over one delimiter cell: GitHub shows no table at all."""
    from qbench.studies.card.render.markdown import _md_table

    header, delimiter, row = _md_table(["block", "max |act|"], [["0", "|x| = 3"]]).splitlines()
    assert len(_md_cells(header)) == len(_md_cells(delimiter)) == len(_md_cells(row)) == 2
    assert _md_cells(header)[1].strip() == r"max \|act\|"


def test_size_columns_are_in_mb_whatever_the_size():
    """A column headed "(MB)" holds MB (10⁶ bytes) in every cell: a tiny model's 237,570-byte KV cache is 0.238,
    not "237.57 kB" under an MB header; prose and the summary carry the unit."""
    from qbench.studies.card.render.formats import format_columns
    from qbench.studies.card.render.kv import kv_columns
    from qbench.studies.card.units import mb as _mb
    from qbench.studies.card.units import mb_text as _mb_text

    assert [_mb(n) for n in (None, 0, 180_220, 237_570, 5_120, 14_750_000, 2_500_000_000)] == [
        "-",
        "-",
        "0.180",
        "0.238",
        "0.00512",
        "14.75",
        "2,500.00",
    ]
    assert _mb_text(193_250_000) == "193.25 MB" and _mb_text(None) == "-"
    fmt = {
        **_row("int4", "zeropoint-int4", 0.5, 900_000),
        "weight_bytes_rest_float": 1_900_000,
        "perplexity": 9.0,
    }
    fmt["memory_bytes"] = 1_424_290
    columns = format_columns({"speed_measured": False}, "1 %")
    sizes = {c.header: c.text(fmt) for c in columns if "(MB)" in c.header}
    assert sizes == {"size (MB)": "0.900", "rest fp32 (MB)": "1.90", "+ bf16 KV (MB)": "1.42"}
    kv = {"scheme": "kivi", "bits": 4, "keep_sinks": 0, "label": "kv4", "perplexity": 10.0, "status": "ok"}
    kv |= {"ppl_change_pct": 0.1, "within_tolerance": True, "cache_bytes": 237_570}
    cells = {c.header: c.text(kv) for c in kv_columns({"bf16_bytes": 524_290}, "1 %")}
    assert cells["cache (MB)"] == "0.238" and cells["of bf16 cache"] == "45.3%"


def test_the_html_keys_the_numbers_its_column_specs_name():
    """data-key comes from each column's spec, not from a cell's position: a format the model ran keys its
    perplexity, change and size under its own card.json path; one it could not run keeps its "-" unkeyed and
    still keys its nominal size; the same columns give card.md its text."""
    import html as _html
    import json

    from qbench.studies.card.render.formats import format_table
    from qbench.studies.card.render.html import _table

    ran = {**_row("int4", "zeropoint-int4", 0.5, 900_000), "perplexity": 9.0, "note": ""}
    skipped = {**_row("W4A8 + QuaRot", "x:rotate=quarot", None, 100, status="unsupported"), "note": ""}
    skipped["perplexity"] = None
    m = {"formats": [ran, skipped], "kv": {"rows": []}, "protocol": {}, "speed_measured": False}
    table = format_table(m, 3, "1 %")
    page = _table(table)
    keys = re.findall(r'data-key="([^"]+)" data-value="([^"]*)">([^<]*)<', page)
    assert [(k, json.loads(_html.unescape(v)), t) for k, v, t in keys] == [
        ("models.3.formats.0.perplexity", 9.0, "9.0000"),
        ("models.3.formats.0.ppl_change_pct", 0.5, "+0.50 %"),
        ("models.3.formats.0.weight_bytes", 900_000, "0.900"),
        ("models.3.formats.1.weight_bytes", 100, "0.000100"),
    ]
    assert [row[2:4] for row in table.texts()] == [["9.0000", "+0.50 %"], ["-", "-"]]


def test_a_collapsed_models_change_prints_in_three_significant_digits():
    """SmolLM2's 2-bit activations: +465470924390373424889856.00 % said nothing its first three digits do not."""
    from qbench.studies.card.render.formats import change_ci as _change_ci
    from qbench.studies.card.units import pct as _pct

    assert _pct(4.6547092439037342e23) == "+4.65e+23 %" and _pct(52994204.8) == "+5.30e+07 %"
    assert _pct(9999.994) == "+9999.99 %" and _pct(-0.004) == "-0.00 %" and _pct(None) == "NaN"
    row = {"status": "ok", "ppl_change_pct": 3.16e4, "ppl_change_ci95": [2.5e4, 4.1e4]}
    assert _change_ci(row) == "+3.16e+04 % [+2.50e+04, +4.10e+04]"


def _curve(family, axis, changes):
    return {
        "family": family,
        "axis": axis,
        "curve": {str(b): {"ppl_change_pct": c} for b, c in changes.items()},
    }


def test_the_breaking_point_panels_are_fitted_to_their_data_and_legible():
    """SmolLM2's standard card: +170 % … +4.7×10²³ % on symlog ran to −10²¹ % with no negative point, labelled
    every decade, with the legend over a panel. Each panel's y range is now its data's (and the tolerance line's)
    with a small margin, a few ticks in %, the legend below the panels, no text under 9 pt."""
    from qbench.studies.card.render.figures import FONT, MAX_TICKS, _breaking_point_figure
    from qbench.studies.plots import _pyplot

    plt = _pyplot()
    long_name = "SmolLM2-135M-Instruct.Q4_1 from a checkpoint folder with a long name"
    curves = [
        (
            "SmolLM2-135M-Instruct.Q4_1",
            _curve("absmax-coarse", "a", {8: 170.7, 6: 2143.5, 4: 1.29e7, 2: 4.65e23}),
        ),
        (
            "SmolLM2-135M-Instruct.Q4_1",
            _curve("absmax-coarse", "o", {8: -30.0, 6: 40.0, 4: 6.1e7, 2: 2.1e11}),
        ),
        ("SmolLM2-135M-Instruct.Q4_1", _curve("fp", "kv kivi", {8: -0.004, 4: 0.03, 3: 1.87, 2: 8.58})),
        (long_name, _curve("fp", "kv kivi", {8: 0.01, 4: 0.2, 3: None, 2: 0.6})),
        (long_name, _curve("fp", "kv per-token", {4: 8.03, 2: 764.3})),
    ]
    card_ = {"tolerance_pct": 1.0, "metric": "ppl"}
    with plt.rc_context({"font.size": FONT, "axes.titlesize": FONT + 1, "legend.fontsize": FONT - 1}):
        fig = _breaking_point_figure(plt, card_, curves)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {"absmax-coarse a", "absmax-coarse o", "fp kv kivi", "fp kv per-token"}
    for title, ax in panels.items():
        ys = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y)]
        forward = ax.yaxis.get_transform()
        t_lo, t_hi = (float(forward.transform([v])[0]) for v in ax.get_ylim())
        d_lo, d_hi = (float(forward.transform([v])[0]) for v in (min(ys), max(ys)))
        span = t_hi - t_lo
        assert t_lo <= d_lo and d_hi <= t_hi, title  # every point (and the tolerance line) shows
        assert d_lo - t_lo <= 0.1 * span and t_hi - d_hi <= 0.1 * span, title  # and no empty region beyond
        lo, hi = ax.get_ylim()
        shown = [v for v in ax.get_yticks() if lo <= v <= hi]
        assert 2 <= len(shown) <= MAX_TICKS, (title, shown)
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert labels and all(text.endswith(" %") for text in labels), (title, labels)
    assert panels["absmax-coarse a"].get_yscale() == "log" and panels["absmax-coarse a"].get_ylim()[0] > 0
    assert panels["absmax-coarse o"].get_yscale() == "symlog"  # decades above, a point below zero
    assert min(panels["absmax-coarse o"].get_yticks()) < 0  # ... on a scale that says how far below
    assert panels["fp kv kivi"].get_yscale() == "linear"  # within ten times the tolerance: read directly
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts[0] == "SmolLM2-135M-Instruct.Q4_1" and texts[-1] == "tolerance 1 %"
    assert texts[1].replace("\n", " ") == long_name and "\n" in texts[1]  # wrapped, not cut
    box = legend.get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in panels.values())
    sizes = [t.get_fontsize() for t in fig.findobj(plt.Text) if t.get_visible() and t.get_text()]
    plt.close(fig)
    assert min(sizes) >= 9


@pytest.mark.parametrize(("layers", "heads", "numbers"), [(4, 4, True), (12, 12, False), (30, 9, False)])
def test_heat_map_cells_carry_numbers_only_where_they_are_legible(layers, heads, numbers):
    """gpt2's 12 × 12 heat map printed its cells' numbers at 7 pt (~7 px at 1×): a cell too small for a 9-pt
    number gets none (the colour bar reads it); a large one gets one as large as it holds."""
    from qbench.studies.card.render.figures import _attention_figure
    from qbench.studies.plots import _pyplot

    plt = _pyplot()
    grid = [[(r * heads + c) / (layers * heads) for c in range(heads)] for r in range(layers)]
    m = {"name": "m", "attention": {"top1_share": grid, "mass": grid}, "outliers": {"sink_chance": 0.03}}
    fig = _attention_figure(plt, m)
    cells = [t for ax in fig.axes[:2] for t in ax.texts]
    bars = [ax for ax in fig.axes[2:]]
    assert [bar.get_ylabel() for bar in bars] == ["share of queries (q ≥ 1)", "mean weight (q ≥ 1)"]
    assert all(bar.get_ylim()[1] == pytest.approx(max(map(max, grid))) for bar in bars)  # fitted to the data
    plt.close(fig)
    assert bool(cells) is numbers
    assert all(t.get_fontsize() >= 9 for t in cells)


def test_massive_activation_sites_name_their_window():
    """A site is found in one of the profiled windows: the outlier table names it (window/position:token), so a
    reader can find the text that produced it; records without a window keep position:token."""
    from qbench.studies.card.render.sections import _site

    assert _site({"window": 3, "position": 0, "channel": 507, "value": 2e4, "token": "<|endoftext|>"}) == (
        "3/0:'<|endoftext|>'"
    )
    assert _site({"position": 5, "token": "the"}) == "5:'the'"


def test_side_by_side_kv_cells_tell_missing_from_nan():
    """A KV row only one model ran shows "-" for the other; a measured NaN stays "NaN"; a measured change carries
    its quantised perplexity."""
    from qbench.studies.card.render.overview import comparison_cell as _cell

    row = {
        "section": "kv",
        "values": {"a": 0.5, "b": None, "c": None},
        "perplexity": {"a": 88.9, "b": None, "c": None},
        "missing": ["c"],
    }
    assert _cell(row, "a") == "+0.50 % (ppl 88.90)"
    assert _cell(row, "b") == "NaN" and _cell(row, "c") == "-"


def test_architecture_reads_grouped_key_value_heads():
    """A qbench checkpoint with grouped-query attention reports its n_kv_head key/value heads (the KV memory
    estimate multiplies by them), and n_head without grouping."""
    from types import SimpleNamespace

    from models import build, family_config

    for kv in (None, 2):
        config = family_config("llama", n_layer=1, n_head=4, n_kv_head=kv, d_model=32, d_ff=64, vocab_size=97)
        lm = SimpleNamespace(
            model=build(config), description={"kind": "qbench", "config": config.to_dict(), "parameters": 1}
        )
        assert card_profile.architecture(lm)["kv_heads"] == (kv or 4)
