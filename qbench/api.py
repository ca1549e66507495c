"""The Python API: ``qbench.quantize``, ``qbench.load``, ``qbench.evaluate`` (re-exported lazily by ``qbench``).

    import qbench
    lm = qbench.load("ckpts/vanilla")                        # a qbench checkpoint, transformers folder, .gguf, hub name
    qmodel = qbench.quantize(lm.model, "absmax-coarse", mode="fake", exclude=["lm_head"])
    record = qbench.evaluate(lm, "absmax-coarse")            # the record `qbench run` writes, as a dict
    record["metrics"]["ppl_ratio"]

Like ``lm_eval.simple_evaluate`` and torchao's ``quantize_``: one call each, the same objects the CLI uses.
``evaluate`` is the harness's single-cell evaluation (``harness.ModelEvaluation``), not a second path, so its
record is exactly what ``qbench run`` would write; it writes nothing unless ``output_path`` is given (then it also
reuses a float baseline already there).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor, nn

    from qbench.eval.load import LoadedModel
    from qbench.quant.schemes import QuantScheme


def quantize(
    model: nn.Module,
    scheme: str | QuantScheme | dict,
    mode: str = "fake",
    exclude: Iterable[str] = (),
    calibration: Tensor | None = None,
) -> nn.Module:
    """A quantised copy of ``model`` (``model`` is never modified): ``qbench.quant.quantize``."""
    from qbench.quant.apply import quantize as _quantize

    return _quantize(model, scheme, mode=mode, exclude=exclude, calibration=calibration)


def load(
    ckpt: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    allow_unsafe_weights: bool = False,
) -> LoadedModel:
    """``--ckpt`` resolution (``qbench.eval.load``): ``.model``, ``.tokenizer``, ``.name``, ``.description``."""
    from qbench.eval.load import load_model

    return load_model(
        str(ckpt),
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        allow_unsafe_weights=allow_unsafe_weights,
    )


def _as_loaded(model_or_ckpt: Any, tokenizer: Any, dtype: str, device: str, name: str | None) -> LoadedModel:
    from qbench.eval.load import LoadedModel

    if isinstance(model_or_ckpt, LoadedModel):
        return model_or_ckpt
    if isinstance(model_or_ckpt, (str, Path)):
        return load(model_or_ckpt, dtype=dtype, device=device)
    if tokenizer is None:
        raise UserError(
            "qbench.evaluate(model, ...) with a model object needs tokenizer=...; "
            "or pass a checkpoint path, or what qbench.load returns"
        )
    n_params = sum(p.numel() for p in {id(p): p for p in model_or_ckpt.parameters()}.values())
    description = {
        "kind": "in-memory",
        "architecture": type(model_or_ckpt).__name__,
        "fingerprint": None,  # nothing on disk names these weights: records made from them are never reused
        "parameters": n_params,
        "dtype": dtype,
    }
    label = name or type(model_or_ckpt).__name__
    return LoadedModel(model_or_ckpt.eval(), tokenizer, label, "<in-memory>", description)


def evaluate(
    model_or_ckpt: Any,
    scheme: str | None = "absmax-fine",
    *,
    mode: str = "fake",
    tokenizer: Any = None,
    corpus: str = "embedded",
    split: str | None = None,
    tokens: int = 8192,
    window: int | None = None,
    batch_size: int = 8,
    exclude: Iterable[str] = (),
    quantize_lm_head: bool = False,
    attention: bool = True,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    output_path: str | Path | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Evaluate one (model, scheme, mode) cell and return its record (``scheme=None``: the float baseline).

    ``model_or_ckpt``: a path or name as ``--ckpt`` takes, what :func:`load` returns, or an ``nn.Module`` with its
    ``tokenizer``. ``scheme`` is a registered name (``qbench ls schemes``). The protocol arguments are those of
    ``qbench run`` (``corpus`` = ``--data``; ``split`` None: validation of a registered corpus, all of a file).
    """
    from qbench.eval.harness import GridSpec, ModelEvaluation, check_modes
    from qbench.eval.metrics import Protocol

    check_modes([mode])
    lm = _as_loaded(model_or_ckpt, tokenizer, dtype, device, name)
    protocol = Protocol(corpus=corpus, split=split, tokens=tokens, window=window, batch_size=batch_size)
    with tempfile.TemporaryDirectory(prefix="qbench-evaluate-") as scratch:
        spec = GridSpec(
            models=[lm.source],
            schemes=[] if scheme is None else [scheme],
            modes=[mode],
            protocol=protocol,
            output_path=Path(output_path) if output_path is not None else Path(scratch),
            seed=seed,
            dtype=dtype,
            device=device,
            exclude=tuple(exclude),
            attention=attention,
            quantize_lm_head=quantize_lm_head,
        )
        evaluation = ModelEvaluation(spec, lm.source, lm=lm)
        return evaluation.fp_record() if scheme is None else evaluation.quantised_record(scheme, mode)
