"""KV-cache schemes (qbench.quant.kvschemes): each scheme against a reference written from its source (KIVI
Algorithm 1 simulated token by token, llama.cpp's reference block quantisers element by element), causality of
every scheme but ``window`` in our models and in transformers GPT-2/Llama/Mistral (sliding window), and one pass
over a window equal to generating it through the quantised cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models import build
from models.attention import attention_reference, attention_two_version
from models.errors import UserError
from models.hf import SOFTMAX1_EAGER, to_hf_model
from models.transformer import Transformer
from qbench.quant.kv import KVConfig, apply_kv, quantize_kv
from qbench.quant.kvschemes import KVSchemeQuantizer
from tests.qbench.conftest import micro_config, trained_like

SMALL = "kivi:group=4,residual=8"  # KIVI with groups small enough to act inside a 32-token window
CAUSAL = [
    KVConfig(2, SMALL),
    KVConfig(2, SMALL, keep_first=3),
    KVConfig(3, "kivi:group=3,residual=6"),
    KVConfig(4, "per-token"),
    KVConfig(3, "per-token:sym=false,block=16", keep_first=1),
    KVConfig(8, "per-token"),
    KVConfig(8, "fp8-e4m3:scale=0.01"),
    KVConfig(8, "fp8-e5m2"),
    KVConfig(2, SMALL + ",rotate=true"),  # QuaRot's rotated cache: what it stores is rotated
    KVConfig(3, "per-token:sym=false,block=16,rotate=true", keep_first=1),
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------- KIVI, Algorithm 1


def kivi_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """KIVI eq. 1 over all of ``x`` (one group): z = min, s = (max − min)/(2^b − 1), round((x − z)/s)·s + z."""
    lo, hi = x.min(), x.max()
    s = max((hi - lo).item() / (2**bits - 1), torch.finfo(torch.float32).tiny)
    return torch.clamp(torch.round((x - lo) / s), 0, 2**bits - 1) * s + lo


def kivi_streaming_reference(q, k, v, bits, G, R, kind="softmax", sink_k=None, sink_v=None):
    """KIVI Algorithm 1, decoding every token: append t_K to the float residual X_Kr; when it holds R keys,
    quantise it per channel in groups of G tokens into X_Kg; append t_V to X_Vr; when it holds more than R
    values, quantise the oldest per token (groups of G channels) into X_Vg; then attend t_Q over
    [X_Kg, X_Kr] and [X_Vg, X_Vr]. One (sequence, head) and one query at a time, explicit softmax."""
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    vg = G if D % G == 0 else D
    for b in range(B):
        for h in range(H):
            kg, kr, vq, vr = [], [], [], []
            for t in range(T):
                kr.append(k[b, h, t])
                vr.append(v[b, h, t])
                if len(kr) == R:
                    chunk = torch.stack(kr)
                    for g0 in range(0, R, G):
                        block = chunk[g0 : g0 + G].clone()
                        for d in range(D):
                            block[:, d] = kivi_quant(block[:, d], bits)
                        kg.extend(block)
                    kr = []
                if len(vr) > R:
                    old = vr.pop(0)
                    vq.append(torch.cat([kivi_quant(old[c : c + vg], bits) for c in range(0, D, vg)]))
                keys, values = torch.stack(kg + kr), torch.stack(vq + vr)
                logits = [float(q[b, h, t] @ key) / math.sqrt(D) for key in keys]
                extra = []
                if kind == "softmax1":
                    extra = [0.0]
                elif kind == "sink":
                    extra = [float(q[b, h, t] @ sink_k[h]) / math.sqrt(D)]
                m = max(logits + extra)
                weights = [math.exp(x - m) for x in logits]
                total = sum(weights) + sum(math.exp(x - m) for x in extra)
                o = sum(w / total * val for w, val in zip(weights, values))
                if kind == "sink":
                    o = o + math.exp(extra[0] - m) / total * sink_v[h]
                out[b, h, t] = o
    return out


@pytest.mark.parametrize("kind", ["softmax", "softmax1", "sink"])
@pytest.mark.parametrize(
    "bits, G, R", [(2, 3, 3), (3, 4, 4), (2, 3, 6)]
)  # two values per group would be exact
def test_one_pass_equals_kivi_algorithm_1_token_by_token(kind, bits, G, R):
    q, k, v = (torch.randn(2, 2, 13, 6, generator=gen(i)) for i in range(3))
    k[..., 1] *= 8.0  # an outlier channel, as KIVI's keys have
    sink_k, sink_v = torch.randn(2, 6, generator=gen(5)), torch.randn(2, 6, generator=gen(6))
    view = KVSchemeQuantizer(KVConfig(bits, f"kivi:group={G},residual={R}")).read(k, v)
    got, _ = attention_two_version(q, *view[:6], kind, sink_k, sink_v)
    expected = kivi_streaming_reference(q, k, v, bits, G, R, kind, sink_k, sink_v)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # the banded path (far part on the flash kernel, each query's band explicit) against the same reference
    banded, probs = attention_two_version(
        q, *view[:6], kind, sink_k, sink_v, residual=view.residual, need_probs=False
    )
    assert view.residual == R and probs is None
    torch.testing.assert_close(banded, expected, rtol=1e-4, atol=1e-5)
    float_out, _ = attention_reference(q, k, v, kind, sink_k, sink_v)
    assert (got - float_out).abs().max() > 1e-3  # the cache was quantised


def test_query_blocks_give_the_whole_matrix_result(monkeypatch):
    import models.attention

    q, k, v = (torch.randn(2, 2, 13, 6, generator=gen(i)) for i in range(3))
    view = KVSchemeQuantizer(KVConfig(2, "kivi:group=3,residual=3")).read(k, v)
    whole, whole_probs = attention_two_version(q, *view[:6], "softmax1")
    banded, _ = attention_two_version(q, *view[:6], "softmax1", residual=3, need_probs=False)
    monkeypatch.setattr(models.attention, "QUERY_BLOCK_ELEMENTS", 2 * 2 * 13 * 4)  # blocks of 4 queries
    blocked, blocked_probs = attention_two_version(q, *view[:6], "softmax1")
    torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(blocked_probs, whole_probs, rtol=0, atol=1e-7)
    # the banded path in ranges of blocks (here one block of 3 queries at a time) as in one
    monkeypatch.setattr(models.attention, "QUERY_BLOCK_ELEMENTS", 2 * 2 * 3 * 6)
    banded_blocks, _ = attention_two_version(q, *view[:6], "softmax1", residual=3, need_probs=False)
    torch.testing.assert_close(banded_blocks, banded, rtol=0, atol=1e-6)
    torch.testing.assert_close(banded, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["kivi", "kivi:group=4,residual=8"])
@pytest.mark.parametrize("keep", [dict(), dict(keep_first=3), dict(keep_sinks=2)])
def test_banded_kivi_equals_the_explicit_path_with_kept_positions(spec, keep):
    """Kept positions (keep_first, the sinks) are float in both versions: the banded path needs no case for them,
    and a window that is not a multiple of R (nor of G) ends in a part block."""
    q, k, v = (torch.randn(2, 3, 45, 8, generator=gen(i)) for i in range(3))
    k[..., 2] *= 6.0
    quantizer = KVSchemeQuantizer(KVConfig(2, spec, **keep))
    if "keep_sinks" in keep:
        quantizer.sinks = torch.tensor([[5, 17], [0, 40]])
    R = quantizer.config.residual
    if R >= 45:  # KIVI's default residual of 128 keeps this short window float: shorten it for the test
        quantizer = KVSchemeQuantizer(KVConfig(2, "kivi:group=4,residual=16", **keep))
        quantizer.sinks = torch.tensor([[5, 17], [0, 40]]) if "keep_sinks" in keep else None
    view = quantizer.read(k, v)
    explicit, _ = attention_two_version(q, *view[:6], "softmax")
    banded, probs = attention_two_version(q, *view[:6], "softmax", residual=view.residual, need_probs=False)
    assert probs is None
    torch.testing.assert_close(banded, explicit, rtol=1e-5, atol=2e-6)
    float_out, _ = attention_reference(q, k, v, "softmax")
    assert (banded - float_out).abs().max() > 1e-2  # the cache was quantised


def test_banded_kivi_is_only_taken_where_it_is_exact():
    """Probabilities asked for, a chunk after a past, another mask, or the switch off: the explicit path."""
    import models.attention

    q, k, v = (torch.randn(1, 2, 20, 8, generator=gen(i)) for i in range(3))
    view = KVSchemeQuantizer(KVConfig(2, "kivi:group=2,residual=4")).read(k, v)
    assert attention_two_version(q, *view[:6], residual=4, need_probs=True)[1] is not None
    window = torch.ones(20, 20, dtype=torch.bool).tril() & ~torch.ones(20, 20, dtype=torch.bool).tril(-8)
    assert (
        attention_two_version(q, *view[:6], mask=window[None, None], residual=4, need_probs=False)[1]
        is not None
    )
    causal = torch.ones(20, 20, dtype=torch.bool).tril()[None, None]
    assert attention_two_version(q, *view[:6], mask=causal, residual=4, need_probs=False)[1] is None
    models.attention.KIVI_BANDED = False
    try:
        assert attention_two_version(q, *view[:6], residual=4, need_probs=False)[1] is not None
    finally:
        models.attention.KIVI_BANDED = True
    assert KVSchemeQuantizer(KVConfig(2, "kivi:group=2,residual=4")).read(k, v, past=4).residual is None


@pytest.mark.parametrize("kind", ["softmax", "softmax1", "sink"])
@pytest.mark.parametrize("blocks", [False, True])
def test_attention_received_sums_the_reference_probabilities(kind, blocks, monkeypatch):
    import models.attention
    from models.attention import attention_received

    if blocks:  # queries in blocks of 5, each over the keys it can see only
        monkeypatch.setattr(models.attention, "QUERY_BLOCK_ELEMENTS", 2 * 3 * 33 * 5)
    q, k, v = (torch.randn(2, 3, 33, 8, generator=gen(i)) * 2 for i in range(3))
    sink_k, sink_v = torch.randn(3, 8, generator=gen(5)), torch.randn(3, 8, generator=gen(6))
    out, probs = attention_reference(q, k, v, kind, sink_k, sink_v)
    got_out, received = attention_received(q, k, v, kind, sink_k, sink_v)
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(received, probs.sum(dim=(1, 2)), rtol=1e-5, atol=1e-5)


def test_kivi_masks_follow_the_residual_and_the_value_window():
    quantizer = KVSchemeQuantizer(KVConfig(2, "kivi:group=2,residual=4", keep_first=1))
    mk, mv = quantizer.masks(0, 10, quantizer.keep_mask(1, 10, torch.device("cpu")), torch.device("cpu"))
    t, j = 5, torch.arange(10)
    assert mk[0, 0, t].tolist() == ((j < 4) & (j >= 1)).tolist()  # 6 keys written: one full residual of 4
    assert mk[0, 0, 7].tolist() == ((j < 8) & (j >= 1)).tolist()  # the 8th key completes the second
    assert mv[0, 0, t].tolist() == ((j <= t - 4) & (j >= 1)).tolist()  # values older than the 4 newest


# ------------------------------------------------------------------------------------------ llama.cpp


def ggml_reference(row: np.ndarray, bits: int, symmetric: bool) -> np.ndarray:
    """ggml-quants.c quantize_row_q8_0_ref / q4_0_ref (q{b}_0) / q4_1_ref (q{b}_1) then dequantize_row_*, one
    block, element by element in float32; scales through fp16 as block_q8_0/q4_0/q4_1 store them."""
    f32, f16 = np.float32, np.float16
    out = np.empty_like(row)
    if symmetric and bits == 8:
        amax = f32(max(abs(x) for x in row))
        d = f32(amax / f32(127))
        inv = f32(1) / d if d else f32(0)
        for i, x in enumerate(row):
            y = f32(x * inv)
            qv = math.floor(abs(y) + 0.5) * (1 if y >= 0 else -1)  # roundf
            out[i] = f32(qv) * f32(f16(d))
        return out
    levels = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        amax, m = f32(0), f32(0)
        for x in row:
            if amax < abs(x):
                amax, m = abs(x), x
        d = f32(m / f32(-half))
        inv = f32(1) / d if d else f32(0)
        for i, x in enumerate(row):
            qv = min(levels, int(f32(f32(x * inv) + f32(half + 0.5))))
            out[i] = f32(qv - half) * f32(f16(d))
        return out
    lo, hi = f32(row.min()), f32(row.max())
    d = f32((hi - lo) / f32(levels))
    inv = f32(1) / d if d else f32(0)
    for i, x in enumerate(row):
        qv = min(levels, int(f32(f32(f32(x - lo) * inv) + f32(0.5))))
        out[i] = f32(f32(qv) * f32(f16(d))) + f32(f16(lo))
    return out


@pytest.mark.parametrize("bits, sym", [(8, True), (4, True), (4, False), (5, True), (3, False)])
def test_per_token_equals_llama_cpp_reference_blocks(bits, sym):
    if bits == 5:  # q5_0 has no entry in KV_BITS: check the block quantiser itself
        from qbench.quant.kvschemes import ggml_quantize_blocks

        x = torch.randn(3, 32, generator=gen(1)) * 2
        got = ggml_quantize_blocks(x, 5, True).numpy()
        expected = np.stack([ggml_reference(r, 5, True) for r in x.numpy()])
        np.testing.assert_array_equal(got, expected)
        return
    k = torch.randn(2, 4, 5, 16, generator=gen(2)) * 3  # a token's row = 4 heads × 16 = 64 values: 2 blocks
    config = KVConfig(bits, f"per-token:sym={str(sym).lower()}")
    kq, _ = quantize_kv(k, k, config)
    rows = k.transpose(1, 2).reshape(2, 5, 64).numpy()
    expected = np.empty_like(rows)
    for b in range(2):
        for t in range(5):
            for start in (0, 32):
                expected[b, t, start : start + 32] = ggml_reference(rows[b, t, start : start + 32], bits, sym)
    got = kq.transpose(1, 2).reshape(2, 5, 64).numpy()
    np.testing.assert_array_equal(got, expected)


def test_fp8_values_lie_on_the_scaled_grid():
    k = torch.randn(1, 2, 6, 8, generator=gen(3))
    for name, dtype in (("fp8-e4m3", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2)):
        kq, vq = quantize_kv(k, k * 10, KVConfig(8, f"{name}:scale=0.01"))
        grid = (kq / 0.01).to(dtype).float() * 0.01
        torch.testing.assert_close(kq, grid, rtol=1e-6, atol=0)
        assert (kq - k).abs().max() <= k.abs().max() * 2**-3  # within half a step of a 3- (2-) bit mantissa
        assert (vq - k * 10).abs().max() > 0
    big = torch.full((1, 1, 2, 4), 1000.0)
    assert (
        quantize_kv(big, big, KVConfig(8, "fp8-e4m3"))[0].max() == 448.0
    )  # scale 1: saturates at E4M3's max


def test_calibrated_fp8_scales_are_per_layer_maxima_over_the_calibration_batches(ours):
    from qbench.quant.kvschemes import calibrate_kv_scales, kv_quantizers

    model = ours["llama"]
    config = KVConfig(8, "fp8-e4m3:scale=calib")
    assert config.label == "kv8-e4m3-calib" and KVConfig.from_dict(config.to_dict()) == config
    kv = apply_kv(model, config)
    batches = [torch.randint(0, 64, (2, 16), generator=gen(20 + i)) for i in range(2)]
    with pytest.raises(UserError, match="needs calibrate_kv_scales"):
        kv(batches[0])
    scales = calibrate_kv_scales(kv, batches)
    recorders = [Recorder() for _ in model.transformer.h]
    for block, recorder in zip(model.transformer.h, recorders):
        block.attn.kv_transform = recorder
    try:
        with torch.no_grad():
            for ids in batches:
                model(ids)
    finally:
        for block in model.transformer.h:
            block.attn.kv_transform = None
    for layer, recorder in enumerate(recorders):
        k_max = max(float(k.abs().max()) for k, _ in recorder.calls)
        v_max = max(float(v.abs().max()) for _, v in recorder.calls)
        assert scales[layer] == pytest.approx((k_max / 448, v_max / 448), rel=1e-6)
    k = torch.randn(1, 4, 5, 8, generator=gen(21))
    k_scale, v_scale = scales[0]
    quantizer = kv_quantizers(kv)[0]
    expected_k = (k / k_scale).to(torch.float8_e4m3fn).float() * k_scale
    torch.testing.assert_close(quantizer.quantize_keys(k, 0, 5), expected_k, rtol=1e-6, atol=0)
    expected_v = (k / v_scale).to(torch.float8_e4m3fn).float() * v_scale
    torch.testing.assert_close(quantizer.quantize_values(k, 0, 5), expected_v, rtol=1e-6, atol=0)
    with torch.no_grad():
        assert torch.isfinite(kv(batches[0])).all()


class Recorder:
    """A kv transform that records what it is given and changes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, k, v):
        self.calls.append((k.detach().clone(), v.detach().clone()))
        return k, v


