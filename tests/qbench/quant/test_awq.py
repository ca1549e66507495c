"""AWQ (``qbench.quant.awq``, ``algo=awq``): the scale search and the clipping search against brute-force references
on real inputs, the scaled float model equal to the original, errors at most round-to-nearest's, fake = real."""

import pytest
import torch

from models.errors import UserError
from qbench.quant.apply import linear_weight, quantize, select_layers
from qbench.quant.awq import candidate_scales, clipped, search_clip, search_scale
from qbench.quant.calibrate import input_statistics
from qbench.quant.fake import FakeQuantLinear, fake_quantize_weight
from qbench.quant.gptq import HessianAccumulator, layer_error
from qbench.quant.granularity import PerAxis, PerGroup, PerTensor
from qbench.quant.primitives import qparams_from_stats
from qbench.quant.schemes import QuantScheme, get_scheme
from qbench.quant.solve import awq_layers

transformers = pytest.importorskip("transformers")
from tests.qbench.quant.test_apply import assert_same_state, snapshot, tiny_gpt2, tiny_llama  # noqa: E402

CALIB = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))


def _awq(model, layers, scheme, calibration):
    """AWQ on the float model's inputs: ({layer: its input scale}, {layer: (weight, clipped grid or None)})."""
    found = awq_layers(model, layers, input_statistics(model, layers, calibration), scheme)
    return {n: s for n, (s, _) in found.items() if s is not None}, {n: e for n, (_, e) in found.items()}


def _inputs(n=400, inn=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inn, generator=gen) * torch.linspace(0.1, 2.0, inn)
    x[:, 7] *= 30  # an outlier channel: the salient weights AWQ protects
    acc = HessianAccumulator(inn)
    acc.add(x)
    return x, acc


def test_scale_search_is_the_papers_objective_on_real_inputs():
    x, acc = _inputs()
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(32, 96, generator=gen), torch.randn(16, 96, generator=gen)]
    g = PerGroup(32)
    _, alpha, errors = search_scale(weights, acc.hessian, acc.abs_mean, 4, g, False, grid=20)
    # brute force: ‖Q(W·diag(s))·(X/s)ᵀ − W·Xᵀ‖² / n summed over the layers, for every α of the grid
    brute = []
    for _, cand in candidate_scales(x.abs().mean(0), 20):
        total = 0.0
        for w in weights:
            q = fake_quantize_weight(w * cand, 4, g, False)
            total += float(((x / cand) @ q.T - x @ w.T).double().pow(2).sum() / len(x))
        brute.append(total)
    torch.testing.assert_close(torch.tensor(errors), torch.tensor(brute), rtol=2e-3, atol=1e-6)
    assert alpha == pytest.approx(torch.tensor(brute).argmin().item() / 20)
    assert errors[0] == pytest.approx(
        sum(layer_error(w, fake_quantize_weight(w, 4, g, False), acc.hessian) for w in weights), rel=1e-3
    )  # α = 0 is round-to-nearest
    assert min(errors) < 0.9 * errors[0] and alpha > 0  # the outlier channel makes scaling pay
    assert torch.equal(candidate_scales(acc.abs_mean, 20)[0][1], torch.ones(96))


