"""qbench's decode runtime (qbench.eval.decode) and its C ops (native_decode.c): each op against a torch
reference written from the model's own formulas, on every build this CPU runs (native, AVX2-only, portable C);
the runtime against the model's eager step on every configuration it serves, float and real-quantised; the
configurations it refuses, refused with their reason."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from models import build
from models.config import family_config
from models.errors import UserError
from models.transformer import apply_rope, fuse_projections
from qbench.eval import decode
from qbench.quant import quantize
from qbench.quant.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: model.generate runs instead")


@functools.cache
def _builds() -> dict[str, object]:
    """This machine's library, and the AVX2-only and portable builds where they compile (the loops other CPU
    classes take: the ops are plain C that each target vectorises its own way)."""
    libs = {"native": native.library()}
    avx2 = native.build(["-march=x86-64-v3", "-fopenmp"])
    if avx2 is not None and avx2.qk_isa() == 1:
        libs["avx2"] = avx2
    portable = native.build(["-fopenmp"]) or native.build([])
    if portable is not None:
        libs["portable"] = portable
    return libs


BUILDS = ("native", "avx2", "portable")


def _lib(name: str):
    lib = _builds().get(name)
    if lib is None:
        pytest.skip(f"the {name} build does not compile here")
    return lib


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@pytest.mark.parametrize("build_name", BUILDS)
@pytest.mark.parametrize(
    "kind", ["layernorm", "layernorm-no-bias", "layernorm-no-affine", "rms", "rms-single"]
)
@pytest.mark.parametrize("n", [7, 384, 1000])
def test_norm_matches_torch(build_name, kind, n):
    lib = _lib(build_name)
    g = torch.Generator().manual_seed(n)
    x0 = torch.randn(n, generator=g) * 3 + 0.5
    delta = torch.randn(n, generator=g)
    w = torch.randn(1 if kind == "rms-single" else n, generator=g)
    b = torch.randn(n, generator=g) if kind == "layernorm" else None
    eps = 1e-5
    for with_delta in (False, True):
        x = x0.clone()
        out = torch.empty(n)
        rms = kind.startswith("rms")
        weight = None if kind == "layernorm-no-affine" else w
        lib.qk_decode_norm(
            _p(x), _p(delta) if with_delta else None, n, _p(weight), 0 if weight is None else weight.numel(),
            _p(b), eps, int(rms), _p(out),
        )  # fmt: skip
        expected_x = x0 + delta if with_delta else x0
        assert torch.equal(x, expected_x)  # the residual add, in place, exactly
        if rms:  # models.transformer.RMSNorm: weight * (x * rsqrt(mean(x^2) + eps))
            ref = w * F.rms_norm(expected_x, (n,), None, eps)
        else:
            ref = F.layer_norm(expected_x, (n,), weight, b, eps)
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)


def _attention_reference(q, k_new, v_new, kc, vc, pos, cos, sin, kind, sink_k, sink_v):
    """The model's decode attention written out: RoPE (models.transformer.apply_rope), the cache append, SDPA over
    positions 0 … pos with the extra key of softmax-1 (zeros) or the sink, grouped-query heads repeated."""
    nkv, _, hs = kc.shape
    nh = q.numel() // hs
    q = q.view(1, nh, 1, hs)
    k = k_new.view(1, nkv, 1, hs)
    if cos is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kc, vc = kc.clone(), vc.clone()
    kc[:, pos], vc[:, pos] = k[0, :, 0], v_new.view(nkv, hs)
    K, V = kc[None, :, : pos + 1], vc[None, :, : pos + 1]
    K, V = K.repeat_interleave(nh // nkv, dim=1), V.repeat_interleave(nh // nkv, dim=1)
    if kind == 1:
        z = torch.zeros(1, nh, 1, hs)
        K, V = torch.cat([z, K], 2), torch.cat([z, V], 2)
    if kind == 2:
        K, V = torch.cat([sink_k.view(1, nh, 1, hs), K], 2), torch.cat([sink_v.view(1, nh, 1, hs), V], 2)
    y = F.scaled_dot_product_attention(q.double(), K.double(), V.double()).float()
    return y.reshape(-1), kc, vc


@pytest.mark.parametrize("build_name", BUILDS)
@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize(
    "nh, nkv, hs, pos, rope",
    [(4, 4, 16, 0, False), (6, 2, 64, 37, True), (3, 1, 8, 70, True), (2, 1, 640, 5, True)],
)
def test_attention_matches_the_model(build_name, kind, nh, nkv, hs, pos, rope):
    lib = _lib(build_name)
    g = torch.Generator().manual_seed(pos * 10 + kind)
    context = pos + 5
    q, k, v = (torch.randn(n * hs, generator=g) * 2 for n in (nh, nkv, nkv))
    kc, vc = torch.randn(nkv, context, hs, generator=g), torch.randn(nkv, context, hs, generator=g)
    sink_k, sink_v = torch.randn(nh, hs, generator=g), torch.randn(nh, hs, generator=g)
    cos = sin = None
    if rope:
        angles = torch.rand(hs // 2, generator=g) * 6
        cos, sin = torch.cat([angles, angles]).cos()[None], torch.cat([angles, angles]).sin()[None]
    expected, kc_ref, vc_ref = _attention_reference(
        q, k, v, kc, vc, pos, cos, sin, kind, sink_k if kind == 2 else None, sink_v if kind == 2 else None
    )
    out = torch.empty(nh * hs)
    for threads in (1, 2):
        kc_c, vc_c = kc.clone(), vc.clone()
        lib.qk_decode_attention(
            _p(q), _p(k), _p(v), nh, nkv, hs, _p(kc_c), _p(vc_c), context * hs, pos,
            _p(cos), _p(sin), kind, _p(sink_k), _p(sink_v), hs**-0.5, _p(out), threads,
        )  # fmt: skip
        # RoPE as the model computes it (the same products, one rounding each): the cache equal bit for bit
        assert torch.equal(kc_c, kc_ref) and torch.equal(vc_c, vc_ref)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_attention_softmax_is_stable_for_large_logits():
    """Logits of ±400 (exp overflows float32 without the max shift) and a key far below the rest (exp underflows):
    the weights still sum to one — the output equals the reference in float64."""
    lib = native.library()
    nh, hs, pos = 2, 8, 9
    q = torch.full((nh * hs,), 20.0)
    kc = torch.randn(nh, pos + 1, hs) * 20
    kc[:, 3] = -50.0
    vc = torch.randn(nh, pos + 1, hs)
    k, v = kc[:, pos].reshape(-1).clone(), vc[:, pos].reshape(-1).clone()
    out = torch.empty(nh * hs)
    for kind in (0, 1):
        expected, _, _ = _attention_reference(q, k, v, kc, vc, pos, None, None, kind, None, None)
        lib.qk_decode_attention(
            _p(q), _p(k), _p(v), nh, nh, hs, _p(kc), _p(vc), (pos + 1) * hs, pos, None, None, kind, None, None,
            hs**-0.5, _p(out), 1,
        )  # fmt: skip
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _model(family: str, **over):
    shape = dict(n_layer=2, n_head=4, d_model=64, d_ff=160, context=48, vocab_size=300)
    model = build(family_config(family, **{**shape, **over}), seed=0).eval()
    if model.config.attn == "sink":  # zero at init (= softmax-1): give the sink something to do
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.sink_k.normal_(), block.attn.sink_v.normal_()
    return model


SERVED = [
    ("gpt2", {}),
    ("gpt2", {"attn": "softmax1"}),
    ("gpt2", {"attn": "sink", "bias": False}),
    ("gpt2", {"pos": "none", "norm": "rmsnorm"}),
    ("llama", {}),
    ("llama", {"n_kv_head": 2}),
    ("llama", {"n_kv_head": 1, "attn": "softmax1", "norm": "rmsnorm_single"}),
    ("llama", {"emb_proj": True, "head_proj": True}),
]


def _step_logits(model, runtime, prompt, token):
    """The logits of one decode step after ``prompt``, by the model's eager forward and by the runtime."""
    with torch.inference_mode():
        eager_cache, runtime_cache = model.new_cache(), model.new_cache()
        model(prompt, eager_cache), model(prompt, runtime_cache)
        eager = model(torch.tensor([[token]]), eager_cache)
        fast = runtime.step(token, runtime_cache)
    assert runtime_cache.pos == eager_cache.pos == prompt.size(1) + 1
    return eager, fast


