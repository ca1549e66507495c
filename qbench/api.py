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
    from torch import nn

    from qbench.quant.apply import quantize as _quantize

    if not isinstance(model, nn.Module):
        raise TypeError(
            f"qbench.quantize: model must be a torch nn.Module (e.g. qbench.load(...).model), "
            f"got {_shown(model)}"
        )
    if calibration is not None and _is_causal_lm(model):
        calibration = _calibration_ids(model, calibration)
    return _quantize(model, scheme, mode=mode, exclude=_patterns(exclude), calibration=calibration)


def _vocab_size(model: nn.Module) -> int | None:
    """Rows of the model's token embedding (transformers' ``get_input_embeddings``, else ``config.vocab_size``)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def _calibration_ids(model: nn.Module, calibration: Any) -> Tensor:
    """A language model's calibration windows checked before they reach the embedding, where a wrong shape, dtype
    or id fails deep inside the forward pass with an IndexError or RuntimeError naming neither: a 2-d integer
    tensor (windows x tokens), ids in [0, vocabulary). Returned as int64, what an embedding takes."""
    import torch

    what = "calibration must be a 2-d integer tensor of token ids (windows x tokens)"
    if not isinstance(calibration, torch.Tensor):
        raise UserError(f"{what}, got {_shown(calibration)}")
    if calibration.is_floating_point() or calibration.is_complex() or calibration.dtype == torch.bool:
        raise UserError(f"{what}, got a {str(calibration.dtype).removeprefix('torch.')} tensor")
    if calibration.ndim != 2:
        hint = "; one window: ids.unsqueeze(0)" if calibration.ndim == 1 else ""
        raise UserError(f"{what}, got shape {tuple(calibration.shape)}{hint}")
    if calibration.numel() == 0:
        raise UserError(f"{what} holding at least one token, got shape {tuple(calibration.shape)}")
    vocab = _vocab_size(model)
    lo, hi = int(calibration.min()), int(calibration.max())
    if lo < 0 or (vocab is not None and hi >= vocab):
        where = "ids are never negative" if vocab is None else f"the model's vocabulary has {vocab} tokens"
        raise UserError(
            f"calibration holds token id {lo if lo < 0 else hi}, outside the vocabulary ({where}: ids 0 to "
            f"{'...' if vocab is None else vocab - 1})"
        )
    return calibration.long()


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


def _shown(value: Any) -> str:
    """``str 'x'``: a value's type and (shortened) repr, for an error about a wrong argument."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _patterns(exclude: Any) -> tuple[str, ...]:
    """``exclude`` as a tuple of patterns; a bare string would be read one character at a time: refused."""
    if isinstance(exclude, (str, bytes)):
        raise TypeError(
            f"exclude must be a list of layer-name patterns, got {_shown(exclude)}; use [{exclude!r}]"
        )
    try:
        patterns = tuple(exclude)
    except TypeError:
        raise TypeError(f"exclude must be a list of layer-name patterns, got {_shown(exclude)}") from None
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"exclude must hold layer-name patterns (strings), got {_shown(bad[0])}")
    return patterns


def _int_at_least(argument: str, value: Any, least: int) -> int:
    """``value`` when it is an int >= ``least``, else a one-line error naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument} must be an integer >= {least}, got {_shown(value)}")
    if value < least:
        raise ValueError(f"{argument} must be at least {least}, got {value}")
    return value


def _is_causal_lm(model: Any) -> bool:
    """Whether the harness can score ``model``: a qbench Transformer, or a module with a transformers-style
    ``config`` (what ``adapters`` read: its context length; its forward returns ``.logits``)."""
    from torch import nn

    from qbench.eval.adapters import is_ours

    return is_ours(model) or (isinstance(model, nn.Module) and getattr(model, "config", None) is not None)


def _check_model(model: Any) -> None:
    if not _is_causal_lm(model):
        raise TypeError(
            "model_or_ckpt must be a checkpoint path or name, what qbench.load returns, or a causal LM "
            f"(a qbench Transformer or a transformers model, with .config) with its tokenizer; got {_shown(model)}"
        )


def _check_tokenizer(tokenizer: Any) -> None:
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TypeError(
            "tokenizer must be a transformers fast tokenizer object (e.g. qbench.load(...).tokenizer or "
            f"models.tokenizer.load_tokenizer(name)), got {_shown(tokenizer)}"
        )


_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _model_dtype(model: nn.Module) -> str:
    """The name (a key of ``qbench.eval.load.DTYPES``) of the dtype ``model``'s floating weights are in."""
    from qbench.eval.load import DTYPES

    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
    if len(dtypes) != 1 or dtypes[0] not in _DTYPE_NAMES:
        raise ValueError(
            f"the model's floating weights are {', '.join(dtypes) or 'absent'}; pass dtype= one of "
            f"{', '.join(sorted(DTYPES))} to evaluate a copy cast to it"
        )
    return _DTYPE_NAMES[dtypes[0]]


