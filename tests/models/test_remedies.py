"""Training-time remedies: clipped softmax, softpick, the sink logit, gated attention, OSP's embedding projection.

Each equation is checked against a plain-loop implementation written from its paper (not from our vectorised
code), on ordinary rows, rows masked but for the diagonal, very large and very negative logits, and gradients
(gradcheck in float64). The fast and reference paths, the KV cache, observation and the transformers export are
held equal to each other.
"""

from __future__ import annotations

import math

import pytest
import torch

from models import UserError, build
from models.attention import (
    RemedyParams,
    clipped_softmax,
    remedy_attention,
    remedy_attention_reference,
    softmax1,
    softmax_with_sink_logit,
    softpick,
)
from models.observe import observe
from models.transformer import KVCache, merge_projections

from .conftest import micro

NEG = float("-inf")

# --------------------------------------------------------------------------------- plain-loop paper references


def loop_clipped(row: list[float], gamma: float, zeta: float) -> list[float]:
    """Bondarenko et al. eq. 4.1, one row: clip((ζ − γ)·softmax(x)_i + γ, 0, 1); softmax via the max shift."""
    m = max(row)
    e = [math.exp(x - m) if x != NEG else 0.0 for x in row]
    total = sum(e)
    return [min(1.0, max(0.0, (zeta - gamma) * ei / total + gamma)) for ei in e]


def loop_softpick(row: list[float], eps: float) -> list[float]:
    """Zuhri et al.: ReLU(e^x_i − 1) / (Σ_j |e^x_j − 1| + ε) with masked (−inf) keys left out of both sums.
    Written unshifted (math.expm1), so only for logits where e^x does not overflow."""
    num = [max(0.0, math.expm1(x)) if x != NEG else 0.0 for x in row]
    den = sum(abs(math.expm1(x)) for x in row if x != NEG) + eps
    return [n / den for n in num]


def loop_sink_logit(row: list[float], s: float) -> list[float]:
    """softmax over [s] + row, the first entry dropped (gpt-oss's sinks)."""
    m = max([s, *row])
    e = [math.exp(x - m) if x != NEG else 0.0 for x in row]
    return [ei / (math.exp(s - m) + sum(e)) for ei in e]


def rows_of(x: torch.Tensor) -> list[list[float]]:
    return x.reshape(-1, x.size(-1)).tolist()