@pytest.mark.parametrize(
    "granularity,sym", [(PerGroup(32), False), (PerGroup(32), True), (PerAxis(0), False), (PerTensor(), True)]
)
def test_clip_search_picks_the_best_ratio_of_each_group(granularity, sym):
    x, acc = _inputs(inn=96, seed=3)
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(4))
    w[0, 5] = 9.0  # one large weight: clipping it pays
    qp = search_clip(w, acc.hessian, 4, granularity, sym, grid=20)
    g = granularity.group_size if isinstance(granularity, PerGroup) else 96
    blocks = (
        [(r, c) for r in range(8) for c in range(0, 96, g)] if granularity != PerTensor() else [(None, None)]
    )
    for row, col in blocks:
        part = w if row is None else w[row : row + 1, col : col + g]
        xs = x if row is None else x[:, col : col + g]
        best = None
        for i in range(10):  # r = 1, 0.95, …, 0.55: brute force on the real inputs
            r = 1 - i / 20
            peak = part.abs().max()
            lo, hi = part.min().clamp(min=-r * peak), part.max().clamp(max=r * peak)
            s, z = qparams_from_stats((lo.reshape(1, 1), hi.reshape(1, 1)), 4, sym)
            code = (torch.round(part / s) + (0 if z is None else z)).clamp(*((-7, 7) if sym else (0, 15)))
            deq = (code - (0 if z is None else z)) * s
            err = float((xs @ (deq - part).T).double().pow(2).sum())
            if best is None or err < best[0] * (1 - 1e-4):
                best = (err, s)
        got = qp.scale.reshape(-1)[0] if row is None else qp.scale[row, col // g]
        assert got == pytest.approx(float(best[1]), rel=1e-5), (row, col)
    assert qp.scale[0, 0] < w[0, :g].abs().max() / 7 if sym and row is not None else True


def test_the_scales_leave_the_float_model_unchanged_and_errors_fall():
    model = tiny_llama()
    before = snapshot(model)
    scheme = get_scheme("zeropoint-int4-g128:algo=awq,group=32")
    layers = select_layers(model, scheme)
    scales, solved = _awq(model, layers, scheme, CALIB)
    assert_same_state(model, before)
    stats = input_statistics(model, layers, CALIB)
    attn = "model.layers.0.self_attn."
    assert scales[attn + "q_proj"] is scales[attn + "k_proj"] is scales[attn + "v_proj"]  # one norm, one s
    assert (
        not clipped(attn + "q_proj") and clipped(attn + "v_proj") and clipped("model.layers.0.mlp.down_proj")
    )
    assert solved[attn + "q_proj"][1] is None and solved[attn + "v_proj"][1] is not None
    # grouped-query attention (4 query, 2 key/value heads): v_proj cannot absorb o_proj's scale, so llm-awq
    # leaves o_proj unscaled; its clipping is still searched
    assert attn + "o_proj" not in scales and solved[attn + "o_proj"][1] is not None
    float_scheme = QuantScheme("float", weight_bits=None)
    x = torch.randn(3, 5, 128)
    groups = {}
    for name, module in layers.items():
        w, b = linear_weight(module)
        # folding s into the layer changes nothing in float: (x / s) · (W · diag(s))ᵀ = x · Wᵀ
        scaled = FakeQuantLinear(w, b, float_scheme, input_scale=scales.get(name))
        torch.testing.assert_close(
            scaled(x[..., : w.shape[1]]), module(x[..., : w.shape[1]]), rtol=1e-5, atol=1e-5
        )
        groups.setdefault(id(stats[name]), []).append(name)
    q = dict(quantize(model, scheme, calibration=CALIB).named_modules())
    rtn = dict(quantize(model, "zeropoint-int4-g128:group=32").named_modules())
    for names in groups.values():  # the shared scale minimises the group's summed error: at most RTN's
        h = stats[names[0]].hessian

        def err(mods, names=names, h=h):
            total = 0.0
            for n in names:
                w = linear_weight(layers[n])[0]
                eye = torch.eye(w.shape[1])
                with torch.no_grad():
                    eff = (mods[n](eye) - (0 if mods[n].bias is None else mods[n].bias)).T
                total += layer_error(w, eff, h)
            return total

        assert err(q) <= err(rtn) * (1 + 1e-5), names


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize(
    "name",
    [
        "zeropoint-int4:algo=awq",
        "zeropoint-int3-g128:algo=awq,group=32",
        "absmax-w4a8-g32:algo=awq,clip=false",
    ],
)
def test_fake_equals_real_code_for_code(make, name):
    from qbench.quant.apply import real_kernel_problem

    if real_kernel_problem(name) is not None:
        pytest.skip(real_kernel_problem(name))
    model = make()
    fake = quantize(model, name, calibration=CALIB)
    real = quantize(model, name, mode="real", calibration=CALIB)
    reals = dict(real.named_modules())
    layers = [(n, m) for n, m in fake.named_modules() if isinstance(m, FakeQuantLinear)]
    assert layers
    for layer_name, layer in layers:
        assert torch.equal(reals[layer_name].dequantized_weight(), layer.weight.float()), layer_name
    with torch.no_grad():
        torch.testing.assert_close(real(TOKENS).logits, fake(TOKENS).logits, rtol=1e-3, atol=1e-3)


def test_awq_scheme_names_and_refusals():
    s = get_scheme("zeropoint-int4:algo=awq,grid=20")
    assert s.name == "zeropoint-int4:algo=awq" and s.label == "W4-channel-zp-awq"
    assert s.algo_params == {"grid": 20, "clip": True, "sequential": True} and get_scheme(s.name) == s
    assert get_scheme("zeropoint-int4:algo=awq,clip=false").name == "zeropoint-int4:algo=awq,clip=false"
    for bad, match in (
        ("zeropoint-int4:grid=10", "awq settings: add algo=awq"),
        ("zeropoint-int4:algo=awq,damp=0.1", "gptq settings: add algo=gptq"),
        ("zeropoint-int4:algo=awq,grid=1", "grid takes an integer ≥ 2"),
        ("smoothquant:algo=awq", "does not combine with smoothquant"),
        ("hadamard-zeropoint-int4:algo=awq", "does not combine with hadamard"),
        ("nvfp4:algo=awq", "integer grids"),
    ):
        with pytest.raises(UserError, match=match):
            get_scheme(bad)


def test_o_proj_is_scaled_where_v_proj_can_absorb_it():
    """With one key/value head per query head v_proj's outputs are o_proj's inputs, and the fold exists."""
    model = tiny_llama(kv_heads=4)
    scheme = get_scheme("zeropoint-int4-g128:algo=awq,group=32")
    scales, _ = _awq(model, select_layers(model, scheme), scheme, CALIB)
    assert "model.layers.0.self_attn.o_proj" in scales