def _on(lm: LoadedModel, dtype: str, device: str) -> LoadedModel:
    """``lm`` with its model in ``dtype`` on ``device``: ``lm`` itself when it already is, else a cast copy (the
    caller's model is never modified), described with the dtype it now has."""
    import copy

    import torch

    from qbench.eval.load import LoadedModel, parse_dtype

    torch_dtype = parse_dtype(dtype)
    params = [p for p in lm.model.parameters() if p.is_floating_point()]
    target = torch.device(device)
    if all(p.dtype == torch_dtype and p.device.type == target.type for p in params) and (
        target.index is None or all(p.device == target for p in params)
    ):
        return lm
    model = copy.deepcopy(lm.model).to(device=target, dtype=torch_dtype).eval()
    return LoadedModel(model, lm.tokenizer, lm.name, lm.source, {**lm.description, "dtype": dtype})


def _as_loaded(
    model_or_ckpt: Any, tokenizer: Any, dtype: str | None, device: str, name: str | None
) -> tuple[LoadedModel, str]:
    """The model to evaluate and the name of the dtype it is evaluated in (``dtype`` None: the model's own, for
    a path float32): a model in another dtype or on another device is evaluated as a cast copy."""
    from qbench.eval.load import LoadedModel

    if isinstance(model_or_ckpt, (str, Path)):
        dtype = dtype or "float32"
        return load(model_or_ckpt, dtype=dtype, device=device), dtype
    if isinstance(model_or_ckpt, LoadedModel):
        _check_model(model_or_ckpt.model)
        _check_tokenizer(model_or_ckpt.tokenizer)
        dtype = dtype or _model_dtype(model_or_ckpt.model)
        return _on(model_or_ckpt, dtype, device), dtype
    _check_model(model_or_ckpt)
    if tokenizer is None:
        raise UserError(
            "qbench.evaluate(model, ...) with a model object needs tokenizer=...; "
            "or pass a checkpoint path, or what qbench.load returns"
        )
    _check_tokenizer(tokenizer)
    dtype = dtype or _model_dtype(model_or_ckpt)
    n_params = sum(p.numel() for p in {id(p): p for p in model_or_ckpt.parameters()}.values())
    description = {
        "kind": "in-memory",
        "architecture": type(model_or_ckpt).__name__,
        "fingerprint": None,  # nothing on disk names these weights: records made from them are never reused
        "parameters": n_params,
        "dtype": dtype,  # what it is evaluated in: _on casts a copy when the weights are in another
    }
    label = name or type(model_or_ckpt).__name__
    lm = LoadedModel(model_or_ckpt.eval(), tokenizer, label, "<in-memory>", description)
    return _on(lm, dtype, device), dtype


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
    dtype: str | None = None,
    device: str = "cpu",
    output_path: str | Path | None = None,
    name: str | None = None,
    calib_data: str | None = None,
    calib_tokens: int | None = None,
    calib_sample: str = "documents",
) -> dict[str, Any]:
    """Evaluate one (model, scheme, mode) cell and return its record (``scheme=None``: the float baseline).

    ``model_or_ckpt``: a path or name as ``--ckpt`` takes, what :func:`load` returns, or an ``nn.Module`` with its
    ``tokenizer``. ``scheme`` is a registered name (``qbench ls schemes``). The protocol arguments are those of
    ``qbench run`` (``corpus`` = ``--data``; ``split`` None: validation of a registered corpus, all of a file).
    ``dtype``: what the model is evaluated in (None: a path loads in float32, a model object stays in its own);
    a model object in another dtype, or on another ``device``, is evaluated as a cast copy, never modified.
    The record names the dtype actually used. ``calib_data`` / ``calib_tokens`` / ``calib_sample``: a calibrated
    scheme's windows, as ``--calib-data`` / ``--calib-tokens`` / ``--calib-sample`` give them. A bad argument is a one-line error naming it.
    """
    from qbench.eval.harness import GridSpec, ModelEvaluation, check_modes
    from qbench.eval.load import check_device, parse_dtype
    from qbench.eval.metrics import Protocol
    from qbench.quant.calibrate import CalibrationData

    check_modes([mode])
    _int_at_least("tokens", tokens, 2)
    _int_at_least("batch_size", batch_size, 1)
    _int_at_least("seed", seed, 0)
    if window is not None:
        _int_at_least("window", window, 2)
    if dtype is not None:
        parse_dtype(dtype)
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {_shown(device)}")
    check_device(device)
    exclude = _patterns(exclude)
    if calib_tokens is not None and (
        isinstance(calib_tokens, bool) or not isinstance(calib_tokens, int) or calib_tokens < 1
    ):
        raise UserError(
            f"calib_tokens must be a positive integer (calibration tokens) or None (each scheme's windows), "
            f"got {_shown(calib_tokens)}"
        )
    calibration = CalibrationData(calib_data, calib_tokens, calib_sample)
    lm, dtype = _as_loaded(model_or_ckpt, tokenizer, dtype, device, name)
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
            exclude=exclude,
            attention=attention,
            quantize_lm_head=quantize_lm_head,
            calibration=calibration,
        )
        evaluation = ModelEvaluation(spec, lm.source, lm=lm)
        return evaluation.fp_record() if scheme is None else evaluation.quantised_record(scheme, mode)