# ---------------------------------------------------------------------------- two-version attention


@pytest.mark.parametrize("kind", ["softmax", "softmax1", "sink"])
def test_two_version_attention_reads_either_version_whole(kind):
    q, k, k_hat, v, v_hat = (torch.randn(1, 2, 7, 4, generator=gen(i)) for i in range(5))
    sink = torch.randn(2, 4, generator=gen(9)), torch.randn(2, 4, generator=gen(10))
    no, yes = torch.zeros(7, 7, dtype=torch.bool), torch.ones(7, 7, dtype=torch.bool)
    for mask, (kk, vv) in ((no, (k, v)), (yes, (k_hat, v_hat))):
        got, probs = attention_two_version(q, k, k_hat, v, v_hat, mask, mask, kind, *sink)
        expected, expected_probs = attention_reference(q, kk, vv, kind, *sink)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ causality


def _later_tokens_changed(ids: torch.Tensor, t: int) -> torch.Tensor:
    other = ids.clone()
    other[:, t + 1 :] = torch.randint(0, 64, other[:, t + 1 :].shape, generator=gen(7))
    return other


@pytest.fixture(scope="module")
def ours():
    models = {
        "gpt2": trained_like(micro_config("gpt2")),
        "llama": trained_like(micro_config("llama")),
        "llama-softmax1": trained_like(micro_config("llama", attn="softmax1")),
        "gpt2-sink": trained_like(micro_config("gpt2", attn="sink")),
        # gated attention: the quantised cache's path must apply the gate as the float path does
        "llama-gate": trained_like(micro_config("llama", gate="elementwise")),
        "gpt2-gate-head": trained_like(micro_config("gpt2", gate="headwise")),
    }
    with torch.no_grad():
        for block in models["gpt2-sink"].transformer.h:
            block.attn.sink_k.normal_(generator=gen(11))
            block.attn.sink_v.normal_(generator=gen(12))
    return models


