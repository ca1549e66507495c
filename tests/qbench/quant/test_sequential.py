"""Sequential calibration (``qbench.quant.sequential``) and the layer error in and out of sample
(``qbench.quant.solve``): block i's statistics are those of the float block i fed by the quantised blocks before it —
checked against a model built by hand with only block 0 quantised — on transformers' and qbench's own blocks; the
float model is untouched; a model whose blocks take different arguments is refused; the reported layer error is
its formula on the rows it names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import build
from models.errors import UserError
from qbench.quant.apply import linear_weight, quantize, select_layers
from qbench.quant.calibrate import StatisticsCollector, input_statistics
from qbench.quant.fake import FakeQuantLinear
from qbench.quant.schemes import get_scheme
from qbench.quant.sequential import check_shared_arguments, decoder_blocks, run_sequential
from qbench.quant.solve import effective_weight

transformers = pytest.importorskip("transformers")
from tests.qbench.conftest import micro_config  # noqa: E402
from tests.qbench.quant.test_apply import assert_same_state, snapshot, tiny_llama  # noqa: E402

CALIB = torch.randint(0, 128, (12, 32), generator=torch.Generator().manual_seed(3))
HELD = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(4))


def _ours():
    return build(micro_config("llama", norm="rmsnorm"), seed=2).eval()


@pytest.mark.parametrize("make", [tiny_llama, _ours], ids=["transformers-llama", "ours"])
def test_block_one_sees_what_quantised_block_zero_outputs(make):
    model = make()
    vocab = 128
    calib = CALIB % vocab
    scheme = get_scheme("zeropoint-int4:algo=gptq")
    layers = select_layers(model, scheme)
    name, blocks = decoder_blocks(model, layers)
    assert len(blocks) == 2 and name in ("model.layers", "transformer.h")
    before = snapshot(model)
    built: dict[str, nn.Module] = {}

    def solve_block(part, stats):  # round-to-nearest stands in for the solve: the test is about the inputs
        out = {n: FakeQuantLinear(linear_weight(m)[0], linear_weight(m)[1], scheme) for n, m in part.items()}
        built.update(out)
        return out

    stats, held, outside = run_sequential(model, layers, calib, HELD % vocab, solve_block)
    assert_same_state(model, before) and outside == []
    assert set(stats) == set(layers) == set(held)
    # by hand: the float model with block 0's layers swapped for their quantised versions, observed at block 1
    import copy

    first = {n for n in layers if any(m is layers[n] for m in blocks[0].modules())}
    memo = {id(layers[n]): built[n] for n in first}
    hybrid = copy.deepcopy(model, memo)
    hybrid_layers = select_layers(hybrid, scheme)  # block 0's layers are fake-quantised now: not selected
    assert set(hybrid_layers) == set(layers) - first
    expected = input_statistics(hybrid, hybrid_layers, calib)
    for n in hybrid_layers:
        torch.testing.assert_close(stats[n].hessian, expected[n].hessian, rtol=1e-4, atol=1e-6)
    # block 0 itself is calibrated on the float model's inputs
    float_stats = input_statistics(model, {n: layers[n] for n in first}, calib)
    for n in first:
        torch.testing.assert_close(stats[n].hessian, float_stats[n].hessian, rtol=1e-5, atol=1e-7)
    # and block 1 really saw other inputs than the float model's
    second = sorted(set(layers) - first)
    float_second = input_statistics(model, {n: layers[n] for n in second}, calib)
    assert not torch.allclose(stats[second[0]].hessian, float_second[second[0]].hessian)


def test_sequential_is_the_default_and_the_float_input_variant_differs_only_after_block_zero():
    model = tiny_llama()
    seq = quantize(model, "zeropoint-int4:algo=gptq", calibration=CALIB, held_out=HELD)
    flat = quantize(model, "zeropoint-int4:algo=gptq,sequential=false", calibration=CALIB, held_out=HELD)
    assert seq.qbench_calibration["sequential"] is True and flat.qbench_calibration["sequential"] is False
    a, b = dict(seq.named_modules()), dict(flat.named_modules())
    for n, m in a.items():
        if isinstance(m, FakeQuantLinear):
            same = torch.equal(m.weight, b[n].weight)
            assert same == n.startswith("model.layers.0."), n


def test_layer_error_is_its_formula_on_the_rows_it_names():
    model = tiny_llama()
    scheme = get_scheme("zeropoint-int4-g128:algo=gptq,group=32,sequential=false")
    q = quantize(model, scheme, calibration=CALIB, held_out=HELD)
    report = q.qbench_calibration["layer_error"]
    name = "model.layers.1.mlp.down_proj"
    layer = dict(model.named_modules())[name]
    rows = {}
    for key, windows in (("calibration", CALIB), ("held_out", HELD)):  # the layer's float inputs, by hand
        seen = []
        handle = layer.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(a[0].reshape(-1, 128)))
        with torch.no_grad():
            model(windows)
        handle.remove()
        rows[key] = torch.cat(seen).double()
    w = linear_weight(layer)[0].double()
    algo = effective_weight(dict(q.named_modules())[name]).double()
    rtn = FakeQuantLinear(
        linear_weight(layer)[0], None, get_scheme("zeropoint-int4-g128:group=32")
    ).weight.double()
    for i, key in enumerate(("calibration", "held_out")):
        x = rows[key]
        want = ((x @ (w - algo).T) ** 2).sum() / ((x @ (w - rtn).T) ** 2).sum()
        assert report["per_layer"][name][i] == pytest.approx(float(want), rel=1e-3)
    assert report["layers"] == 14 and report["calibration"] < 1  # GPTQ beats rounding on the rows it saw
    assert report["held_out"] is not None


def test_awq_sequential_runs_and_reports():
    model = tiny_llama()
    before = snapshot(model)
    q = quantize(model, "zeropoint-int4-g128:algo=awq,group=32", calibration=CALIB, held_out=HELD)
    assert_same_state(model, before)
    report = q.qbench_calibration
    assert report["sequential"] and report["layer_error"]["calibration"] <= 1 + 1e-6


def test_blocks_with_their_own_arguments_are_refused():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x, mask=None):
            return self.inner(x) * mask

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(Wrapped() for _ in range(2))

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x, mask=torch.ones(1))  # a new mask object per block
            return x

    model = Model()
    with pytest.raises(UserError, match=r"block 1 .* other arguments than block 0.*sequential=false"):
        check_shared_arguments(model, model.blocks, torch.zeros(1, 4, dtype=torch.long))


def test_a_model_without_blocks_is_refused_in_one_line():
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8))
    with pytest.raises(UserError, match="sequential=false"):
        decoder_blocks(model, {"1": model[1]})


def test_collector_shares_one_accumulator_for_one_input():
    model = tiny_llama()
    layers = select_layers(model, get_scheme("absmax-fine"))
    collector = StatisticsCollector(layers)
    with torch.no_grad(), collector.attached():
        model(CALIB[:2])
        collector.end_batch()
    found = collector.result()
    attn = "model.layers.0.self_attn."
    assert found[attn + "q_proj"] is found[attn + "k_proj"] is found[attn + "v_proj"]
    assert found[attn + "o_proj"] is not found[attn + "q_proj"]
