"""llama.cpp beside qbench in ``qbench speed``: type names, the missing-package message, the matched ratio, and
(where llama-cpp-python is installed) the rows a tiny model's generation figure gains."""

from __future__ import annotations

import sys

import pytest

from models.errors import UserError
from qbench.studies import llamacpp


def test_types_are_checked_with_a_suggestion():
    assert llamacpp.check_types(None) == list(llamacpp.LLAMA_CPP_TYPES)
    assert llamacpp.check_types(["q8_0", "Q4_K_M"]) == ["Q8_0", "Q4_K_M"]
    with pytest.raises(UserError, match=r"unknown llama\.cpp type 'Q9_0'.*did you mean"):
        llamacpp.check_types(["Q9_0"])


def test_every_type_is_matched_with_a_registered_scheme():
    from qbench.quant.schemes import SCHEMES

    assert set(llamacpp.MATCHED) == set(llamacpp.LLAMA_CPP_TYPES)
    for match in llamacpp.MATCHED.values():
        assert match in ("fp32", "bf16") or match.split(":")[0] in SCHEMES.names()


def test_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(UserError, match=r"pip install 'qbench\[llama-cpp\]'"):
        llamacpp.require_llama_cpp()


def test_annotate_divides_the_matched_qbench_row():
    # each row's speed-up over the fp32 times of its own round; tokens/s of different rounds (the machine got
    # slower during the Q8_0 round: 210 tokens/s) must not be compared directly
    records = [
        {"kind": "generate", "name": "m fp32", "tokens_per_s": 100.0, "speedup_best": 1.0},
        {"kind": "generate", "name": "absmax-fine [real]", "tokens_per_s": 999.0, "speedup_best": 9.9},  # float head
        {"kind": "generate", "name": "absmax-fine:head=true [real]", "tokens_per_s": 150.0, "speedup_best": 1.5},
        {"kind": "generate", "name": "llama.cpp F32", "llama_cpp_type": "F32", "tokens_per_s": 200.0,
         "speedup_best": 2.0},
        {"kind": "generate", "name": "llama.cpp Q8_0", "llama_cpp_type": "Q8_0", "tokens_per_s": 210.0,
         "speedup_best": 3.0},
        {"kind": "generate", "name": "llama.cpp Q4_0", "llama_cpp_type": "Q4_0", "tokens_per_s": None,
         "speedup_best": None},
    ]  # fmt: skip
    llamacpp.annotate(records, "m")
    f32, q8, q4 = records[3:]
    assert f32["qbench_match"] == "m fp32" and f32["qbench_vs_llama_cpp"] == pytest.approx(0.5)
    assert q8["qbench_match"] == "absmax-fine:head=true [real]"
    assert q8["qbench_vs_llama_cpp"] == pytest.approx(0.5)
    assert q4["qbench_vs_llama_cpp"] is None  # llama.cpp row failed: no ratio, not a zero


def _run(ratio_q4: float | None, threads: int = 1, new_tokens: int = 64) -> list[dict]:
    """One run's records as ``annotate`` leaves them: a Q4_0 row (and a qbench row that is not llama.cpp's)."""
    common = {"kind": "generate", "model": "m", "threads": threads, "cpu": "cpu", "prompt_tokens": 16}
    return [
        {
            **common,
            "name": "absmax-w4a8-g32:head=true [real]",
            "new_tokens": new_tokens,
            "tokens_per_s": 80.0,
        },
        {
            **common,
            "name": "llama.cpp Q4_0",
            "new_tokens": new_tokens,
            "llama_cpp_type": "Q4_0",
            "qbench_match": "absmax-w4a8-g32:head=true [real]",
            "qbench_vs_llama_cpp": ratio_q4,
        },
    ]


def test_across_runs_interval_and_verdict():
    import math

    from qbench.eval.evidence import t_quantile

    ratios = [0.77, 0.81, 0.80, 0.82]
    (row,) = llamacpp.across_runs([_run(r) for r in ratios], goal=0.8)
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 4
    half = t_quantile(0.975, 3) * math.sqrt(sum((x - mean) ** 2 for x in logs) / 3) / 2
    assert row["runs"] == 4 and row["ratios"] == ratios
    assert row["geomean"] == pytest.approx(math.exp(mean))
    assert row["ci"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)])
    assert row["ci"][0] < 0.8 < row["ci"][1] and row["verdict"] == llamacpp.UNDECIDED
    # the interval entirely above, entirely below; one run has no interval; no goal, no verdict
    assert llamacpp.across_runs([_run(r) for r in (0.90, 0.91, 0.92)], goal=0.8)[0]["verdict"] == llamacpp.MET
    assert (
        llamacpp.across_runs([_run(r) for r in (0.60, 0.61, 0.62)], goal=0.8)[0]["verdict"]
        == llamacpp.NOT_MET
    )
    single = llamacpp.across_runs([_run(0.99)], goal=0.8)[0]
    assert single["ci"] is None and single["verdict"] == llamacpp.UNDECIDED
    assert llamacpp.across_runs([_run(0.9), _run(0.9)])[0]["verdict"] is None


