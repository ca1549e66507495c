"""What qbench needs from any causal LM — ours or a transformers model, float or quantised.

Three things: logits for a batch of token ids, the list of decoder blocks (whose outputs are the residual
stream), and a way to record block outputs and attention probabilities. Our models answer through
``models.observe``; transformers models through forward hooks on their decoder layers — never
``output_hidden_states``, whose last entry is taken after the final norm — and an eager attention
implementation for the probabilities (``softmax1_eager`` for softmax-1 exports, which must not silently turn
into ordinary softmax).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from models.errors import UserError
from models.hf import GATED_PREFIX, REMEDY_IMPLEMENTATIONS, SOFTMAX1, SOFTMAX1_EAGER, ungated
from models.observe import EveryLayer, Observation, observe
from models.transformer import Transformer


def is_ours(model: nn.Module) -> bool:
    return isinstance(model, Transformer)


def logits(model: nn.Module, input_ids: Tensor) -> Tensor:
    """(B, T, V) logits of either kind of model."""
    if is_ours(model):
        return model(input_ids)
    return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits


# Config fields that hold the longest sequence a model was built for (MPT: max_seq_len sizes its ALiBi table).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len")


def context_length(model: nn.Module, window: int | None = None) -> int:
    """The longest window ``model`` can score: its config's context length; for a config without one (Bloom:
    ALiBi, no position table) the caller's ``window`` (``--window``), or a one-line error asking for it."""
    if is_ours(model):
        return model.config.context
    config = model.config
    for key in CONTEXT_KEYS:
        if getattr(config, key, None):
            return int(getattr(config, key))
    if window is not None:  # no limit in the config (ALiBi): the user's window is the context
        return window
    raise UserError(
        f"cannot tell the context length of {type(model).__name__}: its config has none of "
        f"{', '.join(CONTEXT_KEYS)}; give the evaluation window with --window"
    )


# lm-evaluation-harness's HFLM scores windows of at most 2,048 tokens unless told otherwise; so does qbench.
# Why a cap: a window's logits are T x vocabulary floats and an eager attention map T^2 per head, so a long
# context (SmolLM2: 8,192, vocabulary 49,152) costs 1.6 GB of logits per window and 2.4 GB per attention map.
MAX_DEFAULT_WINDOW = 2048


