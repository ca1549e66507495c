"""Device maps (accelerate): a model placed under a memory cap that forces offload scores exactly as the model
loaded whole — float and quantised — and what cannot be quantised one offloaded layer at a time is refused."""

from __future__ import annotations

import json

import pytest
import torch

from models.errors import UserError
from qbench.cli import main
from qbench.eval.load import load_model, resolve_dtype
from qbench.eval.placement import Placement, parse_max_memory
from qbench.quant import offload
from qbench.quant.apply import model_bytes, quantize
from qbench.quant.fake import FakeQuantLinear

# caps that leave the micro models partly on the CPU and partly on disk (GPT-2: embedding and head in memory,
# the blocks on disk) or wholly on disk (Llama)
MIXED, DISK = "1100KB", "100KB"


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize(
    ("fixture", "cap"),
    [("ckpt_dir", MIXED), ("ckpt_dir", DISK), ("hf_gpt2_dir", MIXED), ("hf_llama_dir", DISK)],
)
def test_an_offloaded_model_and_its_quantised_copies_score_as_the_whole_model(fixture, cap, request):
    path = request.getfixturevalue(fixture)
    whole = load_model(str(path))
    placed = load_model(str(path), placement=Placement("auto", (("cpu", cap),)))
    assert offload.is_offloaded(placed.model)
    assert any(p.is_meta for p in placed.model.parameters())  # the cap really moved weights out of memory
    assert set(placed.description["placement"]["placed"]) >= {"disk"}
    ids = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = _logits(whole.model, ids)
        assert torch.equal(_logits(placed.model, ids), reference)
        for scheme in ("zeropoint-int4", "absmax-coarse", "mxfp4"):
            expected = _logits(quantize(whole.model, scheme), ids)
            copy = quantize(placed.model, scheme)
            layers = [m for m in copy.modules() if isinstance(m, FakeQuantLinear)]
            assert layers and all(m.storage == "shared" for m in layers)
            got = _logits(copy, ids)
            assert torch.equal(got, expected), scheme
            # the copy's size counts each float weight it reads from disk once, as the whole model's copy does
            assert model_bytes(copy) == model_bytes(quantize(whole.model, scheme)), scheme
            assert not torch.equal(got, reference)  # the copy is quantised, not the float model through hooks
        # the float model is untouched: still offloaded, and the same logits
        assert any(p.is_meta for p in placed.model.parameters())
        assert torch.equal(_logits(placed.model, ids), reference)
    assert model_bytes(placed.model) == model_bytes(whole.model)  # an offloaded tensor counts at its size


def test_a_quantised_kv_cache_on_an_offloaded_model_scores_as_on_the_whole_model(hf_gpt2_dir):
    from qbench.quant.kv import KVConfig, apply_kv

    whole = load_model(str(hf_gpt2_dir))
    placed = load_model(str(hf_gpt2_dir), placement=Placement("auto", (("cpu", MIXED),)))
    ids = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(1))
    config = KVConfig(2, "per-token")
    with torch.no_grad():
        expected = _logits(apply_kv(whole.model, config), ids)
        got = _logits(apply_kv(placed.model, config), ids)
        assert torch.equal(got, expected) and not torch.equal(got, _logits(whole.model, ids))
    assert any(p.is_meta for p in placed.model.parameters())


def test_decoding_an_offloaded_copy_keeps_no_dequantised_weight(hf_llama_dir):
    placed = load_model(str(hf_llama_dir), placement=Placement("auto", (("cpu", DISK),)))
    copy = quantize(placed.model, "zeropoint-int4")
    with torch.no_grad():
        for _ in range(3):  # consecutive short calls: a whole model keeps Ŵ per layer from the second on
            copy(torch.tensor([[1, 2]]))
    layers = [m for m in copy.modules() if isinstance(m, FakeQuantLinear)]
    assert layers and not any("_kept" in m.__dict__ for m in layers)


def test_schemes_that_change_the_weights_are_refused_on_an_offloaded_model(hf_gpt2_dir):
    placed = load_model(str(hf_gpt2_dir), placement=Placement("auto", (("cpu", MIXED),)))
    for scheme, why in (("hadamard-zeropoint-int4", "hadamard"), ("zeropoint-int4:algo=gptq", "gptq")):
        with pytest.raises(UserError, match=f"offloaded.*{why}|{why}.*offloaded"):
            quantize(placed.model, scheme)
    with pytest.raises(UserError, match="offloaded"):
        quantize(placed.model, "absmax-fine", mode="real")