def _tiny_mistral():
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def theirs(ours):
    gpt2, llama1 = to_hf_model(ours["gpt2"]), to_hf_model(ours["llama-softmax1"])
    eager = to_hf_model(ours["llama"])
    eager.set_attn_implementation("eager")
    return {
        "hf-gpt2": gpt2,
        "hf-llama-softmax1": llama1,
        "hf-llama-eager": eager,
        "hf-mistral": _tiny_mistral(),
    }


def _logits(model, ids):
    if isinstance(model, Transformer):
        return model(ids)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


@pytest.mark.parametrize("config", [*CAUSAL, KVConfig(2, "kivi")], ids=str)
def test_causal_schemes_never_read_later_tokens(ours, theirs, config):
    ids = torch.randint(0, 64, (2, 32), generator=gen(4))
    t = 17
    other = _later_tokens_changed(ids, t)
    with torch.no_grad():
        for name, model in {**ours, **theirs}.items():
            kv = apply_kv(model, config)
            a, b = _logits(kv, ids), _logits(kv, other)
            torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6, msg=name)


def test_the_window_scheme_is_not_causal_and_says_so(ours, theirs):
    config = KVConfig(2, "window")
    assert config.to_dict()["causal"] == "no" and KVConfig(2).to_dict()["causal"] == "yes"
    ids = torch.randint(0, 64, (2, 32), generator=gen(4))
    other = _later_tokens_changed(ids, 17)
    with torch.no_grad():
        for name, model in {**ours, **theirs}.items():
            kv = apply_kv(model, config)
            assert (_logits(kv, ids)[:, :18] - _logits(kv, other)[:, :18]).abs().max() > 0, name
    assert KVConfig(2, keep_sinks=1).to_dict()["causal"] == "no"  # sinks chosen over the whole window


