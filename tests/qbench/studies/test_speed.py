"""The speed benchmark's structure (not its figures): records, ratios, table, thread restore."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.errors import UserError
from qbench.quant.apply import model_bytes
from qbench.quant.kv import KVConfig
from qbench.studies.speed import format_speed_table, greedy_generate, run_speed, time_interleaved

SCHEMES = [
    "absmax-fine",
    "absmax-coarse",
    "absmax-fine-perchannel",
    "zeropoint-int4",
    "absmax-w4a8",
    "llm-int8",
    "smoothquant",
]


@pytest.fixture(scope="module")
def records():
    torch.set_num_threads(2)
    recs = run_speed(
        shape=(64, 32),
        tokens=16,
        threads=1,
        repeats=1,
        schemes=SCHEMES,
        bandwidth=False,
        model="tiny",
        model_tokens=16,
        new_tokens=4,
        kv_configs=[KVConfig(4, "per-token"), KVConfig(2), KVConfig(8, "fp8-e4m3"), KVConfig(2, "window")],
        kv_contexts=(8, 140),  # 140 > tiny's context 128: the preset is rebuilt with a longer one
        kv_new_tokens=3,
    )
    assert torch.get_num_threads() == 2  # restored
    return recs


def by_name(records, kind):
    return {r["name"]: r for r in records if r["kind"] == kind}


def test_layer_records(records):
    layer = by_name(records, "layer")
    fp32 = layer["fp32 (F.linear)"]
    assert (
        fp32["speedup"] == 1.0 and fp32["weight_bytes"] == (64 * 32 + 32) * 4 and fp32["bytes_vs_fp32"] == 1.0
    )
    for scheme in (s for s in SCHEMES if not s.startswith("gguf:")):  # llama.cpp's: timed by --llama-cpp
        for mode in ("fake", "real"):
            assert f"{scheme} [{mode}]" in layer
    for name in (
        "absmax-fine [real]",
        "zeropoint-int4 [real]",
        "llm-int8 [real]",
        "smoothquant [real]",
        "torch._int_mm alone (ceiling)",
        "torch.ao quantize_dynamic int8",
        "absmax-fine:a=none [real] (W8A16)",
    ):
        rec = layer[name]
        assert rec["error"] is None and rec["ms"] > 0 and rec["speedup"] > 0, name
        assert rec["bytes_vs_fp32"] < 0.4, name  # int8 / int4 storage, scales and bias included
    assert layer["absmax-fine [real]"]["backend"].startswith("Int8Linear")
    assert layer["zeropoint-int4 [real]"]["weight_bytes"] < layer["absmax-fine [real]"]["weight_bytes"]
    unsupported = layer["absmax-fine-perchannel [real]"]
    assert unsupported["ms"] is None and "no real kernel" in unsupported["error"]
    weights = [r for r in records if r["kind"] != "kv"]
    assert all(r["threads"] == 1 and r["tokens"] == 16 and r["repeats"] == 1 for r in weights)


def test_model_records(records):
    model = by_name(records, "model")
    assert model["tiny fp32"]["speedup"] == 1.0
    assert model["tiny bf16"]["error"] is None and model["tiny bf16"]["bytes_vs_fp32"] == 0.5
    real = model["absmax-fine [real]"]
    assert real["error"] is None and 0.3 < real["bytes_vs_fp32"] < 1.0  # embeddings stay float


def test_generate_records(records):
    gen = by_name(records, "generate")
    assert gen["tiny fp32"]["speedup"] == 1.0 and gen["tiny fp32"]["tokens_per_s"] > 0
    assert gen["tiny bf16"]["error"] is None and gen["tiny bf16"]["tokens_per_s"] > 0
    for name in ("absmax-fine [real]", "zeropoint-int4 [real]", "absmax-w4a8 [real]"):
        assert gen[name]["error"] is None and gen[name]["tokens_per_s"] > 0, name
        assert gen[name]["via"] == "qbench models.KVCache" and gen[name]["new_tokens"] == 4
        # the linear layers' kernels alone per step, against the measured time per token
        rec = gen[name]
        assert 0 < rec["linear_kernels_ms"] and rec["ms_per_token"] == rec["ms_min"] / 4
        assert rec["linear_share"] == rec["linear_kernels_ms"] / rec["ms_per_token"]
    assert "no real kernel" in gen["absmax-fine-perchannel [real]"]["error"]
    assert gen["absmax-fine-perchannel [real]"]["linear_share"] is None
    # decode steps through qbench's runtime where it serves the net (float32 on CPU), the eager step elsewhere
    from qbench.eval import decode
    from qbench.quant.kernels import native

    runtime = (
        decode.ENGINE if native.available() else f"{decode.EAGER}: native kernels not built or switched off"
    )
    for name in ("tiny fp32", "absmax-fine [real]", "zeropoint-int4 [real]", "absmax-w4a8 [real]"):
        assert gen[name]["decode"] == runtime, name
    assert gen["tiny bf16"]["decode"].startswith(f"{decode.EAGER}: torch.bfloat16")
    assert "decode steps: " in format_speed_table(records)


def test_generate_eager_runs_the_model_forward_every_step():
    recs = run_speed(
        repeats=1, schemes=["absmax-fine"], modes=["real"], model="tiny", model_tokens=8, new_tokens=3,
        layer=False, kv=False, generate_via="eager", threads=1,
    )  # fmt: skip
    gen = {r["name"]: r for r in recs if r["kind"] == "generate"}
    assert {r["decode"] for r in gen.values()} == {"model.generate (torch eager): --generate-via eager"}
    assert all(r["error"] is None for r in gen.values())


def test_kv_records(records):
    kv = [r for r in records if r["kind"] == "kv"]
    assert [(r["context"], r["cache"]) for r in kv] == [
        (c, name) for c in (8, 140) for name in ("float", "kv4-tok", "kv2", "kv8-e4m3", "kv2-win")
    ]
    for r in kv:  # self-describing
        assert r["model"] == "tiny" and r["new_tokens"] == 3 and r["threads"] == 1 and r["seed"] == 0
        assert (
            r["torch"] == torch.__version__ and r["cpu"] and "git_commit" in r and r["model_context"] == 143
        )
        assert r["float_dtype"] == "float32"
    by = {(r["context"], r["cache"]): r for r in kv}
    for c in (8, 140):
        assert by[c, "float"]["speedup"] == 1.0 and by[c, "float"]["bytes_vs_float"] == 1.0
        assert by[c, "kv4-tok"]["bytes_vs_float"] == pytest.approx(18 / 128)  # q4_0 blocks vs float32
        assert by[c, "kv8-e4m3"]["bytes_vs_float"] == pytest.approx(1 / 4)
        assert by[c, "kv8-e4m3"]["kv"]["scheme"] == "fp8-e4m3" and by[c, "kv2"]["kv"]["residual"] == 128
        for name in ("kv4-tok", "kv2", "kv8-e4m3"):
            rec = by[c, name]
            assert rec["error"] is None and rec["tokens_per_s"] > 0 and rec["speedup"] > 0, rec
        assert "no packed form" in by[c, "kv2-win"]["error"] and by[c, "kv2-win"]["tokens_per_s"] is None
    assert by[8, "kv2"]["bytes_vs_float"] == 1.0  # KIVI: fewer than R = 128 positions, all float
    assert by[140, "kv2"]["bytes_vs_float"] < 1.0
    table = format_speed_table(records, "github")
    assert "KV cache, generation: tiny, prefill 140 tokens then 3 decode steps timed" in table
    assert "| kv4-tok" in table and "speed vs float" in table


def test_kv_section_bounds_and_checkpoints(ckpt_dir):
    from qbench.studies.kvspeed import kv_configs

    assert [c.label for c in kv_configs(None, None)] == [
        "kv8", "kv4", "kv2", "kv8-tok", "kv4-tok", "kv2-tok", "kv8-e4m3"
    ]  # fmt: skip
    assert [c.label for c in kv_configs(["per-token", "fp8-e5m2"], [4, 2])] == [
        "kv4-tok",
        "kv2-tok",
        "kv8-e5m2",
    ]
    with pytest.raises(UserError, match="KV contexts"):
        run_speed(repeats=1, schemes=[], layer=False, model="tiny", kv_contexts=(0,))
    recs = run_speed(
        repeats=1, schemes=[], model=None, ckpt=str(ckpt_dir), model_tokens=8, new_tokens=2, layer=False,
        generate=False, kv_configs=[KVConfig(8, "fp8-e4m3")], kv_contexts=(4, 100000), kv_new_tokens=2,
    )  # fmt: skip
    kv = [r for r in recs if r["kind"] == "kv"]
    assert kv[0]["error"] is None and kv[1]["tokens_per_s"] > 0
    assert all("exceeds the model's context" in r["error"] for r in kv[2:])  # a checkpoint keeps its context


def test_greedy_generate_equals_transformers_generate():
    from models import build, preset_config
    from models.hf import to_hf_model

    hf = to_hf_model(build(preset_config("tiny"), seed=0))
    prompt = torch.randint(0, 8192, (1, 7))
    ours = greedy_generate(hf, prompt, 5)
    theirs = hf.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)[:, 7:]
    assert torch.equal(ours, theirs)


def test_our_cache_generates_what_the_transformers_export_generates():
    """Our models decode with models.KVCache; the same tokens come out of their transformers twin's cache."""
    from models import build, preset_config
    from models.hf import to_hf_model

    model = build(preset_config("tiny"), seed=0).eval()
    prompt = torch.randint(0, 8192, (1, 7), generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy_generate(model, prompt, 6), greedy_generate(to_hf_model(model), prompt, 6))


