"""quantize(): a new model, float model untouched, ties, exclude, LM head, SQNR floors, SmoothQuant, Hadamard."""

import dataclasses

import pytest
import torch
from torch import nn

from models.errors import UserError
from qbench.quant.apply import lm_head_names, model_bytes, quantize, select_layers
from qbench.quant.fake import FakeQuantLinear, HadamardRotation
from qbench.quant.granularity import PerAxis
from qbench.quant.primitives import fake_quantize
from qbench.quant.schemes import BNB_METHODS, SCHEMES, QuantScheme, get_scheme

transformers = pytest.importorskip("transformers")

# bitsandbytes and llama.cpp run their own layers in either mode (their own tests)
FAKE_SCHEMES = [name for name in SCHEMES if get_scheme(name).method not in (*BNB_METHODS, "gguf")]
INT4 = {"zeropoint-int4", "hadamard-zeropoint-int4"}
SQNR_FLOOR_DB = {"int8": 30.0, "int4": 15.0}  # measured ~34–44 dB (int8) and ~19–22 dB (int4) on these toys
# float formats by element width: measured fp8 22–31 dB, mxfp6 27–29 dB, mxfp4/nvfp4 15–20 dB on these toys
FORMAT_FLOOR_DB = {8: 20.0, 6: 24.0, 4: 12.0}
# weight-only int, per channel or group: measured int4 20–24, int3 14–16, int2 7–9 dB on these toys
LOWBIT_FLOOR_DB = {4: SQNR_FLOOR_DB["int4"], 3: 10.0, 2: 4.0}


def sqnr_floor(name: str) -> float:
    scheme = get_scheme(name)
    if scheme.format != "int":
        return FORMAT_FLOOR_DB[scheme.weight_bits]
    if scheme.act_bits is None or scheme.weight_bits < 8:  # by weight bits (W4A8: measured 20–24 dB)
        return LOWBIT_FLOOR_DB[scheme.weight_bits]
    return SQNR_FLOOR_DB["int8"]


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum()))


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_llama(kv_heads: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=128,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def toy_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def snapshot(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(model: nn.Module, before: dict) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_sqnr_floors_and_float_model_untouched(make):
    model = make()
    model.train()  # a mode the float model must get back after SmoothQuant's calibration pass
    before = snapshot(model)
    with torch.no_grad():
        ref = model.eval()(TOKENS).logits
    model.train()
    figures = {}
    for name in FAKE_SCHEMES:
        quantized = quantize(model, name, calibration=TOKENS).eval()
        with torch.no_grad():
            figures[name] = sqnr_db(ref, quantized(TOKENS).logits)
        assert_same_state(model, before)
        assert model.training and all(m.training for m in model.modules())
        assert not any(m._forward_pre_hooks for m in model.modules())
    for name, db in figures.items():
        assert db > sqnr_floor(name), figures
    int8 = [
        db
        for n, db in figures.items()
        if get_scheme(n).act_bits and get_scheme(n).weight_bits == 8 and get_scheme(n).format == "int"
    ]
    assert min(int8) > max(figures[n] for n in INT4) + 6, figures


def test_layers_replaced_and_conv1d_weight_transposed(gpt2):
    quantized = quantize(gpt2, "absmax-fine")
    fc, fc_float = quantized.transformer.h[0].mlp.c_fc, gpt2.transformer.h[0].mlp.c_fc
    assert isinstance(fc, FakeQuantLinear) and (fc.in_features, fc.out_features) == (64, 256)
    assert torch.equal(
        fc.weight, fake_quantize(fc_float.weight.t(), 8, PerAxis(0), True)
    )  # Conv1D is (in, out)
    assert sum(isinstance(m, FakeQuantLinear) for m in quantized.modules()) == 8  # 4 per block, head kept
    assert "FakeQuantLinear(64→256, W8 per-channel, A8 per-token)" in str(quantized)


def test_tied_head_stays_float_and_tied_by_default(gpt2):
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    quantized = quantize(gpt2, "absmax-coarse")
    assert type(quantized.lm_head) is nn.Linear
    assert quantized.lm_head.weight is quantized.transformer.wte.weight  # the copy keeps the tie ...
    assert quantized.lm_head.weight is not gpt2.lm_head.weight  # ... in a parameter of its own ...
    assert (
        quantized.lm_head.weight.data_ptr() == gpt2.lm_head.weight.data_ptr()
    )  # ... sharing the float storage
    assert model_bytes(quantized) == model_bytes(gpt2)  # every tensor shared, the tied matrix counted once
    quantized.to(
        torch.bfloat16
    )  # a cast of the copy replaces its own parameters' data, never the float model's
    assert (
        gpt2.lm_head.weight.dtype == torch.float32
        and gpt2.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32
    )


def test_quantising_a_tied_head_does_not_quantise_the_embedding(gpt2):
    before = snapshot(gpt2)
    quantized = quantize(gpt2, dataclasses.replace(get_scheme("absmax-coarse"), quantize_lm_head=True))
    assert isinstance(quantized.lm_head, FakeQuantLinear)
    assert torch.equal(quantized.transformer.wte.weight, gpt2.transformer.wte.weight)  # embedding stays float
    assert not torch.equal(quantized.lm_head.weight, gpt2.transformer.wte.weight)
    assert quantized.config.tie_word_embeddings is False and gpt2.config.tie_word_embeddings is True
    assert_same_state(gpt2, before)
    # untied, yet no new matrix: the head fake-quantises the embedding's float storage in each forward
    assert quantized.lm_head.storage == "shared"
    assert quantized.lm_head.weight_source.data_ptr() == gpt2.transformer.wte.weight.data_ptr()
    assert model_bytes(quantized) == model_bytes(gpt2)


def test_lm_head_detection(gpt2, llama):
    assert lm_head_names(gpt2) == {"lm_head"}
    assert lm_head_names(llama) == {"lm_head"}
    renamed = nn.ModuleDict({"emb": nn.Embedding(10, 4), "out": nn.Linear(4, 10, bias=False)})
    renamed["out"].weight = renamed["emb"].weight  # tied, not named lm_head
    assert lm_head_names(renamed) == {"out"}
    assert "lm_head" not in select_layers(llama, get_scheme("absmax-fine"))


def test_exclude_patterns(llama):
    quantized = quantize(llama, "absmax-fine", exclude=["*.mlp.*"])
    assert type(quantized.model.layers[0].mlp.up_proj) is nn.Linear
    assert isinstance(quantized.model.layers[0].self_attn.q_proj, FakeQuantLinear)
    with pytest.raises(UserError, match=r"'\*\.attention\.\*' matches no layer the scheme quantises"):
        quantize(llama, "absmax-fine", exclude=["*.mlp.*", "*.attention.*"])


def test_batch_invariance_of_per_tensor_activation_scales():
    """Per-sequence scales: a batch of two windows gives the logits of the two run separately."""
    model = tiny_gpt2().double()
    quantized = quantize(model, "absmax-coarse")
    with torch.no_grad():
        batched = quantized(TOKENS).logits
        separate = torch.cat([quantized(TOKENS[i : i + 1]).logits for i in range(2)])
    torch.testing.assert_close(batched, separate, rtol=0, atol=1e-9)


def outlier_inputs() -> torch.Tensor:
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1))
    x[..., 7] *= 80.0  # one massive activation channel, as in the paper's trained models
    return x


