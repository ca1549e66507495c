"""The transformer: one module, the paper's switches (see ``models.config``).

Read top to bottom: norms, rotary positions, attention, MLP, block, model. Names follow nanoGPT (``wte``,
``wpe``, ``h``, ``ln_f``, ``c_attn``, ``c_proj``, ``c_fc``) for the GPT-2 family and Llama's for its
projections (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``/``down_proj``), so each family maps
one-to-one onto its transformers layout (``models.hf``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import (
    REMEDY_KINDS,
    RemedyParams,
    attention_fast,
    attention_received,
    attention_reference,
    attention_two_version,
    attention_with_past,
    remedy_attention,
    remedy_attention_reference,
    repeat_kv,
)
from models.config import ModelConfig
from models.kvcache import KVCache, PackedKVCache, QuantizedKVCache  # KVCache is defined there, used here

# ---------------------------------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * gain; per-channel gain ("RMSNorm-M") or one scalar gain ("RMSNorm-S").

    Computed in float32 and cast back, as Llama does, so bf16 training does not lose the normaliser.
    """

    def __init__(self, dim: int, eps: float, single_gain: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(1 if single_gain else dim))

    def forward(self, x: Tensor) -> Tensor:
        # F.rms_norm is x * rsqrt(mean(x^2) + eps), the formula written out, in one dispatched op: equal bit for
        # bit (tests/models/test_transformer.py checks it) and 3x faster per decode token than five Python ops
        normed = F.rms_norm(x.float(), (x.size(-1),), None, self.eps)
        return self.weight * normed.to(x.dtype)


def build_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
    return RMSNorm(config.d_model, config.norm_eps, single_gain=config.norm == "rmsnorm_single")


# ------------------------------------------------------------------------------------------- rotary positions