def default_window(
    model: nn.Module, window: int | None = None, tokens: int = 0, sample: str | None = None
) -> int:
    """The evaluation window: ``window`` when given (``--window``), else the model's context, at most
    :data:`MAX_DEFAULT_WINDOW`, and under the documents sample of a ``tokens`` budget at most tokens/16
    (``qbench.eval.sampling.default_window``: the rule ``qbench.eval.metrics.make_windows`` applies)."""
    from qbench.eval.sampling import FIRST
    from qbench.eval.sampling import default_window as sampled

    if window is not None:
        return window
    return sampled(tokens, context_length(model), sample or FIRST)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks in order: ours ``transformer.h``; transformers' the ModuleList of
    ``num_hidden_layers`` blocks (``model.layers`` in Llama-likes, ``transformer.h`` in GPT-2)."""
    if is_ours(model):
        return list(model.transformer.h)
    n = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer", None)
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return list(module)
    raise UserError(
        f"cannot find the {n} decoder layers of {type(model).__name__}: not a supported causal LM layout"
    )


def _block_output(output: Tensor | tuple) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def _eager_attention(model: nn.Module) -> Iterator[None]:
    """Temporarily switch a transformers model to an attention implementation that returns probabilities."""
    current = model.config._attn_implementation
    gated, inner = ungated(current or "sdpa")  # a gated export keeps its gate around the eager base
    # The remedies' attention functions (clipped softmax, softpick, sink logit) are explicit already.
    explicit = (SOFTMAX1_EAGER, "eager", *REMEDY_IMPLEMENTATIONS)
    eager = SOFTMAX1_EAGER if inner == SOFTMAX1 else inner if inner in explicit else "eager"
    if inner not in (SOFTMAX1, "sdpa", *explicit):
        raise UserError(f"attention implementation {current!r} has no eager equivalent for attention metrics")
    model.set_attn_implementation(GATED_PREFIX + eager if gated else eager)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


@contextmanager
def observe_any(model: nn.Module, attention: bool = False) -> Iterator[Observation]:
    """``models.observe`` for any model; run the forward pass with :func:`forward_observed`."""
    if is_ours(model):
        with observe(model, hidden=True, attention=attention) as obs:
            yield obs
        return
    obs = Observation()
    layers = decoder_layers(model)
    ran = EveryLayer(model, list(range(len(layers))), "recording decoder-layer outputs", SUPPORTED_LAYOUTS)
    handles = [layer.register_forward_hook(_record_hidden(obs, ran, i)) for i, layer in enumerate(layers)]
    handles.extend(ran.attach(model))
    try:
        if attention:
            with _eager_attention(model):
                model._qbench_want_attentions = True
                yield obs
        else:
            yield obs
    finally:
        model.__dict__.pop("_qbench_want_attentions", None)
        for handle in handles:
            handle.remove()


SUPPORTED_LAYOUTS = (
    "qbench models and transformers causal LMs whose num_hidden_layers decoder layers form one ModuleList"
)


def _record_hidden(obs: Observation, ran: EveryLayer, index: int):
    def record(_module: nn.Module, _args: tuple, output: Tensor | tuple) -> None:
        ran.hit(index)
        obs.hidden.append(_block_output(output).detach())

    return record


def attention_modules(model: nn.Module) -> list[nn.Module] | None:
    """Each decoder layer's self-attention module (its direct child named ``self_attn``, ``attn`` or
    ``attention``), or None when some layer has none of them."""
    found = []
    for layer in decoder_layers(model):
        children = dict(layer.named_children())
        module = next((children[n] for n in ("self_attn", "attn", "attention") if n in children), None)
        if module is None:
            return None
        found.append(module)
    return found


def forward_observed(model: nn.Module, input_ids: Tensor, obs: Observation) -> Tensor:
    """Forward pass inside :func:`observe_any`; for transformers models, collects attention probabilities.

    Each layer's (B, nh, T, T) map is handed to ``obs.attention`` by a hook on its attention module the
    moment the module returns it, so a consumer that reduces maps as they arrive (``outlier_metrics``) holds
    one layer's map at a time. Why not ``output_attentions=True``: transformers then keeps every layer's map
    until the forward pass ends — 30 layers x 9 heads x 8,192^2 float32 is 72 GB for SmolLM2-135M's context.
    """
    if is_ours(model) or not getattr(model, "_qbench_want_attentions", False):
        return logits(model, input_ids)
    n = len(decoder_layers(model))
    modules = attention_modules(model)
    if modules is None:  # no attention module to hook: ask transformers for the maps, all held at once
        out = model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            use_cache=False,
            output_attentions=True,
        )
        maps = list(out.attentions or ())
        got = [a for a in maps if a is not None]
        if len(maps) != n or len(got) != n:
            _missing_attention(model, len(got), n)
        obs.attention.extend(a.detach() for a in got)
        return out.logits
    seen = [0]

    def take(_module: nn.Module, _args: tuple, output: Tensor | tuple) -> None:
        probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if isinstance(probs, Tensor) and probs.dim() == 4:
            seen[0] += 1
            obs.attention.append(probs.detach())

    handles = [module.register_forward_hook(take) for module in modules]
    try:
        out = logits(model, input_ids)
    finally:
        for handle in handles:
            handle.remove()
    if seen[0] != n:
        _missing_attention(model, seen[0], n)
    return out


def _missing_attention(model: nn.Module, got: int, n: int) -> None:
    raise UserError(
        f"{type(model).__name__} returned attention probabilities for {got} of its {n} layers: "
        f"attention metrics need an eager attention implementation that returns them in every layer "
        f"({SUPPORTED_LAYOUTS})"
    )


def first_parameter(model: nn.Module) -> torch.Tensor:
    return next(iter(model.parameters()))