def special_rows() -> torch.Tensor:
    """(4, 5) float64: random; masked but for the diagonal entry (position 2); causal-like tail mask; small range."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, dtype=torch.float64, generator=g) * 3
    x[1] = NEG
    x[1, 2] = 0.7
    x[2, 3:] = NEG
    x[3] = torch.tensor([0.0, 1e-3, -2.0, 5.0, 0.0])
    return x


# ------------------------------------------------------------------------------------------ the normalisations


def test_clipped_softmax_matches_the_paper_equation_by_loop():
    x = special_rows()
    for gamma, zeta in ((-0.03, 1.0), (-0.2, 1.1), (0.0, 1.0)):
        got = clipped_softmax(x, gamma, zeta)
        want = torch.tensor([loop_clipped(r, gamma, zeta) for r in rows_of(x)], dtype=torch.float64)
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(clipped_softmax(x, 0.0, 1.0), torch.softmax(x, -1))  # γ = 0, ζ = 1: softmax
    big = torch.tensor([[1000.0, 999.0, NEG, -1000.0]])
    out = clipped_softmax(big, -0.1, 1.0)
    torch.testing.assert_close(out, torch.tensor([loop_clipped(big[0].tolist(), -0.1, 1.0)], dtype=out.dtype))
    assert (
        out[0, 2] == 0 and out[0, 3] == 0
    )  # masked and tiny weights are exactly 0: the head can "do nothing"


def test_softpick_matches_the_paper_equation_by_loop():
    x = special_rows()
    got = softpick(x, eps=1e-8)
    want = torch.tensor([loop_softpick(r, 1e-8) for r in rows_of(x)], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    assert (got[1, [0, 1, 3, 4]] == 0).all() and got[1, 2] > 0.99  # only the diagonal visible, e^0.7 − 1 > 0
    # diagonal alone with a negative logit: e^x − 1 < 0, so nothing is picked (the row is all zeros, no NaN)
    lone = torch.tensor([[NEG, -0.5, NEG]], dtype=torch.float64)
    assert (softpick(lone) == 0).all()


def test_softpick_is_stable_for_huge_and_very_negative_logits():
    big = torch.tensor([[1000.0, 999.0, NEG, -1000.0]])
    out = softpick(big)
    # e^1000 − 1 ≈ e^1000 and |e^−1000 − 1| ≈ 1 is negligible next to it: weights e^0 : e^−1 over their sum
    w = torch.tensor([1.0, math.exp(-1.0)])
    torch.testing.assert_close(out[0, :2], w / w.sum())
    assert out[0, 2] == 0 and out[0, 3] == 0
    low = torch.full((2, 6), -500.0)  # the reference code's e^−max overflows here; ours gives exact zeros
    low[1, 3:] = NEG
    assert torch.isfinite(softpick(low)).all() and (softpick(low) == 0).all()


def test_sink_logit_at_zero_is_softmax1_and_matches_the_loop():
    x = special_rows().view(1, 1, 4, 5).expand(1, 2, 4, 5)
    s = torch.tensor([0.0, -1.3], dtype=torch.float64)
    got = softmax_with_sink_logit(x, s)
    for h in range(2):
        want = torch.tensor([loop_sink_logit(r, s[h].item()) for r in rows_of(x[0, h])], dtype=torch.float64)
        torch.testing.assert_close(got[0, h], want)
    torch.testing.assert_close(got[0, 0], softmax1(x[0, 0]))  # the one code path: s = 0 is softmax-1
    big = torch.tensor([[1000.0, 999.0, NEG]]).view(1, 1, 1, 3)
    assert torch.isfinite(softmax_with_sink_logit(big, torch.zeros(1))).all()


def test_gradients_of_the_normalisations_gradcheck():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, dtype=torch.float64, generator=g).requires_grad_()
    # clipped: away from the clip's kinks (gradcheck needs differentiability at the point)
    assert torch.autograd.gradcheck(lambda t: clipped_softmax(t, -0.01, 1.0), (x,))
    # softpick: away from x = 0, where ReLU(e^x − 1) has its kink
    xs = (x.detach() + 0.3 * torch.sign(x.detach())).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: softpick(t, 1e-8), (xs,))
    masked = xs.detach().clone()
    masked[0, 3:] = NEG
    keep = torch.isfinite(masked)
    fill = masked.detach().clone()

    def softpick_masked(t):
        return softpick(torch.where(keep, t, fill), 1e-8)

    assert torch.autograd.gradcheck(softpick_masked, (xs.detach().clone().requires_grad_(),))
    s = torch.tensor([0.2, -0.4], dtype=torch.float64, requires_grad=True)
    x4 = torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(softmax_with_sink_logit, (x4, s))


# --------------------------------------------------------------------------------- fast == reference, in attention


def qkv(T=9, hs=8, nh=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, nh, T, hs, generator=g, dtype=dtype) * 2 for _ in range(3))


PARAMS = RemedyParams(gamma=-0.1, zeta=1.0, eps=1e-8, sink_logit=torch.tensor([0.5, -1.0]))


@pytest.mark.parametrize("kind", ["clipped", "softpick", "sink-logit"])
def test_fast_path_equals_reference_and_is_causal(kind):
    q, k, v = qkv()
    fast = remedy_attention(q, k, v, kind, PARAMS)
    ref, probs = remedy_attention_reference(q, k, v, kind, PARAMS)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert (probs.triu(1) == 0).all()
    # after a KV cache: the last 3 queries over all 9 keys are the reference's last 3 rows
    torch.testing.assert_close(
        remedy_attention(q[:, :, -3:], k, v, kind, PARAMS), ref[:, :, -3:], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kind", ["clipped", "softpick", "sink-logit"])
def test_attention_gradients_gradcheck(kind):
    q, k, v = (t.requires_grad_() for t in qkv(T=4, hs=3, dtype=torch.float64, seed=2))
    s = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)

    def fast(q, k, v, s):
        return remedy_attention(q, k, v, kind, RemedyParams(gamma=-0.05, zeta=1.0, eps=1e-8, sink_logit=s))

    assert torch.autograd.gradcheck(fast, (q, k, v, s))


def test_bfloat16_keeps_its_dtype_and_the_float32_weights():
    q, k, v = qkv()
    for kind in ("clipped", "softpick", "sink-logit"):
        ref = remedy_attention(q, k, v, kind, PARAMS)
        low = remedy_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), kind, PARAMS)
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.float(), ref, rtol=0.05, atol=0.05)


def test_sink_logit_fast_path_carries_the_gradient_to_the_logits():
    q, k, v = qkv(T=5, hs=4, dtype=torch.float64)
    s_fast = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    s_ref = s_fast.detach().clone().requires_grad_()
    remedy_attention(q, k, v, "sink-logit", RemedyParams(sink_logit=s_fast)).square().sum().backward()
    remedy_attention_reference(q, k, v, "sink-logit", RemedyParams(sink_logit=s_ref))[
        0
    ].square().sum().backward()
    torch.testing.assert_close(s_fast.grad, s_ref.grad)
    assert s_fast.grad.abs().min() > 0


def test_sink_logit_fast_path_at_zero_is_softmax1s_extra_key_path_after_a_cache_too():
    from models.attention import attention_with_past

    q, k, v = qkv()
    zero = RemedyParams(sink_logit=torch.zeros(2))
    for rows in (9, 3, 1):  # no past, a chunk after 6 cached positions, one decoding step
        got = remedy_attention(q[:, :, -rows:], k, v, "sink-logit", zero)
        want = attention_with_past(q[:, :, -rows:], k, v, 9 - rows, "softmax1")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sink_logit_model_with_zero_logits_is_the_softmax1_model():
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    for family in ("gpt2", "llama"):
        a = build(micro(family, attn="sink-logit"), seed=4).eval()
        b = build(micro(family, attn="softmax1"), seed=4).eval()
        b.load_state_dict({k: v for k, v in a.state_dict().items() if not k.endswith("sinks")})
        torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ gated attention


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gate_matches_its_formula(gate):
    """y_h ← y_h ⊙ σ(x W_g + b_g) per head (headwise: one scalar per head) before c_proj (Qiu et al. G1)."""
    model = build(micro("llama", gate=gate), seed=1).eval()
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        attn.g_proj.bias.normal_()
    x = torch.randn(2, 7, 32)
    q, k, v = (t.view(2, 7, 4, 8).transpose(1, 2) for t in (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)))
    from models.transformer import apply_rope

    cos, sin = model.rope_cos[:7], model.rope_sin[:7]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = (
        torch.softmax(
            (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(
                ~torch.ones(7, 7, dtype=torch.bool).tril(), NEG
            ),
            -1,
        )
        @ v
    )
    y = y.transpose(1, 2)  # (B, T, nh, hs)
    logits = x @ attn.g_proj.weight.t() + attn.g_proj.bias
    g = 1 / (1 + torch.exp(-logits))
    y = y * (g[..., None] if gate == "headwise" else g.view(2, 7, 4, 8))
    want = y.reshape(2, 7, 32) @ attn.c_proj.weight.t()
    torch.testing.assert_close(attn(x, (cos, sin)), want, rtol=1e-5, atol=1e-5)
    assert attn.g_proj.weight.shape == ((4, 32) if gate == "headwise" else (32, 32))


# ------------------------------------------------------------------------------- KV cache, observation, generate

CASES = [
    ("gpt2", dict(attn="clipped")),
    ("gpt2", dict(attn="softpick", gate="elementwise")),
    ("llama", dict(attn="sink-logit", gate="headwise")),
    ("llama", dict(attn="softmax", gate="elementwise", emb_proj=True)),
]


def perturbed(family, switches, seed=3):
    model = build(micro(family, **switches), seed=seed).eval()
    with torch.no_grad():  # non-trivial sinks, gate biases and projection
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "g_proj.bias", "emb_proj.weight", "head_proj.weight")):
                p.add_(0.5 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(("family", "switches"), CASES)
def test_cache_observation_and_generation_agree_with_one_full_pass(family, switches):
    model = perturbed(family, switches)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config)
        parts = [model(ids[:, :6], cache)] + [model(ids[:, i : i + 1], cache) for i in range(6, 20)]
        with observe(model, hidden=False, attention=True) as obs:
            observed = model(ids)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(observed, full, rtol=1e-5, atol=1e-5)
    assert len(obs.attention) == 2 and obs.attention[0].shape == (2, 4, 20, 20)
    assert (obs.attention[0].sum(-1) <= 1 + 1e-5).all()
    out = model.generate(ids[:, :5], 4)
    seq = ids[:, :5]
    for _ in range(4):
        with torch.no_grad():
            seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq[:, 5:])


# ---------------------------------------------------------------------------------------- OSP embedding projection


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("which", [("emb_proj",), ("head_proj",), ("emb_proj", "head_proj")])
def test_merged_osp_projections_give_the_same_logits_in_the_plain_architecture(family, tied, which):
    switches = {name: True for name in which}
    model = build(micro(family, tie_embeddings=tied, **switches), seed=3).eval()
    with torch.no_grad():  # trained projections: not orthogonal any more
        for name in which:
            model.transformer[name].weight.add_(0.3 * torch.randn(32, 32))
    merged = merge_projections(model)
    assert merged.config == model.config.replace(emb_proj=False, head_proj=False, tie_embeddings=False)
    assert not {"transformer.emb_proj.weight", "transformer.head_proj.weight"} & set(merged.state_dict())
    x = torch.randint(0, 97, (2, 24))
    torch.testing.assert_close(merged(x), model(x), rtol=1e-5, atol=1e-5)
    if tied and "head_proj" in which:  # the tied head read E: it is E P₂ now, the embedding E (P₁ᵀ)
        wte = model.transformer.wte.weight
        expected = wte.double() @ model.transformer.head_proj.weight.double()
        torch.testing.assert_close(merged.lm_head.weight.double(), expected, rtol=1e-6, atol=1e-6)
    plain = build(micro(family), seed=0)
    assert merge_projections(plain) is plain


def test_osp_projections_start_orthogonal_as_the_reference_model():
    """OSP's reference (dmis-lab/Outlier-Safe-Pre-Training) initialises both projections orthogonally."""
    fresh = build(micro("llama", emb_proj=True, head_proj=True), seed=5)
    for name in ("emb_proj", "head_proj"):
        w = fresh.transformer[name].weight.double()
        torch.testing.assert_close(w @ w.t(), torch.eye(32, dtype=torch.float64), rtol=0, atol=1e-6)
    assert not torch.equal(fresh.transformer.emb_proj.weight, fresh.transformer.head_proj.weight)


