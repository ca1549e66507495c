"""Every dispatch branch of the real layers that this CPU can take, forced, equals fake mode (``paths.force``).

The default branch depends on the CPU (``torch._int_mm`` for W8A8 above 16 rows only with AVX-512 VNNI / AMX,
the C GEMV / GEMM only in AVX2 builds), so a test of the defaults alone leaves branches untested on any one
machine. Here each path ``paths.offered`` lists for this build is forced at 1, 16, 17 and 512 rows and compared
with ``FakeQuantLinear``; the integer paths (W8A8 all four, W4A8 per channel) must agree bit for bit.
"""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch

from models.errors import UserError
from qbench.quant.granularity import PerGroup
from qbench.quant.kernels import PATH_LAYERS, kernel_paths, native, paths
from qbench.quant.kernels.bnb import bnb_available
from tests.qbench.quant.real_cases import CASES, build, inputs, rel_err

ROWS = (1, 16, 17, 512)  # decode, the last GEMV row count, the first above it, a prefill
# float32 dot products of fake mode against the kernels' exact integer sums or reassociated float sums
FLOAT_ROUNDING = 5e-6


def _forward(layer: torch.nn.Module, x: torch.Tensor, path: str | None) -> tuple[torch.Tensor, str]:
    with paths.force(path), torch.inference_mode():
        y = layer(x)
    return y, layer.last_path


def _bound(case, path: str) -> float:
    if case.float_exact and path in ("c-dequant", "torch"):
        return 0.0  # the same Ŵ (bit for bit) and the same F.linear as fake mode
    if case.scheme.out_bits is not None:
        # output quantised per sequence: a float-rounding difference may move one output code by one step
        return 1.01 / 127
    return FLOAT_ROUNDING


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_offered_path_equals_fake_mode(case, rows):
    real, fake = build(case)
    x = inputs(rows, case.in_features)
    with torch.inference_mode():
        expected = fake(x)
    outputs = {}
    for path in paths.offered(case.kind):
        with paths.force(path):
            assert paths.choose(case.kind, rows) == path
        y, taken = _forward(real, x, path)
        assert taken == path, f"{case.id}: forced {path}, ran {taken}"
        assert y.dtype == torch.float32 and not y.isnan().any()
        err = rel_err(y, expected)
        assert err <= _bound(case, path), f"{case.id} {path} at {rows} rows: {err:.3g}"
        outputs[path] = y
    integer: tuple[str, ...] = ()
    if case.kind == "w8a8":
        integer = tuple(outputs)  # every W8A8 path: exact int32 sums, then the same epilogue order
    elif case.kind == "w4a8" and not isinstance(case.scheme.weight_granularity, PerGroup):
        # per channel the C loops' int32 sums are exact; per group of 32 the decode loop adds the scaled group
        # sums in another float order (equal to rounding, checked above)
        integer = ("c-gemv", "c-gemm", "int-mm")
    elif case.kind == "w4a8":  # per group: _int_mm per group folds the sums in the C GEMM's order
        integer = ("c-gemm", "int-mm")
    same = [p for p in integer if p in outputs]
    for path in same[1:]:
        assert torch.equal(outputs[path], outputs[same[0]]), f"{case.id}: {path} != {same[0]} at {rows} rows"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layers_take_the_path_choose_names(case, rows):
    """What ``qbench env`` lists (``paths.choose``) is what the layer runs, unforced."""
    real, _ = build(case)
    _, taken = _forward(real, inputs(rows, case.in_features), None)
    scales = getattr(real, "scales", None)  # per-group W4A8 takes the C GEMM where per channel takes _int_mm
    groups = scales.shape[1] if scales is not None and scales.dim() == 2 else 1
    assert taken == paths.choose(case.kind, rows, (case.in_features, case.out_features, groups))


