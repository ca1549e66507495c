"""Optimisers by name, for the paper's optimiser ablation: AdamW, OrthoAdam, RMSProp, SGD, SGD with momentum.

Every entry is built by ``build_optimizer(name, params_or_groups, lr, weight_decay, betas, seed)``. The ablations
are torch's own classes. Weight decay: AdamW and OrthoAdam decay decoupled (θ ← θ(1 − lr·wd)); torch's RMSprop and
SGD add wd·θ to the gradient (L2). For plain SGD the two are the same update; with momentum or RMSprop's
normalisation they differ — what torch calls weight_decay is what these entries do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from models.registry import Registry

if TYPE_CHECKING:  # torch is imported by the factories, not here: `qbench ls optimizers` lists names only
    import torch
    from torch import Tensor, nn

Params = Iterable["Tensor"] | Iterable[dict[str, Any]]
OptimizerFactory = Callable[..., "torch.optim.Optimizer"]


def _adamw(params: Params, lr: float, weight_decay: float, betas: tuple[float, float], seed: int, **kw: Any):
    import torch

    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, **kw)


def _orthoadam(
    params: Params, lr: float, weight_decay: float, betas: tuple[float, float], seed: int, **kw: Any
):
    from trainers.optim.orthoadam import OrthoAdam

    return OrthoAdam(params, lr=lr, betas=betas, weight_decay=weight_decay, seed=seed, **kw)


def _rmsprop(
    params: Params, lr: float, weight_decay: float, betas: tuple[float, float], seed: int, **kw: Any
):
    import torch

    # RMSProp's squared-gradient average plays the role of Adam's second moment, so it takes β2 as its decay.
    return torch.optim.RMSprop(params, lr=lr, alpha=betas[1], weight_decay=weight_decay, **kw)


def _sgd(params: Params, lr: float, weight_decay: float, betas: tuple[float, float], seed: int, **kw: Any):
    import torch

    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, **kw)


def _sgd_momentum(
    params: Params, lr: float, weight_decay: float, betas: tuple[float, float], seed: int, **kw
):
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, **kw)


def _muon(params: Params, lr: float, weight_decay: float, betas: tuple[float, float], seed: int, **kw: Any):
    from trainers.optim.muon import MuonAdamW

    return MuonAdamW(list(params), lr=lr, weight_decay=weight_decay, betas=betas, **kw)


OPTIMIZERS: Registry[OptimizerFactory] = Registry("optimizer")
OPTIMIZERS.register("adamw", _adamw, "torch.optim.AdamW (decoupled weight decay)")
OPTIMIZERS.register(
    "orthoadam",
    _orthoadam,
    "OrthoAdam: AdamW on randomly rotated gradients (randomised Hadamard per axis)",
    aliases=("ortho-adam", "ortho_adam"),
)
OPTIMIZERS.register("rmsprop", _rmsprop, "torch.optim.RMSprop, alpha = beta2, L2 weight decay")
OPTIMIZERS.register("sgd", _sgd, "torch.optim.SGD, no momentum, L2 weight decay")
OPTIMIZERS.register(
    "sgd-momentum",
    _sgd_momentum,
    "torch.optim.SGD with momentum 0.9, L2 weight decay",
    aliases=("sgdm", "sgd_momentum"),
)
OPTIMIZERS.register(
    "muon",
    _muon,
    "torch.optim.Muon on hidden matrices (adjust_lr_fn=match_rms_adamw) + AdamW on embeddings, head, norms, biases",
)


def optimizer_param_groups(name: str, model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The parameter groups the optimiser ``name`` is built over: Muon's split (:func:`muon_param_groups`) for
    ``muon``, nanoGPT's weight-decay groups (:func:`param_groups`) for every other."""
    if OPTIMIZERS.canonical(name) == "muon":
        from trainers.optim.muon import muon_param_groups

        return muon_param_groups(model, weight_decay)
    return param_groups(model, weight_decay)


def optimizer_settings(name: str) -> dict[str, Any]:
    """Fixed hyper-parameters of ``name`` beyond lr / weight decay / betas, for a run's provenance."""
    if OPTIMIZERS.canonical(name) != "muon":
        return {}
    from trainers.optim.muon import MUON_SETTINGS

    return dict(MUON_SETTINGS)


def build_optimizer(
    name: str,
    params_or_groups: Params,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    seed: int = 0,
    **options: Any,
) -> torch.optim.Optimizer:
    """The optimiser registered as ``name`` (or an alias); a did-you-mean UserError for an unknown name.

    ``seed`` only matters for OrthoAdam (its rotations); ``betas`` are ignored by SGD. ``options`` go to the
    constructor unchanged (e.g. ``rotation="dense"`` for OrthoAdam). A group's own ``weight_decay`` (see
    :func:`param_groups`) overrides the ``weight_decay`` argument, as in torch.
    """
    return OPTIMIZERS.get(name)(params_or_groups, lr, weight_decay, tuple(betas), seed, **options)


def output_embedding(model: nn.Module) -> nn.Module | None:
    """The LM head (vocab, d) of our models (``lm_head``) or of a transformers model (``get_output_embeddings``)."""
    from torch import nn

    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(model, "lm_head", None)
    return head if isinstance(getattr(head, "weight", None), nn.Parameter) else None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's convention: weight decay on parameters with ≥ 2 dims (matmul weights, embeddings), none on
    biases, norm gains and scalars. Frozen parameters are left out; a tied weight appears once. Empty groups are
    dropped. The order is the model's parameter order within each group (OrthoAdam seeds by it).

    Embedding tables — input embeddings (``nn.Embedding`` weights) and the output embedding, the LM head, whether
    tied or not (an untied Llama-style head is an ``nn.Linear`` of shape (vocab, d)) — form their own group with
    ``fixed_axes=(0,)``: OrthoAdam rotates their hidden-channel axis but not their token axis. The token axis is
    a lookup index, not a basis of the hidden state, and rotating it mixes the second moments of frequent and
    rare tokens: measured here on the tiny preset, rotating it raised validation perplexity after 100 steps from
    579 to 740 (plain AdamW: 565); the outliers OrthoAdam targets live in the channel axis.
    """
    from torch import nn

    params = [p for p in model.parameters() if p.requires_grad]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = output_embedding(model)
    if head is not None:
        embeddings.add(id(head.weight))
    groups = [
        {
            "params": [p for p in params if id(p) in embeddings],
            "weight_decay": weight_decay,
            "fixed_axes": (0,),
        },
        {
            "params": [p for p in params if p.dim() >= 2 and id(p) not in embeddings],
            "weight_decay": weight_decay,
        },
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