def test_a_cache_that_quantises_nothing_is_the_float_model(ours, theirs):
    """R longer than the window: the explicit attention (GQA, sliding window, scaling, softmax-1) is exact."""
    ids = torch.randint(0, 64, (2, 32), generator=gen(4))
    with torch.no_grad():
        for name, model in {**ours, **theirs}.items():
            kv = apply_kv(model, KVConfig(2, "kivi:group=64,residual=64"))
            torch.testing.assert_close(_logits(kv, ids), _logits(model, ids), rtol=1e-5, atol=1e-5, msg=name)


def test_a_left_padded_transformers_batch_stays_finite_and_exact(theirs):
    ids = torch.randint(0, 64, (2, 16), generator=gen(19))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # the first sequence is left-padded by 5
    for name in ("hf-llama-eager", "hf-mistral", "hf-gpt2"):
        model = theirs[name]
        kv = apply_kv(model, KVConfig(2, "kivi:group=64,residual=64"))  # quantises nothing
        with torch.no_grad():
            got = kv(input_ids=ids, attention_mask=mask, use_cache=False).logits
            expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got[0, 5:], expected[0, 5:], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("config", [KVConfig(2, SMALL), KVConfig(4, "per-token")], ids=str)
def test_ours_and_the_export_agree(ours, theirs, config):
    ids = torch.randint(0, 64, (2, 32), generator=gen(4))
    with torch.no_grad():
        a = _logits(apply_kv(ours["llama-softmax1"], config), ids)
        b = _logits(apply_kv(theirs["hf-llama-softmax1"], config), ids)
        c = _logits(apply_kv(_eager(ours["llama-softmax1"]), config), ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def _eager(model):
    hf = to_hf_model(model)
    hf.set_attn_implementation(SOFTMAX1_EAGER)
    return hf


# ----------------------------------------------------------------------------- one cache, two ways in


@pytest.mark.parametrize("config", CAUSAL, ids=str)
@pytest.mark.parametrize("chunks", [(5,) + (1,) * 19, (4, 3, 1, 6, 2, 8)], ids=["decode", "chunks"])
def test_generating_through_the_quantised_cache_equals_one_pass(ours, config, chunks):
    ids = torch.randint(0, 64, (2, sum(chunks)), generator=gen(8))
    with torch.no_grad():
        for name, model in ours.items():
            kv = apply_kv(model, config)
            full = kv(ids)
            cache, start, parts = kv.new_cache(), 0, []
            for size in chunks:
                parts.append(kv(ids[:, start : start + size], cache))
                start += size
            torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5, msg=name)
    stored_k, _ = cache.stored(0)
    assert stored_k.size(2) == sum(chunks)


def test_the_cache_holds_quantised_values_and_keep_first_counts_absolute_positions(ours):
    config = KVConfig(2, SMALL, keep_first=3)
    kv = apply_kv(ours["llama"], config)
    ids = torch.randint(0, 64, (1, 20), generator=gen(9))
    with torch.no_grad():
        cache, float_cache = kv.new_cache(), ours["llama"].new_cache()
        for start, stop in [(0, 2), *((i, i + 1) for i in range(2, 20))]:  # the same chunks: the same floats
            kv(ids[:, start:stop], cache)
            ours["llama"](ids[:, start:stop], float_cache)
    k, v = cache.stored(0)
    fk, fv = float_cache._k[0][:, :, :20], float_cache._v[0][:, :, :20]
    assert torch.equal(k[:, :, :3], fk[:, :, :3]) and torch.equal(v[:, :, :3], fv[:, :, :3])  # kept
    assert not torch.equal(k[:, :, 3:16], fk[:, :, 3:16]) and torch.equal(k[:, :, 16:], fk[:, :, 16:])
    assert not torch.equal(v[:, :, 3:12], fv[:, :, 3:12]) and torch.equal(v[:, :, 12:], fv[:, :, 12:])
    expected_k, expected_v = quantize_kv(fk, fv, config)
    torch.testing.assert_close(k, expected_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, expected_v, rtol=1e-6, atol=1e-6)


def test_generate_uses_the_quantised_cache(ours):
    kv = apply_kv(ours["gpt2"], KVConfig(2, SMALL))
    prompt = torch.randint(0, 64, (1, 5), generator=gen(10))
    got = kv.generate(prompt, 12)
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, kv(ids)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, ids[:, 5:])