def test_default_choice_follows_the_cpu(monkeypatch):
    if not native.available():
        assert {paths.choose(k, r) for k in paths.KINDS for r in ROWS} == {"torch"}
        return
    avx2 = native.isa() == "AVX2"
    for preferred, big in ((True, "int-mm"), (False, "c-gemm" if avx2 else "c-gemv")):
        monkeypatch.setattr(paths, "int_mm_preferred", lambda p=preferred: p)
        assert paths.choose("w8a8", 16) == "c-gemv" and paths.choose("w8a8", 17) == big
    assert paths.choose("w4a8", 17) == ("c-gemm" if avx2 else "c-gemv")
    assert (
        paths.choose("w4", 16) == ("c-gemv" if avx2 else "c-dequant")
        and paths.choose("w8", 17) == "c-dequant"
    )
    assert paths.choose("lowbit", 1) == "c-gemv" and paths.choose("lowbit", 17) == "c-dequant"


def test_the_portable_build_runs_its_one_loop_at_every_row_count(monkeypatch):
    """Without AVX2 (``native.isa() == "C"``) there is no C GEMM and no weight-only GEMV to choose."""
    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(native, "isa", lambda: "C")
    monkeypatch.setattr(paths, "int_mm_preferred", lambda: False)
    assert paths.offered("w8a8") == ("c-gemv", "int-mm", "torch")
    assert [paths.choose(k, r) for k in ("w8a8", "w4a8") for r in (1, 512)] == ["c-gemv"] * 4
    assert {paths.choose(k, r) for k in ("w4", "w8") for r in (1, 512)} == {"c-dequant"}
    # the packed 2/3/4-bit codes have a scalar loop in the portable build too
    assert [paths.choose("lowbit", r) for r in (1, 512)] == ["c-gemv", "c-dequant"]
    assert paths.describe("w8a8", 512) == "portable C GEMV"


def test_force_by_environment_and_bad_names(monkeypatch):
    monkeypatch.setattr(paths, "env_forced", functools.cache(paths.env_forced.__wrapped__))
    monkeypatch.setenv(paths.FORCE_ENV, "torch")
    assert {paths.choose(k, r) for k in paths.KINDS for r in ROWS} == {"torch"}
    with paths.force("c-dequant"):  # the context manager wins over the environment
        assert paths.choose("w8", 1) == ("c-dequant" if native.available() else "torch")
        assert paths.choose("w8a8", 1) != "c-dequant"  # a kind without that path keeps its default
    monkeypatch.setenv(paths.FORCE_ENV, "c-gemmm")
    paths.env_forced.cache_clear()  # the variable is read once per process
    with pytest.raises(UserError, match=r"QBENCH_FORCE_PATH='c-gemmm'.*c-gemm"):
        paths.choose("w8a8", 1)
    with pytest.raises(UserError, match="kernel path 'gemv'"), paths.force("gemv"):
        pass
    with pytest.raises(UserError, match="real layer kind"):
        paths.choose("int5", 1)


def test_the_env_listing_is_the_dispatch():
    """``qbench env``'s paths come from ``paths.choose``: forcing a path changes the listing with it."""
    listing = kernel_paths()
    assert {"cpu instruction set", "path W8A8 (Int8Linear)", "path W4A8 (Int4A8Linear)"} <= set(listing)
    for name, kind in PATH_LAYERS:
        text = listing[f"path {name}"]
        assert (
            f"1 row: {paths.describe(kind, 1)};" in text and f"512 rows: {paths.describe(kind, 512)}" in text
        )
    big = "torch._int_mm" if paths.int_mm_preferred() and native.available() else "GEMM"
    assert big in listing["path W8A8 (Int8Linear)"].split("512 rows:")[1]
    with paths.force("torch"):
        assert "C " not in kernel_paths()["path W8A8 (Int8Linear)"]
    if bnb_available():
        from bitsandbytes.functional import has_avx512bf16

        nf4 = "bf16 compute" if has_avx512bf16() else "fp32 compute"
        assert nf4 in listing["path bnb-nf4 (BnbLinear)"]


