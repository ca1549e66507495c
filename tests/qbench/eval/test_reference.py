"""The float logits every cell compares with are computed once per model (``qbench.eval.reference``): a grid runs
the float model over its windows once, its cells' divergences are those a float forward beside each cell gives,
and the store steps aside where it does not pay or fit."""

from __future__ import annotations

import os

import torch

from qbench.eval import reference as ref_module
from qbench.eval.harness import GridSpec, ModelEvaluation, run_grid
from qbench.eval.metrics import Protocol, output_width, perplexity
from qbench.eval.reference import ReferenceLogits, reference_store

SMALL = Protocol(tokens=32 * 4, window=32, batch_size=3, outlier_windows=2)


def _spec(tmp_path, ckpt):
    return GridSpec(
        models=[str(ckpt)],
        schemes=["absmax-coarse:w=3", "zeropoint-int4"],
        modes=["fake"],
        protocol=SMALL,
        output_path=tmp_path / "r",
    )


def test_a_grid_runs_the_float_model_once_and_its_cells_match_a_fresh_float_forward(ckpt_dir, tmp_path):
    from qbench.quant import get_scheme, quantize

    spec = _spec(tmp_path, ckpt_dir)
    evaluation = ModelEvaluation(spec, str(ckpt_dir))
    fp = evaluation.fp_record()
    store = evaluation.reference()
    assert isinstance(store, ReferenceLogits) and bool(
        store.filled.all()
    )  # the float record's pass filled it
    records = run_grid(spec, loaded={str(ckpt_dir): evaluation.lm})
    assert [r["status"] for r in records] == ["ok"] * 3 and records[0]["cell_id"] == fp["cell_id"]
    assert store.forward_passes == 0  # no cell ran the float model again
    qmodel = quantize(evaluation.lm.model, get_scheme("zeropoint-int4"), mode="fake")
    fresh = perplexity(qmodel, evaluation.windows, 2, reference=evaluation.lm.model)["per_token"]
    stored = perplexity(qmodel, evaluation.windows, 2, reference=store)["per_token"]
    assert torch.allclose(stored["kld"], fresh["kld"], rtol=1e-5, atol=1e-9)
    assert torch.equal(stored["top1"], fresh["top1"])
    assert abs(records[2]["metrics"]["kld_mean"] - fresh["kld"].double().mean().item()) < 1e-6


def test_the_store_fills_lazily_is_shared_per_model_and_windows_and_is_removed(ckpt_dir, tmp_path):
    evaluation = ModelEvaluation(_spec(tmp_path, ckpt_dir), str(ckpt_dir))
    model, ids = evaluation.lm.model, evaluation.windows.ids
    width = output_width(model)
    store = reference_store(model, ids, width, "cpu")
    assert reference_store(model, ids.clone(), width, "cpu") is store  # same windows, same store
    assert reference_store(model, ids[:2], width, "cpu") is not store
    first = store.batch(1, ids[1:3])
    assert store.forward_passes == 2 and store.filled.tolist() == [False, True, True, False]
    again = store.batch(1, ids[1:3])
    assert store.forward_passes == 2 and torch.equal(again, first)
    path = store.path
    assert os.path.getsize(path) == 4 * ids.numel() * width
    store.close()
    assert not os.path.exists(path)


def test_the_store_steps_aside_on_a_gpu_and_when_the_disk_is_short(ckpt_dir, tmp_path, monkeypatch):
    evaluation = ModelEvaluation(_spec(tmp_path, ckpt_dir), str(ckpt_dir))
    model, ids = evaluation.lm.model, evaluation.windows.ids
    assert reference_store(model, ids, 10, "cuda") is None
    monkeypatch.setattr(ref_module, "DISK_SHARE", 0.0)
    assert reference_store(model, ids[:1], 10, "cpu") is None