def test_table(records):
    table = format_speed_table(records)
    assert "per layer: 64→32, 16 tokens, 1 thread(s)" in table and "whole model, prefill: tiny" in table
    assert "whole model, generation: tiny, 4 new tokens after 16, batch 1, KV cache" in table
    assert "absmax-fine [real]" in table and "has no real" in table


def test_bandwidth_table_from_records():
    common = {
        "kind": "bandwidth",
        "scheme": None,
        "mode": None,
        "backend": "x",
        "threads": 1,
        "shape": [4, 8],
        "tokens": 2,
        "repeats": 3,
        "malloc_env": True,
        "speedup": None,
        "weight_bytes": None,
        "bytes_vs_fp32": None,
        "error": None,
    }
    recs = [
        {**common, "name": "copy (clone)", "ms": 1.0, "gb_per_s": 20.0, "vs_copy": 1.0},
        {**common, "name": "fake-quant fused", "ms": 2.0, "gb_per_s": 10.0, "vs_copy": 0.5},
    ]
    table = format_speed_table(recs)
    assert "fake-quant bandwidth" in table and "50" in table and "page faults" not in table


def test_time_interleaved_round_robin():
    order = []
    times = time_interleaved([lambda: order.append("a"), lambda: order.append("b")], repeats=3)
    assert order == ["a", "b"] * 3 and [len(t) for t in times] == [3, 3]