@pytest.mark.parametrize(
    "name, config",
    [
        ("hf-llama-softmax1", KVConfig(2, SMALL, keep_first=1)),
        ("hf-llama-eager", KVConfig(3, "kivi:group=3,residual=6")),
        ("hf-mistral", KVConfig(4, "per-token", keep_first=2)),  # its sliding-window cache drops positions
        ("hf-mistral", KVConfig(8, "fp8-e5m2")),
    ],
)
def test_transformers_decoding_with_its_cache_equals_one_pass(theirs, name, config):
    model = apply_kv(theirs[name], config)
    ids = torch.randint(0, 64, (1, 20), generator=gen(11))
    with torch.no_grad():
        full = _logits(model, ids)
        out = model(input_ids=ids[:, :6], use_cache=True)
        parts, past = [out.logits], out.cache
        for i in range(6, 20):
            out = model(input_ids=ids[:, i : i + 1], cache=past, use_cache=True)
            parts.append(out.logits)
            past = out.cache
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "args, message",
    [
        ((2, "kivy"), "did you mean 'kivi'"),
        ((2, "kivi:group=3,residual=8"), "not a multiple of group=3"),
        ((2, "kivi:block=32"), "unknown key 'block' for kivi"),
        ((2, "kivi:group=0"), "group takes a positive integer"),
        ((2, "kivi:group"), "is not key=value"),
        ((2, "kivi:group=4,group=8"), "given twice"),
        ((4, "fp8-e4m3"), "stores 8 bits"),
        ((8, "fp8-e5m2:scale=-1"), "scale takes a positive number"),
        ((5, "per-token"), "choose from: 8, 6, 4, 3, 2"),
        ((2, "window:key_axis=row"), "channel or token"),
    ],
)
def test_bad_schemes_are_one_line_errors(args, message):
    with pytest.raises(UserError) as e:
        KVConfig(*args)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="takes no 'group'"):
        KVConfig(4, "per-token", group=32)


def test_records_describe_the_scheme_fully_and_round_trip():
    config = KVConfig(2, "kivi:residual=64", keep_first=1, keep_sinks=2)
    d = config.to_dict()
    assert {
        k: d[k] for k in ("scheme", "bits", "group", "residual", "keep_first", "keep_sinks", "causal")
    } == {
        "scheme": "kivi",
        "bits": 2,
        "group": 32,
        "residual": 64,
        "keep_first": 1,
        "keep_sinks": 2,
        "causal": "no",  # the sinks are chosen over the whole window
    }
    assert config.label == "kv2-g32r64-keep1-sinks2"
    for c in (
        config,
        KVConfig(4, "per-token:sym=false"),
        KVConfig(8, "fp8:scale=0.5"),
        KVConfig(3, "window"),
    ):
        assert KVConfig.from_dict(c.to_dict()) == c
    assert KVConfig(2, "kivi:group=32") == KVConfig(2) and KVConfig(8, "fp8").scheme == "fp8-e4m3"
    legacy = KVConfig.from_dict({"bits": 2, "granularity": "per-token", "keep_first": 1})
    assert (legacy.scheme, legacy.key_axis, legacy.label) == ("window", "token", "kv2-win-tok-keep1")


def test_the_torch_free_names_are_the_registry():
    from qbench.quant.kv_options import KV_SCHEME_NAMES
    from qbench.quant.kvschemes import KV_SCHEMES

    assert tuple(KV_SCHEMES.names()) == KV_SCHEME_NAMES


def test_command_line_options():
    import argparse

    from qbench.cli.args import add_kv_arguments, kv_from_args

    parser = argparse.ArgumentParser()
    add_kv_arguments(parser)
    parse = lambda *a: kv_from_args(parser.parse_args(list(a)))  # noqa: E731
    assert parse() is None
    assert parse("--kv-bits", "2") == KVConfig(2)
    assert parse("--kv-bits", "2", "--kv-scheme", "kivi:residual=32", "--kv-keep-sinks", "1") == KVConfig(
        2, "kivi", residual=32, keep_sinks=1
    )
    assert parse("--kv-scheme", "fp8-e5m2") == KVConfig(8, "fp8-e5m2")
    assert parse("--kv-scheme", "per-token:bits=4") == KVConfig(4, "per-token")
    assert parse("--kv-scheme", "fp8-e4m3:scale=calib").label == "kv8-e4m3-calib"  # calibrated by the harness
    rotated = parse("--kv-bits", "4", "--kv-rotate")
    assert rotated == parse("--kv-scheme", "kivi:bits=4,rotate=true") == KVConfig(4, rotate=True)
    assert rotated.label == "kv4-rot" and parse("--kv-bits", "4").rotate is False
    assert (
        parse("--kv-bits", "3", "--kv-granularity", "window", "--kv-keep-first", "2").label == "kv3-win-keep2"
    )
    for args, message in [
        (("--kv-scheme", "kivi"), "needs --kv-bits"),
        (("--kv-keep-sinks", "1"), "need --kv-bits or --kv-scheme"),
        (("--kv-bits", "4", "--kv-scheme", "per-token:bits=2"), "bits=2 but bits=4"),
        (("--kv-scheme", "fp8-e4m3:scale=foo"), "a positive number or calib"),
        (("--kv-rotate",), "need --kv-bits or --kv-scheme"),
    ]:
        with pytest.raises(UserError, match=message):
            parse(*args)


# ----------------------------------------------------------------------------------------------- sinks


def test_sinks_are_the_most_attended_positions_of_the_float_pass_and_stay_float(ours, theirs):
    from models.observe import observe
    from qbench.quant.kvschemes import kv_quantizers

    model = ours["llama-softmax1"]
    ids = torch.randint(0, 64, (2, 32), generator=gen(13))
    config = KVConfig(2, "per-token", keep_sinks=2)
    kv = apply_kv(model, config)
    with torch.no_grad(), observe(model, hidden=False, attention=True) as obs:
        model(ids)
        got = kv(ids)
    quantizers = kv_quantizers(kv)
    assert len(quantizers) == model.config.n_layer
    for layer, quantizer in enumerate(quantizers):
        received = obs.attention[layer].sum(dim=(1, 2))  # (B, L): over heads and queries
        expected = received.topk(2, dim=-1).indices
        assert torch.equal(quantizer.sinks.sort(-1).values, expected.sort(-1).values)
        assert not quantizer.observing and quantizer.received is None
    # kept in float: the view reads them unquantised, every other position quantised
    k = torch.randn(2, 4, 32, 8, generator=gen(14))
    view = quantizers[0].read(k, k)
    for b in range(2):
        sinks = quantizers[0].sinks[b]
        assert torch.equal(view.k_hat[b][:, sinks], k[b][:, sinks])
        others = torch.ones(32, dtype=torch.bool)
        others[sinks] = False
        assert (view.k_hat[b][:, others] != k[b][:, others]).any(-1).all()
    # the transformers export chooses the same positions and gives the same logits
    hf = apply_kv(theirs["hf-llama-softmax1"], config)
    with torch.no_grad():
        hf_got = _logits(hf, ids)
    for ours_q, hf_q in zip(quantizers, kv_quantizers(hf)):
        assert torch.equal(ours_q.sinks.sort(-1).values, hf_q.sinks.sort(-1).values)
    torch.testing.assert_close(got, hf_got, rtol=1e-4, atol=1e-4)