def test_an_offloaded_weight_is_read_from_where_it_lives(hf_gpt2_dir):
    whole = load_model(str(hf_gpt2_dir))
    placed = load_model(str(hf_gpt2_dir), placement=Placement("auto", (("cpu", MIXED),)))
    name = "transformer.h.1.mlp.c_fc.weight"
    assert placed.model.get_parameter(name).is_meta
    assert torch.equal(offload.offloaded_tensor(placed.model, name), whole.model.get_parameter(name))
    values = dict(offload.parameter_values(placed.model))
    assert all(not v.is_meta for v in values.values())
    assert offload.execution_device(placed.model) == torch.device("cpu")


def test_run_under_a_memory_cap_writes_the_uncapped_records(hf_gpt2_dir, tmp_path, capsys):
    base = ["run", "--ckpt", str(hf_gpt2_dir), "--scheme", "zeropoint-int4", "--tokens", "256"]
    assert main([*base, "--output-path", str(tmp_path / "whole")]) == 0
    capped = [
        "--device-map",
        "auto",
        "--max-memory",
        f"cpu={MIXED}",
        "--output-path",
        str(tmp_path / "capped"),
    ]
    assert main([*base, *capped]) == 0
    assert "peak memory" in capsys.readouterr().out
    for cell in ("fp.json", "zeropoint-int4__fake.json"):
        whole = json.loads((tmp_path / "whole" / hf_gpt2_dir.name / cell).read_text())
        capped_record = json.loads((tmp_path / "capped" / hf_gpt2_dir.name / cell).read_text())
        assert capped_record["metrics"] == whole["metrics"]
        assert capped_record["cell_id"] == whole["cell_id"]  # the placement is not part of the cell
        assert capped_record["model"]["placement"]["max_memory"] == {"cpu": MIXED}
        assert "placement" not in whole["model"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device-map", "auto", "--max-memory", "cpu=12XB"], "'12XB' is not a size"),
        (["--device-map", "auto", "--max-memory", "gpu=1GiB"], "unknown device 'gpu'"),
        (["--device-map", "auto", "--max-memory", "cpu"], "give DEVICE=SIZE"),
        (["--max-memory", "cpu=1GiB"], "--max-memory needs --device-map"),
        (["--offload-folder", "x"], "--offload-folder needs --device-map"),
    ],
)
def test_bad_placement_flags_are_one_line_errors(hf_gpt2_dir, tmp_path, capsys, flags, message):
    code = main(["run", "--ckpt", str(hf_gpt2_dir), "--output-path", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_a_checkpoint_whose_weights_do_not_match_its_config_is_a_clear_error(ckpt_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ckpt_dir, broken)
    meta = json.loads((broken / "config.json").read_text())
    meta["model"]["d_ff"] *= 2
    (broken / "config.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"cannot place .*the model needs"):
        load_model(str(broken), placement=Placement("auto", (("cpu", DISK),)))


def test_a_gguf_file_cannot_be_placed(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UserError, match="dequantised whole into memory"):
        load_model(str(gguf), placement=Placement("auto"))


def test_placement_validates_itself():
    with pytest.raises(UserError, match=r"did you mean 'auto'|valid"):
        Placement("autp")
    with pytest.raises(UserError, match="give --device-map auto"):
        Placement(None, (("cpu", "1GiB"),))
    assert parse_max_memory(["0=70GiB", "cuda:1=60GiB", "cpu=8GiB"]) == (
        ("0", "70GiB"),
        ("1", "60GiB"),
        ("cpu", "8GiB"),
    )
    assert Placement("auto", (("0", "70GiB"), ("cpu", "8GiB"))).memory() == {0: "70GiB", "cpu": "8GiB"}
    with pytest.raises(UserError, match="twice"):
        parse_max_memory(["cpu=1GiB", "cpu=2GiB"])


def test_auto_dtype_is_bf16_on_a_gpu_and_float32_on_the_cpu(monkeypatch):
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda:0") == "float32"  # a GPU without bf16 (pre-Ampere) keeps float32