def test_evaluation_loads_the_merged_model(tmp_path):
    from models.checkpoint import save_checkpoint
    from models.tokenizer import load_tokenizer
    from qbench.eval.load import load_model

    model = build(
        micro("llama", emb_proj=True, head_proj=True).replace(vocab_size=8192), seed=6
    )  # the tokenizer's vocabulary
    with torch.no_grad():
        model.transformer.emb_proj.weight.add_(0.3 * torch.randn(32, 32))
        model.transformer.head_proj.weight.add_(0.3 * torch.randn(32, 32))
    save_checkpoint(tmp_path / "ckpt", model.eval(), load_tokenizer("bpe8192"))
    loaded = load_model(str(tmp_path / "ckpt"))
    assert not loaded.model.config.emb_proj and not loaded.model.config.head_proj
    assert loaded.description["merged_projections"] == ["emb_proj", "head_proj"]
    x = torch.randint(0, 8192, (1, 16))
    torch.testing.assert_close(loaded.model(x), model(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- transformers export


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("attn", ["clipped", "softpick", "sink-logit"])
def test_transformers_export_reproduces_the_remedies(family, attn, tmp_path):
    from transformers import AutoModelForCausalLM

    from models.hf import to_hf_model

    model = perturbed(family, dict(attn=attn, emb_proj=True))
    hf = to_hf_model(model)
    x = torch.randint(0, 97, (2, 24))
    assert (hf(x).logits - model(x)).abs().max() <= 1e-4
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 1) % 97  # still causal through the registered mask function
    torch.testing.assert_close(hf(x).logits[:, :12], hf(y).logits[:, :12])
    from qbench.eval.adapters import forward_observed, observe_any

    with observe_any(hf, attention=True) as obs:  # the harness's attention statistics: probabilities as ours
        forward_observed(hf, x, obs)
    with observe(model, hidden=False, attention=True) as ours:
        model(x)
    torch.testing.assert_close(obs.attention[1], ours.attention[1], rtol=1e-4, atol=1e-5)
    assert hf.config._attn_implementation == {"clipped": "clipped_softmax", "softpick": "softpick"}.get(
        attn, "sink_logit"
    )
    if family == "llama":  # a plain from_pretrained of the saved folder (parameters in config.json)
        hf.save_pretrained(str(tmp_path))
        again = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), attn_implementation=hf.config._attn_implementation
        )
        assert (again(x).logits - model(x)).abs().max() <= 1e-4