@pytest.mark.parametrize(
    ("baseline", "method", "gain_db"),
    [("absmax-moderate", "smoothquant", 6), ("absmax-coarse", "hadamard-absmax-coarse", 3)],
)
def test_outlier_mitigations_beat_plain_absmax(baseline, method, gain_db):
    """An activation outlier channel: SmoothQuant and the rotation both win (~+10 dB, +5 dB here; the coarse
    scheme's per-tensor output quantisation is not helped by a rotation of the input)."""
    model = toy_mlp()
    x = outlier_inputs()
    with torch.no_grad():
        ref = model(x)
        plain = sqnr_db(ref, quantize(model, baseline)(x))
        mitigated = sqnr_db(ref, quantize(model, method, calibration=x)(x))
    assert mitigated > plain + gain_db, (plain, mitigated)


def test_smoothquant_needs_calibration_and_computes_the_formula():
    model = toy_mlp()
    with pytest.raises(UserError, match="calibration"):
        quantize(model, "smoothquant")
    x = outlier_inputs()
    layer = quantize(model, "smoothquant", calibration=x)[0]
    act_max = x.abs().reshape(-1, 64).amax(0)
    w_max = model[0].weight.detach().abs().amax(0)
    torch.testing.assert_close(layer.input_scale, (act_max.sqrt() / w_max.sqrt()).clamp_min(1e-5))