def rope_tables(context: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (context, head_dim) in Llama's half-split ("rotate_half") convention."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, nh, T, hs) by position: x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    if cos.dtype != x.dtype:  # a no-op .to still costs a dispatch per call at decode
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotated * sin


# ------------------------------------------------------------------------------------------------- attention


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, bias = config.d_model, config.bias
        self.kind, self.n_head, self.n_kv_head = config.attn, config.n_head, config.kv_heads
        if config.family == "gpt2":
            self.c_attn = nn.Linear(d, 3 * d, bias=bias)  # fused q, k, v, as GPT-2 stores them
        else:
            kv = config.kv_heads * config.head_dim  # grouped-query attention: fewer key/value heads
            self.q_proj = nn.Linear(d, d, bias=bias)
            self.k_proj = nn.Linear(d, kv, bias=bias)
            self.v_proj = nn.Linear(d, kv, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        if config.attn == "sink":
            # The learned always-visible key/value per head. Zero init = softmax-1 at step 0.
            self.sink_k = nn.Parameter(torch.zeros(config.n_head, config.head_dim))
            self.sink_v = nn.Parameter(torch.zeros(config.n_head, config.head_dim))
        else:
            self.sink_k = self.sink_v = None
        if config.attn == "sink-logit":
            # gpt-oss's per-head sink logit; 0 at init, where the head computes softmax-1.
            self.sinks = nn.Parameter(torch.zeros(config.n_head))
        self.remedy = RemedyParams(gamma=config.clip_gamma, zeta=config.clip_zeta, eps=config.softpick_eps)
        # Gated attention (Qiu et al. 2025, G1): y_h <- y_h * sigmoid(x W_g + b_g), one gate per head (headwise)
        # or per channel (elementwise), from this layer's input x. Bondarenko et al.'s conditional gate is the
        # headwise case (a linear G_h(x) per head, sigmoid, scaling that head's output).
        self.gate = config.gate
        if config.gate != "none":
            self.g_proj = nn.Linear(d, config.n_head if config.gate == "headwise" else d, bias=True)
        # Set by ``models.observe``; None means "don't materialise probabilities" (the fast path).
        self.probs_hook: Callable[[Tensor], None] | None = None
        # A neutral hook on what a KV cache would store: called on (k, v) after RoPE, returns the (k, v) every
        # query then reads (e.g. qbench's KV-cache quantisation). None changes nothing.
        self.kv_transform: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if hasattr(self, "c_attn"):
            return self.c_attn(x).chunk(3, dim=-1)
        if "qkv_proj" in self._modules:  # fuse_projections: one matmul, split as q, k, v
            kv = self.n_kv_head * (x.size(-1) // self.n_head)
            return self.qkv_proj(x).split([x.size(-1), kv, kv], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, kv: tuple[KVCache, int] | None = None
    ) -> Tensor:
        """``kv`` = (cache, this block's index): attend over the cached positions too (probabilities are not
        observed then; ``kv_transform`` sees only the new positions, i.e. what gets stored)."""
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self._qkv(x)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_head, hs).transpose(1, 2) for t in (k, v))
        if rope is not None:  # (B, nh, T, hs)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if getattr(self.kv_transform, "streaming", False):  # the gate applies as on every other path
            return self._project(self._read_quantised_cache(q, k, v, kv), x)
        if self.kv_transform is not None:
            k, v = self.kv_transform(k, v)
        past = 0
        if kv is not None:
            cache, layer = kv
            past = cache.pos
            k, v = cache.append(layer, k, v)  # the cache holds the n_kv_head heads
        if past > 0 and self.kind not in REMEDY_KINDS:  # SDPA reads grouped heads as they are
            return self._project(attention_with_past(q, k, v, past, self.kind, self.sink_k, self.sink_v), x)
        if self.probs_hook is None and self.kind not in REMEDY_KINDS:
            return self._project(attention_fast(q, k, v, self.kind, self.sink_k, self.sink_v), x)
        k, v = repeat_kv(q, k, v)
        if past > 0:  # after the prompt: attend over the cached positions too
            return self._project(remedy_attention(q, k, v, self.kind, self._remedy_params()), x)
        if self.kind in REMEDY_KINDS:
            if self.probs_hook is None:
                y = remedy_attention(q, k, v, self.kind, self._remedy_params())
            else:
                y, probs = remedy_attention_reference(q, k, v, self.kind, self._remedy_params())
                self.probs_hook(probs)
            return self._project(y, x)
        y, probs = attention_reference(q, k, v, self.kind, self.sink_k, self.sink_v)
        self.probs_hook(probs)
        return self._project(y, x)

    def _remedy_params(self) -> RemedyParams:
        if self.kind != "sink-logit":
            return self.remedy
        return RemedyParams(self.remedy.gamma, self.remedy.zeta, self.remedy.eps, self.sinks)

    def _project(self, y: Tensor, x: Tensor) -> Tensor:
        """Heads (B, nh, T, hs) -> gate (if any) -> concatenated channels -> output projection.

        The gate is Qiu et al.'s G1 (after SDPA, before the output projection): y_h ⊙ σ(x W_g + b_g) with x this
        layer's input. Head-wise, it is Bondarenko et al.'s conditional gated attention (2023) with a linear gating
        function: one sigmoid per head and token, scaling that head's output.
        """
        B, nh, T, hs = y.shape
        y = y.transpose(1, 2)  # (B, T, nh, hs)
        if self.gate != "none":
            g = torch.sigmoid(self.g_proj(x))  # (B, T, nh) or (B, T, C)
            y = y * (g.unsqueeze(-1) if self.gate == "headwise" else g.view(B, T, nh, hs))
        return self.c_proj(y.reshape(B, T, nh * hs))

    def _read_quantised_cache(
        self, q: Tensor, k: Tensor, v: Tensor, kv: tuple[KVCache, int] | None
    ) -> Tensor:
        """Attention over a quantised KV cache (``kv_transform.read``, qbench.quant.kvschemes) as each query saw
        it after its own token was written: one pass over a window, or a :class:`models.kvcache.QuantizedKVCache`
        filled chunk by chunk; both give the same output (positions are absolute)."""
        if kv is None:
            past, view = 0, self.kv_transform.read(k, v, past=0)
        else:
            cache, layer = kv
            if not hasattr(cache, "append_read"):
                raise ValueError("a model with a quantised KV cache generates with model.new_cache()")
            past, view = cache.pos, cache.append_read(layer, k, v, self.kv_transform)
        # grouped-query attention: stored (and quantised) as the n_kv_head heads; SDPA reads them as they are,
        # the other paths get them repeated to the query heads (repeat_kv), only when they run
        if self.kv_transform.observing and self.probs_hook is None and kv is None:
            # the sink finder's float pass: the attention received, without materialising the probabilities
            fast = attention_received(q, *repeat_kv(q, k, v), self.kind, self.sink_k, self.sink_v)
            if fast is not None:
                self.kv_transform.add_received(fast[1])
                return fast[0]
        if self.kv_transform.reads_one_version and self.probs_hook is None:
            # Every position a query may see is stored (or kept float) the moment it is written: the stored
            # version alone, on the fused kernels.
            if self.kind in REMEDY_KINDS:
                k_hat, v_hat = repeat_kv(q, view.k_hat, view.v_hat)
                return remedy_attention(q, k_hat, v_hat, self.kind, self._remedy_params())
            if past:
                return attention_with_past(
                    q, view.k_hat, view.v_hat, past, self.kind, self.sink_k, self.sink_v
                )
            return attention_fast(q, view.k_hat, view.v_hat, self.kind, self.sink_k, self.sink_v)
        if view.k.size(1) != q.size(1):
            (vk, vv), (vkh, vvh) = repeat_kv(q, view.k, view.v), repeat_kv(q, view.k_hat, view.v_hat)
            view = view._replace(k=vk, v=vv, k_hat=vkh, v_hat=vvh)
        y, probs = attention_two_version(
            q, view.k, view.k_hat, view.v, view.v_hat, view.key_quantised, view.value_quantised,
            self.kind, self.sink_k, self.sink_v, past=past,
            remedy=self._remedy_params() if self.kind in REMEDY_KINDS else None,
            residual=view.residual, need_probs=self.probs_hook is not None or self.kv_transform.observing,
        )  # fmt: skip
        if probs is None:
            return y
        self.kv_transform.observe(probs)
        if self.probs_hook is not None and kv is None:
            self.probs_hook(probs.to(q.dtype))
        return y


# ------------------------------------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """GELU MLP (GPT-2: c_fc -> gelu -> c_proj) or SwiGLU (Llama: down(silu(gate(x)) * up(x)))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f, bias = config.d_model, config.d_ff, config.bias
        self.kind = config.mlp
        if config.mlp == "gelu":
            self.c_fc = nn.Linear(d, f, bias=bias)
            self.c_proj = nn.Linear(f, d, bias=bias)
        else:
            self.gate_proj = nn.Linear(d, f, bias=bias)
            self.up_proj = nn.Linear(d, f, bias=bias)
            self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "gelu":
            return self.c_proj(F.gelu(self.c_fc(x)))
        if "gate_up_proj" in self._modules:  # fuse_projections: one matmul, halves as gate and up
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------------------- block


class Block(nn.Module):
    """Pre-norm: x + f(norm(x)). Post-norm: norm(x + f(x)) (original Transformer; "Spike, Sparse, Sink" ablation)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.ln_1 = build_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = build_norm(config)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, kv: tuple[KVCache, int] | None = None
    ) -> Tensor:
        if self.pre_norm:
            x = x + self.attn(self.ln_1(x), rope, kv)
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.attn(x, rope, kv))
        return self.ln_2(x + self.mlp(x))


# ----------------------------------------------------------------------------------------------------- model


class Transformer(nn.Module):
    """A causal LM: ``model(input_ids (B, T)) -> logits (B, T, vocab)``.

    Each block's output (the residual stream) is what the outlier metrics read; ``models.observe`` records it
    with forward hooks on ``transformer.h[i]``, so the forward pass here carries no observation code.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.d_model),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            )
        )
        if config.pos == "learned":
            self.transformer["wpe"] = nn.Embedding(config.context, config.d_model)
        if config.norm_position == "pre":  # post-norm blocks already end in a norm
            self.transformer["ln_f"] = build_norm(config)
        for name in ("emb_proj", "head_proj"):  # OSP's projections (models.config)
            if getattr(config, name):
                self.transformer[name] = nn.Linear(config.d_model, config.d_model, bias=False)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        if config.pos == "rope":
            self.make_rope_tables()
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2L) so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layer))
        for name in ("emb_proj", "head_proj"):  # orthogonal, as OSP's reference model initialises rot1, rot2
            if name in self.transformer:
                nn.init.orthogonal_(self.transformer[name].weight)

    def make_rope_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)build the non-persistent RoPE tables, e.g. after loading weights into a model built on 'meta'."""
        cos, sin = rope_tables(self.config.context, self.config.head_dim, self.config.rope_theta)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def tie_weights(self) -> None:
        """Point the LM head at the token embedding (again) when the config ties them."""
        # Only between float layers: a quantised copy's head (not an nn.Linear) must keep its own weight.
        if self.config.tie_embeddings and type(self.lm_head) is nn.Linear:
            self.lm_head.weight = self.transformer.wte.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def forward(self, input_ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """Logits (B, T, V). With a ``cache``, ``input_ids`` continue the cached positions (see :class:`KVCache`)."""
        T = input_ids.size(1)
        pos = 0 if cache is None else cache.pos
        if pos + T > self.config.context:
            raise ValueError(f"sequence length {pos + T} exceeds the model's context {self.config.context}")
        x = self.transformer.wte(input_ids)  # (B, T, C)
        if "emb_proj" in self.transformer:  # OSP: the token embedding only, before positions are added
            x = self.transformer.emb_proj(x)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(torch.arange(pos, pos + T, device=input_ids.device))
        rope = (
            (self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T])
            if self.config.pos == "rope"
            else None
        )
        for i, block in enumerate(self.transformer.h):
            x = block(x, rope, None if cache is None else (cache, i))
        if cache is not None:
            cache.pos += T
        if "ln_f" in self.transformer:
            x = self.transformer.ln_f(x)
        if "head_proj" in self.transformer:  # OSP: between the final norm and the head
            x = self.transformer.head_proj(x)
        return self.lm_head(x)  # (B, T, V)

    def new_cache(self, packed: bool = False) -> KVCache:
        """An empty cache for generation: when the blocks quantise their KV cache (qbench.quant.kvschemes) a
        :class:`models.kvcache.QuantizedKVCache` (dequantised values), or with ``packed`` a
        :class:`models.kvcache.PackedKVCache` (codes and scales, dequantised on read); else a float
        :class:`KVCache`."""
        if any(getattr(block.attn.kv_transform, "streaming", False) for block in self.transformer.h):
            return PackedKVCache(self.config) if packed else QuantizedKVCache(self.config)
        return KVCache(self.config)

    @torch.inference_mode()
    def generate(self, prompt: Tensor, new_tokens: int) -> Tensor:
        """``new_tokens`` greedy tokens (B, new_tokens) after ``prompt`` (B, P), with a KV cache (:meth:`new_cache`)."""
        cache = self.new_cache()
        logits = self(prompt, cache)
        out = []
        for i in range(new_tokens):
            token = logits[:, -1:].argmax(-1)
            out.append(token)
            if i + 1 < new_tokens:
                logits = self(token, cache)
        return torch.cat(out, dim=1)

    def num_parameters(self, embedding: bool = True) -> int:
        """Parameters counted once (tied weights once); ``embedding=False`` drops token/position embeddings
        and an untied head (the "non-embedding" count of scaling-law papers)."""
        params = {id(p): p for p in self.parameters()}
        n = sum(p.numel() for p in params.values())
        if not embedding:
            n -= self.transformer.wte.weight.numel()
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n


def count_parameters(config: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameter counts of ``config``, without allocating weights (built on 'meta')."""
    with torch.device("meta"):
        model = Transformer(config)
    return model.num_parameters(), model.num_parameters(embedding=False)