def test_kv_cache_quantisation_reads_the_same_keys_in_ours_and_the_export():
    from models.hf import to_hf_model
    from qbench.quant.kv import KVConfig, apply_kv

    x = torch.randint(0, 97, (1, 24))
    for attn in ("clipped", "softpick", "sink-logit"):
        model = perturbed("llama", dict(attn=attn))
        # per-token: every key/value quantised as written (KIVI keeps a 24-token window float)
        config = KVConfig(4, "per-token")
        ours, theirs = apply_kv(model, config), apply_kv(to_hf_model(model), config)
        assert (ours(x) - model(x)).abs().max() > 1e-4  # 4-bit keys/values change something
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=1e-4, atol=1e-4)


def test_an_osp_checkpoint_exports_as_the_plain_model(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from models.checkpoint import save_checkpoint
    from models.hf import export_to_hf

    model = perturbed("llama", dict(emb_proj=True, head_proj=True, norm="rmsnorm_single", attn="softpick"))
    save_checkpoint(tmp_path / "ckpt", model, None)
    out = export_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["qbench"]["merged_projections"] == ["emb_proj", "head_proj"]
    assert config["attn_implementation"] == "softpick"
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    x = torch.randint(0, 97, (2, 24))
    assert (hf(x).logits - model(x)).abs().max() <= 1e-4


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
@pytest.mark.parametrize("attn", ["softmax", "softmax1", "sink-logit"])
def test_gated_llama_exports_and_generates_the_same_tokens(gate, attn, tmp_path):
    """The gate rides in extra query heads whose rotary embedding the registered function undoes (models.hf)."""
    from transformers import AutoModelForCausalLM

    from models.checkpoint import save_checkpoint
    from models.hf import GATED_PREFIX, export_to_hf, to_hf_model
    from qbench.eval.adapters import forward_observed, observe_any

    model = perturbed("llama", dict(gate=gate, attn=attn, emb_proj=True))
    hf = to_hf_model(model)
    assert hf.config._attn_implementation.startswith(GATED_PREFIX)
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    assert (hf(x).logits - model(x)).abs().max() <= 1e-4
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 1) % 97  # causal through the base's mask function
    torch.testing.assert_close(hf(x).logits[:, :12], hf(y).logits[:, :12])
    with observe_any(hf, attention=True) as obs:  # probabilities through the gated eager variant
        forward_observed(hf, x, obs)
    with observe(model, hidden=False, attention=True) as ours:
        model(x)
    torch.testing.assert_close(obs.attention[1], ours.attention[1], rtol=1e-4, atol=1e-5)
    assert hf.config._attn_implementation.startswith(GATED_PREFIX)  # restored after observing
    ours_tokens = model.generate(x[:, :6], 8)
    theirs = hf.generate(x[:, :6], max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs[:, 6:], ours_tokens)  # through transformers' KV cache: positions > 0
    save_checkpoint(tmp_path / "ckpt", model, None)  # a plain from_pretrained of the exported folder
    again = AutoModelForCausalLM.from_pretrained(str(export_to_hf(tmp_path / "ckpt", tmp_path / "hf")))
    assert (again(x).logits - model(x)).abs().max() <= 1e-4
    from types import SimpleNamespace

    from qbench.studies.card.profile import architecture

    arch = architecture(SimpleNamespace(model=again, description={}))  # what a card of the folder says
    assert (arch["attention"], arch["gate"], arch["heads"]) == (attn, gate, model.config.n_head)


