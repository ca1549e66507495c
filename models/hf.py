"""Interop with transformers: softmax-1 as a registered attention function, and export to a model folder.

    from models.hf import export_to_hf, register_softmax1
    export_to_hf(checkpoint, "out/")        # GPT2LMHeadModel or LlamaForCausalLM layout + tokenizer
    AutoModelForCausalLM.from_pretrained("out/")   # after `import qbench` (or register_softmax1())

softmax-1 is registered under the name ``softmax1`` in transformers' ``AttentionInterface`` *and*
``AttentionMaskInterface``: without a registered mask function transformers passes no mask to an unknown
implementation and attention silently stops being causal. The exported config.json carries
``"attn_implementation": "softmax1"``, so loading such a folder without registering first fails loudly
instead of running ordinary softmax. The remedies' attention functions and gated attention (``qbench_gated+<base>``,
for Llama-family models) export the same way; see their sections below.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.attention import clipped_softmax, repeat_kv, softmax1, softmax_with_sink_logit, softpick
from models.checkpoint import Checkpoint, load_checkpoint
from models.config import ModelConfig, family_config
from models.errors import UserError
from models.io import atomic_write_json

SOFTMAX1 = "softmax1"
SOFTMAX1_EAGER = "softmax1_eager"


def softmax1_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function for softmax-1: SDPA over one extra zero key/value visible to all queries.

    ``attention_mask`` is the additive float mask of the eager mask function, (B, 1, Q, K); the extra key gets
    a 0 (visible) column in front. Keys/values with fewer heads (GQA) are repeated to the query's heads.
    """
    key, value = repeat_kv(query, key, value)
    B, H, Q, D = query.shape
    zero = query.new_zeros(B, H, 1, D)
    key, value = torch.cat([zero, key], dim=2), torch.cat([zero, value], dim=2)
    if attention_mask is None:
        if Q > 1:  # never hit with our mask function registered; refuse rather than silently drop causality
            raise RuntimeError(
                "softmax1 attention got no mask; register it with models.hf.register_softmax1()"
            )
        mask = None
    else:
        mask = attention_mask[..., : key.size(2) - 1].to(query.dtype)
        mask = torch.cat([mask.new_zeros(*mask.shape[:-1], 1).expand(mask.size(0), 1, Q, 1), mask], dim=-1)
    dropout_p = dropout if module.training else 0.0
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def softmax1_eager_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """softmax-1 computed explicitly, returning the probabilities (rows sum to < 1) like transformers' eager.

    Registered as ``softmax1_eager``: what metrics switch a softmax-1 model to when they need attention weights.
    """
    key, value = repeat_kv(query, key, value)
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    scores = (query @ key.transpose(-2, -1)).float() * scale
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.size(2)].float()
    probs = softmax1(scores, dim=-1).to(query.dtype)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def register_softmax1() -> None:
    """Register ``softmax1`` and ``softmax1_eager`` with transformers (idempotent). ``import qbench`` calls this."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(SOFTMAX1, softmax1_attention)
    AttentionInterface.register(SOFTMAX1_EAGER, softmax1_eager_attention)
    AttentionMaskInterface.register(SOFTMAX1, eager_mask)
    AttentionMaskInterface.register(SOFTMAX1_EAGER, eager_mask)
    register_remedies()


# ---------------------------------------------------------------------------- training-time remedies (attention)
#
# clipped softmax, softpick and the sink logit as transformers attention functions, computed explicitly (they
# return their probabilities, like transformers' eager). Their parameters travel in the exported config.json, so a
# plain ``from_pretrained`` after registering reproduces the model: ``clipped_softmax_gamma``/``_zeta``,
# ``softpick_eps`` and ``sink_logits`` (one list of n_head logits per layer, read through the attention module's
# ``layer_idx``; a float32 value written as JSON reads back bit-exactly).

CLIPPED = "clipped_softmax"
SOFTPICK = "softpick"
SINK_LOGIT = "sink_logit"
ATTN_IMPLEMENTATIONS = {
    "softmax1": SOFTMAX1,
    "clipped": CLIPPED,
    "softpick": SOFTPICK,
    "sink-logit": SINK_LOGIT,
}
REMEDY_IMPLEMENTATIONS = (CLIPPED, SOFTPICK, SINK_LOGIT)  # explicit: they return their probabilities
# transformers implementation -> our attention kind (what a card of an exported folder reports)
HF_ATTENTION_KINDS = {impl: kind for kind, impl in ATTN_IMPLEMENTATIONS.items()} | {
    SOFTMAX1_EAGER: "softmax1"
}


def _masked_scores(
    query: Tensor, key: Tensor, attention_mask: Tensor | None, scaling: float | None
) -> Tensor:
    """float32 scores (B, H, Q, K) with masked entries at exactly −inf: eager_mask marks them with the dtype's
    minimum, which softpick would count in its denominator (e^x − 1 = −1 there) where its paper counts 0."""
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    scores = (query @ key.transpose(-2, -1)).float() * scale
    if attention_mask is None:
        # Never hit with the mask function registered; refuse rather than silently drop causality.
        if query.size(2) > 1:
            raise RuntimeError("attention got no mask; register it with models.hf.register_remedies()")
        return scores
    mask = attention_mask[..., : key.size(2)]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores.masked_fill(mask <= torch.finfo(mask.dtype).min, float("-inf"))


def _explicit(query: Tensor, key: Tensor, value: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    probs = probs.to(query.dtype)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def clipped_softmax_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Clipped softmax (``models.attention.clipped_softmax``) with γ, ζ from the model config."""
    key, value = repeat_kv(query, key, value)
    scores = _masked_scores(query, key, attention_mask, scaling)
    cfg = module.config
    return _explicit(
        query, key, value, clipped_softmax(scores, cfg.clipped_softmax_gamma, cfg.clipped_softmax_zeta)
    )


