"""Training recipes: the paper's variants and ablations as named model-switch overrides plus an optimiser.

A recipe changes only what it names; every other switch keeps the preset's value, so any recipe applies to
any preset (``vanilla`` on ``llama2-130m`` keeps its RMSNorm and RoPE). Explicit CLI switches (``--attn``,
``--norm``, ``--pos``, ``--optim``, ...) override the recipe.

The main variants (Kaul et al., ICLR 2025):

- ``vanilla``: softmax attention, AdamW — the baseline in which attention sinks and outliers appear;
- ``softmax1``: softmax-1 attention, AdamW — removes the attention sink;
- ``orthoadam``: softmax attention, OrthoAdam — rotates the optimiser's basis;
- ``softmax1-orthoadam``: both;
- ``paper``: softmax-1 + OrthoAdam + RMSNorm-S (one scalar norm gain) — the paper's full recipe; per-channel
  norm gains (LayerNorm, RMSNorm-M) reintroduce outlier channels.

The component ablations (the paper's Table 4) apply one change on top of ``softmax1-orthoadam`` (which keeps
the preset's norm, positions and biases — for the GPT-2 presets LayerNorm, learned positions, biases on):

- ``no-bias``: no biases in linear layers and norms;
- ``rmsnorm-m``: RMSNorm with a per-channel gain (Llama's);
- ``rmsnorm-s``: RMSNorm with a single scalar gain (equal to ``paper``; listed so the ablation table is complete);
- ``rope``: rotary position embeddings instead of learned absolute positions;
- ``no-pos``: no position information at all (NoPE; the causal mask alone orders tokens);
- ``rmsprop``, ``sgd``, ``sgd-momentum``: softmax-1 with that optimiser instead of OrthoAdam (the optimiser
  ablation: non-adaptive SGD does not create outlier channels; RMSProp's per-coordinate normalisation does).

Two further fixes from the literature, on top of ``vanilla`` (AdamW):

- ``attn-bias``: a learned per-head key/value bias, an always-visible extra key (Sun et al., Massive
  Activations: it gives heads a place to dump attention and removes massive activations in GPT-2);
- ``postnorm``: normalisation after the residual add instead of before the block ("The Spike, the Sparse and the
  Sink": moving the norm decouples massive activations from attention sinks).

Training-time remedies beyond the paper's recipe, each on top of ``vanilla`` and changing only what it names:

- ``muon``: the Muon optimiser on hidden matrices, AdamW on the rest (``trainers.optim.muon``);
- ``osp``: Outlier-Safe Pre-Training (Park et al. 2025): Muon + RMSNorm-S + the learnable embedding projection
  (merged into the embedding for evaluation and export);
- ``clipped-softmax``: clipped softmax attention (Bondarenko et al. 2023), γ = −12/T, ζ = 1 (the reference OPT script);
- ``gated-attn``: an element-wise sigmoid gate on the attention output (Qiu et al. 2025, their best variant:
  G1, element-wise);
- ``softpick``: softpick attention (Zuhri et al. 2025);
- ``sink-logit``: a learned per-head sink logit (gpt-oss), softmax-1 at initialisation;

and ``paper+gate``: the paper's recipe plus a head-wise gate (one scalar per head, Bondarenko et al.'s
conditional gate).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from models.registry import Registry

MODEL_SWITCHES = ("attn", "norm", "norm_position", "pos", "bias", "gate", "emb_proj", "head_proj")


@dataclass(frozen=True)
class Recipe:
    """An optimiser name plus model switch overrides; ``None`` leaves the preset's value."""

    optim: str = "adamw"
    attn: str | None = None
    norm: str | None = None
    norm_position: str | None = None
    pos: str | None = None
    bias: bool | None = None
    gate: str | None = None
    emb_proj: bool | None = None
    head_proj: bool | None = None

    def model_switches(self) -> dict[str, Any]:
        """The switches this recipe sets, as ``ModelConfig`` field overrides."""
        return {name: getattr(self, name) for name in MODEL_SWITCHES if getattr(self, name) is not None}

    def replace(self, **changes: Any) -> Recipe:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


RECIPES: Registry[Recipe] = Registry("recipe")

_VANILLA = Recipe(optim="adamw", attn="softmax")
_S1_ORTHO = Recipe(optim="orthoadam", attn="softmax1")

