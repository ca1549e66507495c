"""QuaRot's rotation of the residual stream (Ashkboos et al. 2024, "QuaRot: Outlier-Free 4-Bit Inference in
Rotated LLMs", §4 and Figure 3), as the scheme modifier ``rotate=quarot``.

A pre-norm transformer with RMSNorm is *computationally invariant* under an orthogonal Q of the residual stream:
RMSNorm(x Q) = RMSNorm(x) Q once the norm's gain is folded into the linear layers that read it (RMS is a norm, and
‖x Q‖ = ‖x‖). So the float model is rewritten, computing the same function (tested to float rounding):

1. **Norms folded** (§4, "we fuse the RMSNorm scaling into the next linear layer"): every RMSNorm gain g moves into
   the columns of the layers that read that norm's output, W ← W · diag(g) (q/k/v and a gate after the attention
   norm, gate/up after the MLP norm, the LM head after the final norm); the gains become 1. A single-gain
   RMSNorm-S folds the same way.
2. **Residual rotated** by one random Hadamard matrix Q of the model width (``qbench.quant.hadamard`` through
   ``fake.HadamardRotation``: a Hadamard matrix where one of that order exists, seeded signs): the token embedding
   E ← E Q; every layer reading the residual W ← W Q; every layer writing into it (o_proj, down_proj) W ← Qᵀ W
   and its bias b ← b Q. A tied head is untied (embedding E Q, head E · diag(g) · Q).
3. **Online Hadamard** before ``down_proj`` (§4, "online Hadamard transformation before the down-projection") and
   before ``o_proj``: these two read activations the residual rotation does not reach. Here each gets a full-size
   seeded Hadamard rotation R of its input inside the layer (the ``rotation`` of ``fake.FakeQuantLinear`` and the
   real layers: x ↦ x Rᵀ with W ↦ W Rᵀ, exact in float), so its activation quantiser sees x Rᵀ. QuaRot itself
   rotates o_proj's input by a Hadamard across heads online and within heads offline in W_v; the full-size
   rotation here is the same invariance at a higher cost.

The quantiser then sees rotated weights and activations (outliers spread over every channel) and rounds them with
its own algorithm: round-to-nearest or GPTQ (``algo=gptq``: its Hessians are the rotated model's). Models: qbench's
own Llama-style checkpoints (RMSNorm or RMSNorm-S, pre-norm, RoPE) and the transformers Llama family with plain
RMSNorm blocks (Llama, Mistral, Qwen2, Qwen3 — whose q/k norms act per head, after the projections); anything else
(LayerNorm, post-norm, Gemma's sandwich norms, learned positions added to the residual) is refused in one line.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError

QUAROT_SEED = (
    0  # the residual rotation's signs: fixed, so a rotated cell is reproducible (recorded as rotate=quarot)
)


@dataclass
class _Block:
    attn_norm: nn.Module
    attn_readers: list[nn.Linear]  # q, k, v (and a gate) read the attention norm's output
    attn_writer: nn.Linear  # o_proj writes into the residual
    mlp_norm: nn.Module
    mlp_readers: list[nn.Linear]  # gate, up
    mlp_writer: nn.Linear  # down_proj


@dataclass
class _Layout:
    embedding: nn.Embedding
    blocks: list[_Block]
    final_norm: nn.Module
    head: nn.Linear
    online: list[str] = field(
        default_factory=list
    )  # layer names that take an online Hadamard (o_proj, down_proj)
    untie: Any = None  # a callable that gives the head its own weight (tied models)


def _refuse(model: nn.Module, why: str) -> UserError:
    return UserError(
        f"rotate=quarot: {type(model).__name__} {why}; QuaRot's rotation needs a pre-norm RMSNorm transformer "
        "(qbench's Llama-style models; transformers' Llama, Mistral, Qwen2, Qwen3)"
    )


def _ours(model: nn.Module) -> _Layout:
    from models.transformer import RMSNorm, Transformer

    assert isinstance(model, Transformer)
    c = model.config
    if c.norm not in ("rmsnorm", "rmsnorm_single") or c.norm_position != "pre":
        raise _refuse(
            model, f"has {c.norm_position}-{c.norm} blocks (LayerNorm is not invariant to rotation)"
        )
    if c.family != "llama" or "wpe" in model.transformer:
        raise _refuse(model, f"is {c.family}-style (fused q/k/v, learned positions added to the residual)")
    if c.emb_proj or c.head_proj:
        raise _refuse(model, "still holds OSP's projections (evaluate the merged model)")
    blocks = []
    names = []
    for i, b in enumerate(model.transformer.h):
        assert isinstance(b.ln_1, RMSNorm) and isinstance(b.ln_2, RMSNorm)
        readers = [
            b.attn.q_proj,
            b.attn.k_proj,
            b.attn.v_proj,
            *([b.attn.g_proj] if b.attn.gate != "none" else []),
        ]
        blocks.append(
            _Block(b.ln_1, readers, b.attn.c_proj, b.ln_2, [b.mlp.gate_proj, b.mlp.up_proj], b.mlp.down_proj)
        )
        names += [f"transformer.h.{i}.attn.c_proj", f"transformer.h.{i}.mlp.down_proj"]

    def untie() -> None:
        model.config = c.replace(tie_embeddings=False)  # tie_weights() must not tie them again
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())

    return _Layout(
        model.transformer.wte,
        blocks,
        model.transformer.ln_f,
        model.lm_head,
        names,
        untie if c.tie_embeddings else None,
    )


def _transformers(model: nn.Module) -> _Layout:
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in ("llama", "mistral", "qwen2", "qwen3"):
        raise _refuse(model, f"(model_type {family!r}) is not a family qbench rotates")
    if getattr(config, "qbench_gate", None):
        raise _refuse(model, "is a gated export (the gate sits inside q_proj)")
    inner = model.model
    blocks, names = [], []
    for i, layer in enumerate(inner.layers):
        a, m = layer.self_attn, layer.mlp
        if not type(layer.input_layernorm).__name__.endswith("RMSNorm"):
            raise _refuse(model, f"layer {i} norm is {type(layer.input_layernorm).__name__}")
        blocks.append(
            _Block(layer.input_layernorm, [a.q_proj, a.k_proj, a.v_proj], a.o_proj, layer.post_attention_layernorm,
                   [m.gate_proj, m.up_proj], m.down_proj)
        )  # fmt: skip
        names += [f"model.layers.{i}.self_attn.o_proj", f"model.layers.{i}.mlp.down_proj"]
    tied = model.lm_head.weight is inner.embed_tokens.weight

    def untie() -> None:
        config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())

    return _Layout(inner.embed_tokens, blocks, inner.norm, model.lm_head, names, untie if tied else None)


def _layout(model: nn.Module) -> _Layout:
    from models.transformer import Transformer

    if isinstance(model, Transformer):
        return _ours(model)
    if (
        hasattr(model, "model")
        and hasattr(getattr(model, "model", None), "layers")
        and hasattr(model, "lm_head")
    ):
        return _transformers(model)
    raise _refuse(model, "has no layout qbench knows")


def residual_rotation(dim: int, seed: int = QUAROT_SEED) -> Tensor:
    """Q (dim × dim, float64, orthogonal): the residual stream's rotation, x ↦ x Q. The seeded Hadamard rotation
    is built in float32; re-orthonormalised in float64 (QR, signs kept) so the rewritten weights carry no float32
    departure from orthogonality (~1e-7) into the invariance."""
    from qbench.quant.fake import HadamardRotation

    q, r = torch.linalg.qr(HadamardRotation(dim, seed=seed).matrix().double().t())
    return q * torch.sign(torch.diagonal(r))


def _fold(norm: nn.Module, readers: list[nn.Linear]) -> None:
    """W ← W · diag(g) for every reader of ``norm``'s output, then g ← 1 (a one-element gain folds as a scalar)."""
    g = norm.weight.detach().double()
    for layer in readers:
        w = (
            layer.weight.detach().double() * g
        )  # broadcasts over output rows: columns scaled by g (or by the scalar)
        layer.weight.data.copy_(w.to(layer.weight.dtype))
    norm.weight.data.fill_(1.0)