@pytest.mark.parametrize("family, over", SERVED, ids=[f"{f}-{o}" for f, o in SERVED])
def test_runtime_equals_the_eager_step(family, over):
    model = _model(family, **over)
    variants = [model] + ([fuse_projections(model)] if family == "llama" else [])
    prompt = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(1))
    for net in variants:
        assert decode.unsupported(net) is None
        runtime = decode.DecodeRuntime(net)
        eager, fast = _step_logits(net, runtime, prompt, 7)
        torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(runtime.generate(prompt, 20), net.generate(prompt, 20))


@pytest.mark.parametrize("scheme", ["absmax-w4a8-g32:head=true", "absmax-fine", "zeropoint-int4"])
def test_runtime_runs_the_real_layers(scheme):
    """A real-quantised copy decodes through its own kernels: the same tokens as its eager step, the layers'
    kept decode calls used (the runtime calls the modules, not a re-implementation of them)."""
    model = _model("gpt2", d_model=64, d_ff=256)
    q = quantize(model, scheme, mode="real").eval()
    prompt = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(2))
    runtime = decode.DecodeRuntime(q)
    assert torch.equal(runtime.generate(prompt, 16), q.generate(prompt, 16))
    eager, fast = _step_logits(q, runtime, prompt, 9)
    torch.testing.assert_close(fast, eager, rtol=1e-4, atol=1e-4)
    layer = q.transformer.h[0].mlp.c_fc
    assert layer.__dict__.get("last_path") not in (None, "torch"), layer.__dict__.get("last_path")
    # after the first step the runtime calls each layer's kept kernel call directly (checks once): the same
    # kernels, so the same logits bit for bit as the step through the modules
    bound = runtime._calls(bind=True)
    assert all(f is not m for f, m in zip(bound[0].values(), runtime._calls(bind=False)[0].values()))
    with torch.inference_mode():
        a, b = q.new_cache(), q.new_cache()
        q(prompt, a), q(prompt, b)
        assert torch.equal(runtime.step(3, a, bound), runtime.step(3, b))