def softpick_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Softpick (``models.attention.softpick``) with ε from the model config; masked keys count 0."""
    key, value = repeat_kv(query, key, value)
    scores = _masked_scores(query, key, attention_mask, scaling)
    return _explicit(query, key, value, softpick(scores, module.config.softpick_eps))


def sink_logit_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """A learned logit per head appended to each row, softmaxed and dropped (gpt-oss's eager attention with
    ``module.sinks``); the logits are the config's ``sink_logits[layer_idx]``."""
    key, value = repeat_kv(query, key, value)
    scores = _masked_scores(query, key, attention_mask, scaling)
    sinks = torch.tensor(
        module.config.sink_logits[module.layer_idx], dtype=torch.float32, device=query.device
    )
    return _explicit(query, key, value, softmax_with_sink_logit(scores, sinks))


def register_remedies() -> None:
    """Register the remedies' attention functions and their (eager) mask functions with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    for name, fn in (
        (CLIPPED, clipped_softmax_attention),
        (SOFTPICK, softpick_attention),
        (SINK_LOGIT, sink_logit_attention),
    ):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, eager_mask)
    for base in GATED_BASES:
        register_gated(base)


def base_attention(base: str, module: torch.nn.Module) -> Callable:
    """The attention function ``base`` names; "eager" is each model file's own ``eager_attention_forward``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


# ---------------------------------------------------------------------------------- gated attention (export)
#
# No transformers architecture has a sigmoid gate on the attention output without q/k norms (Qwen3-Next, Qwen3.5,
# AFMoE and Beam normalise q and k; the rest are hybrids or recurrent stacks), so a gated Llama-family model exports
# as a LlamaForCausalLM with twice the query heads: q_proj's heads n..2n-1 carry the gate logits x W_g + b_g (a
# head-wise gate repeated over its head's channels, which gives the same sigmoid), keys and values keep n heads, and
# o_proj reads zeros for the gate heads. The registered attention function ``qbench_gated+<base>`` undoes the rotary
# embedding transformers applied to the gate heads (it rotates every query head; the inverse rotation uses the very
# cos/sin applied, so it is exact up to the rounding of the model's dtype), runs <base> on the first n heads and
# multiplies each output channel by its sigmoid. The gate is the outermost wrapper, so a quantised KV cache
# (qbench_kv+<base>) sits inside it and sees an ordinary query.

GATED_PREFIX = "qbench_gated+"
GATED_BASES = ("sdpa", "eager", SOFTMAX1, SOFTMAX1_EAGER, *REMEDY_IMPLEMENTATIONS)