def test_hadamard_rotation_is_orthogonal_and_exact_in_float():
    rot = HadamardRotation(64, seed=3)
    r = rot(torch.eye(64))  # rows of I · Rᵀ = Rᵀ
    torch.testing.assert_close(r @ r.T, torch.eye(64), rtol=0, atol=1e-5)
    h = torch.ones(1, 1)
    for _ in range(6):  # Sylvester construction: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    torch.testing.assert_close(r, (torch.diag(rot.signs) @ h / 8.0), rtol=0, atol=1e-6)
    dense = HadamardRotation(
        48
    )  # 48 = 12 · 4: Paley's H_12 ⊗ H_4, full size (tests/qbench/quant/test_hadamard.py)
    assert dense.factor.shape == (12, 12)
    rd = dense(torch.eye(48))
    torch.testing.assert_close(rd @ rd.T, torch.eye(48), rtol=0, atol=1e-5)
    # with float weights and activations the rotated layer is the float layer
    linear = nn.Linear(64, 16)
    scheme = QuantScheme(name="float-rotated", method="hadamard", weight_bits=None, act_bits=None)
    layer = FakeQuantLinear(linear.weight, linear.bias, scheme, rotation=rot)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), linear(x), rtol=0, atol=1e-5)


def test_real_mode_calls_the_kernel_backend(monkeypatch, gpt2):
    calls = []

    def make_real_linear(weight, bias, scheme, *, input_scale=None, rotation=None):
        calls.append((tuple(weight.shape), scheme.name, input_scale is not None, rotation is not None))
        return nn.Identity()

    from qbench.quant.kernels import dispatch

    monkeypatch.setattr(dispatch, "make_real_linear", make_real_linear)
    quantize(gpt2, "absmax-fine", mode="real")
    assert calls[0] == ((192, 64), "absmax-fine", False, False)  # Conv1D (in, out) handed over as (out, in)
    calls.clear()
    quantize(gpt2, "llm-int8")  # bitsandbytes methods always run through the kernel backend
    assert len(calls) == 8 and calls[0][1] == "llm-int8"
    calls.clear()
    quantize(gpt2, "hadamard-zeropoint-int4", mode="real")
    assert calls[0][3]


@pytest.mark.parametrize("name", ["absmax-fine", "zeropoint-int4"])
def test_real_matches_fake(name):
    model = toy_mlp()
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fake, real = quantize(model, name)(x), quantize(model, name, mode="real")(x)
    assert sqnr_db(fake, real) > 60


def test_bad_calls():
    model = toy_mlp()
    with pytest.raises(UserError, match="did you mean 'fake'"):
        quantize(model, "absmax-fine", mode="fak")
    with pytest.raises(UserError, match="did you mean"):
        quantize(model, "absmax-fin")
    with pytest.raises(UserError, match="already quantised"):
        quantize(quantize(model, "absmax-fine"), "absmax-fine")


def test_model_bytes_counts_storage_once_and_honours_nbytes():
    model = toy_mlp()
    params = sum(p.numel() * 4 for p in model.parameters())
    assert model_bytes(model) == params

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("qweight", torch.zeros(8, 4, dtype=torch.uint8))

        def nbytes(self):
            return 32 + 100  # codes + a cache that is no buffer

    assert model_bytes(nn.Sequential(Packed(), nn.Linear(2, 2, bias=False))) == 132 + 16


def test_real_mode_without_a_kernel_is_a_user_error():
    with pytest.raises(UserError, match="no real kernel"):
        quantize(toy_mlp(), "absmax-fine-perchannel", mode="real")  # a scale along the reduction dimension


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fake_quantised_model_on_cuda_matches_cpu():
    model = tiny_gpt2()
    with torch.no_grad():
        cpu = quantize(model, "absmax-coarse")(TOKENS).logits
        cuda = quantize(model.cuda(), "absmax-coarse")(TOKENS.cuda()).logits.cpu()
    assert sqnr_db(cpu, cuda) > 30  # matmuls differ in rounding, which can move a value across a step


def test_model_bytes_counts_a_kernel_module_once_not_also_its_children():
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(8, 8)  # a child whose storage nbytes() already includes

        def nbytes(self):
            return 100

    model = nn.Sequential(Packed(), nn.Linear(4, 2, bias=False))
    assert model_bytes(model) == 100 + 4 * 2 * 4


def test_a_quantised_head_survives_tie_weights():
    import models
    from qbench.quant import quantize as quantize_model

    model = models.build(
        models.family_config("gpt2", n_layer=1, n_head=2, d_model=16, d_ff=32, context=8, vocab_size=64),
        seed=0,
    )
    scheme = dataclasses.replace(get_scheme("absmax-coarse"), quantize_lm_head=True)
    q = quantize_model(model, scheme)
    head = q.lm_head
    q.tie_weights()
    assert q.lm_head is head and type(head) is not nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight  # the float model keeps its tie