def test_storage_bytes_counts_tied_weights_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert model_bytes(nn.Sequential(emb, head)) == 10 * 4 * 4


def test_bad_arguments():
    with pytest.raises(UserError):
        run_speed(shape=(8, 8), tokens=0, repeats=1, schemes=[], bandwidth=False, model=None)
    with pytest.raises(UserError, match="unknown generation path 'hf'"):
        run_speed(shape=(8, 8), repeats=1, schemes=[], bandwidth=False, model=None, generate_via="hf")


@pytest.mark.parametrize("fixture", ["hf_llama_dir", "ckpt_dir"])
def test_whole_model_figures_for_a_checkpoint(request, fixture):
    ckpt = str(request.getfixturevalue(fixture))  # a transformers folder; a qbench checkpoint (softmax-1)
    recs = run_speed(
        threads=1,
        repeats=1,
        schemes=["absmax-fine", "zeropoint-int4"],
        modes=["real"],
        model=None,
        ckpt=ckpt,
        model_tokens=8,
        new_tokens=3,
        layer=False,
        kv=False,
    )
    assert {r["kind"] for r in recs} == {"model", "generate"}
    gen = [r for r in recs if r["kind"] == "generate"]
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in gen), gen
    via = gen[0]["via"]
    # a transformers Llama folder generates on qbench's graph, converted and checked (models.hf.from_hf_model)
    assert via == (
        "qbench models.KVCache (converted from transformers), q/k/v and gate/up fused"
        if fixture == "hf_llama_dir"
        else "qbench models.KVCache"
    )
    if fixture == "hf_llama_dir":  # a scheme that does not fuse ran on the separate layers, and says so
        moderate = run_speed(
            repeats=1, schemes=["absmax-moderate"], modes=["real"], model=None, ckpt=ckpt, model_tokens=8,
            new_tokens=3, layer=False, kv=False,
        )  # fmt: skip
        vias = {r["name"]: r["via"] for r in moderate if r["kind"] == "generate"}
        assert vias["absmax-moderate [real]"] == "qbench models.KVCache (converted from transformers)", vias
    if fixture == "hf_llama_dir":  # transformers' own graph on request
        own = run_speed(
            repeats=1, schemes=["absmax-fine"], modes=["real"], model=None, ckpt=ckpt, model_tokens=8,
            new_tokens=3, layer=False, generate_via="transformers", kv=False,
        )  # fmt: skip
        assert {r["via"] for r in own if r["kind"] == "generate"} == {"transformers (KV cache)"}
    if fixture == "ckpt_dir":  # the export path a user who converts the checkpoint would run
        exported = run_speed(
            repeats=1, schemes=[], modes=["real"], model=None, ckpt=ckpt, model_tokens=8, new_tokens=3,
            layer=False, generate_via="transformers", kv=False,
        )  # fmt: skip
        assert {r["via"] for r in exported if r["kind"] == "generate"} == {
            "exported to transformers (KV cache)"
        }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_speed_on_cuda():
    recs = run_speed(
        shape=(64, 32),
        tokens=16,
        repeats=1,
        schemes=["absmax-fine", "zeropoint-int4"],
        modes=["real"],
        model="tiny",
        model_tokens=16,
        new_tokens=2,
        device="cuda",
        kv_configs=[KVConfig(4, "per-token")],
        kv_contexts=(8,),
        kv_new_tokens=2,
    )
    for kind in ("layer", "model", "generate"):
        rec = by_name(recs, kind)["absmax-fine [real]"]
        assert rec["error"] is None and rec["device"] == "cuda" and rec["ms"] > 0, kind
    kv = [r for r in recs if r["kind"] == "kv"]
    assert all(r["error"] is None and r["device"] == "cuda" and r["tokens_per_s"] > 0 for r in kv), kv