def build(config: ModelConfig, seed: int | None = None) -> Transformer:
    """A freshly initialised model; with ``seed`` the initialisation is reproducible and leaves the global RNG alone."""
    if seed is None:
        return Transformer(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(config)


def fuse_projections(model: Transformer) -> Transformer:
    """A copy of a Llama-family ``model`` whose sibling projections are one linear each: q, k, v → ``qkv_proj``
    (rows q, then k, then v) and gate, up → ``gate_up_proj`` (gate rows, then up), as GPT-2 stores ``c_attn``
    and inference engines store Llama. The same function (each output row is the same dot product; the output is
    split again), one matmul instead of three and two — at decode a call's fixed cost is what a small layer
    spends. Weights are concatenated copies (the float model is untouched); GPT-2-family models (already fused)
    come back as an unchanged copy. Quantising the fused copy equals quantising the separate layers wherever the
    weight scales are per output row or group (not per tensor) and nothing is calibrated per layer."""
    fused = copy.deepcopy(model)
    for block in fused.transformer.h:
        attn, mlp = block.attn, block.mlp
        if hasattr(attn, "q_proj"):
            attn.qkv_proj = _concat_rows(attn.q_proj, attn.k_proj, attn.v_proj)
            del attn.q_proj, attn.k_proj, attn.v_proj
        if hasattr(mlp, "gate_proj"):
            mlp.gate_up_proj = _concat_rows(mlp.gate_proj, mlp.up_proj)
            del mlp.gate_proj, mlp.up_proj
    return fused


def _concat_rows(*linears: nn.Linear) -> nn.Linear:
    first = linears[0]
    out = nn.Linear(first.in_features, sum(lin.out_features for lin in linears), bias=first.bias is not None)
    out = out.to(device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if first.bias is not None:
            out.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return out.requires_grad_(first.weight.requires_grad)


def merge_projections(model: Transformer) -> Transformer:
    """The plain architecture computing the same function: OSP's projections folded away, so what is quantised
    and exported has neither. The embedding projection P₁ folds into the token embedding (E ← E P₁ᵀ, since
    emb_proj(E[t]) = E[t] P₁ᵀ); the head projection P₂ into the head (W ← W P₂, since W (P₂ h) = (W P₂) h).

    A tied head reads the unprojected E, so a tied model comes back untied: embedding E P₁ᵀ (or E) and head E P₂
    (or E). A model without either projection is returned unchanged.
    """
    config = model.config
    if not (config.emb_proj or config.head_proj):
        return model
    plain = config.replace(emb_proj=False, head_proj=False, tie_embeddings=False)
    with torch.device("meta"):
        merged = Transformer(plain)
    projections = ("transformer.emb_proj.weight", "transformer.head_proj.weight")
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in projections}
    wte = model.transformer.wte.weight.detach()
    head = model.lm_head.weight.detach()  # E itself when tied
    if config.emb_proj:
        P1 = model.transformer.emb_proj.weight.detach()
        state["transformer.wte.weight"] = (wte.double() @ P1.double().t()).to(wte.dtype)
    if config.head_proj:
        P2 = model.transformer.head_proj.weight.detach()
        state["lm_head.weight"] = (head.double() @ P2.double()).to(head.dtype)
    else:
        state["lm_head.weight"] = head.clone()
    merged.load_state_dict(state, assign=True)
    if plain.pos == "rope":
        merged.make_rope_tables(wte.device)
    return merged.train(model.training)