@pytest.mark.parametrize("how", ["to", "from_pretrained"])
def test_gated_export_in_bfloat16_undoes_the_rotation_it_applied(how, tmp_path, monkeypatch):
    """``.to(bfloat16)`` rounds the rotary inv_freq, ``from_pretrained(dtype=bfloat16)`` keeps it float32: the
    gate must be un-rotated with the angles actually applied either way, not with recomputed ones."""
    from transformers import AutoModelForCausalLM

    import models.hf as hf_module
    from models.checkpoint import save_checkpoint
    from models.hf import export_to_hf, to_hf_model

    config = micro("llama", gate="elementwise").replace(context=512)
    model = build(config, seed=3).eval()
    x = torch.randint(0, 97, (1, 512), generator=torch.Generator().manual_seed(2))
    if how == "to":
        hf = to_hf_model(model).to(torch.bfloat16)
        assert hf.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    else:
        save_checkpoint(tmp_path / "ckpt", model, None)
        hf = AutoModelForCausalLM.from_pretrained(
            str(export_to_hf(tmp_path / "ckpt", tmp_path / "hf")), dtype=torch.bfloat16
        )
        assert hf.model.rotary_emb.inv_freq.dtype == torch.float32
    applied, used = [], []
    attn = hf.model.layers[1].self_attn
    attn.register_forward_pre_hook(
        lambda m, args, kwargs: applied.append(kwargs["position_embeddings"]), with_kwargs=True
    )
    unrotate = hf_module._unrotate
    monkeypatch.setattr(
        hf_module, "_unrotate", lambda r, cos, sin: used.append((cos, sin)) or unrotate(r, cos, sin)
    )
    with torch.no_grad():
        logits = hf(x).logits.float()
    assert torch.equal(used[1][0], applied[0][0]) and torch.equal(used[1][1], applied[0][1])
    if how == "to":  # what recomputing would have used: visibly other angles at these positions
        inv, _ = type(hf.model.rotary_emb).compute_default_rope_parameters(hf.config)
        assert (
            torch.arange(512)[:, None] * inv - torch.arange(512)[:, None] * inv.bfloat16().float()
        ).abs().max() > 0.04
    ours = build(config, seed=3).eval().to(torch.bfloat16)
    ours.load_state_dict(model.state_dict())
    with torch.no_grad():  # and the logits stay within bf16 rounding of the float model's
        reference = model(x)
        ours_err = (ours(x).float() - reference).abs().max()
    assert (logits - reference).abs().max() <= 2 * ours_err + 1e-2