def test_a_layer_off_the_cpu_is_never_labelled_with_the_cpu_kernels():
    # the first H200 table named "C AVX2 + AVX-512 VNNI" (the host CPU's build) beside CUDA timings
    from torch import nn

    from qbench.quant import quantize
    from qbench.studies.speed import _backend_of

    q = quantize(nn.Sequential(nn.Linear(64, 64)), "absmax-fine", mode="real")
    assert "torch on" not in _backend_of(q, "real")
    assert _backend_of(q.to("meta"), "real") == "Int8Linear, torch on meta (W8A8: torch._int_mm)"


def test_call_overhead_records_time_generic_fast_and_the_bare_kernel():
    from qbench.quant.kernels import native, paths
    from qbench.studies.overhead import OVERHEAD_SCHEMES, call_overhead_records
    from qbench.studies.speed import format_speed_table

    common = {"threads": 1, "cpu": "test cpu", "device": "cpu"}
    if not native.available():
        assert call_overhead_records(common, shape=(64, 48), calls=20) == []
        return
    run_fast = paths.run_fast
    recs = call_overhead_records(common, shape=(64, 48), calls=20)
    assert paths.run_fast is run_fast  # restored
    assert [r["name"] for r in recs] == list(OVERHEAD_SCHEMES)
    for r in recs:
        assert r["kind"] == "overhead", r
        if r["error"] is not None:  # a weight-only kind in the portable build: no GEMV, no bound call
            assert r["error"] == "no bound C call on this build" and not r["kept"] and native.isa() == "C", r
            continue
        assert r["kept"] and min(r["generic_us"], r["fast_us"], r["kernel_us"]) > 0, r
        assert r["overhead_fast_us"] == r["fast_us"] - r["kernel_us"]
    assert recs[0]["error"] is None  # W8A8 has a GEMV in every build
    table = format_speed_table(recs)
    assert "per-call overhead at decode: 64→48, 1 row" in table and "LowBitLinear c-gemv" in table
    assert call_overhead_records({**common, "device": "cuda"}) == []


