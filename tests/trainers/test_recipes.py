"""Recipes: each is a valid override set for every preset; explicit switches win; ablations change one thing."""

from __future__ import annotations

import dataclasses

import pytest

from models.config import PRESETS
from models.errors import UserError
from trainers.loop import TrainConfig
from trainers.recipes import RECIPES, Recipe, get_recipe

ABLATIONS = ("no-bias", "rmsnorm-m", "rmsnorm-s", "rope", "no-pos", "rmsprop", "sgd", "sgd-momentum")


def changed_fields(a: Recipe, b: Recipe) -> set[str]:
    return {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


def test_each_recipe_changes_a_preset_exactly_where_its_switches_say():
    """What differs between recipes: on a GPT-2 and a Llama preset, a recipe's model differs from the preset's
    own config in exactly the switches the recipe sets to another value (and nowhere else: sizes, context,
    tokenizer untouched), and its optimiser is registered. Every other preset builds with every recipe."""
    for preset in ("tiny", "llama2-130m"):
        base = PRESETS.get(preset).config
        for recipe in RECIPES.names():
            model = TrainConfig(preset=preset, recipe=recipe).model_config()
            switches = get_recipe(recipe).model_switches()
            differs = {
                f.name for f in dataclasses.fields(model) if getattr(model, f.name) != getattr(base, f.name)
            }
            assert differs == {k for k, v in switches.items() if getattr(base, k) != v}, (preset, recipe)
            assert TrainConfig(preset=preset, recipe=recipe).optimizer == get_recipe(recipe).optim
    for preset in PRESETS.names():
        for recipe in RECIPES.names():
            TrainConfig(preset=preset, recipe=recipe).model_config()  # validates every combination


def test_main_variants():
    expect = {
        "vanilla": ("softmax", "adamw"),
        "softmax1": ("softmax1", "adamw"),
        "orthoadam": ("softmax", "orthoadam"),
        "softmax1-orthoadam": ("softmax1", "orthoadam"),
        "paper": ("softmax1", "orthoadam"),
        "attn-bias": ("sink", "adamw"),
        "postnorm": ("softmax", "adamw"),
    }
    for name, (attn, optim) in expect.items():
        assert (get_recipe(name).attn, get_recipe(name).optim) == (attn, optim), name
    assert get_recipe("paper").norm == "rmsnorm_single" and get_recipe("softmax1-orthoadam").norm is None
    assert get_recipe("postnorm").norm_position == "post"


@pytest.mark.parametrize("name", ABLATIONS)
def test_ablations_change_one_thing_on_top_of_softmax1_orthoadam(name):
    assert len(changed_fields(get_recipe(name), get_recipe("softmax1-orthoadam"))) == 1


def test_recipe_keeps_the_preset_defaults_it_does_not_name():
    llama = TrainConfig(preset="llama2-130m", recipe="vanilla").model_config()
    assert (llama.norm, llama.pos, llama.bias, llama.attn) == ("rmsnorm", "rope", False, "softmax")
    gpt2 = TrainConfig(preset="tiny", recipe="rope").model_config()
    assert (gpt2.norm, gpt2.pos, gpt2.attn) == ("layernorm", "rope", "softmax1")


def test_explicit_switches_override_the_recipe():
    cfg = TrainConfig(recipe="paper", switches={"norm": "layernorm", "attn": "sink"}, optim="sgd")
    model = cfg.model_config()
    assert (model.norm, model.attn, cfg.optimizer) == ("layernorm", "sink", "sgd")
    assert TrainConfig(recipe="paper", context=64).model_config().context == 64


def test_unknown_names_suggest_the_closest():
    with pytest.raises(UserError, match=r"unknown recipe 'papr' \(did you mean 'paper'\?\)"):
        get_recipe("papr")
    with pytest.raises(UserError, match="did you mean 'sgd-momentum'"):
        TrainConfig(optim="sgd-momentun")
    assert get_recipe("baseline") == get_recipe("vanilla")  # aliases


REMEDIES = {
    "muon": dict(optim="muon"),
    "osp": dict(optim="muon", norm="rmsnorm_single", emb_proj=True, head_proj=True),
    "muon+ssnorm": dict(optim="muon", norm="rmsnorm_single"),
    "osp-input-only": dict(optim="muon", norm="rmsnorm_single", emb_proj=True),
    "clipped-softmax": dict(attn="clipped"),
    "gated-attn": dict(gate="elementwise"),
    "softpick": dict(attn="softpick"),
    "sink-logit": dict(attn="sink-logit"),
}


@pytest.mark.parametrize("name", [*REMEDIES, "paper+gate"])
def test_remedies_change_only_what_they_name_and_learn(name):
    import torch

    from models import build
    from trainers.optim import build_optimizer, optimizer_param_groups

    base, expected = (get_recipe("paper"), dict(gate="headwise")) if name == "paper+gate" else (
        get_recipe("vanilla"), REMEDIES[name])  # fmt: skip
    assert changed_fields(get_recipe(name), base) == set(expected)
    assert all(getattr(get_recipe(name), k) == v for k, v in expected.items())
    # a micro model of the recipe overfits one batch: the loss falls within a few steps
    cfg = TrainConfig(
        recipe=name, switches=dict(n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=97), context=16
    )
    model = build(cfg.model_config(), seed=0)
    opt = build_optimizer(cfg.optimizer, optimizer_param_groups(cfg.optimizer, model, 0.0), lr=3e-3, seed=0)
    x = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
