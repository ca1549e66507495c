"""Bad input that had no test: each ends in one clear line (UserError / exit 2), never a traceback, and a torn
record is recomputed rather than trusted."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from models.errors import UserError
from qbench.cli import main


def _cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_window_above_the_context_is_refused(ckpt_dir, tmp_path, capsys):
    code, _, err = _cli(
        ["run", "--ckpt", ckpt_dir, "--window", 4096, "--tokens", 100, "--output-path", tmp_path], capsys
    )
    assert code == 2 and "--window 4096 exceeds the model's context length 32" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_checkpoint_without_its_tokenizer_is_named(ckpt_dir, tmp_path, capsys):
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(ckpt_dir, broken)
    for f in broken.glob("tokenizer*"):
        f.unlink()
    code, _, err = _cli(["run", "--ckpt", broken, "--tokens", 100, "--output-path", tmp_path / "r"], capsys)
    assert code == 2 and "tokenizer.json is missing" in err and "Traceback" not in err


def test_a_torn_record_is_recomputed_not_trusted(ckpt_dir, tmp_path):
    from qbench.eval.harness import GridSpec, run_grid
    from qbench.eval.metrics import Protocol

    spec = GridSpec(
        models=[str(ckpt_dir)],
        schemes=["absmax-coarse"],
        protocol=Protocol(tokens=64, batch_size=2, outlier_windows=1),
        output_path=tmp_path,
    )
    first = run_grid(spec)
    path = next(tmp_path.rglob("absmax-coarse__fake.json"))
    path.write_text(path.read_text()[:40])  # an interrupted writer without the atomic rename
    flags = []
    again = run_grid(spec, on_record=lambda r, reused: flags.append(reused))
    assert flags == [True, False]
    assert json.loads(path.read_text())["metrics"] == again[1]["metrics"] == first[1]["metrics"]


def test_pack_int4_refuses_float_codes():
    from qbench.quant.kernels.int4 import pack_int4

    with pytest.raises(TypeError, match=r"pack_int4 needs integer codes, got torch\.float32"):
        pack_int4(torch.tensor([1.0, 2.0]))
    assert pack_int4(torch.tensor([1, 2, 15], dtype=torch.int64)).tolist() == [0x21, 0x0F]


def test_bitsandbytes_layers_refuse_a_rotation_or_input_scale():
    pytest.importorskip("bitsandbytes")
    from qbench.quant.kernels import make_real_linear
    from qbench.quant.schemes import SCHEMES

    weight = torch.randn(32, 64)
    from qbench.quant.granularity import PerAxis
    from qbench.quant.primitives import choose_qparams

    grid = choose_qparams(weight, 8, PerAxis(0), True)
    for kwargs in ({"rotation": torch.eye(64)}, {"input_scale": torch.ones(64)}, {"weight_qparams": grid}):
        with pytest.raises(
            UserError, match="bitsandbytes layers take no input scale, rotation or given weight"
        ):
            make_real_linear(weight, None, SCHEMES.get("llm-int8"), **kwargs)


def test_smoothquant_names_a_layer_that_never_ran_during_calibration():
    from torch import nn

    from qbench.quant import quantize

    class TwoPaths(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.used(x)

    model = TwoPaths()
    calibration = torch.randn(2, 4, 8)
    with pytest.raises(UserError, match=r"layer 'unused' never ran during calibration; exclude it"):
        quantize(model, "smoothquant", calibration=calibration)
    assert isinstance(
        quantize(model, "smoothquant", calibration=calibration, exclude=["unused"]).unused, nn.Linear
    )