def test_generation_chooses_the_sinks_in_the_prompt_and_keeps_them_float(ours):
    from qbench.quant.kvschemes import kv_quantizers

    model = ours["gpt2"]
    kv = apply_kv(model, KVConfig(2, SMALL, keep_sinks=1))
    ids = torch.randint(0, 64, (1, 24), generator=gen(15))
    with torch.no_grad():
        cache, float_cache = kv.new_cache(), model.new_cache()
        for start, stop in [(0, 10), *((i, i + 1) for i in range(10, 24))]:
            kv(ids[:, start:stop], cache)
            model(ids[:, start:stop], float_cache)
        prompt_only = apply_kv(model, KVConfig(2, SMALL, keep_sinks=1))
        prompt_only(ids[:, :10])
    for layer, quantizer in enumerate(kv_quantizers(kv)):
        assert torch.equal(
            quantizer.sinks, kv_quantizers(prompt_only)[layer].sinks
        )  # chosen once, on the prompt
        sink = int(quantizer.sinks[0, 0])
        k, v = cache.stored(layer)
        assert torch.equal(k[:, :, sink], float_cache._k[layer][:, :, sink])
        assert torch.equal(v[:, :, sink], float_cache._v[layer][:, :, sink])


def test_a_sink_in_the_middle_is_found():
    """Block 0 of a GPT-2 rigged so that every query attends to the key at position 9 (query bias along u,
    keys' projection u·êᵀ with ê the normalised input at position 9): keep_sinks=1 keeps position 9, not 0."""
    model = build(micro_config("gpt2"), seed=0).eval()  # no planted channel: inputs point every way
    ids = torch.randint(0, 64, (2, 24), generator=gen(16))
    d = model.config.d_model
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        x = model.transformer.wte(ids[:1]) + model.transformer.wpe(torch.arange(24))
        e = model.transformer.h[0].ln_1(x)[0, 9]
        u = torch.ones(d)
        attn.c_attn.weight[:d] = 0.0
        attn.c_attn.bias[:d] = 4.0 * u
        attn.c_attn.weight[d : 2 * d] = torch.outer(u, e / e.norm())
        kv = apply_kv(model, KVConfig(2, SMALL, keep_sinks=1))
        kv(ids[:1])
    from qbench.quant.kvschemes import kv_quantizers

    assert kv_quantizers(kv)[0].sinks.tolist() == [[9]]


# ------------------------------------------------------------------------------------------ packed cache

PACKABLE = [
    KVConfig(2, SMALL),
    KVConfig(3, "kivi:group=3,residual=6"),
    KVConfig(4, "kivi:group=4,residual=4"),
    KVConfig(4, "per-token"),
    KVConfig(4, "per-token:sym=false"),
    KVConfig(2, "per-token"),
    KVConfig(8, "per-token"),
    KVConfig(8, "fp8-e4m3:scale=0.01"),
    KVConfig(8, "fp8-e5m2"),
    KVConfig(2, SMALL + ",rotate=true"),
    KVConfig(4, "per-token:rotate=true"),
    KVConfig(8, "fp8-e4m3:scale=0.01,rotate=true"),
]


