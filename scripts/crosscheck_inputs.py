"""Write the exact token windows a qbench cell calibrates and is scored on, for another tool to use the same ones.

``scripts/llmcompressor_check.py`` (run in its own virtual environment) quantises with llm-compressor on CALIB and
scores on EVAL; this script, run with the project's interpreter, writes both from qbench's own code, so the two
tools see identical tokens:

- ``calib.safetensors``: ``ids`` (N, T) — the windows ``qbench.eval.harness.calibration_sample`` gives the scheme
  (the documents sample of the train split, windows of min(2048, context) tokens, ``--calib-tokens`` of them);
- ``eval.safetensors``: ``ids`` (M, W + 1) and ``scored`` (M, W + 1) — each evaluation window followed by the token
  its last position predicts, every position from 1 scored (qbench's protocol: each input position predicts the
  next token), so a tool computing -log p(ids[t] | ids[:t]) at the scored positions reproduces qbench's NLL;
- ``windows.json``: the protocol, the calibration record (sample, documents, offsets) and the command.

Usage (the same options as ``qbench run``):

    python scripts/crosscheck_inputs.py --ckpt MODEL --scheme 'zeropoint-int4:algo=gptq,group=64' \\
        --tokens 8192 --calib-tokens 16384 --output-path DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a model as qbench run's --ckpt takes it")
    p.add_argument("--scheme", required=True, help="the calibrated scheme whose windows to write")
    p.add_argument("--tokens", type=int, default=8192, help="stream tokens scored (default: 8192)")
    p.add_argument("--window", type=int, default=None, help="evaluation window (default: qbench's)")
    p.add_argument(
        "--calib-tokens", type=int, default=None, help="calibration tokens (default: the scheme's)"
    )
    p.add_argument("--output-path", required=True, help="folder to write the three files into")
    args = p.parse_args(argv)
    try:
        return _write(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _write(args: argparse.Namespace) -> int:
    from qbench.eval.adapters import context_length
    from qbench.eval.harness import calibration_sample
    from qbench.eval.load import load_model
    from qbench.eval.metrics import Protocol, make_windows
    from qbench.quant import get_scheme
    from qbench.quant.calibrate import CalibrationData

    lm = load_model(args.ckpt)
    protocol = Protocol(tokens=args.tokens, window=args.window)
    context = context_length(lm.model, args.window)
    windows = make_windows(lm.tokenizer, protocol, context)
    scheme = get_scheme(args.scheme)
    sample = calibration_sample(
        lm.tokenizer, protocol, windows.window, scheme, CalibrationData(tokens=args.calib_tokens), context
    )
    if not windows.every_position:
        raise UserError("the evaluation scores only some positions (llama.cpp's protocol); use qbench's")
    if not torch.equal(windows.targets[:, :-1], windows.ids[:, 1:]):  # each target is the next input token
        raise UserError(
            "the evaluation windows' targets are not their next input tokens; cannot write them as one"
        )
    full = torch.cat([windows.ids, windows.targets[:, -1:]], dim=1).long().contiguous()
    scored = torch.ones_like(full, dtype=torch.bool)
    scored[:, 0] = False
    out = Path(args.output_path)
    out.mkdir(parents=True, exist_ok=True)
    _atomic(out / "calib.safetensors", lambda p: save_file({"ids": sample.ids.long().contiguous()}, p))
    _atomic(out / "eval.safetensors", lambda p: save_file({"ids": full, "scored": scored}, p))
    meta = {
        "ckpt": args.ckpt,
        "scheme": scheme.name,
        "protocol": {
            "tokens": args.tokens,
            "window": windows.window,
            "windows": len(full),
            "bos": protocol.bos,
        },
        "calibration": sample.record,
        "command": " ".join(["python", "scripts/crosscheck_inputs.py", *sys.argv[1:]]),
    }
    _atomic(out / "windows.json", lambda p: Path(p).write_text(json.dumps(meta, indent=1) + "\n"))
    print(f"{out}: calib {tuple(sample.ids.shape)}, eval {tuple(full.shape)}")
    return 0


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