def test_across_runs_pools_only_the_same_comparison():
    runs = [_run(0.8), _run(0.9, threads=2), _run(0.7, new_tokens=32), _run(None)]
    rows = llamacpp.across_runs(runs, goal=0.8)
    by = {(r["threads"], r["new_tokens"]): r for r in rows}
    assert set(by) == {(1, 64), (2, 64), (1, 32)}
    assert by[(1, 64)]["ratios"] == [0.8]  # the failed run (no ratio) adds nothing, not a zero
    table = llamacpp.across_runs_table(rows)
    assert "0.80" in table and "- (one run)" in table and "undecided" in table and "64 + 32" not in table
    assert "16 + 32" in table  # the protocol is shown: rows that differ only there do not look alike
    # a record repeated within one run is one ratio, and a build with other instruction sets is not pooled
    (row,) = llamacpp.across_runs([_run(0.8) + _run(0.9)])
    assert row["ratios"] == [0.8]
    avx2 = [{**r, "native_isa": "AVX2"} for r in _run(0.7)]
    assert len(llamacpp.across_runs([_run(0.8), avx2])) == 2
    assert "- (no run)" in llamacpp.across_runs_table(llamacpp.across_runs([_run(None)]))


def test_generation_rows_from_llama_cpp(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from qbench.studies.speed import format_speed_table, run_speed

    open_now, most_open = [0], [0]  # each engine maps its whole file: one open at a time

    class Counted(llamacpp.LlamaCppGenerator):
        def __post_init__(self):
            super().__post_init__()
            open_now[0] += 1
            most_open[0] = max(most_open[0], open_now[0])

        def close(self):
            open_now[0] -= 1
            super().close()

    monkeypatch.setattr(llamacpp, "LlamaCppGenerator", Counted)
    records = run_speed(
        threads=1,
        repeats=1,
        schemes=["absmax-fine"],
        modes=["real"],
        layer=False,
        model="tiny",
        model_tokens=16,
        new_tokens=4,
        kv=False,
        llama_cpp_types=["F32", "Q8_0"],
    )
    rows = {r["name"]: r for r in records if r["kind"] == "generate"}
    f32, q8 = rows["llama.cpp F32"], rows["llama.cpp Q8_0"]
    for rec in (f32, q8):
        assert rec["error"] is None and rec["tokens_per_s"] > 0 and rec["speedup"] > 0
        assert rec["backend"].startswith("llama-cpp-python") and rec["qbench_vs_llama_cpp"] > 0
    assert set(f32["gguf_tensor_types"]) == {"F32"}
    assert "Q8_0" in q8["gguf_tensor_types"] and q8["weight_bytes"] < f32["weight_bytes"]
    # the matched scheme (its head quantised, as llama.cpp's is) was added to the generation figure
    assert q8["qbench_match"] == "absmax-fine:head=true [real]" and f32["qbench_match"] == "tiny fp32"
    assert rows["absmax-fine:head=true [real]"]["error"] is None
    table = format_speed_table(records)
    assert "llama.cpp Q8_0" in table and "qbench / llama.cpp" in table
    assert most_open[0] == 1 and open_now[0] == 0


def test_generator_follows_the_greedy_protocol(tmp_path):
    pytest.importorskip("llama_cpp")
    from models import build, preset_config
    from models.gguf_export import write_gguf

    model = build(preset_config("tiny"), seed=0).eval()
    path = write_gguf(model, tmp_path / "m.gguf", None, placeholder_vocab=True)
    gen = llamacpp.LlamaCppGenerator(path, threads=1, context=32)
    try:
        first = gen.generate([1, 2, 3, 4], 6)
        again = gen.generate([1, 2, 3, 4], 6)  # the cache is cleared: the same prompt gives the same tokens
    finally:
        gen.close()
    assert len(first) == 6 and first == again
    assert all(0 <= t < model.config.vocab_size for t in first)