RECIPES.register("vanilla", _VANILLA, "softmax attention + AdamW (the baseline)", aliases=("baseline",))
RECIPES.register("softmax1", Recipe(optim="adamw", attn="softmax1"), "softmax-1 attention + AdamW")
RECIPES.register("orthoadam", Recipe(optim="orthoadam", attn="softmax"), "softmax attention + OrthoAdam")
RECIPES.register("softmax1-orthoadam", _S1_ORTHO, "softmax-1 + OrthoAdam (preset's norm)")
RECIPES.register(
    "paper",
    _S1_ORTHO.replace(norm="rmsnorm_single"),
    "softmax-1 + OrthoAdam + RMSNorm-S: the paper's full recipe",
    aliases=("full",),
)

# Table-4 ablations: one change on top of softmax1-orthoadam.
_ABLATIONS: dict[str, tuple[dict[str, Any], str]] = {
    "no-bias": (dict(bias=False), "softmax1-orthoadam without biases"),
    "rmsnorm-m": (dict(norm="rmsnorm"), "softmax1-orthoadam with RMSNorm-M (per-channel gain)"),
    "rmsnorm-s": (dict(norm="rmsnorm_single"), "softmax1-orthoadam with RMSNorm-S (scalar gain) = paper"),
    "rope": (dict(pos="rope"), "softmax1-orthoadam with rotary position embeddings"),
    "no-pos": (dict(pos="none"), "softmax1-orthoadam without position embeddings (NoPE)"),
    "rmsprop": (dict(optim="rmsprop"), "softmax-1 with RMSProp instead of OrthoAdam"),
    "sgd": (dict(optim="sgd"), "softmax-1 with SGD (no momentum) instead of OrthoAdam"),
    "sgd-momentum": (dict(optim="sgd-momentum"), "softmax-1 with SGD + momentum 0.9 instead of OrthoAdam"),
}
for _name, (_changes, _description) in _ABLATIONS.items():
    RECIPES.register(_name, _S1_ORTHO.replace(**_changes), _description)

RECIPES.register(
    "attn-bias",
    _VANILLA.replace(attn="sink"),
    "learned per-head key/value bias (an always-visible sink key) + AdamW",
    aliases=("sink",),
)
RECIPES.register(
    "postnorm", _VANILLA.replace(norm_position="post"), "post-norm blocks + AdamW", aliases=("post-norm",)
)


_REMEDIES: dict[str, tuple[dict[str, Any], str]] = {
    "muon": (
        dict(optim="muon"),
        "Muon on hidden matrices + AdamW on embeddings, head, norms, biases; softmax attention",
    ),
    "osp": (
        dict(optim="muon", norm="rmsnorm_single", emb_proj=True, head_proj=True),
        "Outlier-Safe Pre-Training: Muon + RMSNorm-S + learnable projections after the embedding and before the "
        "head (orthogonal at init, merged for evaluation)",
    ),
    # OSP's ablation (Park et al. 2025): what each part does
    "muon+ssnorm": (
        dict(optim="muon", norm="rmsnorm_single"),
        "OSP without its projections: Muon + RMSNorm-S",
    ),
    "osp-input-only": (
        dict(optim="muon", norm="rmsnorm_single", emb_proj=True),
        "OSP with the embedding projection only (no projection before the head)",
    ),
    "clipped-softmax": (
        dict(attn="clipped"),
        "clipped softmax attention (gamma = -12/T, zeta = 1: the reference OPT script) + AdamW",
    ),
    "gated-attn": (dict(gate="elementwise"), "element-wise sigmoid gate on the attention output + AdamW"),
    "softpick": (dict(attn="softpick"), "softpick attention, ReLU(e^x - 1) / sum |e^x - 1| + AdamW"),
    "sink-logit": (dict(attn="sink-logit"), "a learned per-head sink logit (gpt-oss) + AdamW"),
}
for _name, (_changes, _description) in _REMEDIES.items():
    RECIPES.register(_name, _VANILLA.replace(**_changes), _description)
RECIPES.register(
    "paper+gate",
    RECIPES.get("paper").replace(gate="headwise"),
    "the paper's recipe + a head-wise sigmoid gate on the attention output",
)


def get_recipe(name: str) -> Recipe:
    """The recipe registered as ``name`` (or an alias); a did-you-mean UserError otherwise."""
    return RECIPES.get(name)