@pytest.mark.parametrize("config", PACKABLE, ids=str)
def test_the_packed_cache_reads_what_the_fake_cache_reads(ours, config):
    chunks = (5, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
    ids = torch.randint(0, 64, (2, sum(chunks)), generator=gen(17))
    for name in ("llama-softmax1", "gpt2"):
        kv = apply_kv(ours[name], config)
        with torch.no_grad():
            fake, packed = kv.new_cache(), kv.new_cache(packed=True)
            start = 0
            for size in chunks:
                a = kv(ids[:, start : start + size], fake)
                b = kv(ids[:, start : start + size], packed)
                start += size
                assert torch.equal(a, b), name
        for layer in range(2):
            assert all(torch.equal(x, y) for x, y in zip(fake.stored(layer), packed.stored(layer)))


def test_packed_bytes_are_the_formats_bytes(ours):
    ids = torch.randint(0, 64, (2, 20), generator=gen(18))
    kv_of = lambda config: apply_kv(ours["llama"], config)  # noqa: E731
    sizes = {}
    for config in (KVConfig(8, "per-token"), KVConfig(4, "per-token"), KVConfig(4, "per-token:sym=false")):
        kv = kv_of(config)
        with torch.no_grad():
            cache = kv.new_cache(packed=True)
            kv(ids, cache)
        sizes[config.label] = cache.nbytes()
    values = 2 * 2 * 2 * 20 * 32  # layers × (k, v) × sequences × positions × (4 heads × 8 channels)
    blocks = values // 32
    assert sizes == {
        "kv8-tok": blocks * 34,
        "kv4-tok": blocks * 18,
        "kv4-tok-asym": blocks * 20,
    }  # ggml-common.h
    kv = kv_of(KVConfig(8, "fp8-e4m3"))
    with torch.no_grad():
        cache = kv.new_cache(packed=True)
        kv(ids, cache)
    assert cache.nbytes() == values
    kv = kv_of(KVConfig(2, SMALL))  # 16 of 20 keys packed (2 groups of 8), 12 values packed, the rest float32
    with torch.no_grad():
        cache = kv.new_cache(packed=True)
        kv(ids, cache)
    per_layer_k = (
        2 * 4 * (16 * 8 // 4 + (16 // 4) * 8 * 4 * 2 + 4 * 8 * 4)
    )  # codes, scale+min per G×ch, 4 float
    per_layer_v = (
        2 * 4 * (12 * 8 // 4 + 12 * 2 * 4 * 2 + 8 * 8 * 4)
    )  # codes, scale+min per token × 4 ch, 8 float
    assert cache.nbytes() == 2 * (per_layer_k + per_layer_v)
    with pytest.raises(UserError, match="no packed form"):
        kv = kv_of(KVConfig(2, SMALL, keep_first=1))
        with torch.no_grad():
            kv(ids, kv.new_cache(packed=True))


def test_kv_cache_speed_reports_bytes_and_tokens_per_second(ours):
    from qbench.studies.kvspeed import kv_cache_speed

    records = kv_cache_speed(
        ours["llama"],
        [KVConfig(4, "per-token"), KVConfig(8, "fp8-e4m3")],
        new_tokens=8,
        prompt_tokens=8,
        repeats=1,
    )
    assert [r["cache"] for r in records] == ["float", "kv4-tok", "kv8-e4m3"]
    assert records[0]["bytes_vs_float"] == 1.0 and records[0]["kv"] is None
    assert records[1]["bytes_vs_float"] == pytest.approx(18 / 128)  # q4_0: 18 bytes per 32 float32 values
    assert records[2]["bytes_vs_float"] == pytest.approx(1 / 4)
    assert all(r["tokens_per_s"] > 0 for r in records) and records[1]["kv"]["scheme"] == "per-token"
    with pytest.raises(UserError, match="exceeds the context"):
        kv_cache_speed(ours["llama"], [], new_tokens=30, prompt_tokens=8)


# ------------------------------------------------------------------------------ training-time remedies


@pytest.mark.parametrize("kind", ["clipped", "softpick", "sink-logit"])
def test_the_remedies_read_the_quantised_cache_causally_and_as_generation_does(kind):
    from models.attention import RemedyParams, remedy_attention_reference

    params = RemedyParams(gamma=-0.03, zeta=1.0, eps=1e-6, sink_logit=torch.randn(2, generator=gen(30)))
    q, k, k_hat, v, v_hat = (torch.randn(1, 2, 9, 4, generator=gen(31 + i)) for i in range(5))
    for flag, (kk, vv) in ((False, (k, v)), (True, (k_hat, v_hat))):
        mask = torch.full((9, 9), flag)
        got, _ = attention_two_version(q, k, k_hat, v, v_hat, mask, mask, kind, remedy=params)
        expected, _ = remedy_attention_reference(q, kk, vv, kind, params)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # alpha = 12 (the reference's) over a 32-token context clips every weight below ~0.27 to zero: an untrained
    # micro model's near-uniform rows would then ignore the cache entirely and the check below could not fail.
    switches = {"clip_alpha": 1.0} if kind == "clipped" else {}
    model = build(micro_config("llama", attn=kind, **switches), seed=0).eval()
    kv = apply_kv(model, KVConfig(2, SMALL))
    ids = torch.randint(0, 64, (1, 24), generator=gen(32))
    with torch.no_grad():
        full = kv(ids)
        assert (full - model(ids)).abs().max() > 1e-5
        torch.testing.assert_close(
            kv(_later_tokens_changed(ids, 15))[:, :16], full[:, :16], rtol=0, atol=1e-6
        )
        cache = kv.new_cache()
        parts = [kv(ids[:, :5], cache)] + [kv(ids[:, i : i + 1], cache) for i in range(5, 24)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_float_read_share_counts_the_kivi_residual_and_kept_positions():
    """Brute force per query against the closed forms: keys Σ((t+1) mod R) / Σ(t+1), values Σ min(t+1, R) / Σ(t+1)."""
    from qbench.quant.kvschemes import float_read_share

    T, R = 128, 32
    reads = sum(t + 1 for t in range(T))
    got = float_read_share({"scheme": "kivi", "residual": R, "keep_first": 0}, T)
    assert got["keys"] == sum((t + 1) % R for t in range(T)) / reads  # 1984 / 8256 ≈ 24 %
    assert got["values"] == sum(min(t + 1, R) for t in range(T)) / reads  # 3600 / 8256 ≈ 44 %
    kept = float_read_share({"scheme": "per-token", "keep_first": 1}, T)
    assert kept == {"keys": T / reads, "values": T / reads}  # position 0, read by every query
    assert float_read_share({"scheme": "fp8-e4m3", "keep_first": 0}, T) == {"keys": 0.0, "values": 0.0}


def test_cache_bytes_follow_each_schemes_storage():
    """One layer's cache after C tokens, against the storage written out by hand from each scheme's layout."""
    from qbench.quant.kv import KVConfig
    from qbench.quant.kvschemes import cache_bytes

    H, D, C = 3, 64, 1000
    # FP8: one byte a value, keys and values
    assert cache_bytes(KVConfig(8, "fp8-e4m3"), H, D, C) == 2 * C * H * D
    # per-token q4_0: 18 bytes per block of 32 values of a token's row (16 of codes, an fp16 d), keys and values
    assert cache_bytes(KVConfig(4, "per-token"), H, D, C) == 2 * C * (H * D // 32) * 18
    # q8_0: 34 bytes per block
    assert cache_bytes(KVConfig(8, "per-token"), H, D, C) == 2 * C * (H * D // 32) * 34
    # KIVI, G = 32, R = 128: keys quantised in whole R-blocks (896 of 1000), per channel over groups of 32 tokens
    # (4-bit codes, a float32 scale and minimum per group); values quantised up to C − R (872), per token over
    # groups of 32 channels; the rest float at 2 bytes
    keys, values = 128 * (C // 128), C - 128
    expected = (keys * H * D // 2 + (keys // 32) * H * D * 8 + (C - keys) * H * D * 2) + (
        values * H * D // 2 + values * H * (D // 32) * 8 + (C - values) * H * D * 2
    )
    assert cache_bytes(KVConfig(4, "kivi"), H, D, C) == expected
    # a kept sink adds its position in float (and keeps counting its codes: an upper bound by one token)
    assert cache_bytes(KVConfig(4, "kivi", 0, 1), H, D, C) == expected + 2 * H * D * 2


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7])
def test_codes_pack_densely_and_round_trip(bits):
    """b-bit codes take b/8 bytes each (3-bit: 8 codes in 3 bytes), code i at bits b·i… of the unit's
    little-endian bytes — written out by hand for 3 bits — and unpack to themselves."""
    from qbench.quant.kvpack import _pack_bits, _unpack_bits

    q = torch.randint(0, 2**bits, (3, 5, 48), generator=gen(40), dtype=torch.int64)
    packed = _pack_bits(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 48 * bits // 8
    assert torch.equal(_unpack_bits(packed, bits, 48), q.to(torch.uint8))
    if bits == 3:
        codes = [1, 2, 3, 4, 5, 6, 7, 0]  # 0b000_111_110_101_100_011_010_001 = 0x1F58D1
        got = _pack_bits(torch.tensor(codes), 3).tolist()
        assert got == [0xD1, 0x58, 0x1F]
    odd = torch.randint(0, 2**bits, (2, 7), generator=gen(41))  # no whole unit: one code a byte
    assert torch.equal(_unpack_bits(_pack_bits(odd, bits), bits, 7), odd.to(torch.uint8))


def test_a_three_bit_cache_is_three_eighths_of_a_byte_a_value():
    from qbench.quant.kvschemes import cache_bytes

    H, D, C = 3, 64, 1024
    keys, values = 128 * (C // 128), C - 128
    expected = (keys * H * D * 3 // 8 + (keys // 32) * H * D * 8 + (C - keys) * H * D * 2) + (
        values * H * D * 3 // 8 + values * H * (D // 32) * 8 + (C - values) * H * D * 2
    )
    assert cache_bytes(KVConfig(3, "kivi"), H, D, C) == expected


# ------------------------------------------------------------------------- QuaRot's rotated cache


def test_the_rotation_is_the_seeded_hadamard_of_the_head_and_its_inverse():
    from qbench.quant.fake import HadamardRotation
    from qbench.quant.kvschemes import rotate_cache

    for dim in (8, 64, 80, 96, 128):  # 80 = 20 · 4 and 96 = 12 · 8: Paley factors
        r = HadamardRotation(dim, seed=0).matrix()
        torch.testing.assert_close(r @ r.t(), torch.eye(dim), rtol=0, atol=1e-5)
        assert torch.allclose(r.abs(), torch.full_like(r, dim**-0.5), atol=1e-6)  # a Hadamard matrix: ±1/√d
        x = torch.randn(2, 3, 5, dim, generator=gen(dim))
        torch.testing.assert_close(rotate_cache(x), x @ r.t(), rtol=0, atol=1e-5)
        torch.testing.assert_close(rotate_cache(rotate_cache(x), inverse=True), x, rtol=0, atol=1e-5)
        # one vector's result does not depend on the others transformed with it (fake = packed, bit for bit)
        assert torch.equal(rotate_cache(x)[:, :, :1], rotate_cache(x[:, :, :1]))


@pytest.mark.parametrize(
    "config", [KVConfig(4, "window:rotate=true"), KVConfig(4, "per-token:sym=false,rotate=true")], ids=str
)
def test_the_stored_cache_is_the_quantised_rotation_read_back(config):
    """QuaRot §4 written out: the cache holds Q(k·Rᵀ), Q(v·Rᵀ); queries rotated alike give q·kᵀ-scores from
    (q·Rᵀ)·Q(k·Rᵀ)ᵀ and outputs softmax(·)·Q(v·Rᵀ)·R — the same as reading back Q(k·Rᵀ)·R, Q(v·Rᵀ)·R."""
    from qbench.quant.fake import HadamardRotation

    plain = KVConfig(4, "window") if config.scheme == "window" else KVConfig(4, "per-token:sym=false")
    r = HadamardRotation(16, seed=0).matrix()
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen(30 + i)) for i in range(3))
    k[..., 3] *= 40.0  # an outlier channel, as RoPE'd keys have
    k_hat, v_hat = KVSchemeQuantizer(config).stored(k, v)
    k_rot, v_rot = KVSchemeQuantizer(plain).stored(
        k @ r.t(), v @ r.t()
    )  # the plain scheme on rotated vectors
    torch.testing.assert_close(k_hat, k_rot @ r, rtol=0, atol=1e-4)
    torch.testing.assert_close(v_hat, v_rot @ r, rtol=0, atol=1e-4)
    scores_quarot = (q @ r.t()) @ k_rot.transpose(-1, -2)
    torch.testing.assert_close(q @ k_hat.transpose(-1, -2), scores_quarot, rtol=0, atol=1e-3)
    # what the rotation is for: the outlier channel's range no longer sets every token's step
    k_plain, _ = KVSchemeQuantizer(plain).stored(k, v)
    if config.scheme == "per-token":
        assert (k_hat - k).norm() < 0.5 * (k_plain - k).norm()


def test_rotating_a_cache_that_rounds_nothing_is_the_float_model(ours, theirs, monkeypatch):
    """The rotation and its inverse on every path a cache is read through (our attention, transformers' eager,
    sdpa, softmax-1 and Mistral's sliding window): with the rounding made the identity, the logits are float's."""
    import qbench.quant.kvschemes as kvschemes

    monkeypatch.setattr(kvschemes, "minmax_quantize", lambda x, bits, dim, exclude=None: x.clone())
    ids = torch.randint(0, 64, (2, 32), generator=gen(31))
    with torch.no_grad():
        for name, model in {**ours, **theirs}.items():
            kv = apply_kv(model, KVConfig(2, "window:rotate=true"))
            torch.testing.assert_close(_logits(kv, ids), _logits(model, ids), rtol=1e-5, atol=1e-5, msg=name)


def test_a_rotated_cache_costs_no_bytes_and_calibrates_rotated_maxima(ours):
    from qbench.quant.fake import HadamardRotation
    from qbench.quant.kvschemes import calibrate_kv_scales, kv_quantizers

    ids = torch.randint(0, 64, (2, 20), generator=gen(32))
    sizes = []
    for config in (KVConfig(4, "per-token"), KVConfig(4, "per-token:rotate=true")):
        kv = apply_kv(ours["llama"], config)
        with torch.no_grad():
            cache = kv.new_cache(packed=True)
            kv(ids, cache)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1]
    config = KVConfig(8, "fp8-e4m3:scale=calib,rotate=true")
    assert config.label == "kv8-e4m3-calib-rot" and KVConfig.from_dict(config.to_dict()) == config
    kv = apply_kv(ours["llama"], config)
    scales = calibrate_kv_scales(kv, [ids])
    recorder = Recorder()
    ours["llama"].transformer.h[0].attn.kv_transform = recorder
    try:
        with torch.no_grad():
            ours["llama"](ids)
    finally:
        ours["llama"].transformer.h[0].attn.kv_transform = None
    k, v = recorder.calls[0]
    r = HadamardRotation(k.size(-1), seed=0).matrix()
    expected = (float((k @ r.t()).abs().max()) / 448, float((v @ r.t()).abs().max()) / 448)
    assert scales[0] == pytest.approx(expected, rel=1e-5)
    assert kv_quantizers(kv)[0].config.rotate


def test_records_without_rotate_keep_their_identity():
    d = KVConfig(4, "per-token").to_dict()
    assert "rotate" not in d and KVConfig.from_dict(d).rotate is False
    d = KVConfig(4, "per-token", rotate=True).to_dict()
    assert d["rotate"] is True and "Hadamard" in d["keys"] and "Hadamard" in d["values"]
    assert KVConfig(4, "per-token:rotate=false") == KVConfig(4, "per-token")
    with pytest.raises(UserError, match="rotate takes true or false"):
        KVConfig(4, "kivi:rotate=yes please")
