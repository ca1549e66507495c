"""Causal attention with three normalisations: softmax, softmax-1 and a learned sink.

softmax-1 (Miller's "off-by-one" softmax, used by Kaul et al.):
    softmax1(x)_i = exp(x_i) / (1 + sum_j exp(x_j))
Rows sum to less than 1, so a head can put its weight "nowhere" instead of on a sink token.
It equals an ordinary softmax over the real keys plus one extra key whose logit is 0 and whose value is the
zero vector — a zero *key vector* gives logit q·0 = 0 for every query. The learned sink (``attn="sink"``) is the
same construction with a learned per-head key and value instead of zeros. So every variant is "softmax over
[extra key] + real keys", and the fast path hands that to ``scaled_dot_product_attention``.

Two paths, held equal by tests:
- fast: fused kernels, never materialising probabilities — SDPA for softmax and the sink; for softmax-1 a causal
  flash kernel whose output is scaled by sigmoid(row logsumexp) (``models.flash_softmax1``: o1 = o·sigmoid(lse)),
  else SDPA with the extra key;
- reference: explicit scores and probabilities, used when probabilities are observed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from models.flash_softmax1 import softmax1_flash

# softmax-1 on a fused kernel through the row logsumexp (models.flash_softmax1); False forces the extra-key path.
SOFTMAX1_FLASH = True
# attention_two_version works on blocks of queries whose (B, nh, rows, L) score matrix has at most this many
# elements (2^24 float32 = 64 MiB per temporary), so long windows do not hold several full T × L matrices.
QUERY_BLOCK_ELEMENTS = 2**24


def softmax1(scores: Tensor, dim: int = -1) -> Tensor:
    """exp(x_i) / (1 + sum_j exp(x_j)), computed stably; -inf entries get exactly 0.

    With m = max(max_j x_j, 0): exp(x_i - m) / (exp(-m) + sum_j exp(x_j - m)). Taking m >= 0 keeps exp(-m) <= 1,
    so neither the implicit "+1" nor any real logit overflows.
    """
    m = scores.amax(dim=dim, keepdim=True).clamp(min=0).detach()
    e = torch.exp(scores - m)
    return e / (torch.exp(-m) + e.sum(dim=dim, keepdim=True))


def _extra_kv(
    kind: str, q: Tensor, sink_k: Tensor | None, sink_v: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """The extra always-visible key/value of softmax-1 (zeros) or the sink (learned), shaped (B, nh, 1, hs)."""
    if kind == "softmax":
        return None
    B, nh, _, hs = q.shape
    if kind == "softmax1":
        zero = q.new_zeros(B, nh, 1, hs)
        return zero, zero
    if sink_k is None or sink_v is None:
        raise ValueError("attn='sink' needs sink_k and sink_v of shape (n_head, head_dim)")
    return (
        sink_k.to(q.dtype)[None, :, None].expand(B, nh, 1, hs),
        sink_v.to(q.dtype)[None, :, None].expand(B, nh, 1, hs),
    )


def attention_fast(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kind: str = "softmax",
    sink_k: Tensor | None = None,
    sink_v: Tensor | None = None,
) -> Tensor:
    """Causal attention via SDPA; q, k, v are (B, nh, T, hs). Returns (B, nh, T, hs).

    softmax-1 runs on a fused causal kernel scaled by sigmoid(row logsumexp) (``models.flash_softmax1``) when
    ``SOFTMAX1_FLASH`` is on and a kernel serves the device/dtype; otherwise (and for the sink) SDPA gets the
    extra key and an explicit (T, T+1) mask, which rules out CUDA's flash kernel.
    """
    if kind == "softmax1" and SOFTMAX1_FLASH:
        y = softmax1_flash(q, k, v)
        if y is not None:
            return y
    return attention_extra_key(q, k, v, kind, sink_k, sink_v)


def attention_extra_key(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kind: str = "softmax",
    sink_k: Tensor | None = None,
    sink_v: Tensor | None = None,
) -> Tensor:
    """SDPA over [extra key] + real keys with an explicit mask (softmax-1's fallback; the sink's only path)."""
    return attention_with_past(q, k, v, 0, kind, sink_k, sink_v)


def attention_with_past(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past: int,
    kind: str = "softmax",
    sink_k: Tensor | None = None,
    sink_v: Tensor | None = None,
) -> Tensor:
    """Causal attention of T queries at positions past … past + T − 1 over keys 0 … past + T − 1
    (k, v: (B, nh, past + T, hs); past = 0 is ordinary causal attention, past > 0 decodes after a KV cache).

    Query i sees keys 0 … past + i: the offset causal mask (True = may attend). One query sees every key and
    needs no mask, the case SDPA serves fastest; plain softmax without a past keeps SDPA's own causal kernel.
    softmax-1 and the sink prepend their extra key, which every query sees.
    """
    T, L = q.size(2), k.size(2)
    extra = _extra_kv(kind, q, sink_k, sink_v)
    if extra is None and past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = None if T == 1 else torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=past)
    if extra is not None:
        k, v = torch.cat([extra[0], k], dim=2), torch.cat([extra[1], v], dim=2)
        if mask is not None:
            mask = torch.cat([torch.ones(T, 1, dtype=torch.bool, device=q.device), mask], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kind: str = "softmax",
    sink_k: Tensor | None = None,
    sink_v: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention computed explicitly. Returns (output (B, nh, T, hs), probs (B, nh, T, T)).

    ``probs`` are the weights on the real keys only, as computed: under softmax-1 and the sink its rows sum to
    less than 1 (the rest went to the extra key), which is what the attention metrics report.
    """
    T = q.size(2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    if kind == "softmax":
        probs = torch.softmax(scores, dim=-1)
        return probs @ v, probs
    if kind == "softmax1":
        probs = softmax1(scores, dim=-1)
        return probs @ v, probs
    extra_k, extra_v = _extra_kv(kind, q, sink_k, sink_v)
    sink_logit = (q @ extra_k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, T, 1)
    all_probs = torch.softmax(torch.cat([sink_logit, scores], dim=-1), dim=-1)
    probs = all_probs[..., 1:]
    return probs @ v + all_probs[..., :1] * extra_v, probs


def _rows(mask: Tensor | None, rows: slice) -> Tensor | None:
    """The query rows ``rows`` of a mask broadcastable to (B, nh, T, L) (a one-row mask serves every query)."""
    return mask if mask is None or mask.size(-2) == 1 else mask[..., rows, :]


def attention_two_version(
    q: Tensor,
    k: Tensor,
    k_hat: Tensor,
    v: Tensor,
    v_hat: Tensor,
    key_quantised: Tensor,
    value_quantised: Tensor,
    kind: str = "softmax",
    sink_k: Tensor | None = None,
    sink_v: Tensor | None = None,
    *,
    past: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    remedy: RemedyParams | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention over a cache that holds some positions quantised and some in float, *as each query saw it*.

    A streaming quantised cache (KIVI's float residual, a value window) holds key j in float for early queries
    and quantised for later ones, so one pass over a window needs both versions: with Mk[t, j] = True where
    query t reads key j quantised (likewise Mv for values),

        scores[t, j] = where(Mk[t, j], q_t·k̂_j, q_t·k_j) · scale,   out = (P ⊙ Mv)·V̂ + (P ⊙ ¬Mv)·V,

    two score matrices selected by position instead of a loop over queries. q: (B, nh, T, hs) at positions
    past … past + T − 1; k, k_hat, v, v_hat: (B, nh, L, hs); the masks broadcast to (B, nh, T, L). ``mask``:
    None = offset causal (query i sees keys 0 … past + i), else boolean (True = may attend) or additive float,
    broadcastable to (B, nh, T, L) (transformers' masks, sliding windows included). softmax-1 and the sink
    follow :func:`attention_reference` (an extra key of logit q·sink_k·scale, value sink_v; zeros for softmax-1);
    the remedies (``clipped``, ``softpick``, ``sink-logit``) normalise the selected scores with ``remedy``'s
    parameters as :func:`remedy_attention_reference` does.
    Scores and probabilities in float32. Returns (output (B, nh, T, hs) in q's dtype, probs on the real keys).
    """
    T, L = q.size(2), k.size(2)
    rows = max(1, QUERY_BLOCK_ELEMENTS // max(1, q.size(0) * q.size(1) * L))
    if T > rows:  # bound the (B, nh, T, L) float32 temporaries: blocks of queries, each a full matrix product
        outs, probs = [], []
        for start in range(0, T, rows):
            stop = min(T, start + rows)
            rows_of = slice(start, stop)
            o, p = attention_two_version(
                q[:, :, rows_of], k, k_hat, v, v_hat, _rows(key_quantised, rows_of), _rows(value_quantised, rows_of),
                kind, sink_k, sink_v, past=past + start, mask=_rows(mask, rows_of), scale=scale, remedy=remedy,
            )  # fmt: skip
            outs.append(o)
            probs.append(p)
        return torch.cat(outs, dim=2), torch.cat(probs, dim=2)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    qf = q.float()
    s_float = (qf @ k.float().transpose(-2, -1)) * scale
    s_quant = (qf @ k_hat.float().transpose(-2, -1)) * scale
    scores = torch.where(key_quantised, s_quant, s_float)
    # The most negative float, not −inf: exp gives exactly 0 all the same, and a query that may see nothing (a
    # padding row of a transformers batch) gets finite weights instead of NaN, which P·V would spread.
    # softpick tells masked keys by −inf (they count 0 in its sums), so the remedies keep −inf.
    lowest = float("-inf") if kind in REMEDY_KINDS else torch.finfo(torch.float32).min
    if mask is None:
        causal = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=past)
        scores = scores.masked_fill(~causal, lowest)
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, lowest)
    else:
        scores = scores + mask.float()
    extra = None
    if kind == "softmax":
        probs = torch.softmax(scores, dim=-1)
    elif kind == "softmax1":
        probs = softmax1(scores, dim=-1)
    elif kind in REMEDY_KINDS:
        if remedy is None:
            raise ValueError(f"attn={kind!r} needs its RemedyParams")
        if kind == "clipped":
            probs = clipped_softmax(scores, remedy.gamma, remedy.zeta)
        elif kind == "softpick":
            probs = softpick(scores, remedy.eps)
        else:
            probs = softmax_with_sink_logit(scores, remedy.sink_logit.float())
    else:
        extra_k, extra_v = _extra_kv(kind, q, sink_k, sink_v)
        sink_logit = (qf @ extra_k.float().transpose(-2, -1)) * scale  # (B, nh, T, 1)
        all_probs = torch.softmax(torch.cat([sink_logit, scores], dim=-1), dim=-1)
        probs, extra = all_probs[..., 1:], all_probs[..., :1] * extra_v.float()
    zero = probs.new_zeros(())
    out = torch.where(value_quantised, probs, zero) @ v_hat.float()
    out = out + torch.where(value_quantised, zero, probs) @ v.float()
    if extra is not None:
        out = out + extra
    return out.to(q.dtype), probs


# ------------------------------------------------------------------------------------- training-time remedies
#
# Three more normalisations, each a switch (``attn=``) with a fast path (no probabilities returned; SDPA where
# the normalisation is a softmax over extra logits) and a reference path (the paper's equation written out,
# returning the probabilities), held equal by tests:
#
# - ``clipped``: clipped softmax, Bondarenko et al. (NeurIPS 2023) eq. 4.1: clip((ζ − γ)·softmax(x) + γ, 0, 1).
#   With γ < 0 small weights become exactly 0, so a head can "do nothing" without pushing its logits to extremes.
# - ``softpick``: Zuhri et al. (2025): ReLU(e^x_i − 1) / Σ_j |e^x_j − 1|; rows need not sum to 1 and weights can
#   be exactly 0. Masked keys contribute 0 to numerator and denominator (as the paper's reference code does).
# - ``sink-logit``: one learned logit s per head appended to every row of scores, softmaxed, then dropped
#   (gpt-oss's ``sinks``). With s = 0 it is softmax-1: exp(x_i) / (e^0 + Σ_j exp(x_j)).
#
# Clipped softmax and softpick have no fused kernel here: their fast path computes the weights explicitly too.

REMEDY_KINDS = ("clipped", "softpick", "sink-logit")


@dataclass(frozen=True)
class RemedyParams:
    """What the remedies need besides q, k, v: γ and ζ (clipped), ε (softpick), the per-head logits (sink-logit)."""

    gamma: float = 0.0
    zeta: float = 1.0
    eps: float = 1e-8
    sink_logit: Tensor | None = None  # (n_head,)


def clipped_softmax(scores: Tensor, gamma: float, zeta: float, dim: int = -1) -> Tensor:
    """clip((ζ − γ)·softmax(x) + γ, 0, 1) (Bondarenko et al. 2023, eq. 4.1). Masked (−inf) entries get
    softmax 0, hence γ < 0, hence exactly 0 after the clip."""
    return torch.clamp((zeta - gamma) * torch.softmax(scores, dim=dim) + gamma, 0.0, 1.0)


def softpick(scores: Tensor, eps: float = 1e-8, dim: int = -1) -> Tensor:
    """ReLU(e^x_i − 1) / (Σ_j |e^x_j − 1| + ε), computed stably; −inf (masked) entries count 0 in both sums.

    The paper's stable form multiplies numerator and denominator by e^−m: (e^(x−m) − e^−m). Its reference code
    takes m = the row max, which overflows e^−m (inf − inf = NaN) when every logit of a row is below about −88
    in float32; m = max(row max, 0) keeps e^−m ≤ 1 and is the same as the paper's for any row whose max is ≥ 0.
    ε is added to the shifted denominator, as in the reference code (it only matters when that sum is near 0, e.g.
    a row whose only visible logit is 0). So m is part of the function and is not detached.
    """
    m = scores.amax(dim=dim, keepdim=True).clamp(min=0)
    shifted = torch.exp(scores - m) - torch.exp(-m)  # e^−m (e^x − 1)
    shifted = torch.where(torch.isneginf(scores), 0.0, shifted)
    return F.relu(shifted) / (shifted.abs().sum(dim=dim, keepdim=True) + eps)


def softmax_with_sink_logit(scores: Tensor, sink_logit: Tensor, dim: int = -1) -> Tensor:
    """softmax([s, x_1 … x_n])[1:] for scores (B, nh, T, L) and one logit s per head (nh,): the weights on the
    real keys (rows sum to < 1). ``sink_logit = 0`` is :func:`softmax1`."""
    s = sink_logit.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([s, scores], dim=dim), dim=dim)[..., 1:]


def _at_least_float32(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _offset_causal(T: int, L: int, device: torch.device) -> Tensor:
    """(T, L) True where query i (at position L − T + i) may see key j."""
    return torch.ones(T, L, dtype=torch.bool, device=device).tril(diagonal=L - T)


def remedy_attention(q: Tensor, k: Tensor, v: Tensor, kind: str, params: RemedyParams) -> Tensor:
    """The fast path of the remedies: T queries at the last T positions of L keys (L > T after a KV cache).

    sink-logit runs on SDPA: one extra zero key and zero value visible to every query, whose logit is set by an
    additive float mask column holding s (softmax-1's extra-key construction with s in place of 0).
    """
    T, L = q.size(2), k.size(2)
    causal = _offset_causal(T, L, q.device)
    if kind == "sink-logit":
        B, nh, _, hs = q.shape
        zero = q.new_zeros(B, nh, 1, hs)
        bias = torch.zeros(T, L, dtype=q.dtype, device=q.device).masked_fill(~causal, float("-inf"))
        s = params.sink_logit.to(q.dtype).view(1, nh, 1, 1).expand(1, nh, T, 1)
        mask = torch.cat([s, bias.expand(1, nh, T, L)], dim=-1)
        return F.scaled_dot_product_attention(
            q, torch.cat([zero, k], dim=2), torch.cat([zero, v], dim=2), attn_mask=mask
        )
    # The weights in float32 (as the softpick reference does): under bf16 autocast e^x − 1 and the clip's
    # (ζ − γ)p + γ lose most of their mantissa near 0, exactly where these normalisations differ from softmax.
    scores = _at_least_float32(q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    scores = scores.masked_fill(~causal, float("-inf"))
    if kind == "clipped":
        return clipped_softmax(scores, params.gamma, params.zeta).to(v.dtype) @ v
    if kind == "softpick":
        return softpick(scores, params.eps).to(v.dtype) @ v
    raise ValueError(f"unknown remedy attention {kind!r}; known: {REMEDY_KINDS}")


def remedy_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, kind: str, params: RemedyParams
) -> tuple[Tensor, Tensor]:
    """The remedies' equations written out over a causal (T, T) score matrix: (output, probs (B, nh, T, T))."""
    T = q.size(2)
    scores = _at_least_float32(q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if kind == "clipped":
        probs = clipped_softmax(scores, params.gamma, params.zeta)
    elif kind == "softpick":
        probs = softpick(scores, params.eps)
    elif kind == "sink-logit":
        probs = softmax_with_sink_logit(scores, params.sink_logit)
    else:
        raise ValueError(f"unknown remedy attention {kind!r}; known: {REMEDY_KINDS}")
    probs = probs.to(v.dtype)
    return probs @ v, probs
