"""What a model is: one frozen dataclass with the paper's switches, and the named presets.

The GPT-2 family (LayerNorm, GELU MLP, learned positions, biases, tied embeddings) and the Llama family
(RMSNorm, SwiGLU MLP, RoPE, no biases, untied head) are the same module with different switch values;
``family`` only picks the defaults and the projection layout (fused ``c_attn`` for GPT-2, separate
``q_proj``/``k_proj``/``v_proj`` for Llama, so that per-tensor quantisation sees the same tensors as the
transformers export of each family).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from models.errors import UserError, unknown_choice
from models.registry import Registry

CHOICES: dict[str, tuple[str, ...]] = {
    "family": ("gpt2", "llama"),
    # softmax1: +1 in the denominator (a head may attend nowhere); sink: a learned per-head key/value bias,
    # i.e. an extra always-visible key (the "attention bias" of Sun et al., Massive Activations).
    # Training-time remedies (models.attention): clipped = clipped softmax (Bondarenko et al. 2023);
    # softpick = ReLU(e^x - 1) / sum|e^x - 1| (Zuhri et al. 2025); sink-logit = one learned logit per head
    # appended to the scores and dropped after the softmax (gpt-oss), softmax-1 when that logit is 0.
    "attn": ("softmax", "softmax1", "sink", "clipped", "softpick", "sink-logit"),
    # rmsnorm = per-channel gain ("RMSNorm-M", Llama); rmsnorm_single = one scalar gain ("RMSNorm-S", the paper's).
    "norm": ("layernorm", "rmsnorm", "rmsnorm_single"),
    "norm_position": ("pre", "post"),
    "pos": ("learned", "rope", "none"),
    "mlp": ("gelu", "swiglu"),
    # A sigmoid gate on each head's attention output, computed from the block's (normed) input (Qiu et al. 2025,
    # position G1): one scalar per head (headwise) or one per channel (elementwise).
    "gate": ("none", "headwise", "elementwise"),
}

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(norm="layernorm", pos="learned", mlp="gelu", bias=True, tie_embeddings=True),
    "llama": dict(norm="rmsnorm", pos="rope", mlp="swiglu", bias=False, tie_embeddings=False),
}


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gpt2"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int = 1024
    context: int = 128
    vocab_size: int = 8192
    attn: str = "softmax"
    norm: str = "layernorm"
    norm_position: str = "pre"
    pos: str = "learned"
    mlp: str = "gelu"
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    gate: str = "none"
    # OSP's learnable d x d projections (Park et al. 2025; dmis-lab/Outlier-Safe-Pre-Training): one after the token
    # embedding (emb_proj), one between the final norm and the LM head (head_proj), both orthogonally initialised
    # as the reference model's ``rot1``/``rot2``; folded into the embedding and the head for evaluation and export
    # (models.transformer.merge_projections), so what is quantised is the plain architecture.
    emb_proj: bool = False
    head_proj: bool = False
    # Clipped softmax clip((zeta - gamma) softmax(x) + gamma, 0, 1) with gamma = -clip_alpha / context (Bondarenko et
    # al. 2023, "Quantizable Transformers"). The defaults are the reference code's causal-LM recipe
    # (Qualcomm-AI-research/outlier-free-transformers, opt_125m_clipped_softmax.sh: --alpha 12 with
    # --block_size 512, and opt_attention.py's gamma = -alpha / max_seq_length, eta = 1.0): alpha = 12, zeta = 1.
    # At the tiny preset's T = 128 that is gamma = -0.094; the BERT script's "clipped(-.025:1)" at T = 128 is
    # alpha = 3.2. T is the model's context, a constant, so a query's weights do not depend on how many tokens a
    # batch or a KV cache happens to hold.
    clip_alpha: float = 12.0
    clip_zeta: float = 1.0
    # Softpick's denominator epsilon: 1e-8, added to the (max-shifted) sum as the paper's reference code does.
    softpick_eps: float = 1e-8
    # Grouped-query attention (Ainslie et al. 2023; Llama 2 70B, SmolLM2): n_kv_head key/value heads, each shared
    # by n_head / n_kv_head consecutive query heads (query head h reads key/value head h // (n_head / n_kv_head),
    # transformers' repeat_kv). None: one key/value head per query head. The Llama layout only (separate k_proj /
    # v_proj of n_kv_head · head_dim outputs); the KV cache holds n_kv_head heads.
    n_kv_head: int | None = None

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise unknown_choice(f"value for {name}", value, choices)
        for name in ("n_layer", "n_head", "d_model", "d_ff", "context", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.d_model % self.n_head:
            raise UserError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.pos == "rope" and self.head_dim % 2:
            raise UserError(f"rope needs an even head dimension, got {self.head_dim}")
        for name in ("emb_proj", "head_proj"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not self.clip_alpha >= 0 or not self.clip_zeta >= 1:
            raise UserError(
                f"clipped softmax needs clip_alpha >= 0 and clip_zeta >= 1, got {self.clip_alpha}, {self.clip_zeta}"
            )
        if not self.softpick_eps > 0:
            raise UserError(f"softpick_eps must be > 0, got {self.softpick_eps}")
        if self.n_kv_head is not None:
            if not isinstance(self.n_kv_head, int) or self.n_kv_head <= 0 or self.n_head % self.n_kv_head:
                raise UserError(
                    f"n_kv_head={self.n_kv_head!r} must be a positive integer dividing n_head={self.n_head}"
                )
            if self.family != "llama" and self.n_kv_head != self.n_head:
                raise UserError(
                    f"n_kv_head={self.n_kv_head} (grouped-query attention) needs the llama family's separate "
                    f"k_proj/v_proj; family {self.family!r} fuses q, k, v"
                )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head``, or ``n_head`` without grouped-query attention."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def clip_gamma(self) -> float:
        """The clipped softmax's lower bound gamma = -alpha / T (T = the context length)."""
        return -self.clip_alpha / self.context

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied; unknown field names are a :class:`UserError`."""
        known = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in known:
                raise unknown_choice("model config field", key, known)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        # absent from every model without grouped-query attention, as before the field existed
        if data["n_kv_head"] is None:
            del data["n_kv_head"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UserError(f"unknown model config fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)


def family_config(family: str, **shape: Any) -> ModelConfig:
    """A config of ``family`` with that family's default switches and the given shape/overrides."""
    if family not in FAMILY_DEFAULTS:
        raise unknown_choice("model family", family, FAMILY_DEFAULTS)
    return ModelConfig(family=family, **{**FAMILY_DEFAULTS[family], **shape})


