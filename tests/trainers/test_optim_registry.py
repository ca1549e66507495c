"""Optimisers by name: the ablation set, did-you-mean errors, nanoGPT's weight-decay groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.errors import UserError
from trainers.optim import OPTIMIZERS, OrthoAdam, build_optimizer, param_groups


def model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 4))


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("adamw", torch.optim.AdamW),
        ("orthoadam", OrthoAdam),
        ("rmsprop", torch.optim.RMSprop),
        ("sgd", torch.optim.SGD),
        ("sgd-momentum", torch.optim.SGD),
    ],
)
def test_every_ablation_optimiser_builds_and_steps(name, cls):
    net = model()
    opt = build_optimizer(name, param_groups(net, 0.1), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), seed=1)
    assert type(opt) is cls
    before = [p.detach().clone() for p in net.parameters()]
    net(torch.tensor([[1, 2, 3]])).square().mean().backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_hyperparameters_reach_the_optimiser():
    params = list(model().parameters())
    assert build_optimizer("sgd-momentum", params, lr=0.5).param_groups[0]["momentum"] == 0.9
    assert build_optimizer("sgd", params, lr=0.5).param_groups[0]["momentum"] == 0
    assert build_optimizer("rmsprop", params, lr=1e-3, betas=(0.9, 0.95)).param_groups[0]["alpha"] == 0.95
    ortho = build_optimizer("ortho-adam", params, lr=1e-3, betas=(0.8, 0.9), seed=7, rotation="dense")
    group = ortho.param_groups[0]
    assert (group["betas"], group["seed"], group["rotation"]) == ((0.8, 0.9), 7, "dense")
    assert build_optimizer("adamw", params, lr=2e-3, weight_decay=0.3).param_groups[0]["weight_decay"] == 0.3


def test_unknown_name_is_a_did_you_mean_user_error():
    with pytest.raises(UserError, match=r"unknown optimizer 'ortoadam' \(did you mean 'orthoadam'\?\)"):
        build_optimizer("ortoadam", model().parameters(), lr=1e-3)
    assert set(OPTIMIZERS.names()) == {"adamw", "orthoadam", "rmsprop", "sgd", "sgd-momentum", "muon"}
    assert all(OPTIMIZERS.describe(name) for name in OPTIMIZERS)


def test_param_groups_decay_only_matrices():
    net = model()
    net[0].weight.requires_grad_(False)  # frozen: left out
    decay, no_decay = param_groups(net, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [tuple(p.shape) for p in decay["params"]] == [(4, 8)]
    assert [tuple(p.shape) for p in no_decay["params"]] == [(8,), (8,), (4,)]


def test_param_groups_list_a_tied_weight_once_and_drop_empty_groups():
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    groups = param_groups(nn.ModuleList([emb, head]), 0.1)
    assert len(groups) == 1 and len(groups[0]["params"]) == 1


def test_embedding_token_axis_is_not_rotated_but_its_channel_axis_is():
    import models
    from trainers.optim.orthoadam import OrthoAdam

    model = models.build(
        models.family_config("gpt2", n_layer=1, n_head=2, d_model=16, d_ff=32, context=8, vocab_size=64),
        seed=0,
    )
    groups = param_groups(model, 0.1)
    assert groups[0]["fixed_axes"] == (0,)
    assert {id(p) for p in groups[0]["params"]} == {
        id(model.transformer.wte.weight),
        id(model.transformer.wpe.weight),
    }
    opt = OrthoAdam(groups, lr=1e-3)
    rot = opt.rotation_for(model.transformer.wte.weight, opt.param_groups[0])
    assert rot.axes[0] is None and rot.axes[1] is not None
    # A gradient on one token's row stays on that row: rows (tokens) are not mixed, channels are.
    g = torch.zeros(64, 16)
    g[5] = torch.randn(16)
    rotated = rot.forward(g)
    assert rotated[torch.arange(64) != 5].abs().max() == 0 and (rotated[5] - g[5]).abs().max() > 1e-3


@pytest.mark.parametrize("transformers_layout", [False, True])
def test_an_untied_lm_head_keeps_its_token_axis_unrotated(transformers_layout):
    """Llama style: the head is an nn.Linear (vocab, d) of its own; its vocabulary axis is a token index too."""
    import models
    from models.hf import to_hf_model
    from trainers.optim.orthoadam import OrthoAdam

    config = models.family_config(
        "llama", n_layer=1, n_head=2, d_model=16, d_ff=32, context=8, vocab_size=64, tie_embeddings=False
    )
    model = models.build(config, seed=0)
    if transformers_layout:
        model = to_hf_model(model)
    head = model.get_output_embeddings() if transformers_layout else model.lm_head
    groups = param_groups(model, 0.1)
    assert any(p is head.weight for p in groups[0]["params"]) and groups[0]["fixed_axes"] == (0,)
    assert not any(p is head.weight for g in groups[1:] for p in g["params"])
    opt = OrthoAdam(groups, lr=1e-3)
    rot = opt.rotation_for(head.weight, opt.param_groups[0])
    assert rot.axes[0] is None and rot.axes[1] is not None
