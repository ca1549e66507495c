"""Every grid cell keeps its per-token evidence; a quantised cell's KL divergence, top-1 agreement and interval are
those of its float model on the same tokens, recomputed here independently."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qbench.eval import evidence
from qbench.eval.adapters import logits
from qbench.eval.harness import GridSpec, ModelEvaluation, run_grid, stored_path
from qbench.eval.metrics import Protocol

SMALL = Protocol(tokens=32 * 4, window=32, batch_size=2, outlier_windows=2)


def _spec(tmp_path, ckpt, schemes=("absmax-coarse:w=3", "zeropoint-int4")):
    return GridSpec(
        models=[str(ckpt)], schemes=list(schemes), modes=["fake"], protocol=SMALL, output_path=tmp_path / "r"
    )


def test_cells_name_their_sidecar_and_its_numbers_are_the_float_models(ckpt_dir, tmp_path):
    from qbench.quant import get_scheme, quantize

    spec = _spec(tmp_path, ckpt_dir)
    fp, coarse, _ = run_grid(spec)
    out = tmp_path / "r"
    for record in (fp, coarse):
        path = stored_path(out, record)
        tensors = evidence.read(path, record)
        assert tensors is not None and tensors["nll"].shape == (4, 32)
        assert record["evidence"]["file"] == path.stem + evidence.SIDECAR_SUFFIX
        assert record["metrics"]["bits_per_byte"] > 0
    assert "kld_mean" not in fp["metrics"]  # the float cell has nothing to be compared with
    # recompute the cell's KL divergence and top-1 agreement with plain torch, from the float model
    evaluation = ModelEvaluation(spec, str(ckpt_dir))
    float_model = evaluation.lm.model
    qmodel = quantize(float_model, get_scheme("absmax-coarse:w=3"), mode="fake")
    ids, targets = evaluation.windows.ids, evaluation.windows.targets
    with torch.no_grad():
        p = F.log_softmax(logits(float_model, ids).double(), -1)
        q = F.log_softmax(logits(qmodel, ids).double(), -1)
    kld = (p.exp() * (p - q)).sum(-1)
    same = (p.argmax(-1) == q.argmax(-1)).double()
    m = coarse["metrics"]
    # within the float32 computation's documented bound, 1e-6·(√KL + KL) (docs/metrics.md)
    for got, want in ((m["kld_mean"], kld.mean().item()), (m["kld_max"], kld.max().item())):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6 * (math.sqrt(want) + want))
    assert math.isclose(m["top1_agreement"], same.mean().item(), abs_tol=1e-9)
    nll_q = -q.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    nll_p = -p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert math.isclose(m["ln_ppl_ratio"], (nll_q - nll_p).mean().item(), abs_tol=1e-5)
    low, high = m["ppl_change_ci95"]
    assert low <= m["ppl_change_pct"] <= high
    assert m["interval"]["windows"] == 4


def test_a_missing_or_altered_sidecar_redoes_the_cell_and_the_float_record(ckpt_dir, tmp_path):
    spec = _spec(tmp_path, ckpt_dir, ["absmax-coarse"])
    fp, cell = run_grid(spec)
    out = tmp_path / "r"
    evidence.sidecar_path(stored_path(out, cell)).unlink()
    seen = []
    run_grid(spec, on_record=lambda r, reused: seen.append(reused))
    assert seen == [True, False]  # the float record reused, the cell without evidence redone
    side = evidence.sidecar_path(stored_path(out, fp))
    side.write_bytes(side.read_bytes()[:-4] + b"\0\0\0\0")
    seen.clear()
    run_grid(spec, on_record=lambda r, reused: seen.append(reused))
    assert seen[0] is False


def test_a_kv_cell_is_compared_with_the_float_model(ckpt_dir, tmp_path):
    from qbench.quant.kv import KVConfig

    spec = GridSpec(
        models=[str(ckpt_dir)],
        schemes=["fp"],
        modes=["fake"],
        protocol=SMALL,
        output_path=tmp_path / "r",
        kv=KVConfig(2, "per-token"),
    )
    _, kv = run_grid(spec)
    m = kv["metrics"]
    assert m["kld_mean"] > 0 and 0 <= m["top1_agreement"] <= 1
    assert m["kld_median"] <= m["kld_p90"] <= m["kld_p99"] <= m["kld_p999"] <= m["kld_max"]