def test_qbench_env_prints_the_paths(capsys):
    from qbench.cli import main

    assert main(["env"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table wraps long cells
    assert "instruction set" in out and "Int8Linear" in out and "LowBitLinear" in out
    assert "1 row:" in out and "rows:" in out


# ------------------------------------------------------------------------------ dispatch by measurement

MEASURED_CASES = [
    c for c in CASES if c.id in ("w8a8-channel-token", "w4a8-g32", "int3-g128", "w8-zp-channel")
]


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """The measured dispatch (the default outside the test suite) with an empty cache folder."""
    monkeypatch.setenv(paths.DISPATCH_ENV, "measure")
    monkeypatch.setenv("QBENCH_CACHE", str(tmp_path))
    paths.reset_measured()
    yield tmp_path
    paths.reset_measured()


@pytest.mark.skipif(not native.available(), reason="no C kernels: nothing to measure")
@pytest.mark.parametrize("case", MEASURED_CASES, ids=[c.id for c in MEASURED_CASES])
def test_measured_choice_is_offered_cached_and_read_back(case, measuring, monkeypatch):
    """First use times the C paths per shape class and keeps the fastest (one of those offered, never torch); the
    choices go to the cache file; a fresh process (memory cleared) reads them back without timing anything."""
    real, fake = build(case)
    taken = {}
    for rows in (1, 5, 17):
        x = inputs(rows, case.in_features)
        y, taken[rows] = _forward(real, x, None)
        assert taken[rows] in paths.offered(case.kind) and taken[rows] != "torch"
        with torch.inference_mode():
            assert rel_err(y, fake(x)) <= max(_bound(case, taken[rows]), FLOAT_ROUNDING)
    file = paths.cache_file()
    assert file.parent == measuring / "dispatch" and file.stem == paths.machine_key()
    data = json.loads(file.read_text())
    assert data["cpu"] == paths.cpu_model() and data["torch"] == torch.__version__
    assert len(data["choices"]) == 3  # rows 1, ≤ 16, > 16: three classes
    shape = (case.in_features, case.out_features, getattr(real, "scales", torch.ones(1, 1)).shape[-1])
    for key, entry in data["choices"].items():
        # the kept path is the fastest, or the rule's where none beats it by the margin (a tie after rounding to
        # 0.1 µs may name either of the tied paths)
        rows = {"1": 1, "le16": 5, "gt16": 17}[key.split("/")[1].removeprefix("rows-")]
        ms, kept, default = entry["ms"], entry["path"], paths.rule(case.kind, rows, shape)
        fastest = min(ms.values())
        assert key.startswith(case.kind + "/")
        if default in ms and fastest * (1 + paths.MEASURE_MARGIN) >= ms[default] - 1e-4:
            assert kept == default or ms[kept] == fastest, entry
        else:
            assert ms[kept] == fastest, entry
        assert set(ms) <= set(paths.offered(case.kind)) - {"torch"}
    paths.reset_measured()

    def no_timing(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(paths, "_measure", no_timing)
    for rows in (1, 5, 17):
        assert _forward(real, inputs(rows, case.in_features), None)[1] == taken[rows]
    assert _forward(real, inputs(1, case.in_features), "torch")[1] == "torch"  # a forced path still wins
    monkeypatch.setenv(paths.DISPATCH_ENV, "rule")  # the fixed rule, whatever was measured
    assert _forward(real, inputs(17, case.in_features), None)[1] == paths.rule(case.kind, 17, shape)


def test_measured_dispatch_survives_a_broken_cache_file(measuring):
    case = MEASURED_CASES[0]
    file = paths.cache_file()
    file.parent.mkdir(parents=True)
    file.write_text("{not json")
    real, _ = build(case)
    _, taken = _forward(real, inputs(1, case.in_features), None)
    assert taken in paths.offered(case.kind)
    assert json.loads(file.read_text())["choices"]  # rewritten whole (atomic rename), the bad content gone
    assert not list(file.parent.glob("*.tmp"))


@pytest.mark.skipif(not native.available(), reason="no C kernels: nothing to measure")
def test_qbench_env_prints_the_measured_choices(measuring, capsys):
    from qbench.cli import main

    case = MEASURED_CASES[0]
    real, _ = build(case)
    _, taken = _forward(real, inputs(1, case.in_features), None)
    listing = kernel_paths()
    assert str(paths.cache_file()) in listing["kernel dispatch"]
    (key,) = [k for k in listing if k.startswith("measured w8a8/rows-1/")]
    assert listing[key].startswith(taken + " (")
    assert main(["env"]) == 0
    out = capsys.readouterr().out  # the table wraps long cells: the listing's keys are checked above
    assert "measured" in out and "kernel dispatch" in out


def test_the_measured_choices_are_keyed_on_the_kernels_sources(monkeypatch):
    """A changed kernel is measured again: the cache key moves when the C sources do (a new kernel judged by its
    predecessor's times would keep a path that is no longer the fastest)."""
    from qbench.quant.kernels import build

    before = paths.machine_key()
    assert _key_with(monkeypatch, "source_digest", lambda names: "another kernel") != before
    assert paths.machine_key() == before == paths.machine_key()
    assert build.source_digest(native.NATIVE_SOURCES) == build.source_digest(native.NATIVE_SOURCES)


@pytest.mark.skipif(not native.available(), reason="no C kernels: nothing to measure")
def test_every_timed_call_of_the_measurement_starts_with_the_caches_flushed(measuring, monkeypatch):
    """A decode step reads each layer's weights from memory: a candidate timed with its weights still in cache
    from the previous run is judged on the wrong thing (hot timing chose torch._int_mm where the C GEMV is faster
    in the model's step). Each timed call follows a flush, and the protocol is part of the cache key."""
    events = []
    real_clock = time.perf_counter
    monkeypatch.setattr(paths, "flush_caches", lambda: events.append("flush"))
    monkeypatch.setattr(paths.time, "perf_counter", lambda: events.append("clock") or real_clock())
    case = MEASURED_CASES[0]
    real, _ = build(case)
    _forward(real, inputs(1, case.in_features), None)
    starts = [i for i, e in enumerate(events) if e == "clock"][::2]  # start, stop, start, stop ...
    assert starts and all(events[i - 1] == "flush" for i in starts)
    assert paths.last_level_cache_bytes() >= 2**20 and paths._eviction_buffer().numel() >= 2**21
    monkeypatch.undo()  # the real clock and flush again
    before = paths.machine_key()
    assert _key_with(monkeypatch, "MEASURE_PROTOCOL", "hot") != before


def _key_with(monkeypatch, attribute, value):
    """The cache key with one of its ingredients changed (then restored, the cached key cleared both times)."""
    monkeypatch.setattr(paths, attribute, value)
    paths.machine_key.cache_clear()
    try:
        return paths.machine_key()
    finally:
        monkeypatch.undo()
        paths.machine_key.cache_clear()


def test_a_near_tie_keeps_the_rules_path():
    """A measured path replaces the rule's only when MEASURE_MARGIN faster: cold timings of a few calls are noisy,
    and a 10 % reading once moved gpt2-130m's W8A8 decode onto the slower torch._int_mm."""
    margin = paths.MEASURE_MARGIN
    assert (
        paths.measured_choice({"c-gemv": 0.160, "int-mm": 0.142}, "c-gemv") == "c-gemv"
    )  # 11 % faster: a tie
    faster = 0.160 / (1 + margin) * 0.99
    assert paths.measured_choice({"c-gemv": 0.160, "int-mm": faster}, "c-gemv") == "int-mm"
    assert (
        paths.measured_choice({"c-gemm": 0.3, "int-mm": 0.2}, "c-gemv") == "int-mm"
    )  # the rule's path untimed
