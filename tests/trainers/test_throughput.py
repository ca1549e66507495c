"""MFU bookkeeping (6·N + 12·L·d·T over a peak table), fused/foreach optimiser choice, --compile wiring."""

from __future__ import annotations

import pytest
import torch

from models import build, preset_config
from trainers import distributed, throughput
from trainers.__main__ import config_from_args
from trainers.loop import _start, optimizer_options

from .helpers import micro_cfg


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_flops_per_token_counts_every_linear_weight_once(family):
    preset = "tiny" if family == "gpt2" else "llama2-130m"
    cfg = preset_config(preset, n_layer=2, d_model=64, n_head=2, d_ff=96, context=16, vocab_size=512)
    model = build(cfg, seed=0)
    d, f, L, V, T = 64, 96, 2, 512, 16
    mlp = 2 * d * f if cfg.mlp == "gelu" else 3 * d * f
    n = L * (4 * d * d + mlp) + V * d  # q, k, v, out; MLP; the head (tied or not: one d×V matmul)
    assert throughput.matmul_parameters(model) == n
    assert throughput.flops_per_token(model, L, d, T) == 6 * n + 12 * L * d * T


def test_peak_table_and_mfu(monkeypatch):
    monkeypatch.delenv(throughput.PEAK_ENV, raising=False)
    assert throughput.peak_tflops(torch.device("cpu"), True)[0] is None
    assert throughput.mfu(1000.0, 10**9, None) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert throughput.peak_tflops(torch.device("cuda"), True)[0] == 756.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert throughput.peak_tflops(torch.device("cuda"), False)[0] == 156.0  # TF32 for float32 training
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10")
    assert throughput.peak_tflops(torch.device("cuda"), True)[0] == 125.0  # not A100's entry
    # 100 TFLOP/s of model FLOPs on 2 devices of 400 TFLOPS peak: 12.5 %
    assert throughput.mfu(1e5, 10**9, 400.0, devices=2) == pytest.approx(0.125)
    monkeypatch.setenv(throughput.PEAK_ENV, "2.5")
    assert throughput.peak_tflops(torch.device("cpu"), True) == (2.5, f"${throughput.PEAK_ENV}")


def test_fused_on_cuda_foreach_on_cpu_and_orthoadam_untouched():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert optimizer_options("adamw", cpu) == {"foreach": True}
    assert optimizer_options("adamw", cuda) == {"fused": True}
    assert optimizer_options("rmsprop", cuda) == {"foreach": True}
    assert optimizer_options("orthoadam", cuda) == {}


def test_compile_flag_wraps_the_training_step_only(corpus, tmp_path):
    cfg = config_from_args({"preset": "tiny", "compile": True})
    assert cfg.compile
    run = _start(
        micro_cfg(corpus, recipe="vanilla", compile=True), tmp_path, False, False, distributed.setup("cpu")
    )
    try:
        assert (
            isinstance(run.ddp, torch._dynamo.eval_frame.OptimizedModule) and run.ddp._orig_mod is run.model
        )
        assert run.throughput["flops_per_token"] > 0 and run.throughput["peak_tflops"] is None
        assert all(
            g.get("foreach") for g in run.optimizer.param_groups
        )  # AdamW's multi-tensor step on the CPU
    finally:
        run.log.close()
