"""GPTQ (``qbench.quant.gptq``, ``algo=gptq``): against a reference written from the paper, its layer objective below
round-to-nearest's on every layer, fake = real code for code, calibration and scheme handling."""

import pytest
import torch
from torch import nn

from models.errors import UserError
from qbench.quant.apply import linear_weight, quantize, select_layers
from qbench.quant.calibrate import hessians, needs_calibration
from qbench.quant.fake import FakeQuantLinear, HadamardRotation, fake_quantize_weight, transform_input
from qbench.quant.gptq import HessianAccumulator, gptq_quantize, layer_error
from qbench.quant.granularity import PerAxis, PerGroup, PerTensor
from qbench.quant.primitives import qparams_from_stats, qrange
from qbench.quant.schemes import QuantScheme, get_scheme
from qbench.quant.solve import transform_hessian

transformers = pytest.importorskip("transformers")
from tests.qbench.quant.test_apply import assert_same_state, snapshot, tiny_gpt2, tiny_llama  # noqa: E402

CALIB = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))


def _layer_case(out=48, inn=160, n=1200, seed=0):
    """A weight and the Hessian of inputs with unequal channel scales and a few outlier channels (as in LLMs)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inn, generator=gen) * torch.linspace(0.2, 3.0, inn)
    x[:, :3] *= 12
    w = torch.randn(out, inn, generator=gen)
    return w, 2 * x.double().T @ x.double() / n


def _params(w, bits, sym, per_tensor=False):
    dims = (0, 1) if per_tensor else (1,)
    s, z = qparams_from_stats((w.amin(dims, keepdim=True), w.amax(dims, keepdim=True)), bits, sym)
    return s.double().reshape(-1), None if z is None else z.double().reshape(-1)


def reference_gptq(w, h, bits, sym, damp=0.01, group=None, act_order=False, per_tensor=False, block=128):
    """Written from the paper (Frantar et al. 2023): the greedy OBS step of Eq. 2–3, one column at a time, with
    the inverse Hessian updated by Gaussian elimination — no Cholesky, no lazy batches — in float64. Groups take
    their grid at their first column from the weights as they were when that column's ``block`` of columns began
    (the reference code's ``find_params(W[:, i1 + i : …])``: W carries the earlier blocks' updates, not those of
    the columns before it in its own block); with ``act_order`` from the original weights (static groups).
    Returns codes in the original column order."""
    w, h = w.double().clone(), h.double().clone()
    cols = w.shape[1]
    qmin, qmax = qrange(bits, sym)
    grids = {}
    if group is None:
        grids[0] = _params(w.float(), bits, sym, per_tensor)
    elif act_order:
        for g in range(-(-cols // group)):
            grids[g] = _params(w[:, g * group : (g + 1) * group].float(), bits, sym)
    order = torch.argsort(torch.diagonal(h), descending=True).tolist() if act_order else list(range(cols))
    h = h + damp * torch.diagonal(h).mean() * torch.eye(cols, dtype=h.dtype)
    hinv = torch.linalg.inv(h)
    codes = torch.zeros_like(w)
    remaining = list(order)
    at_block_start = w.clone()
    for j in order:
        g = 0 if group is None else j // group
        if j % block == 0:
            at_block_start = w.clone()
        if group is not None and not act_order and j % group == 0:
            grids[g] = _params(at_block_start[:, j : j + group].float(), bits, sym)
        s, z = grids[g]
        q = (torch.round(w[:, j] / s) + (0 if z is None else z)).clamp(qmin, qmax)
        codes[:, j] = q
        err = (w[:, j] - s * (q - (0 if z is None else z))) / hinv[j, j]
        remaining.remove(j)
        w[:, remaining] -= err[:, None] * hinv[j, remaining][None, :]
        hinv = hinv - hinv[:, j : j + 1] @ hinv[j : j + 1, :] / hinv[j, j]
    return codes


@pytest.mark.parametrize(
    "bits,sym,granularity,act_order",
    [
        (4, False, PerAxis(0), False),
        (4, True, PerAxis(0), False),
        (3, False, PerAxis(0), False),
        (2, True, PerAxis(0), False),
        (8, True, PerAxis(0), False),
        (8, True, PerTensor(), False),
        (4, False, PerGroup(32), False),
        (3, False, PerGroup(64), False),  # 160 = 2·64 + 32: a shorter last group
        (4, True, PerGroup(32), True),
        (4, False, PerAxis(0), True),
    ],
)
def test_codes_equal_a_reference_written_from_the_paper(bits, sym, granularity, act_order):
    w, h = _layer_case()
    group = granularity.group_size if isinstance(granularity, PerGroup) else None
    for block in (16, 128):  # lazy batches of any size (a grouped block rounded up to whole groups)
        whole = block if group is None or act_order else group * -(-block // group)
        expected = reference_gptq(
            w,
            h,
            bits,
            sym,
            group=group,
            act_order=act_order,
            per_tensor=granularity == PerTensor(),
            block=whole,
        )
        got = gptq_quantize(
            w, h, bits, granularity, sym, block=block, act_order=act_order, dtype=torch.float64
        )
        assert torch.equal(got.codes.double(), expected), (block, (got.codes.double() != expected).sum())
    # in float32 (the default) all but a few codes at a rounding tie agree
    single = gptq_quantize(w, h.float(), bits, granularity, sym, act_order=act_order)
    assert (single.codes.double() == expected).float().mean() > 0.995


def test_result_is_on_its_grid_and_beats_round_to_nearest():
    w, h = _layer_case(seed=3)
    for bits, granularity, sym in ((4, PerAxis(0), False), (3, PerGroup(32), False), (4, PerGroup(64), True)):
        got = gptq_quantize(w, h.float(), bits, granularity, sym)
        assert torch.equal(fake_quantize_weight(got.weight, bits, granularity, sym, got.qparams), got.weight)
        rtn = fake_quantize_weight(w, bits, granularity, sym)
        assert layer_error(w, got.weight, h) < 0.97 * layer_error(w, rtn, h)
        assert got.qparams.scale.shape == (48, -(-160 // getattr(granularity, "group_size", 160)))
    # the objective from the Hessian is ‖(W − Ŵ)X‖² per token
    gen = torch.Generator().manual_seed(4)
    x, delta = torch.randn(50, 160, generator=gen).double(), torch.randn(48, 160, generator=gen).double()
    h = 2 * x.T @ x / 50
    assert layer_error(delta, torch.zeros_like(delta), h) == pytest.approx(
        float((x @ delta.T).pow(2).sum() / 50)
    )


def test_dead_inputs_and_inputs_left_untouched():
    w, h = _layer_case(out=8, inn=32)
    h[5, :], h[:, 5] = 0, 0
    w0, h0 = w.clone(), h.clone()
    got = gptq_quantize(w, h, 4, PerAxis(0), False)
    assert got.dead == 1 and torch.isfinite(got.weight).all()
    assert torch.equal(w, w0) and torch.equal(h, h0)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, h[:4, :4], 4, PerAxis(0), False)


def test_hessian_accumulator_is_the_running_mean():
    x = torch.randn(3, 70, 24, generator=torch.Generator().manual_seed(5)) * 40
    acc = HessianAccumulator(24)
    for chunk in x.split(1):
        acc.add(chunk)
    flat = x.reshape(-1, 24).double()
    torch.testing.assert_close(acc.hessian.double(), 2 * flat.T @ flat / len(flat), rtol=1e-4, atol=1e-2)
    assert acc.n == 210


def _effective_weight(layer: nn.Module, dim: int) -> torch.Tensor:
    """The (out, in) matrix a weight-only layer applies to its raw input (transforms included)."""
    with torch.no_grad():
        y = layer(torch.eye(dim))
    return (y - (0 if layer.bias is None else layer.bias)).T


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize(
    "name",
    ["zeropoint-int4", "zeropoint-int3-g128:group=32", "hadamard-zeropoint-int4", "zeropoint-int4:group=48"],
)
def test_layer_error_below_round_to_nearest_on_every_layer(make, name):
    model = make()
    before = snapshot(model)
    gptq = quantize(model, f"{name},algo=gptq" if ":" in name else f"{name}:algo=gptq", calibration=CALIB)
    rtn = quantize(model, name)
    assert_same_state(model, before)  # the float model is never modified
    layers = select_layers(model, get_scheme(name))
    h = hessians(model, layers, CALIB)
    q, r = dict(gptq.named_modules()), dict(rtn.named_modules())
    for layer_name, module in layers.items():
        w = linear_weight(module)[0]
        err_q = layer_error(w, _effective_weight(q[layer_name], w.shape[1]), h[layer_name])
        err_r = layer_error(w, _effective_weight(r[layer_name], w.shape[1]), h[layer_name])
        assert err_q < err_r, (layer_name, err_q, err_r)


def _real_available() -> bool:
    from qbench.quant.apply import real_kernel_problem

    return real_kernel_problem("zeropoint-int4") is None


@pytest.mark.skipif(not _real_available(), reason="no real kernel backend here")
@pytest.mark.parametrize(
    "name",
    [
        "zeropoint-int4:algo=gptq",
        "zeropoint-int3-g128:algo=gptq,group=32",
        "zeropoint-int4:algo=gptq,group=48",  # a shorter last group (64 = 48 + 16)
        "absmax-w4a8:algo=gptq",
        "absmax-w4a8-g32:act_order=true,algo=gptq",
        "absmax-fine:algo=gptq",
        "absmax-moderate:algo=gptq",
        "hadamard-zeropoint-int4:algo=gptq",
    ],
)
def test_fake_equals_real_code_for_code(name):
    model = tiny_llama()
    fake = quantize(model, name, calibration=CALIB)
    real = quantize(model, name, mode="real", calibration=CALIB)
    reals = dict(real.named_modules())
    compared = 0
    for layer_name, layer in fake.named_modules():
        if isinstance(layer, FakeQuantLinear):  # the real layer holds exactly GPTQ's codes and grid
            assert torch.equal(reals[layer_name].dequantized_weight(), layer.weight.float()), layer_name
            compared += 1
    assert compared == 14
    # the outputs then differ only by integer-matmul accumulation and activation rounding (as for RTN)
    with torch.no_grad():
        torch.testing.assert_close(real(TOKENS).logits, fake(TOKENS).logits, rtol=1e-3, atol=1e-3)


def test_hessians_cached_shared_and_transformed():
    model = tiny_llama()
    scheme = get_scheme("zeropoint-int4:algo=gptq,sequential=false")  # the float model's inputs: cached
    layers = select_layers(model, scheme)
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    h = hessians(model, layers, CALIB)
    n = len(calls)
    quantize(model, scheme, calibration=CALIB)
    quantize(model, "zeropoint-int3-g128:algo=gptq,sequential=false", calibration=CALIB)
    assert len(calls) == n  # computed once for the model and windows
    quantize(model, scheme, calibration=CALIB[:8])
    assert len(calls) > n  # other windows: computed again
    handle.remove()
    attn = "model.layers.0.self_attn."
    assert h[attn + "q_proj"] is h[attn + "k_proj"] is h[attn + "v_proj"]  # one input, one Hessian
    assert h[attn + "o_proj"] is not h[attn + "q_proj"]
    # the Hessian of a transformed input x' = R(x / s) is Mᵀ H M
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(100, 64, generator=gen)
    s, rot = torch.rand(64, generator=gen) + 0.5, HadamardRotation(64, seed=3)
    acc, acc_t = HessianAccumulator(64), HessianAccumulator(64)
    acc.add(x)
    acc_t.add(transform_input(x, s, rot))
    torch.testing.assert_close(transform_hessian(acc.hessian, s, rot), acc_t.hessian, rtol=1e-4, atol=1e-4)


def test_scheme_names_records_and_refusals():
    s = get_scheme("zeropoint-int4:algo=gptq,damp=0.01")
    assert s.name == "zeropoint-int4:algo=gptq" and s.label == "W4-channel-zp-gptq"
    assert s.algo_params == {"damp": 0.01, "block": 128, "act_order": False, "sequential": True}
    assert get_scheme(s.name) == s and QuantScheme.from_dict(s.to_dict()) == s
    t = get_scheme("zeropoint-int3-g128:act_order=true,algo=gptq,damp=0.05")
    assert t.name == "zeropoint-int3-g128:act_order=true,algo=gptq,damp=0.05" and get_scheme(t.name) == t
    assert get_scheme("zeropoint-int4:algo=rtn") is get_scheme("zeropoint-int4")
    assert (
        "algo" not in get_scheme("zeropoint-int4").to_dict()
    )  # records from before algorithms stay identical
    assert needs_calibration(s) and not needs_calibration(get_scheme("zeropoint-int4"))
    for bad, match in (
        ("zeropoint-int4:damp=0.1", "gptq settings: add algo=gptq"),
        ("zeropoint-int4:grid=5", "awq settings: add algo=awq"),
        ("zeropoint-int4:algo=gtpq", "did you mean 'gptq'"),
        ("zeropoint-int4:algo=gptq,damp=2", r"damp takes a number in \(0, 1\]"),
        ("mxfp4:algo=gptq", "integer grids"),
        ("llm-int8:algo=gptq", "unknown override key 'algo'"),
        ("absmax-fine-perchannel:algo=gptq,w=none", "nothing to round"),
    ):
        with pytest.raises(UserError, match=match):
            get_scheme(bad)
    with pytest.raises(UserError, match="needs calibration"):
        quantize(tiny_llama(), s)


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
def test_calibration_stops_at_the_head_with_the_same_statistics(make):
    """The calibration pass never computes logits (the largest tensor of a pass) yet sees exactly what a whole
    forward pass shows the target layers; where the head is itself observed, it still runs."""
    from qbench.quant.calibrate import calibration_batches, observe, output_head

    model = make()
    layers = select_layers(model, get_scheme("zeropoint-int4"))
    head = output_head(model)
    assert head is not None and all(m is not head for m in layers.values())
    calls = []
    handle = head.register_forward_hook(lambda *_: calls.append(1))
    try:
        stats = hessians(model, layers, CALIB)
        ranges = observe(model, layers, CALIB)
        assert calls == []  # stopped before the head
        full = {}
        hooks = [
            m.register_forward_pre_hook(
                lambda _m, a, n=n: full.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]))
            )
            for n, m in layers.items()
        ]
        with torch.no_grad():
            model(CALIB)
        for h in hooks:
            h.remove()
        assert calls == [1]  # a plain forward does reach it
        for name in layers:
            x = torch.cat(full[name]).double()
            torch.testing.assert_close(stats[name].double(), 2 * x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ranges[name].in_hi, x.amax(0).float())
        calls.clear()
        observe(model, {**layers, "head": head}, CALIB)
        assert len(calls) == len(calibration_batches(CALIB))  # observed: not stopped, once per batch
    finally:
        handle.remove()


def test_a_grouped_gptq_record_names_its_group_rule():
    """Records made under the earlier rule (the grid from the fully updated weights) lack the field, so their
    cells are recomputed rather than reused; per-channel GPTQ, whose grid comes from the original weights, and
    act-order's static groups are unchanged."""
    from qbench.quant.schemes import GPTQ_GROUP_RULE, QuantScheme

    grouped = get_scheme("zeropoint-int4-g128:algo=gptq").to_dict()
    assert grouped["algo_recipe"] == GPTQ_GROUP_RULE
    assert QuantScheme.from_dict(grouped) == get_scheme("zeropoint-int4-g128:algo=gptq")
    assert "algo_recipe" not in get_scheme("zeropoint-int4:algo=gptq").to_dict()
    assert "algo_recipe" not in get_scheme("zeropoint-int4-g128:algo=gptq,act_order=true").to_dict()
