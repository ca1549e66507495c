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
# attention_two_version under KIVI's masks through kivi_band_attention; False forces the explicit two-matrix path.
KIVI_BANDED = True
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
        y = softmax1_flash(q, *repeat_kv(q, k, v))
        if y is not None:
            return y
    return attention_extra_key(q, k, v, kind, sink_k, sink_v)


def repeat_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query attention's keys/values (B, n_kv, L, hs) repeated to q's heads (query head h reads head
    h // (n_head / n_kv), transformers' repeat_kv); unchanged when the head counts match."""
    rep = q.size(1) // k.size(1)
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


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
    softmax-1 and the sink prepend their extra key, which every query sees. k, v may have fewer heads than q
    (grouped-query attention, :func:`repeat_kv`'s grouping).
    """
    T, L = q.size(2), k.size(2)
    extra = _extra_kv(kind, q, sink_k, sink_v)
    # grouped-query keys/values (fewer heads than q): SDPA reads them as they are (enable_gqa: no copy of the
    # cache per step, the same numbers); with an extra key they are repeated first
    gqa = k.size(1) != q.size(1)
    if extra is None and past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = None if T == 1 else torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=past)
    if extra is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    k, v = repeat_kv(q, k, v)
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
    residual: int | None = None,
    need_probs: bool = True,
) -> tuple[Tensor, Tensor | None]:
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

    ``residual``: the masks are KIVI's with that float residual R, from position 0 (the caller vouches for it:
    ``KVSchemeQuantizer.read`` sets ``CacheView.residual``). Then, when the probabilities are not needed
    (``need_probs=False``), the window is causal and on the CPU, :func:`kivi_band_attention` computes the same
    output in O(T·R) explicit work plus one flash pass, and the probabilities come back None.
    """
    T, L = q.size(2), k.size(2)
    if (
        KIVI_BANDED
        and residual is not None
        and not need_probs
        and past == 0
        and T == L
        and remedy is None
        and kind in ("softmax", "softmax1", "sink")
        and q.device.type == "cpu"
        and causal_mask(mask, T)
    ):
        return kivi_band_attention(q, k, k_hat, v, v_hat, residual, kind, sink_k, sink_v, scale=scale), None
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


def attention_received(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kind: str = "softmax",
    sink_k: Tensor | None = None,
    sink_v: Tensor | None = None,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor] | None:
    """Causal attention over float keys/values and the attention each position receives, summed over heads and
    queries: (output (B, nh, T, hs), received (B, T)) — what the KV sink finder's float pass needs, without the
    probabilities themselves. The output comes from one flash pass with its row logsumexp (softmax-1's or the
    sink's extra key merged into it); the received sums recompute each block of queries' scores once,
    P[t, j] = exp(s[t, j] − lse_t). None where it does not apply (not on the CPU, or another kind): the caller
    then takes the explicit path. Equal to summing :func:`attention_reference`'s probabilities (tested)."""
    if q.device.type != "cpu" or kind not in ("softmax", "softmax1", "sink") or q.shape != k.shape:
        return None
    B, nh, T, hs = q.shape
    scale = 1.0 / math.sqrt(hs) if scale is None else scale
    qf, kf, vf = q.float(), k.float(), v.float()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qf, kf, vf, 0.0, True, scale=scale)
    out, lse = out.float(), lse.float()[..., None]  # (B, nh, T, 1)
    extra = _extra_kv(kind, q, sink_k, sink_v) if kind != "softmax" else None
    if extra is not None:  # one more always-visible key: renormalise the real keys' part and add its value
        e_logit = (qf @ extra[0].float().transpose(-2, -1)) * scale
        total = torch.logaddexp(lse, e_logit)
        out = out * torch.exp(lse - total) + torch.exp(e_logit - total) * extra[1].float()
        lse = total
    received = qf.new_zeros(B, T)
    rows = max(1, QUERY_BLOCK_ELEMENTS // max(1, B * nh * T))
    j = torch.arange(T, device=q.device)
    for start in range(0, T, rows):
        stop = min(
            T, start + rows
        )  # queries start … stop−1 see keys 0 … stop−1 at most: the rest is not computed
        s = (qf[:, :, start:stop] @ kf[:, :, :stop].transpose(-2, -1)) * scale
        future = j[None, :stop] > torch.arange(start, stop, device=q.device)[:, None]
        received[:, :stop] += torch.exp(s - lse[:, :, start:stop]).masked_fill(future, 0).sum(dim=(1, 2))
    return out.to(q.dtype), received


def causal_mask(mask: Tensor | None, T: int) -> bool:
    """Whether ``mask`` (None, or boolean broadcastable to (B, nh, T, T)) is exactly the causal mask."""
    if mask is None:
        return True
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (T, T):
        return False
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    return bool((mask == causal).all())


def kivi_band_attention(
    q: Tensor,
    k: Tensor,
    k_hat: Tensor,
    v: Tensor,
    v_hat: Tensor,
    residual: int,
    kind: str = "softmax",
    sink_k: Tensor | None = None,
    sink_v: Tensor | None = None,
    *,
    scale: float | None = None,
) -> Tensor:
    """:func:`attention_two_version` under KIVI's masks, without a T × T matrix.

    KIVI (Liu et al., ICML 2024, §3.3) with float residual R: after n tokens, keys below ⌊n/R⌋·R and values
    below n − R are quantised. Query t (n = t + 1) therefore reads

    - far positions j ≤ t − R: key and value quantised (⌊(t+1)/R⌋·R > t + 1 − R > j);
    - its band t − R < j ≤ t: value float; key quantised iff j < ⌊(t+1)/R⌋·R.

    The far part is causal attention of queries R … T−1 over k̂, v̂ shifted by R: one flash pass returning its
    row logsumexp. The band lies inside query t's block of R queries and the block before it, so it is explicit
    attention of each block of R queries over 2R keys. The two (and softmax-1's or the sink's extra key) merge by
    their logsumexps. Kept positions (``keep_first``, sinks) hold k̂ = k and v̂ = v, so they need no case.
    q, k, k_hat, v, v_hat: (B, nh, T, hs) from position 0, causal; float32 arithmetic; returns (B, nh, T, hs).
    """
    B, nh, T, hs = q.shape
    R = residual
    scale = 1.0 / math.sqrt(hs) if scale is None else scale
    qf = q.float()
    # far: queries R … T−1 over positions 0 … T−1−R (query t sees j ≤ t − R), both quantised
    out_far = qf.new_zeros(B, nh, T, hs)
    lse_far = qf.new_full((B, nh, T), float("-inf"))
    if T > R:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qf[:, :, R:], k_hat[:, :, : T - R].float(), v_hat[:, :, : T - R].float(), 0.0, True, scale=scale
        )
        out_far[:, :, R:], lse_far[:, :, R:] = o.float(), lse.float()
    # band: block b holds queries bR … bR+R−1 and reads keys bR−R … bR+R−1 (c = 0 … 2R−1 in the slab)
    nb = -(-T // R)
    pad = nb * R - T

    def slabs(x: Tensor) -> Tensor:  # (B, nh, nb, 2R, hs): block b's keys, zero rows before 0 and past T
        x = F.pad(x.float(), (0, 0, R, pad))
        return x.unfold(2, 2 * R, R).transpose(-2, -1)

    qb = F.pad(qf, (0, 0, 0, pad)).view(B, nh, nb, R, hs)
    r = torch.arange(R, device=q.device)[:, None]
    c = torch.arange(2 * R, device=q.device)[None, :]
    band = (c > r) & (c <= r + R)  # t − R < j ≤ t
    band = band & (c >= R - R * torch.arange(nb, device=q.device)[:, None, None])  # j ≥ 0 (block 0)
    quantised = (c < R) | (r == R - 1)  # j < ⌊(t+1)/R⌋·R: the previous block, or all at a block's last query
    lowest = torch.finfo(torch.float32).min
    # one block range at a time bounds the (B, nh, blocks, R, 2R) temporaries as QUERY_BLOCK_ELEMENTS does
    step = max(1, QUERY_BLOCK_ELEMENTS // max(1, B * nh * R * 2 * R))
    out_band, m_band, l_band = [], [], []
    ks_f, ks_q, vs = slabs(k), slabs(k_hat), slabs(v)
    for start in range(0, nb, step):
        blocks = slice(start, min(nb, start + step))
        s_f = (qb[:, :, blocks] @ ks_f[:, :, blocks].transpose(-2, -1)) * scale
        s_q = (qb[:, :, blocks] @ ks_q[:, :, blocks].transpose(-2, -1)) * scale
        scores = torch.where(quantised, s_q, s_f).masked_fill(~band[blocks], lowest)
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - m)
        out_band.append(p @ vs[:, :, blocks])
        m_band.append(m)
        l_band.append(p.sum(-1, keepdim=True))
    o_n = torch.cat(out_band, 2).reshape(B, nh, nb * R, hs)[:, :, :T]
    m_n = torch.cat(m_band, 2).reshape(B, nh, nb * R, 1)[:, :, :T]
    l_n = torch.cat(l_band, 2).reshape(B, nh, nb * R, 1)[:, :, :T]
    lse_f = lse_far[..., None]
    terms = [lse_f, m_n]
    extra = _extra_kv(kind, q, sink_k, sink_v) if kind != "softmax" else None
    if extra is not None:
        e_logit = (qf @ extra[0].float().transpose(-2, -1)) * scale  # (B, nh, T, 1)
        terms.append(e_logit)
    top = torch.stack(terms).amax(0)
    w_f, w_n = torch.exp(lse_f - top), torch.exp(m_n - top)
    num = w_f * out_far + w_n * o_n
    den = w_f + w_n * l_n
    if extra is not None:
        w_e = torch.exp(e_logit - top)
        num, den = num + w_e * extra[1].float(), den + w_e
    return (num / den).to(q.dtype)


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