@dataclass(frozen=True)
class Preset:
    """A named model shape plus the tokenizer it is meant for (vocab_size must match it)."""

    config: ModelConfig
    tokenizer: str
    notes: str = field(default="", compare=False)


PRESETS: Registry[Preset] = Registry("preset")

# CPU presets: vocabulary 8192 (our BPE) keeps tiny models from being mostly embedding.
PRESETS.register(
    "tiny",
    Preset(
        family_config("gpt2", n_layer=4, n_head=4, d_model=256, d_ff=1024, context=128, vocab_size=8192),
        "bpe8192",
        "the 4-layer d=256 model in which outliers emerge within ~1 M tokens on a CPU (results/emergence/)",
    ),
    "CPU: 4 layers, d 256, 4 heads, context 128, vocab 8192; trains in minutes",
)
PRESETS.register(
    "small",
    Preset(
        family_config("gpt2", n_layer=6, n_head=6, d_model=384, d_ff=1536, context=256, vocab_size=8192),
        "bpe8192",
    ),
    "CPU: 6 layers, d 384, 6 heads, context 256, vocab 8192",
)
# The paper's sizes. Its exact shapes are not public: GPT-2 presets follow GPT-2/GPT-3's published shapes
# (4x MLP, 64-dim heads where they are standard) at the nominal size, with GPT-2's 50257-token vocabulary;
# the Llama preset takes GaLore's C4 Llama-130M shape (12L/768/12 heads/ff 2048), a common anchor for that size.
_GPT2 = dict(context=1024, vocab_size=50257)
PRESETS.register(
    "gpt2-60m",
    Preset(family_config("gpt2", n_layer=8, n_head=8, d_model=512, d_ff=2048, **_GPT2), "gpt2"),
    "paper size: 8 layers, d 512, 8 heads (GaLore-60M depth/width with GPT-2's 4x MLP)",
)
PRESETS.register(
    "gpt2-130m",
    Preset(family_config("gpt2", n_layer=12, n_head=12, d_model=768, d_ff=3072, **_GPT2), "gpt2"),
    "paper size: GPT-2 small shape, 12 layers, d 768, 12 heads",
)
PRESETS.register(
    "gpt2-350m",
    Preset(family_config("gpt2", n_layer=24, n_head=16, d_model=1024, d_ff=4096, **_GPT2), "gpt2"),
    "paper size: GPT-2 medium shape, 24 layers, d 1024, 16 heads",
)
PRESETS.register(
    "gpt2-1.4b",
    Preset(family_config("gpt2", n_layer=24, n_head=16, d_model=2048, d_ff=8192, **_GPT2), "gpt2"),
    "paper size: GPT-3 1.3B shape, 24 layers, d 2048, 16 heads",
)
PRESETS.register(
    "llama2-130m",
    Preset(
        family_config("llama", n_layer=12, n_head=12, d_model=768, d_ff=2048, context=1024, vocab_size=50257),
        "gpt2",
        "Llama-2's own 32000-token tokenizer is not obtainable offline; GPT-2's is used",
    ),
    "paper size: Llama-2 style (RMSNorm, SwiGLU, RoPE), GaLore's 130M shape 12L/768/12/ff 2048",
)


def get_preset(name: str) -> Preset:
    return PRESETS.get(name)


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset's config with switch overrides (``attn="softmax1"``, ``norm=...``); None values are ignored."""
    return get_preset(name).config.replace(**{k: v for k, v in overrides.items() if v is not None})