def _read_rotated(layer: nn.Linear, q: Tensor) -> None:
    """A layer reading the rotated residual x Q: y = x Wᵀ = (x Q)(W Q)ᵀ, so W ← W Q."""
    layer.weight.data.copy_((layer.weight.detach().double() @ q).to(layer.weight.dtype))


def _write_rotated(layer: nn.Linear, q: Tensor) -> None:
    """A layer writing into the rotated residual: y Q = x (Qᵀ W)ᵀ, so W ← Qᵀ W and b ← b Q."""
    layer.weight.data.copy_((q.t() @ layer.weight.detach().double()).to(layer.weight.dtype))
    if layer.bias is not None:
        layer.bias.data.copy_((layer.bias.detach().double() @ q).to(layer.bias.dtype))


@torch.no_grad()
def rotate(model: nn.Module, seed: int = QUAROT_SEED) -> tuple[nn.Module, list[str]]:
    """(a rotated deep copy of ``model`` computing the same function, the names of the layers that take an online
    Hadamard rotation of their input: o_proj and down_proj). ``model`` itself is not modified."""
    layout = _layout(model)  # refuse before copying
    rotated = copy.deepcopy(model)
    layout = _layout(rotated)
    if layout.untie is not None:
        layout.untie()
        layout = _layout(rotated)
    dim = layout.embedding.weight.shape[1]
    q = residual_rotation(dim, seed).to(layout.embedding.weight.device)
    for block in layout.blocks:
        _fold(block.attn_norm, block.attn_readers)
        _fold(block.mlp_norm, block.mlp_readers)
        for layer in (*block.attn_readers, *block.mlp_readers):
            _read_rotated(layer, q)
        for layer in (block.attn_writer, block.mlp_writer):
            _write_rotated(layer, q)
    _fold(layout.final_norm, [layout.head])
    _read_rotated(layout.head, q)
    e = layout.embedding.weight
    e.data.copy_((e.detach().double() @ q).to(e.dtype))
    return rotated, layout.online


__all__ = ["QUAROT_SEED", "residual_rotation", "rotate"]
