"""Parameter counts of a :class:`~models.config.ModelConfig` by arithmetic, without torch.

``qbench ls presets`` prints every preset's size, and building each preset on torch's 'meta' device
(:func:`models.transformer.count_parameters`, the authority) would make that listing import torch, seconds on a
small machine. The formula mirrors ``models.transformer``'s layers; tests/models/test_sizes.py checks it against
``count_parameters`` for every preset and every switch, so a new layer there that is missing here fails a test.
"""

from __future__ import annotations

from models.config import ModelConfig


def _norm(config: ModelConfig) -> int:
    d = config.d_model
    if config.norm == "layernorm":
        return d + (d if config.bias else 0)
    return 1 if config.norm == "rmsnorm_single" else d


def _attention(config: ModelConfig) -> int:
    d, kv = config.d_model, config.kv_heads * config.head_dim
    # q and the output d x d, k and v d x kv (kv = d without grouped-query attention; fused or not: the same count)
    n = 2 * d * d + 2 * d * kv + ((2 * d + 2 * kv) if config.bias else 0)
    if config.attn == "sink":
        n += 2 * config.n_head * config.head_dim  # the learned sink key and value per head
    if config.attn == "sink-logit":
        n += config.n_head  # one learned logit per head
    if config.gate != "none":  # a sigmoid gate from the block input, with a bias: one per head or per channel
        out = config.n_head if config.gate == "headwise" else d
        n += d * out + out
    return n


def _mlp(config: ModelConfig) -> int:
    d, f = config.d_model, config.d_ff
    if config.mlp == "swiglu":  # gate, up, down
        return 3 * d * f + ((2 * f + d) if config.bias else 0)
    return 2 * d * f + ((f + d) if config.bias else 0)


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameters, as :func:`models.transformer.count_parameters` counts them: tied weights
    once; non-embedding leaves out the token and position embeddings and an untied head."""
    block = 2 * _norm(config) + _attention(config) + _mlp(config)
    token = config.vocab_size * config.d_model
    position = config.context * config.d_model if config.pos == "learned" else 0
    head = 0 if config.tie_embeddings else token
    final_norm = _norm(config) if config.norm_position == "pre" else 0  # post-norm blocks already end in one
    # OSP's projections after the token embedding and before the head
    osp = config.d_model**2 * (int(config.emb_proj) + int(config.head_proj))
    total = token + position + config.n_layer * block + final_norm + head + osp
    return total, total - token - position - head
