"""``qbench plan``: budgets, units, the exact knapsack, and a plan measured end to end through llama.cpp."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from models.errors import UserError
from qbench.studies.plan import (
    AGAINST,
    PLAN_TYPES,
    Budget,
    Choice,
    parse_budget,
    solve,
    units_of,
)


def test_budgets_read_bits_sizes_types_and_fractions():
    assert parse_budget("4.5") == Budget("4.5", bits=4.5)
    assert parse_budget("95MB").size == 95_000_000 and parse_budget("90 MiB").size == 90 * 2**20
    assert parse_budget("q4_k_m") == Budget("q4_k_m", file_type="Q4_K_M")
    assert parse_budget("0.9*q4_k_m") == Budget("0.9*q4_k_m", file_type="Q4_K_M", fraction=0.9)
    assert parse_budget("Q4_K_M*0.9").fraction == 0.9
    b = parse_budget("0.9*q4_k_m")
    assert b.bytes(1000, {"Q4_K_M": 2000}) == 1800 and parse_budget("4").bytes(1000, {}) == 500
    for bad, message in [
        ("q4_km", r"did you mean 'Q4_K_M'"),
        ("0.5", "outside 1 … 32"),
        ("3*q4_0", "outside \\(0, 2\\]"),
        ("fast", "bits per weight"),
    ]:
        with pytest.raises(UserError, match=message) as e:
            parse_budget(bad)
        assert "\n" not in str(e.value)


def test_units_hold_every_matrix_once():
    shapes = {
        "token_embd.weight": (100, 64),
        "output_norm.weight": (64,),
        **{f"blk.{i}.{k}.weight": (64, 64) for i in range(3) for k in ("attn_q", "attn_v", "ffn_down")},
        **{f"blk.{i}.attn_norm.weight": (64,) for i in range(3)},
    }
    for by, keys in [
        ("type", {"token_embd", "attn_q", "attn_v", "ffn_down"}),
        ("block", {"token_embd", "blk.0", "blk.1", "blk.2"}),
    ]:
        units = units_of(shapes, by)
        assert {u.key for u in units} == keys
        names = [n for u in units for n in u.tensors]
        assert sorted(names) == sorted(n for n, s in shapes.items() if len(s) == 2)
    q = next(u for u in units_of(shapes, "type") if u.key == "attn_q")
    assert (
        q.bytes("Q8_0") == 3 * 64 * 2 * 34
        and q.fits("Q8_0")
        and not q.fits("Q4_K")
        and q.parameters == 3 * 64 * 64
    )
    with pytest.raises(UserError, match="did you mean 'type'"):
        units_of(shapes, "typ")


def _brute(options, capacity):
    best = None
    for combo in itertools.product(*options.values()):
        if sum(c.bytes for c in combo) <= capacity:
            damage = sum(c.damage for c in combo)
            if best is None or damage < best[0] - 1e-12:
                best = (damage, combo)
    return best


def test_the_knapsack_finds_the_least_damage_that_fits():
    """Against enumeration on random instances: never over the budget, and its damage within one step's rounding
    of the optimum (costs are rounded up to 1/20000 of the budget, so a plan exactly at the budget may be lost)."""
    rng = random.Random(0)
    for _ in range(60):
        options = {}
        for u in range(rng.randint(1, 5)):
            options[f"u{u}"] = [
                Choice(f"u{u}", f"t{t}", rng.randint(10, 1000), rng.random())
                for t in range(rng.randint(1, 4))
            ]
        capacity = rng.randint(10, 3000)
        plan, exact = solve(options, capacity), _brute(options, capacity)
        if exact is None:
            assert plan is None
            continue
        assert plan is not None and sum(c.bytes for c in plan) <= capacity
        assert [c.unit for c in plan] == list(options)
        loose = _brute(options, capacity * (1 - len(options) / 20000))
        assert sum(c.damage for c in plan) <= (loose or exact)[0] + 1e-9
        assert sum(c.damage for c in plan) >= exact[0] - 1e-9
    assert solve({"a": [Choice("a", "x", 10, 0.0)]}, 5) is None and solve({}, 0) is None


def test_the_knapsack_rounds_bytes_up_so_a_plan_never_exceeds_a_large_budget():
    """At file sizes (MB) the bytes are counted in steps of 1/20000 of the budget, rounded up: the plan stays
    within the budget, and no worse than the exact optimum of a budget smaller by one step per unit."""
    rng = random.Random(1)
    for _ in range(40):
        options = {
            f"u{u}": [Choice(f"u{u}", f"t{t}", rng.randint(10**5, 3 * 10**7), rng.random()) for t in range(3)]
            for u in range(4)
        }
        capacity = rng.randint(10**6, 8 * 10**7)
        plan, exact = solve(options, capacity), _brute(options, capacity)
        step = capacity / 20000
        loose = _brute(options, capacity - len(options) * step)
        if loose is None:
            continue
        assert plan is not None and sum(c.bytes for c in plan) <= capacity
        assert exact[0] - 1e-9 <= sum(c.damage for c in plan) <= loose[0] + 1e-9


def test_the_cli_lists_are_the_studys_defaults():
    from qbench.cli.plan import AGAINST_DEFAULT, TYPES_DEFAULT

    assert tuple(TYPES_DEFAULT.split(",")) == PLAN_TYPES and tuple(AGAINST_DEFAULT.split(",")) == AGAINST


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory, tokenizer):
    import torch

    from models import build
    from models.checkpoint import save_checkpoint
    from models.config import family_config

    cfg = family_config("llama", n_layer=1, n_head=4, d_model=256, d_ff=512, context=64, vocab_size=8192)
    model = build(cfg, seed=0).eval()
    with torch.no_grad():
        model.transformer.wte.weight[:, 5] += 3.0
        model.transformer.h[0].mlp.down_proj.weight.mul_(20.0)  # a unit whose damage shows
    path = tmp_path_factory.mktemp("plan") / "wide"
    save_checkpoint(path, model, tokenizer, provenance={"training": None})
    return path


def _run(args):
    from qbench.cli import main

    return main(args)


def test_a_plan_is_measured_against_its_promise_and_written_as_a_file_llama_cpp_runs(tmp_path, wide_ckpt):
    """Damage cells, the solve, the plan's own cell and its GGUF: the file's bytes are the promised bytes (the
    units' exact bytes plus the measured rest, to GGUF's 32-byte tensor alignment), the plan's cell ran, the plan
    fits its budget, and the written file (with the tokenizer) computes what the plan's cell scored."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    out = tmp_path / "plan"
    code = _run(
        [
            "plan",
            "--ckpt",
            str(wide_ckpt),
            "--budget",
            "q4_0,6",
            "--types",
            "Q8_0,Q4_K,Q4_0",
            "--against",
            "Q8_0",
            "--tokens",
            "256",
            "--output-path",
            str(out),
        ]
    )
    assert code in (0, None)
    result = json.loads((out / "plan.json").read_text())
    assert {u["unit"] for u in result["units"]} == {"token_embd", "output", "attn_q", "attn_k", "attn_v"} | {
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    }
    against = {a["type"]: a for a in result["against"]}
    assert set(against) == {"Q8_0", "Q4_0"}  # the type a budget names is measured too
    by_budget = {p["budget"]: p for p in result["plans"]}
    q4 = by_budget["q4_0"]
    assert q4["budget_bytes"] == against["Q4_0"]["bytes"]
    assert q4["promised_bytes"] <= q4["budget_bytes"]
    assert q4["cell"]["status"] == "ok"
    assert abs(q4["cell"]["bytes"] - q4["promised_bytes"]) <= 32 * 20  # GGUF aligns each tensor's data to 32
    assert q4["cell"]["kld_mean"] > 0 and q4["promised_kld"] > 0
    six = by_budget["6"]
    assert six["promised_bits_per_weight"] <= 6.0 and six["promised_kld"] <= q4["promised_kld"] + 1e-12
    assert {v["type"] for v in q4["vs"]} == {"Q8_0", "Q4_0"} and all(v["ppl_ratio_ci95"] for v in q4["vs"])
    table = (out / "table.md").read_text()
    assert "## Damage per unit" in table and "promised" in table and "measured" in table
    # the written file: the plan's tensors, the tokenizer, and llama.cpp computes the plan cell's logits from it
    import gguf
    import torch

    from models.checkpoint import load_checkpoint
    from qbench.quant import quantize
    from qbench.quant.llamacpp import LlamaCppLM

    path = out / q4["gguf"]["file"]
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    for unit, type_name in q4["plan"].items():
        named = [n for n in types if n.startswith(unit + ".") or f".{unit}." in n]
        assert named and all(types[n] == type_name for n in named), unit
    assert any(f.name == "tokenizer.ggml.tokens" for f in reader.fields.values())
    ids = torch.randint(0, 8192, (1, 48), generator=torch.Generator().manual_seed(0))
    model = load_checkpoint(wide_ckpt).model
    cell = quantize(model, q4["scheme"])
    written = LlamaCppLM(path, model.config, 2, None, {})
    try:
        torch.testing.assert_close(
            written(input_ids=ids).logits, cell(input_ids=ids).logits, rtol=0, atol=1e-5
        )
    finally:
        written.close()
        cell.close()


def test_bad_plan_inputs_are_refused_before_a_model_loads(tmp_path, capsys):
    cases = [
        (["--budget", "q4_km"], "did you mean 'Q4_K_M'"),
        (["--budget", "4.5", "--types", "Q4_K,F32"], "F32 is the unplanned float"),
        (["--budget", "4.5", "--types", "Q4KK"], "unknown llama.cpp tensor type"),
        (["--budget", "4.5,4.5"], "twice"),
        (["--budget", "4.5", "--against", "Q4_K"], "did you mean"),
    ]
    for extra, message in cases:
        code = _run(
            ["plan", "--ckpt", str(tmp_path / "missing"), *extra, "--output-path", str(tmp_path / "o")]
        )
        err = capsys.readouterr().err
        assert code == 2 and message in err, (extra, err)
        assert not (tmp_path / "o").exists()


def test_the_committed_plan_tables_are_their_json_rendered():
    from pathlib import Path

    from qbench.studies.plan import render

    root = Path(__file__).resolve().parents[3] / "results" / "plan"
    tables = sorted(root.glob("*/table.md"))
    assert tables
    for table in tables:
        result = json.loads((table.parent / "plan.json").read_text())
        assert table.read_text() == render(result), f"{table} is stale: render it from its plan.json"
