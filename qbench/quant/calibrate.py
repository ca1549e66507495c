"""Calibration: run token windows through the *float* model once and record what each target linear sees.

One loop (forward hooks on the layers ``quantize`` replaces) serves both users of calibration data:

- SmoothQuant needs each input channel's max |x| over all calibration tokens (``apply.smoothquant_scales``);
- static scales (``static.py``) need each channel's min and max of the layer's *transformed* input
  x' = R(x / s) — the tensor the fake and real layers quantise — and, when outputs are quantised, of its output.

So :func:`observe` keeps the per-channel (min, max) of the raw input, of R(x) when the layer has a rotation
(Hadamard mixes channels, so R(x)'s range cannot be derived from x's), and optionally of the output. The
SmoothQuant division x / s is per channel with s > 0, so x'-ranges follow exactly from x's: min(x_j)/s_j, max(x_j)/s_j.

Which windows: the scheme's ``calib`` windows of the corpus's *train* split (never the evaluated text: a scored
split that contains it is refused, :func:`check_calibration_disjoint`), drawn across its documents by default or the
first ones (``CalibrationData.sample``, ``--calib-sample``); the caller builds them
(``qbench.eval.harness.calibration_sample``). The record carries the rule, the windows and where they were drawn.
GPTQ and AWQ statistics: :func:`input_statistics` (the float model's inputs) and :class:`StatisticsCollector`,
which ``qbench.quant.sequential`` also attaches block by block.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.static import StaticQuantizer, static_qparams

# Tokens per forward pass while calibrating: 8 windows of 512, 2 of 2,048. By tokens, not windows, because a batch's
# attention scores grow with the window squared: 8 windows of 2,048 (SmolLM2: 9 heads) hold 1.2 GB of scores per
# layer, which set a 6.2 GB peak for a 135M model; 2 hold 0.3 GB.
CALIBRATION_TOKENS = 4096


def calibration_batches(windows: Tensor) -> tuple[Tensor, ...]:
    """``windows`` (N, T) split into the forward passes of a calibration run: ⌊CALIBRATION_TOKENS / T⌋ windows
    each, at least one."""
    return windows.split(max(1, CALIBRATION_TOKENS // max(1, windows.shape[-1])))


POOL_FACTOR = 4  # a seeded sample draws N windows from the first POOL_FACTOR · N of the train split


@dataclass
class Observed:
    """Per-channel ranges one layer saw over all calibration tokens (float32)."""

    in_lo: Tensor  # (in,) min of the raw input x
    in_hi: Tensor  # (in,) max of x
    rot_lo: Tensor | None = None  # (in,) min of R(x), when the layer has a rotation
    rot_hi: Tensor | None = None
    out_lo: Tensor | None = None  # (out,) min of the output, when asked
    out_hi: Tensor | None = None

    @property
    def in_absmax(self) -> Tensor:
        return torch.maximum(self.in_hi, -self.in_lo)


def needs_calibration(scheme: Any) -> bool:
    """Whether ``quantize`` needs calibration windows for ``scheme`` (SmoothQuant, static scales, GPTQ)."""
    return (
        scheme.method == "smoothquant"
        or bool(getattr(scheme, "static", False))
        or getattr(scheme, "algo", "rtn") != "rtn"
    )


def select_windows(ids: Tensor, n: int, seed: int | None) -> Tensor:
    """N of the offered windows: the first N (``seed=None``), else a seeded sample in their original order."""
    if n >= len(ids) or seed is None:
        return ids[:n]
    pick = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))[:n]
    return ids[pick.sort().values]


CALIBRATION_SPLIT = "train"  # where calibration windows come from (harness.calibration_sample)
CALIB_SAMPLES = ("documents", "first")  # --calib-sample (qbench.eval.harness.calibration_sample)


@dataclass(frozen=True)
class CalibrationData:
    """Where calibration windows come from and how many tokens they hold (``--calib-data``, ``--calib-tokens``).

    ``data`` None: the scored corpus's train split (the default). A registered corpus or a ``qbench data prepare``
    folder: its train split. A user's own file or folder: all of it (it is not the scored text, so nothing of it
    is held out). ``tokens`` None: each scheme's ``calib`` windows; a number: that many tokens, rounded up to whole
    windows of the evaluation's length (llm-compressor's ``num_calibration_samples`` × ``max_seq_length``, said
    in tokens). A seeded scheme (``calib_seed``) samples its windows from ``POOL_FACTOR`` times as many."""

    data: str | None = None
    tokens: int | None = None
    # how the windows are drawn (``--calib-sample``): "documents" across the text (the default), or "first"
    sample: str = "documents"

    def __post_init__(self) -> None:
        if self.sample not in CALIB_SAMPLES:
            from models.errors import unknown_choice

            raise unknown_choice("--calib-sample", self.sample, CALIB_SAMPLES)
        if self.tokens is not None and (
            isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1
        ):
            raise UserError(f"--calib-tokens must be a positive number of tokens, got {self.tokens!r}")
        if self.data is not None:
            from trainers.data import get_corpus

            get_corpus(self.data)  # an unknown name or a missing path: its one-line error now, not mid-grid

    def corpus(self, scored: Any) -> str:
        """The corpus the windows are cut from while ``scored`` is evaluated."""
        return str(scored) if self.data is None else self.data

    def split(self) -> str:
        """The split of :meth:`corpus` the windows are cut from."""
        if self.data is None:
            return CALIBRATION_SPLIT
        from trainers.data import default_split

        return CALIBRATION_SPLIT if default_split(self.data) == "validation" else "all"

    def windows(self, default: int, window: int) -> int:
        """Windows of ``window`` tokens to calibrate on: ``tokens`` rounded up to whole windows, else ``default``
        (the scheme's ``calib``)."""
        return default if self.tokens is None else -(-self.tokens // window)

    def describe(self, scored: Any, default: int, seed: int | None = None) -> dict[str, Any]:
        """The calibration protocol as records state it: corpus, split, and the windows (or the tokens asked for,
        when ``--calib-tokens`` decides the windows once the window length is known)."""
        out: dict[str, Any] = {"corpus": self.corpus(scored), "split": self.split()}
        if self.tokens is None:
            out["windows"] = default
        else:  # the windows follow from the window length: ceil(requested_tokens / window)
            out["requested_tokens"] = self.tokens
        if self.sample == "first":  # worded as every record before the documents sample, which it reproduces
            out["selection"] = "first windows" if seed is None else "seeded sample"
        else:
            out["selection"] = (
                "documents sample (trainers.batches.document_windows, seeded by calib_seed or 0) of windows of "
                "min(2048, context) tokens; one more window per 8 held out"
            )
        return out

    def check_disjoint(self, scored: Any, scored_split: str | None, what: str) -> None:
        """Refuse calibration on the scored text (:func:`check_calibration_disjoint`): the default data, or
        ``--calib-data`` naming the scored corpus itself."""
        if self.data is None or _same_corpus(self.data, scored):
            if self.data is not None and self.split() == "all":
                raise UserError(
                    f"{what}: --calib-data {self.data!r} is the scored corpus itself (all of it is calibration "
                    "text); calibrate on another file, or leave --calib-data out to use the train split"
                )
            check_calibration_disjoint(scored, scored_split, what)


def _same_corpus(a: Any, b: Any) -> bool:
    """Whether two corpus names or paths name the same text (paths compared once resolved)."""
    from pathlib import Path

    if str(a) == str(b):
        return True
    pa, pb = Path(str(a)), Path(str(b))
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def check_calibration_disjoint(corpus: Any, scored_split: str | None, what: str) -> str:
    """The split ``what`` (a calibrated scheme or KV cache) may calibrate on while ``scored_split`` of ``corpus``
    is scored: :data:`CALIBRATION_SPLIT` when the two are disjoint, else a one-line error. Only the validation
    split is disjoint from train; ``all`` (a user file's default) and ``train`` contain every calibration chunk,
    so its scales would be fitted on the very text they are scored on."""
    if scored_split is None:
        from trainers.data import default_split

        scored_split = default_split(corpus)
    if scored_split == "validation":
        return CALIBRATION_SPLIT
    raise UserError(
        f"{what} calibrates on the {CALIBRATION_SPLIT} split of {str(corpus)!r}, which the scored split "
        f"{scored_split!r} contains (calibration on the scored text); score --split validation (where the "
        "corpus has validation documents: a single file has none), calibrate on other text with --calib-data, "
        "or use a scheme without calibration"
    )


def check_calibration(calibration: Any, why: str) -> Tensor:
    if not isinstance(calibration, Tensor) or calibration.ndim < 1 or len(calibration) == 0:
        raise UserError(
            f"{why} needs calibration: a tensor of token windows (B, T), e.g. train-split windows"
        )
    return calibration


def _merge(store: dict[str, Tensor], key: str, lo: Tensor, hi: Tensor) -> None:
    store[key + "_lo"] = lo if key + "_lo" not in store else torch.minimum(store[key + "_lo"], lo)
    store[key + "_hi"] = hi if key + "_hi" not in store else torch.maximum(store[key + "_hi"], hi)


def _ranges(t: Tensor) -> tuple[Tensor, Tensor]:
    flat = t.detach().float().reshape(-1, t.shape[-1])
    return flat.amin(0), flat.amax(0)


def _hooks(
    name: str, seen: dict[str, dict[str, Tensor]], rotation: Callable[[Tensor], Tensor] | None, outputs: bool
) -> tuple[Callable, Callable | None]:
    def pre(module: nn.Module, args: tuple) -> None:
        store = seen.setdefault(name, {})
        _merge(store, "in", *_ranges(args[0]))
        if rotation is not None:
            _merge(store, "rot", *_ranges(rotation(args[0].detach().float())))

    def post(module: nn.Module, args: tuple, output: Tensor) -> None:
        _merge(seen.setdefault(name, {}), "out", *_ranges(output))

    return pre, post if outputs else None


def _model_device(model: nn.Module) -> torch.device:
    from qbench.quant.offload import execution_device

    return execution_device(model)


class _HeadReached(Exception):
    """Raised at the output head's input during a calibration pass: every observed layer has run by then."""


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that maps the last hidden state to logits (transformers' ``get_output_embeddings``, ours'
    ``lm_head``), or None where the model names none."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else getattr(model, "lm_head", None)


@contextmanager
def stop_before_head(model: nn.Module, observed: Iterable[nn.Module]) -> Iterator[Callable[..., None]]:
    """A calibration pass that ends at the output head unless the head itself is observed: its logits are never
    used, and a batch of them is the largest tensor of the pass (8 windows × 2,048 tokens × SmolLM2's 49,152-token
    vocabulary = 3.2 GB of float32, which set the peak memory of a standard card). Yields ``run(*args, **kwargs)``,
    which calls the model for its hooks' sake. The stop hook is registered last, so any observation pre-hook on
    the head still runs first (and then the head is observed: no stop)."""
    head = output_head(model)

    def run(*args: Any, **kwargs: Any) -> None:
        with suppress(_HeadReached):
            model(*args, **kwargs)

    if head is None or any(m is head for m in observed):
        yield run
        return

    def stop(_module: nn.Module, _args: tuple) -> None:
        raise _HeadReached

    handle = head.register_forward_pre_hook(stop)
    try:
        yield run
    finally:
        handle.remove()


def observe(
    model: nn.Module,
    layers: dict[str, nn.Module],
    calibration: Tensor,
    rotations: dict[str, Callable[[Tensor], Tensor]] | None = None,
    outputs: bool = False,
) -> dict[str, Observed]:
    """Run ``calibration`` windows through the float ``model`` (no grad) and return each layer's ranges.

    The model's train/eval flags come back exactly as they were: the float model must return untouched.
    """
    rotations = rotations or {}
    seen: dict[str, dict[str, Tensor]] = {}
    modes = {m: m.training for m in model.modules()}
    handles = []
    for name, module in layers.items():
        pre, post = _hooks(name, seen, rotations.get(name), outputs)
        handles.append(module.register_forward_pre_hook(pre))
        if post is not None:
            handles.append(module.register_forward_hook(post))
    try:
        model.eval()
        with torch.no_grad(), stop_before_head(model, layers.values()) as run:
            for batch in calibration_batches(calibration.to(_model_device(model))):
                run(batch)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return {name: Observed(**store) for name, store in seen.items()}


def static_quantizers(
    scheme: Any, observed: Observed, input_scale: Tensor | None
) -> tuple[StaticQuantizer | None, StaticQuantizer | None]:
    """(activation, output) static quantisers of one layer from its observed ranges (``static.py``)."""
    act = out = None
    if scheme.act_bits is not None:
        lo, hi = (
            (observed.rot_lo, observed.rot_hi)
            if observed.rot_lo is not None
            else (observed.in_lo, observed.in_hi)
        )
        if input_scale is not None:  # x' = x / s per channel, s > 0: the range scales exactly
            lo, hi = lo / input_scale.float(), hi / input_scale.float()
        qp = static_qparams(lo, hi, scheme.act_bits, scheme.act_granularity, scheme.act_symmetric)
        act = StaticQuantizer(qp, scheme.act_bits, scheme.act_symmetric)
    if scheme.out_bits is not None:
        if observed.out_lo is None:
            raise ValueError("static output scales need observe(..., outputs=True)")
        qp = static_qparams(
            observed.out_lo, observed.out_hi, scheme.out_bits, scheme.out_granularity, scheme.out_symmetric
        )
        out = StaticQuantizer(qp, scheme.out_bits, scheme.out_symmetric)
    return act, out


# ------------------------------------------------------------------------------------------- GPTQ's Hessians

# model -> {(calibration fingerprint, weights fingerprint, layer names): {layer: H}}: a grid quantises one model
# many times with the same windows; the Hessians of its float inputs are computed once (each (in, in) float32).
_HESSIANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHED_PER_MODEL = (
    2  # the calibration windows' statistics and the held-out windows' (``qbench.quant.solve``)
)


def _fingerprint(model: nn.Module, calibration: Tensor, names: tuple[str, ...]) -> tuple:
    """What the Hessians depend on: the windows (their bytes), the weights (storage and in-place version of every
    parameter: an edit in place bumps the version) and the layers asked for."""
    ids = calibration.detach().cpu().contiguous()
    digest = hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).hexdigest()
    weights = tuple((p.data_ptr(), p._version) for p in model.parameters())
    return (digest, tuple(ids.shape), weights, names)


def hessians(model: nn.Module, layers: dict[str, nn.Module], calibration: Tensor) -> dict[str, Tensor]:
    """Each layer's input Hessian (:func:`input_statistics`)."""
    return {name: acc.hessian for name, acc in input_statistics(model, layers, calibration).items()}


def input_statistics(model: nn.Module, layers: dict[str, nn.Module], calibration: Tensor) -> dict[str, Any]:
    """Each layer's ``gptq.HessianAccumulator``: its input Hessian H = (2/n) Σ x xᵀ and mean |x| per channel over
    the calibration tokens, from the *float* model (GPTQ, ``gptq.py``; AWQ, ``awq.py``), cached per (model,
    windows, weights). Layers fed the very same input tensor (q/k/v after one norm, gate/up) share one
    accumulator (the same object). The model's train/eval flags come back as they were."""
    names = tuple(layers)
    key = _fingerprint(model, calibration, names)
    cached = _HESSIANS.get(model, {})
    if key in cached:
        check_statistics_finite(cached[key], names)
        return cached[key]
    collector = StatisticsCollector(layers)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), collector.attached(), stop_before_head(model, layers.values()) as run:
            for batch in calibration_batches(calibration.to(_model_device(model))):
                run(batch)
                collector.end_batch()
    finally:
        for m, training in modes.items():
            m.training = training
    out = collector.result()
    entries = _HESSIANS.setdefault(model, {})
    while len(entries) >= _CACHED_PER_MODEL:  # a new protocol replaces the oldest
        del entries[next(iter(entries))]
    entries[key] = out
    check_statistics_finite(out, names)
    return out


