"""Muon + AdamW: which parameter lands in which group, the combined optimiser steps and resumes exactly, the
remedy recipes train on a micro model."""

from __future__ import annotations

import json

import pytest
import torch

from models import UserError, build, family_config
from trainers.loop import train
from trainers.optim import MuonAdamW, build_optimizer, muon_param_groups, optimizer_param_groups

from .helpers import micro_cfg, read_metrics
from .test_resume import assert_bit_identical


def names_by_group(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["use_muon"], g["weight_decay"], sorted(names[id(p)] for p in g["params"])) for g in groups]


def test_muon_groups_are_exactly_the_hidden_matrices():
    config = family_config(
        "llama", n_layer=1, n_head=2, d_model=16, d_ff=32, context=8, vocab_size=64, gate="headwise",
        emb_proj=True, attn="sink-logit", norm="rmsnorm_single",
    )  # fmt: skip
    model = build(config, seed=0)
    groups = names_by_group(model, muon_param_groups(model, 0.1))
    block = "transformer.h.0."
    assert groups == [
        (
            True,
            0.1,
            sorted(
                [f"{block}attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "c_proj", "g_proj")]
                + [f"{block}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
                + ["transformer.emb_proj.weight"]
            ),
        ),
        (False, 0.1, ["lm_head.weight", "transformer.wte.weight"]),
        (
            False,
            0.0,
            sorted(
                [f"{block}{n}" for n in ("attn.sinks", "attn.g_proj.bias", "ln_1.weight", "ln_2.weight")]
                + ["transformer.ln_f.weight"]
            ),
        ),
    ]
    # GPT-2 style: tied head (listed once, as the embedding), learned positions, biases, the learned sink's vectors
    gpt2 = build(
        family_config("gpt2", n_layer=1, n_head=2, d_model=16, d_ff=32, context=8, vocab_size=64, attn="sink")
    )
    gpt2_groups = muon_param_groups(gpt2, 0.1)
    muon, fused, adam_decay, adam_plain = names_by_group(gpt2, gpt2_groups)
    assert muon[2] == sorted(f"{block}{n}.weight" for n in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    # the fused q/k/v is Muon's too, orthogonalised as three blocks
    assert fused[:2] == (True, 0.1) and fused[2] == [f"{block}attn.c_attn.weight"]
    assert gpt2_groups[1]["blocks"] == 3
    assert adam_decay[2] == sorted(
        ["transformer.wte.weight", "transformer.wpe.weight", f"{block}attn.sink_k", f"{block}attn.sink_v"]
    )
    assert all(n.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) for n in adam_plain[2])
    assert optimizer_param_groups("adamw", gpt2, 0.1)[0].get("use_muon") is None


def test_combined_optimizer_steps_both_halves_with_the_named_lr_adjustment():
    model = build(
        family_config("llama", n_layer=1, n_head=2, d_model=16, d_ff=32, context=8, vocab_size=64), seed=0
    )
    opt = build_optimizer("muon", muon_param_groups(model, 0.1), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    assert isinstance(opt, MuonAdamW)
    muon_group, *adam_groups = opt.param_groups
    assert muon_group["adjust_lr_fn"] == "match_rms_adamw" and muon_group["momentum"] == 0.95
    assert all(g["betas"] == (0.9, 0.95) for g in adam_groups)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randint(0, 64, (2, 8))).square().mean().backward()
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert set(opt.state[model.lm_head.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[model.transformer.h[0].attn.q_proj.weight]) == {"momentum_buffer"}
    with pytest.raises(UserError, match="use_muon"):
        build_optimizer("muon", model.parameters(), lr=1e-2)


@pytest.fixture(scope="module")
def osp_run(corpus, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("osp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "qbench-cache"))
        cfg = micro_cfg(corpus, recipe="osp", steps=6, warmup=1, eval_every=6, probe_every=6, ckpt_every=6)
        train(cfg, out, progress=False)
    return cfg, out


def test_osp_recipe_trains_and_records_muon(osp_run):
    _, out = osp_run
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    meta = json.loads((out / "config.json").read_text())
    training = meta["provenance"]["training"]
    assert (
        training["optimizer"] == "muon"
        and training["optimizer_settings"]["adjust_lr_fn"] == "match_rms_adamw"
    )
    assert training["model"]["emb_proj"] and training["model"]["norm"] == "rmsnorm_single"


def test_muon_state_resumes_bit_identically(osp_run, tmp_path):
    cfg, whole = osp_run
    train(cfg, tmp_path, stop_at=2, progress=False)
    train(cfg, tmp_path, resume=True, progress=False)
    assert_bit_identical(whole, tmp_path)


def test_gate_and_embedding_projection_flags_override_the_recipe():
    from trainers.__main__ import build_parser, config_from_args

    args = vars(build_parser().parse_args(["--recipe", "osp", "--gate", "headwise", "--no-emb-proj"]))
    model = config_from_args(args).model_config()
    assert (model.gate, model.emb_proj, model.norm) == ("headwise", False, "rmsnorm_single")


def test_a_fused_qkv_steps_as_three_separate_projections_under_muon():
    """GPT-2's fused c_attn (3d × d) under BlockMuon = its q, k and v blocks as three separate parameters under
    plain torch.optim.Muon (the reference splits the matrix): same momentum, Newton–Schulz per block, the lr
    adjusted for a d × d matrix — over several steps, with weight decay."""
    from trainers.optim.muon import MUON_SETTINGS, BlockMuon

    torch.manual_seed(0)
    d = 16
    fused = torch.nn.Parameter(torch.randn(3 * d, d))
    parts = [torch.nn.Parameter(block.detach().clone()) for block in fused.detach().chunk(3, dim=0)]
    ours = BlockMuon([{"params": [fused], "blocks": 3}], lr=0.02, weight_decay=0.1, **MUON_SETTINGS)
    reference = torch.optim.Muon(parts, lr=0.02, weight_decay=0.1, **MUON_SETTINGS)
    for _ in range(4):
        grad = torch.randn(3 * d, d)
        fused.grad = grad.clone()
        for p, g in zip(parts, grad.chunk(3, dim=0), strict=True):
            p.grad = g.clone()
        ours.step()
        reference.step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in parts]), rtol=0, atol=0)
    # orthogonalised as one 3d × d matrix it would differ (the issue this fixes)
    whole = torch.nn.Parameter(torch.cat([p.detach() for p in parts]).clone())
    whole.grad = torch.randn(3 * d, d)
    split = torch.nn.Parameter(whole.detach().clone())
    split.grad = whole.grad.clone()
    torch.optim.Muon([whole], lr=0.02, **MUON_SETTINGS).step()
    BlockMuon([{"params": [split], "blocks": 3}], lr=0.02, **MUON_SETTINGS).step()
    assert not torch.allclose(whole, split)