def _applied_rotation(
    module: torch.nn.Module, position_ids: Tensor | None, like: Tensor
) -> tuple[Tensor, Tensor]:
    """The (cos, sin) transformers rotated ``module``'s queries with, each (B or 1, T, D).

    They are read from the calling ``LlamaAttention.forward`` (its ``position_embeddings`` argument), not
    recomputed: after ``model.to(torch.bfloat16)`` the model's ``inv_freq`` buffer is bf16-rounded while
    ``from_pretrained(dtype=torch.bfloat16)`` keeps it float32, and a recomputed angle would differ from the
    applied one by up to position × 2⁻⁹ rad. Without that frame (another caller), the angles are recomputed in
    float32, which is what a float32 model applied.
    """
    frame = sys._getframe(2)  # _gated_attention's caller: the attention module's forward
    applied = frame.f_locals.get("position_embeddings") if frame.f_locals.get("self") is module else None
    del frame
    if applied is not None:
        return applied
    if like.dtype != torch.float32:
        raise RuntimeError(
            "gated attention in a non-float32 model needs the rotary angles its attention module applied; "
            "call it from LlamaAttention.forward"
        )
    # LlamaDecoderLayer passes them down; refuse rather than gate with rotated logits
    if position_ids is None:
        raise RuntimeError(
            "gated attention got no position_ids to undo the rotary embedding of its gate heads"
        )
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(module.config)
    freqs = position_ids[..., None].float() * inv_freq.to(like.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _unrotate(rotated: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Undo ``apply_rotary_pos_emb`` on (B, H, T, D) heads: x = r·cos − rotate_half(r)·sin (rotation by −θ)."""
    cos, sin = cos.to(rotated.dtype)[:, None], sin.to(rotated.dtype)[:, None]
    half = rotated.size(-1) // 2
    rotate_half = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    return rotated * cos - rotate_half * sin


def _gated_attention(base: str) -> Callable:
    def attention(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        n = module.config.qbench_gate_heads
        if query.size(1) != 2 * n:
            raise RuntimeError(
                f"gated attention expects {2 * n} query heads (queries, gates), got {query.size(1)}"
            )
        rope = module.config.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise RuntimeError(
                f"gated attention expects the default rotary embedding, not {rope['rope_type']!r}"
            )
        q_proj = getattr(module, "q_proj", None)
        stashed = getattr(q_proj, "pre_rope_gate", None)
        if stashed is not None:  # an unpacked export: the gate as its own linear computed it, bit for bit
            q_proj.pre_rope_gate = None
            gate = stashed.view(*stashed.shape[:-1], n, -1).transpose(1, 2)
        else:  # the packed export: undo the rotary embedding (exact to float rounding, ~1e-7 relative)
            cos, sin = _applied_rotation(module, kwargs.get("position_ids"), query)
            gate = _unrotate(query[:, n:], cos, sin)
        if module.num_key_value_groups != 1:  # the base sees n query heads over n key/value heads
            module.num_key_value_groups = 1
        out, probs = base_attention(base, module)(
            module, query[:, :n], key, value, attention_mask, *args, **kwargs
        )
        out = out * torch.sigmoid(gate.transpose(1, 2)).to(out.dtype)  # (B, T, n, D)
        return torch.cat([out, torch.zeros_like(out)], dim=2), probs  # o_proj reads zeros for the gate heads

    attention.__doc__ = (
        f"{base} attention with a sigmoid output gate carried in query heads n..2n-1 (models.hf)."
    )
    return attention


def register_gated(base: str) -> str:
    """Register ``qbench_gated+<base>`` (attention, and the base's mask function) with transformers; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = GATED_PREFIX + base
    AttentionInterface.register(name, _gated_attention(base))
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    if base not in masks:  # transformers would pass no mask and attention would silently stop being causal
        raise RuntimeError(f"cannot gate attention {base!r}: it has no registered mask function")
    AttentionMaskInterface.register(name, masks[base])
    return name


def ungated(implementation: str) -> tuple[bool, str]:
    """(whether ``implementation`` is a gated one, the implementation it wraps)."""
    if implementation.startswith(GATED_PREFIX):
        return True, implementation[len(GATED_PREFIX) :]
    return False, implementation


class UnpackedQueryGate(torch.nn.Module):
    """A gated export's ``q_proj`` as the two layers it packs: the queries (n heads) and the gate (n head-wise
    rows, repeated over each head's channels, or n·head_dim element-wise rows). Same output as the packed
    ``q_proj``; quantising it quantises the query and gate weights as the checkpoint's ``q_proj`` and ``g_proj``
    are quantised, each with its own scales (:func:`unpack_gates`)."""

    qbench_unpacked = True  # qbench.quant.apply.select_layers: the parts answer to this module's name too

    def __init__(self, query: torch.nn.Module, gate: torch.nn.Module, repeat: int) -> None:
        super().__init__()
        self.query, self.gate, self.repeat = query, gate, repeat
        # The gate as computed here, for the attention function to read instead of undoing RoPE on the packed
        # gate heads: that round trip moves values by ~1e-7, enough to flip a few 4-bit codes of the o_proj input
        # and make the quantised export drift from its quantised checkpoint. Read once, then cleared.
        self.pre_rope_gate: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate(x)
        if self.repeat > 1:
            gate = gate.repeat_interleave(self.repeat, dim=-1)
        self.pre_rope_gate = gate
        return torch.cat([self.query(x), gate], dim=-1)


class UnpackedOutput(torch.nn.Module):
    """A gated export's ``o_proj`` ([W_o, 0]) as the checkpoint's output projection: it reads only the first
    ``width`` input channels (the gate heads' are zeros), so its input has the checkpoint's size (a Hadamard
    rotation of it, and any per-input scale, are the checkpoint's)."""

    qbench_unpacked = True

    def __init__(self, inner: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.inner, self.width = inner, width

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x[..., : self.width])


def _linear(weight: Tensor, bias: Tensor | None) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer = layer.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def unpack_gates(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a gated export (a LlamaForCausalLM whose config has ``qbench_gate_heads``) whose packed
    ``q_proj`` = [W_q; W_g] and ``o_proj`` = [W_o, 0] are :class:`UnpackedQueryGate` / :class:`UnpackedOutput`:
    the same function, but per-tensor (and per-block) quantisation scales then see the queries, the gate and the
    output projection apart, as in the checkpoint, not the gate heads packed into the queries. ``model`` itself
    when it is not a gated export (or is already unpacked); ``model`` is never modified."""
    import copy

    config = getattr(model, "config", None)
    n = getattr(config, "qbench_gate_heads", None)
    if not n:
        return model
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = n * head_dim
    memo: dict[int, Any] = {}
    for name, attn in model.named_modules():
        q, o = getattr(attn, "q_proj", None), getattr(attn, "o_proj", None)
        if not (isinstance(q, torch.nn.Linear) and isinstance(o, torch.nn.Linear)):
            continue
        if q.out_features != 2 * width or o.in_features != 2 * width:
            raise UserError(
                f"{name}: a gated export's q_proj packs {2 * width} outputs (queries, gates) and its o_proj reads "
                f"{2 * width}; got {q.out_features} and {o.in_features} (not an export of `qbench export`)"
            )
        w, b = q.weight.detach(), None if q.bias is None else q.bias.detach()
        gate_w, gate_b = w[width:], None if b is None else b[width:]
        repeat = 1
        if getattr(config, "qbench_gate", None) == "headwise":
            rows, row_b = gate_w[::head_dim], None if gate_b is None else gate_b[::head_dim]
            if torch.equal(rows.repeat_interleave(head_dim, dim=0), gate_w) and (
                gate_b is None or torch.equal(row_b.repeat_interleave(head_dim), gate_b)
            ):
                gate_w, gate_b, repeat = rows, row_b, head_dim
        query = _linear(w[:width], None if b is None else b[:width])
        memo[id(q)] = UnpackedQueryGate(query, _linear(gate_w, gate_b), repeat)
        if o.weight.detach()[:, width:].any():
            raise UserError(
                f"{name}.o_proj reads the gate heads (its columns {width}.. are not zero): not an export of "
                "`qbench export`; cannot quantise it as its checkpoint"
            )
        ob = None if o.bias is None else o.bias.detach()
        memo[id(o)] = UnpackedOutput(_linear(o.weight.detach()[:, :width], ob), width)
    return copy.deepcopy(model, memo) if memo else model


# ------------------------------------------------------------------------------------------------ export


def _require(config: ModelConfig, target: str, **allowed: tuple[Any, ...]) -> None:
    for name, values in allowed.items():
        value = getattr(config, name)
        if value not in values:
            raise UserError(
                f"cannot export to {target}: {name}={value!r} has no equivalent there "
                f"(it supports {name} in {list(values)}); keep using the qbench checkpoint for this model"
            )


def _gpt2_model(config: ModelConfig, state: dict[str, Tensor]) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    _require(
        config,
        "GPT2LMHeadModel",
        attn=("softmax", *ATTN_IMPLEMENTATIONS),
        gate=("none",),
        norm=("layernorm",),
        norm_position=("pre",),
        pos=("learned", "none"),
        mlp=("gelu",),
    )
    hf_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.context,
        n_embd=config.d_model,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_inner=config.d_ff,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(hf_config)
    hf_state = {name: torch.zeros_like(t) for name, t in model.state_dict().items()}  # absent biases/wpe = 0
    rename = {"lm_head.weight": "lm_head.weight"}
    for name, tensor in state.items():
        hf_name = rename.get(name, name)
        # GPT-2's Conv1D stores (in, out): our Linear weights transposed.
        is_conv1d = any(k in name for k in ("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        hf_state[hf_name] = tensor.t().contiguous() if is_conv1d else tensor
    return model, hf_state


_LLAMA_NAMES = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LLAMA_BLOCK_NAMES = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}


def _llama_name(name: str) -> str:
    if name in _LLAMA_NAMES:
        return _LLAMA_NAMES[name]
    _, _, layer, rest = name.split(".", 3)  # transformer.h.<i>.<rest>
    for ours, theirs in _LLAMA_BLOCK_NAMES.items():
        if rest.startswith(ours):
            return f"model.layers.{layer}.{theirs}{rest[len(ours) :]}"
    raise KeyError(name)


def _llama_model(config: ModelConfig, state: dict[str, Tensor]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    _require(
        config,
        "LlamaForCausalLM",
        attn=("softmax", *ATTN_IMPLEMENTATIONS),
        norm=("rmsnorm", "rmsnorm_single"),
        norm_position=("pre",),
        pos=("rope",),
        mlp=("swiglu",),
    )
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.context,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        hidden_act="silu",
        attention_bias=config.bias,
        mlp_bias=config.bias,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
    )
    gated = config.gate != "none"
    if gated and config.kv_heads != config.n_head:  # the gate's extra query heads would regroup the heads
        raise UserError(
            "cannot export to LlamaForCausalLM: an output gate with grouped-query attention (n_kv_head="
            f"{config.n_kv_head}) has no equivalent there; keep using the qbench checkpoint for this model"
        )
    if gated:  # the gate rides in n extra query heads (see "gated attention (export)" above)
        hf_config.num_attention_heads = 2 * config.n_head
        hf_config.attention_bias = True  # the gate's bias; zero for q, k, v and o where the model has none
        hf_config.qbench_gate = config.gate
        hf_config.qbench_gate_heads = config.n_head
    model = LlamaForCausalLM(hf_config)
    hf_state = {}
    for name, tensor in state.items():
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) and tensor.numel() == 1:
            tensor = tensor.expand(config.d_model).clone()  # RMSNorm-S: one scalar gain = a constant vector
        if ".attn.g_proj." not in name:
            hf_state[_llama_name(name)] = tensor
    if gated:
        _pack_gates(config, state, hf_state)
    return model, hf_state


def _pack_gates(config: ModelConfig, state: dict[str, Tensor], hf_state: dict[str, Tensor]) -> None:
    """q_proj = [W_q; W_g] (head-wise gate rows repeated over the head's channels), o_proj = [W_o, 0]."""
    width = config.n_head * config.head_dim
    for i in range(config.n_layer):
        ours, theirs = f"transformer.h.{i}.attn", f"model.layers.{i}.self_attn"
        gate_w, gate_b = state[f"{ours}.g_proj.weight"], state[f"{ours}.g_proj.bias"]
        if config.gate == "headwise":
            gate_w = gate_w.repeat_interleave(config.head_dim, dim=0)
            gate_b = gate_b.repeat_interleave(config.head_dim, dim=0)
        q_w = hf_state[f"{theirs}.q_proj.weight"]
        q_b = hf_state.get(f"{theirs}.q_proj.bias", q_w.new_zeros(width))
        hf_state[f"{theirs}.q_proj.weight"] = torch.cat([q_w, gate_w])
        hf_state[f"{theirs}.q_proj.bias"] = torch.cat([q_b, gate_b])
        o_w = hf_state[f"{theirs}.o_proj.weight"]
        hf_state[f"{theirs}.o_proj.weight"] = torch.cat([o_w, torch.zeros_like(o_w)], dim=1)
        for proj, size in (("k_proj", width), ("v_proj", width), ("o_proj", config.d_model)):
            hf_state.setdefault(f"{theirs}.{proj}.bias", q_w.new_zeros(size))


def to_hf_model(model: torch.nn.Module, tokenizer: Any | None = None) -> Any:
    """A transformers model computing the same function as our ``model`` (same weights, float32 copy).

    With ``tokenizer``, its ``<|endoftext|>`` id becomes the config's bos/eos/pad id (generation needs them).
    """
    from models.transformer import Transformer, merge_projections

    assert isinstance(model, Transformer)
    model = merge_projections(model)  # OSP's projections fold into the embedding and head: the plain model
    config = model.config
    # The sink logits travel in the config (see register_remedies), not as weights.
    state = {
        k: v.detach().float().cpu() for k, v in model.state_dict().items() if not k.endswith(".attn.sinks")
    }
    if config.tie_embeddings:
        state.pop("lm_head.weight")
    build = _gpt2_model if config.family == "gpt2" else _llama_model
    hf_model, hf_state = build(config, state)
    if config.tie_embeddings:
        hf_state.pop("lm_head.weight", None)
    missing, unexpected = hf_model.load_state_dict(hf_state, strict=False)
    missing = [m for m in missing if not (config.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"export mapping is incomplete: missing {missing}, unexpected {unexpected}")
    if config.tie_embeddings:
        hf_model.tie_weights()
    attn_impl = ATTN_IMPLEMENTATIONS.get(config.attn, "sdpa")
    if attn_impl != "sdpa" or config.gate != "none":
        register_softmax1()  # and the remedies' and gated functions
    if config.attn == "clipped":
        hf_model.config.clipped_softmax_gamma = config.clip_gamma
        hf_model.config.clipped_softmax_zeta = config.clip_zeta
    if config.attn == "softpick":
        hf_model.config.softpick_eps = config.softpick_eps
    if config.attn == "sink-logit":
        hf_model.config.sink_logits = [
            block.attn.sinks.detach().float().cpu().tolist() for block in model.transformer.h
        ]
    if config.gate != "none":
        attn_impl = GATED_PREFIX + attn_impl
    hf_model.config._attn_implementation = attn_impl
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(hf_model.config, key, tokenizer.eos_token_id)
            setattr(hf_model.generation_config, key, tokenizer.eos_token_id)
    return hf_model.eval()


def export_to_hf(checkpoint: Checkpoint | str | Path, out: str | Path) -> Path:
    """Write a transformers model folder (weights, config, tokenizer) for a GPT-2- or Llama-family checkpoint."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
    hf_model = to_hf_model(ckpt.model, ckpt.tokenizer)
    out = Path(out)
    hf_model.save_pretrained(str(out), safe_serialization=True)
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save_pretrained(str(out))
    config_file = out / "config.json"
    hf_config = json.loads(config_file.read_text())
    hf_config["attn_implementation"] = hf_model.config._attn_implementation
    hf_config["qbench"] = {
        "exported_from": str(ckpt.path),
        "model": ckpt.config.to_dict(),
        "provenance": ckpt.provenance,
    }
    if (
        ckpt.config.emb_proj or ckpt.config.head_proj
    ):  # "model" is what was trained; the weights its plain form
        hf_config["qbench"]["merged_projections"] = [
            n for n in ("emb_proj", "head_proj") if getattr(ckpt.config, n)
        ]
    atomic_write_json(config_file, hf_config)
    return out


# ------------------------------------------------------------------------------------ import from transformers


def _hf_rope_theta(c: Any) -> float | None:
    """RoPE's base of a transformers config, None when it scales positions (no plain-RoPE equivalent here)."""
    params = getattr(c, "rope_parameters", None) or {}
    scaling = getattr(c, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        return None
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    return None if theta is None else float(theta)


def hf_config_to_ours(c: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a transformers ``LlamaForCausalLM`` config, or a one-line :class:`UserError`
    naming what has no equivalent here (another architecture, scaled RoPE, biases on only some projections …)."""
    arch = (getattr(c, "architectures", None) or [type(c).__name__])[0]
    if getattr(c, "model_type", None) != "llama":
        raise UserError(
            f"{arch} (model_type {getattr(c, 'model_type', None)!r}) has no qbench equivalent: only "
            "LlamaForCausalLM models convert (GPT-2's transformers graph uses tanh GELU, ours exact GELU)"
        )
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    theta = _hf_rope_theta(c)
    problems = []
    if head_dim * heads != c.hidden_size:
        problems.append(f"head_dim {head_dim} x {heads} heads != hidden_size {c.hidden_size}")
    if getattr(c, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {c.hidden_act!r} (SwiGLU needs silu)")
    if theta is None:
        problems.append("scaled RoPE (rope_type other than default)")
    if bool(getattr(c, "attention_bias", False)) != bool(getattr(c, "mlp_bias", False)):
        problems.append("biases on the attention or the MLP only")
    if getattr(c, "pretraining_tp", 1) not in (None, 1):
        problems.append(f"pretraining_tp {c.pretraining_tp}")
    impl = getattr(c, "_attn_implementation", None) or "eager"
    if impl in HF_ATTENTION_KINDS or impl.startswith(GATED_PREFIX):  # qbench's softmax-1, remedies and gates
        problems.append(f"attention implementation {impl!r} (only plain softmax converts)")
    if problems:
        raise UserError(f"{arch} does not convert to a qbench model: {'; '.join(problems)}")
    kv = getattr(c, "num_key_value_heads", None) or heads
    return family_config(
        "llama",
        n_layer=c.num_hidden_layers,
        n_head=heads,
        n_kv_head=None if kv == heads else kv,
        d_model=c.hidden_size,
        d_ff=c.intermediate_size,
        context=c.max_position_embeddings,
        vocab_size=c.vocab_size,
        bias=bool(getattr(c, "attention_bias", False)),
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        norm_eps=float(c.rms_norm_eps),
        rope_theta=theta,
    )


def from_hf_model(hf_model: torch.nn.Module, check: Tensor | None = None) -> torch.nn.Module:
    """A qbench :class:`~models.transformer.Transformer` computing what a transformers ``LlamaForCausalLM``
    computes (float32 copies of its weights; the inverse of :func:`to_hf_model`'s Llama mapping), so it runs on
    qbench's own graph and KV cache. Tied embeddings stay tied. With ``check`` (token ids (B, T)) both models'
    logits are compared and a difference beyond 1e-4 of their scale is an error — a conversion that did not
    apply is never used silently."""
    from models.transformer import Transformer

    config = hf_config_to_ours(hf_model.config)
    with torch.device("meta"):
        ours = Transformer(config)
    theirs = hf_model.state_dict()
    state = {}
    for name in ours.state_dict():
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        hf_name = _llama_name(name)
        if hf_name not in theirs:
            raise UserError(f"{type(hf_model).__name__} has no tensor {hf_name} (for qbench's {name})")
        state[name] = theirs[hf_name].detach().float().clone()
    if not config.tie_embeddings:
        state["lm_head.weight"] = theirs["lm_head.weight"].detach().float().clone()
    missing, unexpected = ours.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"import mapping is incomplete: missing {missing}, unexpected {unexpected}")
    ours.tie_weights()
    device = next(hf_model.parameters()).device
    ours.make_rope_tables(device)
    ours = ours.to(device).eval()
    if check is not None:
        with torch.inference_mode():
            want = hf_model(check.to(device), use_cache=False).logits.float()
            got = ours(check.to(device))
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        if not err <= 1e-4:
            raise RuntimeError(
                f"the converted model's logits differ from the transformers model's by {err:.2e}"
            )
    return ours