class StatisticsCollector:
    """Forward pre-hooks that feed each layer's inputs to a ``gptq.HessianAccumulator`` (:func:`input_statistics`,
    and block by block for sequential calibration, ``qbench.quant.sequential``). Layers fed the very same input
    tensor in the first batch (q/k/v after one norm, gate/up) share one accumulator — the same object, so the
    GPTQ and AWQ code sees which layers read one input; a later batch that breaks the sharing is an error."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self.layers = layers
        self.accumulators: dict[str, Any] = {}
        self.shared: dict[str, str] = {}  # layer -> the layer whose accumulator it shares (the first batch's)
        self._last: tuple[Any, str | None] = (None, None)  # (input tensor, its owner) within one batch
        self._first = True

    def _hook(self, name: str) -> Callable:
        from qbench.quant.gptq import HessianAccumulator

        def pre(module: nn.Module, args: tuple) -> None:
            x = args[0]
            last, owner = self._last
            if self._first and name not in self.accumulators and name not in self.shared:
                if last is x:
                    self.shared[name] = owner
                else:
                    self.accumulators[name] = HessianAccumulator(x.shape[-1], x.device)
            if name in self.shared:
                if last is not x:  # not the same input as in the first batch: cannot share
                    raise RuntimeError(
                        f"calibration: {name!r} no longer shares its input with {self.shared[name]!r}"
                    )
                return
            self.accumulators[name].add(x)
            self._last = (x, name)

        return pre

    @contextmanager
    def attached(self) -> Iterator[None]:
        handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.layers.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def end_batch(self) -> None:
        """Call after each forward pass (one batch of windows)."""
        self._first = False
        self._last = (None, None)

    def result(self) -> dict[str, Any]:
        """{layer: accumulator} for every layer that ran (shared ones map to the same object)."""
        out: dict[str, Any] = dict(self.accumulators)
        out.update({name: out[owner] for name, owner in self.shared.items()})
        return out


def check_statistics_finite(stats: dict[str, Any], names: Iterable[str]) -> None:
    """Refuse statistics that overflowed or hold NaN, naming the first such layer: GPTQ's Cholesky and AWQ's
    searches would fail on them with a linear-algebra traceback, or pick a scale from NaN errors. The harness
    records the ``NonFiniteError`` as a non-finite cell. Checked on cached statistics too, so every cell of a grid
    is refused the same way, without recomputing them."""
    from qbench.quant.primitives import NonFiniteError

    bad = [n for n in names if not _finite_statistics(stats[n])]
    if bad:
        more = f" (and {len(bad) - 1} more layer(s))" if len(bad) > 1 else ""
        raise NonFiniteError(
            f"calibration: the inputs of layer {bad[0]!r}{more} hold NaN or inf, or overflow float32 in their "
            "Hessian (2/n) sum x x^T; GPTQ/AWQ cannot quantise it"
        )


def _finite_statistics(acc: Any) -> bool:
    return bool(torch.isfinite(acc.h).all()) and bool(torch.isfinite(acc.abs_sum).all())