def test_kept_call_is_refused_once_stale():
    """paths.kept_decode_call validates the layer's kept call when it binds: a swapped weight, or another
    dispatch (the kernels switched off), and it gives None — the runtime then calls the module."""
    from qbench.quant.kernels import paths

    q = quantize(_model("gpt2"), "absmax-fine", mode="real").eval()
    layer = q.transformer.h[0].mlp.c_fc
    with torch.inference_mode():
        layer(torch.randn(1, 1, 64))
    assert paths.kept_decode_call(layer) is not None
    with native.enabled(False):
        assert paths.kept_decode_call(layer) is None
    layer.bias.data = layer.bias.clone()  # not a setattr on the layer: only the bound pointer shows it
    assert paths.kept_decode_call(layer) is None


@pytest.mark.parametrize(
    "over, reason",
    [
        ({"attn": "clipped"}, "attn=clipped"),
        ({"gate": "headwise"}, "gate=headwise"),
        ({"norm_position": "post"}, "norm_position=post"),
    ],
)
def test_unsupported_configs_say_why(over, reason):
    model = _model("gpt2", **over)
    assert decode.unsupported(model) == reason
    with pytest.raises(UserError, match=reason):
        decode.DecodeRuntime(model)
    prompt = torch.randint(0, 300, (1, 5))
    tokens, engine = decode.generate(model, prompt, 4)  # falls back to the model's own loop, and says so
    assert torch.equal(tokens, model.generate(prompt, 4)) and engine == f"{decode.EAGER}: {reason}"


def test_unsupported_states_say_why():
    model = _model("gpt2")
    assert decode.unsupported(model.to(torch.bfloat16)) == "torch.bfloat16 on cpu (float32 on CPU only)"
    model = _model("gpt2")
    handle = model.transformer.h[0].register_forward_hook(lambda *a: None)
    assert decode.unsupported(model) == "forward hooks are registered"  # an observer would miss the steps
    handle.remove()
    model.transformer.h[1].attn.kv_transform = lambda k, v: (k, v)
    assert decode.unsupported(model) == "a KV-cache scheme or an attention observer is attached"
    model.transformer.h[1].attn.kv_transform = None
    with native.enabled(False):
        assert decode.unsupported(model) == "native kernels not built or switched off"
    assert decode.unsupported(torch.nn.Linear(2, 2)) == "not a qbench Transformer"
    tokens, engine = decode.generate(model, torch.zeros(2, 3, dtype=torch.long), 2)
    assert tokens.shape == (2, 2) and engine.endswith("batch > 1")
    assert decode.generate(model, torch.zeros(1, 3, dtype=torch.long), 2)[1] == decode.ENGINE


def test_runtime_refuses_past_the_context():
    model = _model("gpt2", context=12)
    with pytest.raises(ValueError, match="exceeds the model's context 12"):
        decode.DecodeRuntime(model).generate(torch.zeros(1, 8, dtype=torch.long), 6)
    with pytest.raises(ValueError, match="one sequence"):
        decode.DecodeRuntime(model).generate(torch.zeros(2, 3, dtype=torch.long), 2)


def test_cache_buffers_need_a_prefill():
    cache = _model("gpt2").new_cache()
    with pytest.raises(ValueError, match="layer 0 of the KV cache holds nothing yet"):
        cache.buffers(0)


def test_runtime_does_not_touch_the_model():
    model = _model("llama", n_kv_head=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decode.DecodeRuntime(model).generate(torch.randint(0, 300, (1, 4)), 8)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert dataclasses.asdict(model.config)["n_kv_head"] == 2