def test_gated_kv_cache_quantisation_matches_ours_inside_the_gate():
    from models.hf import to_hf_model
    from qbench.quant.kv import KVConfig, apply_kv

    x = torch.randint(0, 97, (1, 24))
    model = perturbed("llama", dict(gate="elementwise"))
    # per-token on one version; KIVI with a short float window reads two versions (the streaming path)
    for config in (KVConfig(4, "per-token"), KVConfig(4, "kivi", group=8, residual=8)):
        ours, theirs = apply_kv(model, config), apply_kv(to_hf_model(model), config)
        assert (ours(x) - model(x)).abs().max() > 1e-4  # 4-bit keys/values change something
        torch.testing.assert_close(theirs(x).logits, ours(x), rtol=1e-4, atol=1e-4)


def test_gated_gpt2_attention_is_refused_by_the_export():
    from models.hf import to_hf_model

    with pytest.raises(UserError, match="gate='headwise' has no equivalent"):
        to_hf_model(build(micro("gpt2", gate="headwise")))


# -------------------------------------------------------------------------------------------------- config errors


def test_bad_switch_values_are_one_line_errors():
    with pytest.raises(UserError, match="did you mean 'headwise'"):
        micro("gpt2", gate="headwse")
    with pytest.raises(UserError, match="did you mean 'softpick'"):
        micro("gpt2", attn="softpik")
    with pytest.raises(UserError, match="clip_zeta"):
        micro("gpt2", attn="clipped", clip_zeta=0.5)
    # the reference OPT script's alpha = 12 (gamma = -alpha / T, T the context: 24 here)
    assert micro("gpt2", attn="clipped").clip_gamma == pytest.approx(-12.0 / 24)