def test_fused_projections_quantise_as_the_separate_layers_where_fusable():
    """Generation quantises the fused q/k/v and gate/up where that equals quantising them apart (row-wise scales,
    round to nearest, nothing calibrated per layer): the real models' outputs are equal bit for bit; per-tensor
    scales would see the three matrices at once, so those schemes keep the separate layers."""
    from models import family_config
    from models.transformer import build, fuse_projections
    from qbench.quant import quantize
    from qbench.quant.kernels import paths
    from qbench.studies.speed import fusable

    assert all(fusable(s) for s in ("absmax-fine", "zeropoint-w4a8-g32:head=true", "absmax-w4a8", "int4-g32"))
    assert not any(
        fusable(s)
        for s in (
            "absmax-moderate",
            "absmax-coarse",
            "smoothquant",
            "absmax-w4a8-g32:algo=gptq",
            "nvfp4",
            "no",
        )
    )
    model = build(family_config("llama", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, context=32,
                                vocab_size=100, bias=True), seed=1).eval()  # fmt: skip
    fused = fuse_projections(model)
    x = torch.randint(0, 100, (1, 20))
    for scheme in ("zeropoint-w4a8-g32", "absmax-fine", "zeropoint-int4-g32"):
        a, b = quantize(model, scheme, mode="real"), quantize(fused, scheme, mode="real")
        for path in ("c-gemv", None):
            with torch.inference_mode(), paths.force(path):
                assert torch.equal(a(x), b(x)), (scheme, path)


def test_whole_model_figures_hold_one_quantised_model_at_a_time(monkeypatch):
    """Prefill and generation build each scheme's copy for its own round and drop it before the next: the
    memory held is the float model's plus one copy's, whatever the number of schemes."""
    import gc
    import weakref

    from qbench.studies import speed

    built, most_alive = [], [0]
    real_quantized = speed._quantized

    def counting(model, scheme, mode, calibration):
        gc.collect()
        alive = sum(ref() is not None for ref in built)
        most_alive[0] = max(most_alive[0], alive)
        q = real_quantized(model, scheme, mode, calibration)
        built.append(weakref.ref(q))
        return q

    monkeypatch.setattr(speed, "_quantized", counting)
    recs = run_speed(
        repeats=2, schemes=["absmax-fine", "zeropoint-int4", "absmax-coarse"], modes=["fake", "real"],
        model="tiny", model_tokens=8, new_tokens=3, layer=False, kv=False, threads=1,
    )  # fmt: skip
    assert len(built) == 3 * 2 + 3  # prefill: every scheme × mode; generation: every scheme, real
    assert most_alive[0] == 0  # when a copy is built, no earlier copy is left
    gc.collect()
    assert all(ref() is None for ref in built)
    for kind in ("model", "generate"):
        rows = {r["name"]: r for r in recs if r["kind"] == kind}
        fp32 = rows.pop("tiny fp32")
        assert len(fp32["ms_repeats"]) == 2 * len(rows)  # the reference is timed beside every candidate
        for r in rows.values():
            assert r["error"] is None and len(r["ms_repeats"]) == 2 and r["speedup"] > 0
            assert r["weight_bytes"] > 0
