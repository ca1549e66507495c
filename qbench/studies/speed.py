"""Speed and memory of every quantisation scheme × mode against float32 and against other libraries' kernels.

``run_speed`` returns plain records (one dict per measurement); ``format_speed_table`` renders them. Measured in
one process, **interleaved**: every repeat runs each candidate once, round-robin, so a noisy neighbour or a clock
change hits all candidates alike; speed is a ratio to float32 measured in the same run: ``speedup`` = median
t_fp32 / median t (> 1 is faster) and ``speedup_best`` = min t_fp32 / min t, the steadier figure on a shared
machine. Layer candidates are all timed in one round-robin; whole-model candidates (a bf16 copy, each scheme's
quantised copy, each llama.cpp engine) each in a round of their own beside fp32, their ratio against those
adjacent fp32 times, and dropped before the next is built — one quantised model in memory at a time, so the
peak does not grow with the number of schemes. Each candidate runs once untimed first (warm-up; that is where
``torch.compile`` compiles).

What is measured:

- ``layer``: one linear of ``shape = (in, out)`` on a (tokens, in) input (one sequence): fp32, bf16, every
  registered scheme in every mode (via ``qbench.quant.apply.quantize``; SmoothQuant calibrates on the benchmark
  input), our int4 layer on bf16 input (the CPU int4 kernel), our int8 layer unfused, the peers — torch.ao
  ``quantize_dynamic`` int8, bitsandbytes ``Linear8bitLt``, torchao int8-dynamic when torchao is importable — and
  the bare ``torch._int_mm`` on pre-quantised codes (the ceiling of any W8A8 kernel built on it).
  ``weight_bytes`` is the layer's true storage (weights, scales, zero points, bias).
- ``bandwidth``: fake quantisation of the layer's (out, in) weight per output channel — the eager primitive and
  the fused custom op — against a plain copy of the same tensor, as GB/s (bytes read + written / time).
- ``model``: whole-model **prefill** — a ``models`` preset (default ``small``) or any ``--ckpt`` (qbench or
  transformers) on ``model_tokens`` tokens (default 512), fp32 and a bf16 copy vs each scheme × mode; ``weight_bytes`` counts
  every parameter and buffer.
- ``generate``: whole-model **generation** — greedy decoding of ``new_tokens`` tokens (default 128) after a
  16-token prompt, batch 1, with a KV cache, fp32 and bf16 vs each scheme in real mode; ``tokens_per_s`` per record.
  Our own ``Transformer`` generates with its own cache (``models.KVCache``): the prompt through the model's
  forward, each later token through qbench's decode runtime where it serves the model (``qbench.eval.decode``:
  the model's own linears — a quantised copy's real kernels — with one C call for each norm and each attention
  between them; the record's ``decode`` names the engine, and why not where the model's eager step ran), every
  step through ``Transformer.generate`` with ``generate_via="eager"``,
  or with ``generate_via="transformers"`` through its exported transformers twin (``models.hf.to_hf_model``:
  same weights, same function, the path of a user who converts the checkpoint) — quantised the same way. A
  transformers Llama-family checkpoint (a folder or a GGUF) is converted the other way
  (``models.hf.from_hf_model``, its logits checked against the transformers model's) and generates on
  qbench's graph and cache too, as llama.cpp generates on its own; ``generate_via="transformers"`` keeps
  transformers' own, and so do architectures without a qbench equivalent (the record's ``via`` says which).
- ``backend`` of a real layer names the module and, where the compiled CPU kernels run
  (``kernels/paths.py``), the instruction set they were built for.

Memory-allocator note (Linux/glibc): a fresh tensor above glibc's mmap threshold is mapped on allocation and
unmapped on free, so every call pays page faults (~28 ms per 64 MB on small VMs) that have nothing to do with
the kernel. For stable numbers run with ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000`` in the
environment (glibc reads them at start-up, so set them before Python starts); the records note whether they were.
"""

from __future__ import annotations

import copy
import gc
import inspect
import os
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError, unknown_choice
from models.transformer import Transformer, fuse_projections
from qbench.quant.apply import model_bytes, real_kernels
from qbench.quant.granularity import PerGroup
from qbench.studies.timing import time_interleaved

DEFAULT_MODES = ("fake", "real")
W8A16 = (
    "absmax-fine:a=none"  # int8 weights per output channel, float activations (an override of absmax-fine)
)
PROMPT_TOKENS = 16
MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


@dataclass
class Candidate:
    """One thing to time: ``fn`` runs one forward; ``weight_bytes`` is the storage it holds."""

    kind: str
    name: str
    fn: Callable[[], Any] | None
    scheme: str | None = None
    mode: str | None = None
    backend: str | None = None
    weight_bytes: int | Callable[[], int] | None = None  # a callable is evaluated after the warm-up (caches)
    error: str | None = None
    traffic_bytes: int | None = None  # bandwidth records: bytes read + written per call
    note: Any = None  # what a lazily built candidate's record adds (its decode engine)
    # a model-sized candidate is built only for its own round and dropped after it (``_measure``): ``build``
    # sets ``fn`` (and ``backend``, ``weight_bytes``) or raises; ``release`` drops what it built
    build: Callable[[], None] | None = None
    release: Callable[[], None] | None = None


# --------------------------------------------------------------------------------------------- timing


# what building or running one candidate may raise (a scheme with no kernel on this device, a kernel the
# device's library refuses): recorded as that row's error, so one broken backend never hides the others
CANDIDATE_ERRORS = (UserError, RuntimeError, NotImplementedError, ValueError, TypeError)


def _warm_up(candidates: list[Candidate]) -> None:
    """Run each candidate once; a failure (missing kernel, unsupported scheme) becomes the record's error."""
    for c in candidates:
        if c.fn is None:
            continue
        try:
            c.fn()
        except CANDIDATE_ERRORS as err:
            c.fn, c.error = None, f"{type(err).__name__}: {err}".splitlines()[0][:200]


# ---------------------------------------------------------------------------------------- candidates


def _quantized(model: nn.Module, scheme: str, mode: str, calibration: Tensor) -> nn.Module:
    from qbench.quant.apply import quantize

    return quantize(model, scheme, mode, calibration=calibration)  # calibration: used by SmoothQuant only


def _scheme_candidates(
    kind: str,
    model: nn.Module,
    x: Tensor,
    schemes: Sequence[str],
    modes: Sequence[str],
    calibration: Tensor,
    runner: Callable[[nn.Module, Tensor], Callable[[], Any]] | None = None,
) -> list[Candidate]:
    """Every scheme × mode of ``model`` on input ``x`` (run by ``runner``, default one inference-mode forward);
    SmoothQuant calibrates on ``calibration`` (the input)."""
    runner = runner or _forward
    out = []
    for scheme in schemes:
        for mode in modes:
            name = f"{scheme} [{mode}]"
            try:
                q = _quantized(model, scheme, mode, calibration).eval()
            except CANDIDATE_ERRORS as err:
                out.append(
                    Candidate(kind, name, None, scheme, mode, mode, error=str(err).splitlines()[0][:200])
                )
                continue
            out.append(
                Candidate(
                    kind, name, runner(q, x), scheme, mode, _backend_of(q, mode), partial(model_bytes, q)
                )
            )
    return out


def _backend_of(model: nn.Module, mode: str) -> str:
    if mode != "real":
        return mode
    names = real_kernels(model)
    from qbench.quant.kernels import NATIVE_LAYERS, native

    first = next(iter([*model.parameters(), *model.buffers()]), None)
    device = first.device if first is not None else torch.device("cpu")
    if device.type != "cpu":  # the C kernels are CPU-only: on a GPU every layer takes its torch path
        int8 = " (W8A8: torch._int_mm)" if "Int8Linear" in names else ""
        return f"{'+'.join(names) or 'real'}, torch on {device.type}{int8}"
    if native.available() and set(names) & set(NATIVE_LAYERS):
        # the int8 GEMMs' build (qbench env says which path runs at which row count)
        vnni = " + AVX-512 VNNI" if native.vnni() else ""
        return f"{'+'.join(names)}, C {native.isa()}{vnni}"
    return "+".join(names) or "real"


def _forward(module: nn.Module, x: Tensor) -> Callable[[], Any]:
    def run() -> Any:
        with torch.inference_mode():
            return module(x)

    return run


def _peer_candidates(linear: nn.Linear, x: Tensor) -> list[Candidate]:
    """Other libraries' int8 linears (built from the same weight) and the bare integer GEMM."""
    peers = []
    for name, build in (
        ("torch.ao quantize_dynamic int8", _ao_dynamic),
        ("bitsandbytes Linear8bitLt", _bnb_peer),
        ("torchao int8-dynamic", _torchao_peer),
    ):
        try:
            module = build(linear)
        except (ImportError, UserError, RuntimeError, AttributeError, NotImplementedError) as err:
            peers.append(Candidate("layer", name, None, backend="peer", error=f"unavailable: {err}"[:200]))
            continue
        peers.append(
            Candidate(
                "layer",
                name,
                _forward(module, x),
                backend="peer",
                weight_bytes=partial(model_bytes, module),
            )
        )
    peers.append(_int_mm_ceiling(linear, x))
    return peers


def _variant_candidates(linear: nn.Linear, x: Tensor) -> list[Candidate]:
    """bf16 float, our int4 layer on bf16 input (the CPU int4 kernel) and our int8 layer without fusion."""
    from qbench.quant.kernels import Int4Linear, Int8Linear

    x16 = x.to(torch.bfloat16)
    lin16 = copy.deepcopy(linear).to(torch.bfloat16)
    int4 = Int4Linear.from_float(linear.weight, linear.bias)
    int8_eager = Int8Linear.from_float(linear.weight, linear.bias, fused=False)
    w8a16 = _quantized(nn.Sequential(linear), W8A16, "real", x[None])
    return [
        Candidate(
            "layer",
            "bf16 (F.linear)",
            _forward(lin16, x16),
            backend="torch",
            weight_bytes=partial(model_bytes, lin16),
        ),
        Candidate(
            "layer",
            "zeropoint-int4 [real], bf16 input",
            _forward(int4, x16),
            "zeropoint-int4",
            "real",
            "Int4Linear int4pack kernel (bf16)",
            partial(model_bytes, int4),
        ),
        Candidate(
            "layer",
            f"{W8A16} [real] (W8A16)",
            _forward(w8a16, x),
            W8A16,
            "real",
            _backend_of(w8a16, "real"),
            partial(model_bytes, w8a16),
        ),
        Candidate(
            "layer",
            "absmax-fine [real], not fused",
            _forward(int8_eager, x),
            "absmax-fine",
            "real",
            "Int8Linear eager torch (_int_mm)",
            partial(model_bytes, int8_eager),
        ),
    ]


def _ao_dynamic(linear: nn.Linear) -> nn.Module:
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            nn.Sequential(copy.deepcopy(linear)), {nn.Linear}, dtype=torch.qint8
        ).eval()


def _bnb_peer(linear: nn.Linear) -> nn.Module:
    from qbench.quant.kernels.bnb import bnb_int8_linear

    return bnb_int8_linear(linear.weight, linear.bias, threshold=6.0)


def _torchao_peer(linear: nn.Linear) -> nn.Module:
    import torchao.quantization as tq  # optional; never installed by qbench

    model = nn.Sequential(copy.deepcopy(linear))
    config = getattr(tq, "Int8DynamicActivationInt8WeightConfig", None)
    tq.quantize_(model, config() if config else tq.int8_dynamic_activation_int8_weight())
    return model.eval()


def _int_mm_ceiling(linear: nn.Linear, x: Tensor) -> Candidate:
    from qbench.quant.kernels.int8 import int_mm

    a = torch.randint(-127, 128, x.shape, dtype=torch.int8, device=x.device)
    b = torch.randint(-127, 128, linear.weight.t().shape, dtype=torch.int8, device=x.device)
    return Candidate(
        "layer",
        "torch._int_mm alone (ceiling)",
        lambda: int_mm(a, b),
        backend="int8 GEMM only",
        weight_bytes=b.numel(),
    )


def _bandwidth_candidates(weight: Tensor) -> list[Candidate]:
    """Fake-quantise the (out, in) weight per output channel, eager and fused, vs a plain copy."""
    from qbench.quant import ops
    from qbench.quant.granularity import PerAxis
    from qbench.quant.primitives import fake_quantize

    w = weight.detach().contiguous()
    traffic = 2 * w.numel() * w.element_size()

    def fused() -> Tensor:
        with ops.cpu_fast_path(True, min_numel=1):
            return ops.fake_quantize(w, 8, PerAxis(0), True)

    return [
        Candidate("bandwidth", "copy (clone)", w.clone, backend="torch", traffic_bytes=traffic),
        Candidate(
            "bandwidth",
            "fake-quant int8 per channel, eager",
            lambda: fake_quantize(w, 8, PerAxis(0), True),
            backend="primitives",
            traffic_bytes=traffic,
        ),
        Candidate(
            "bandwidth",
            "fake-quant int8 per channel, fused op",
            fused,
            backend="ops (compiled)",
            traffic_bytes=traffic,
        ),
    ]


# --------------------------------------------------------------------------------------------- records


def _records(
    candidates: list[Candidate], times: dict[int, list[float]], reference: str, common: dict[str, Any]
) -> list[dict[str, Any]]:
    """One record per candidate. ``speedup`` compares medians; ``speedup_best`` compares minima, which is the
    steadier figure on a shared machine (contention only ever adds time)."""
    ref = next(c for c in candidates if c.name == reference)
    ref_ts = times.get(id(ref))
    records = []
    for c in candidates:
        ts = times.get(id(c))
        ms, ms_min = (statistics.median(ts) * 1e3, min(ts) * 1e3) if ts else (None, None)
        rec = {
            "kind": c.kind,
            "name": c.name,
            "scheme": c.scheme,
            "mode": c.mode,
            "backend": c.backend,
            "ms": ms,
            "ms_min": ms_min,
            "ms_repeats": [t * 1e3 for t in ts] if ts else None,  # each interleaved repeat, in order
            "speedup": statistics.median(ref_ts) * 1e3 / ms if ms and ref_ts else None,
            "speedup_best": min(ref_ts) * 1e3 / ms_min if ms_min and ref_ts else None,
            "weight_bytes": c.weight_bytes,
            "bytes_vs_fp32": c.weight_bytes / ref.weight_bytes
            if c.weight_bytes and ref.weight_bytes
            else None,
            "error": c.error,
            **common,
        }
        if c.traffic_bytes and ms:
            rec["gb_per_s"] = c.traffic_bytes / (ms * 1e-3) / 1e9
        records.append(rec)
    if candidates and candidates[0].kind == "bandwidth":
        copy_rate = records[0].get("gb_per_s")
        for rec in records:
            rec["vs_copy"] = rec["gb_per_s"] / copy_rate if copy_rate and rec.get("gb_per_s") else None
    return records


def _synchronized(fn: Callable[[], Any]) -> Any:
    out = fn()
    torch.cuda.synchronize()
    return out


def _timed(
    candidates: list[Candidate], repeats: int, common: dict[str, Any], warm: bool = True
) -> dict[int, list[float]]:
    if warm:
        _warm_up(candidates)
    for c in candidates:  # after the warm-up, so caches built on first use (int4 kernel layout) count
        if callable(c.weight_bytes):
            c.weight_bytes = c.weight_bytes()
    live = [c for c in candidates if c.fn is not None]
    fns = [c.fn for c in live]
    if common.get("device", "cpu") != "cpu":  # CUDA runs asynchronously: time to completion
        fns = [partial(_synchronized, fn) for fn in fns]
    return {id(c): t for c, t in zip(live, time_interleaved(fns, repeats))}


def _measure(candidates: list[Candidate], repeats: int, reference: str, common: dict[str, Any]) -> list[dict]:
    """Time ``candidates`` interleaved, ``repeats`` rounds; one record each, ratios against ``reference``.

    Candidates with a ``build`` (a quantised copy of a whole model, a llama.cpp engine) exist one at a time: each
    is built, timed interleaved with the reference alone for ``repeats`` rounds — its ratio is against those
    adjacent reference times — and released before the next is built, so the memory held is the reference's plus
    one candidate's, whatever the number of schemes. The reference's own record pools all its rounds."""
    lazy = [c for c in candidates if c.build is not None]
    eager = [c for c in candidates if c.build is None]
    live_eager = [c for c in eager if c.fn is not None]
    times = _timed(eager, repeats, common) if not lazy or len(live_eager) > 1 else {}
    ref = next(c for c in candidates if c.name == reference)
    records: dict[int, dict[str, Any]] = {}
    pooled = list(times.get(id(ref), []))
    if lazy and not times:
        _warm_up([ref])
    for c in lazy:
        try:
            try:
                c.build()
            except CANDIDATE_ERRORS as err:
                c.fn, c.error = None, str(err).splitlines()[0][:200]  # as a layer row says it
            _warm_up([c])
            live = c.fn is not None and ref.fn is not None
            round_times = _timed([ref, c], repeats, common, warm=False) if live else {}
            pooled += round_times.get(id(ref), [])
            records[id(c)] = _records([ref, c], round_times, reference, common)[1]
        finally:
            if c.release is not None:
                c.release()
            c.fn = None
            gc.collect()  # the candidate's model is gone before the next one is built
    if id(ref) in times or pooled:
        times[id(ref)] = pooled
    for c, rec in zip(eager, _records(eager, times, reference, common)):
        records[id(c)] = rec
    return [records[id(c)] for c in candidates]


def _layer_records(
    shape: tuple[int, int],
    tokens: int,
    repeats: int,
    schemes: Sequence[str],
    modes: Sequence[str],
    peers: bool,
    common: dict[str, Any],
) -> list[dict]:
    in_features, out_features = shape
    linear = nn.Linear(in_features, out_features).eval().to(common["device"])
    x = torch.randn(tokens, in_features, device=common["device"])
    fp32 = Candidate(
        "layer",
        "fp32 (F.linear)",
        _forward(linear, x),
        backend="torch",
        weight_bytes=partial(model_bytes, linear),
    )
    candidates = [fp32, *_variant_candidates(linear, x), *(_peer_candidates(linear, x) if peers else [])]
    candidates += _scheme_candidates("layer", nn.Sequential(linear), x, schemes, modes, calibration=x[None])
    return _measure(candidates, repeats, fp32.name, common)


def _load_model(preset: str | None, ckpt: str | None) -> tuple[nn.Module, str, int, int]:
    """(float model, display name, context length, vocabulary size) of a preset or a checkpoint."""
    if ckpt is not None:
        from qbench.eval.load import load_model

        loaded = load_model(ckpt)
        model = loaded.model.eval()
        # transformers refuses .float() on a model read from a GGUF (it flags it quantised, though its weights
        # are dequantised float32): cast only what is not float32 already
        if any(p.dtype != torch.float32 for p in model.parameters()):
            model = model.float()
        config = getattr(model, "config", None)
        context = getattr(config, "context", None) or getattr(config, "max_position_embeddings", None) or 512
        vocab = getattr(config, "vocab_size", None) or len(loaded.tokenizer)
        return model, loaded.name, int(context), int(vocab)
    from models import build, preset_config

    config = preset_config(preset)
    return build(config, seed=0).eval(), preset, config.context, config.vocab_size


def check_generation_fits(name: str, context: int, new_tokens: int) -> None:
    """Refuse, in one line, a generation the model's context cannot hold: every row of the figure would record
    the same error, after the minutes of timing before it."""
    needed = PROMPT_TOKENS + new_tokens - 1  # the last new token is produced, never fed back
    if needed <= context:
        return
    largest = context - PROMPT_TOKENS + 1
    fix = f"the largest valid --new-tokens is {largest}, or" if largest >= 1 else "no --new-tokens fits:"
    raise UserError(
        f"--new-tokens {new_tokens} does not fit {name}'s context of {context} tokens: the "
        f"{PROMPT_TOKENS}-token prompt and {new_tokens} new tokens need {needed} positions (the last token is not "
        f"fed back); {fix} pass --no-generate"
    )


def _is_transformers(model: nn.Module) -> bool:
    """A transformers model (its own generation API and ``use_cache``), as opposed to our ``Transformer``."""
    return (
        not isinstance(model, Transformer)
        and callable(getattr(model, "generate", None))
        and hasattr(model, "config")
    )


def _bf16(model: nn.Module) -> nn.Module:
    """A bfloat16 copy: the float baseline a deployment would compare with (AMX/AVX512-BF16 GEMMs where the CPU
    has them, a conversion on every matmul where it does not), beside fp32 in the same run."""
    return copy.deepcopy(model).to(torch.bfloat16)


def _prefill(model: nn.Module, ids: Tensor) -> Callable[[], Any]:
    kwargs = {"use_cache": False} if _is_transformers(model) else {}

    def run() -> Any:
        with torch.inference_mode():
            return model(ids, **kwargs)

    return run


def _model_records(
    model: nn.Module,
    name: str,
    context: int,
    vocab: int,
    tokens: int,
    repeats: int,
    schemes: Sequence[str],
    modes: Sequence[str],
    common: dict[str, Any],
) -> list[dict]:
    """Prefill: ``tokens`` tokens as windows of at most the context, fp32 vs every scheme × mode."""
    batch = max(1, tokens // context)
    ids = torch.randint(0, vocab, (batch, min(tokens, context)), device=common["device"])
    fp32 = Candidate("model", f"{name} fp32", _prefill(model, ids), backend="torch")
    fp32.weight_bytes = partial(model_bytes, model)
    bf16 = _lazy("model", f"{name} bf16", lambda: _bf16(model), lambda m: (_prefill(m, ids), None), "torch")
    candidates = [fp32, bf16]
    for scheme in schemes:
        for mode in modes:

            def build(scheme: str = scheme, mode: str = mode) -> nn.Module:
                return _quantized(model, scheme, mode, ids).eval()

            candidates.append(
                _lazy(
                    "model",
                    f"{scheme} [{mode}]",
                    build,
                    lambda q: (_prefill(q, ids), None),
                    mode,
                    scheme=scheme,
                    mode=mode,
                )
            )
    extra = {**common, "model": name, "model_tokens": ids.numel()}
    return _measure(candidates, repeats, fp32.name, extra)


def _lazy(
    kind: str,
    name: str,
    make: Callable[[], nn.Module],
    run: Callable[[nn.Module], tuple[Callable[[], Any], Any]],
    backend: str,
    scheme: str | None = None,
    mode: str | None = None,
    on_release: Callable[[Candidate, nn.Module], None] | None = None,
) -> Candidate:
    """A whole-model candidate built only for its own round (``_measure``): ``make`` builds the model, ``run``
    gives its timed call (and anything its record should say, kept as ``c.note``); ``on_release`` sees the
    candidate and its model once more before the model is dropped (per-model figures taken while it exists)."""
    c = Candidate(kind, name, None, scheme, mode, backend)
    held: dict[str, nn.Module] = {}

    def build() -> None:
        held["model"] = m = make()
        c.fn, c.note = run(m)
        if mode == "real" or (mode is None and scheme is not None):
            c.backend = _backend_of(m, "real")
        c.weight_bytes = partial(model_bytes, m)

    def release() -> None:
        m = held.pop("model", None)
        if m is not None and on_release is not None:
            on_release(c, m)
        c.weight_bytes = c.weight_bytes() if callable(c.weight_bytes) else c.weight_bytes

    c.build, c.release = build, release
    return c


def greedy_generate(model: nn.Module, prompt: Tensor, new_tokens: int) -> Tensor:
    """``new_tokens`` greedy tokens after ``prompt`` (1, P) with the model's KV cache: our models' own
    (``models.KVCache``, through ``Transformer.generate``: every step the model's torch forward), a transformers
    model's through its API."""
    if not _is_transformers(model):
        return model.generate(prompt, new_tokens)
    # transformers 5 names the cache argument and output ``cache`` (``past_key_values`` before)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out_ids = []
    with torch.inference_mode():
        out = model(prompt, use_cache=True)
        for i in range(new_tokens):
            token = out.logits[:, -1:].argmax(-1)
            out_ids.append(token)
            if i + 1 < new_tokens:
                out = model(token, use_cache=True, **{name: out[name]})
    return torch.cat(out_ids, dim=1)


def _generator(model: nn.Module, prompt: Tensor, new_tokens: int, via: str) -> tuple[Callable[[], Any], str]:
    """One candidate's generation call and the engine of its decode steps: with ``via="own"``, qbench's decode
    runtime where it serves the model (``qbench.eval.decode``: C norms and attention between the model's own
    linears), else — and with ``via="eager"`` — the model's torch forward every step; transformers' loop for a
    transformers model."""
    from qbench.eval import decode

    if not isinstance(model, Transformer):
        return partial(greedy_generate, model, prompt, new_tokens), "transformers forward per step"
    return decode.generator(
        model, prompt, new_tokens, eager="--generate-via eager" if via == "eager" else None
    )


# own: qbench's graph and KV cache, decode steps through the runtime where it serves the model; eager: the same
# graph, every step the model's torch forward (what the runtime is tested against); transformers: transformers'
GENERATE_VIA = ("own", "eager", "transformers")


def fusable(scheme: str) -> bool:
    """Quantising ``fuse_projections``' fused q/k/v and gate/up gives what quantising them apart gives: integer
    round-to-nearest with weight scales per output channel or group (a row never sees another's values), no
    per-layer calibration (SmoothQuant, static scales, GPTQ/AWQ, rotations) and no output quantisation."""
    from qbench.quant.kernels.registry import per_out_channel
    from qbench.quant.schemes import get_scheme

    try:
        s = get_scheme(scheme)
    except UserError:
        return False
    return (
        s.method == "rtn"
        and s.algo == "rtn"
        and s.rotate == "none"
        and getattr(s, "format", "int") == "int"
        and not s.static
        and s.out_bits is None
        and (per_out_channel(s) or isinstance(s.weight_granularity, PerGroup))
    )


def _generation_model(model: nn.Module, via: str = "own") -> tuple[nn.Module, str]:
    """A model with a KV cache: ours with their own cache (``via="own"`` or ``"eager"``) or exported to
    transformers (``via="transformers"``, the path of a user who converts the checkpoint); a transformers model
    converted to ours where it has an equivalent (``models.hf.from_hf_model``), else as it is."""
    if via not in GENERATE_VIA:
        raise unknown_choice("generation path", via, GENERATE_VIA)
    if _is_transformers(model):
        if via == "transformers":
            return model, "transformers (KV cache)"
        from models.hf import from_hf_model

        vocab = model.config.vocab_size
        check = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
        try:  # the same function on qbench's graph: logits checked against transformers' before any timing
            return from_hf_model(model, check=check), "qbench models.KVCache (converted from transformers)"
        except UserError as e:  # no qbench equivalent: transformers' graph, said so
            return model, f"transformers (KV cache; no qbench equivalent: {str(e)[:120]})"
    if via != "transformers":
        return model, "qbench models.KVCache"
    from models.hf import to_hf_model

    device = next(model.parameters()).device
    return to_hf_model(model).to(device), "exported to transformers (KV cache)"


def _generate_records(
    model: nn.Module,
    name: str,
    vocab: int,
    new_tokens: int,
    repeats: int,
    schemes: Sequence[str],
    common: dict[str, Any],
    via: str = "own",
    llama_cpp_types: Sequence[str] = (),
    ckpt: str | None = None,
) -> list[dict]:
    """Generation: tokens/s of greedy decoding, batch 1, fp32 vs every scheme in real mode (and, with
    ``llama_cpp_types``, the same model generated by llama.cpp at each of those types:
    ``qbench.studies.llamacpp``)."""
    if not llama_cpp_types:
        return _generation(model, name, vocab, new_tokens, repeats, schemes, common, via)
    from qbench.studies import llamacpp

    with llamacpp.engines(
        model, ckpt, llama_cpp_types, common["threads"], PROMPT_TOKENS + new_tokens
    ) as loaded:
        matched = llamacpp.matched_schemes([e.type_name for e in loaded if e.type_name in llamacpp.MATCHED])
        schemes = [*schemes, *(m for m in matched if m not in schemes)]
        extra = []
        for e in loaded:
            c = Candidate("generate", f"llama.cpp {e.type_name}", None, backend=e.backend, error=e.error)
            if e.error is None:  # opened for its own round only: each engine maps its whole file

                def build(c: Candidate = c, e: Any = e) -> None:
                    generator = e.open()
                    c.fn = generator.generate  # bound to the prompt in _generation, which owns it
                    c.weight_bytes = generator.weight_bytes()

                c.build, c.release = build, e.close
            extra.append((c, e.fields))
        records = _generation(model, name, vocab, new_tokens, repeats, schemes, common, via, extra)
    llamacpp.annotate(records, name)
    return records


def _generation(
    model: nn.Module,
    name: str,
    vocab: int,
    new_tokens: int,
    repeats: int,
    schemes: Sequence[str],
    common: dict[str, Any],
    via: str = "own",
    extra_candidates: Sequence[tuple[Candidate, dict[str, Any]]] = (),
) -> list[dict]:
    """The generation figure's candidates timed together; each of ``extra_candidates`` (an outside engine's
    generator taking (prompt ids, new tokens), and fields for its record) gets the same prompt."""
    gen_model, how = _generation_model(model, via)
    separate, how_separate = gen_model, how
    if isinstance(gen_model, Transformer) and gen_model.config.family == "llama":
        gen_model = fuse_projections(gen_model)  # q/k/v and gate/up one matmul each, as engines store them
        how += ", q/k/v and gate/up fused"
    prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), device=common["device"])
    calibration = torch.randint(0, vocab, (2, PROMPT_TOKENS * 4), device=common["device"])
    from qbench.studies.overhead import linear_kernel_ms

    on_cpu = common["device"] == "cpu"  # CUDA kernels run asynchronously: not timed one by one here
    kernels_ms: dict[str, float | None] = {}  # the linear layers' kernels of each net, taken while it exists

    def generate(net: nn.Module) -> tuple[Callable[[], Any], str]:
        return _generator(net, prompt, new_tokens, via)  # through its decode engine (where it serves the net)

    def kernels(c: Candidate, net: nn.Module) -> None:
        if on_cpu and c.fn is not None:
            kernels_ms[c.name] = linear_kernel_ms(net)

    fp32 = Candidate("generate", f"{name} fp32", None)
    fp32.backend, fp32.weight_bytes = "torch", partial(model_bytes, gen_model)
    fp32.fn, fp32.note = generate(gen_model)
    bf16 = _lazy("generate", f"{name} bf16", lambda: _bf16(gen_model), generate, "torch", on_release=kernels)
    candidates = [fp32, bf16]
    fields_of: dict[str, dict[str, Any]] = {}
    for scheme in schemes:
        # the fused copy where quantising it equals quantising the layers apart, else the separate layers
        fused = fusable(scheme)
        source = gen_model if fused else separate

        def build(scheme: str = scheme, source: nn.Module = source) -> nn.Module:
            return _quantized(source, scheme, "real", calibration).eval()

        c = _lazy("generate", f"{scheme} [real]", build, generate, "real", scheme, "real", on_release=kernels)
        if not fused:
            fields_of[c.name] = {"via": how_separate}
        candidates.append(c)
    for c, fields in extra_candidates:
        if c.build is not None:
            opened = c.build

            def bound(c: Candidate = c, opened: Callable[[], None] = opened) -> None:
                opened()
                c.fn = partial(c.fn, prompt[0].tolist(), new_tokens)

            c.build = bound
        candidates.append(c)
        fields_of[c.name] = fields
    extra = {**common, "model": name, "new_tokens": new_tokens, "prompt_tokens": PROMPT_TOKENS, "via": how}
    extra["repeats"] = repeats  # capped: one call generates every token
    if on_cpu:
        kernels_ms[fp32.name] = None  # measured after the rounds, on the float model that stays
    records = _measure(candidates, repeats, fp32.name, extra)
    if on_cpu:
        kernels_ms[fp32.name] = linear_kernel_ms(gen_model)
    for c, rec in zip(candidates, records):
        rec.update(fields_of.get(rec["name"], {}))
        if c.note is not None and c.kind == "generate" and not rec["name"].startswith("llama.cpp"):
            rec["decode"] = c.note
    for rec in records:
        rec["tokens_per_s"] = new_tokens / (rec["ms_min"] * 1e-3) if rec["ms_min"] else None
        # the linear layers' kernels alone per step against the measured time per token (the 16-token prompt's
        # prefill spread over the steps): what the rest — attention, norms, Python — costs
        kernels = kernels_ms.get(rec["name"]) if rec["ms_min"] else None
        per_token = rec["ms_min"] / new_tokens if rec["ms_min"] else None
        rec["linear_kernels_ms"] = kernels
        rec["ms_per_token"] = per_token
        rec["linear_share"] = kernels / per_token if kernels and per_token else None
    return records


def run_speed(
    shape: tuple[int, int] = (1024, 4096),
    tokens: int = 512,
    threads: int = 1,
    repeats: int = 15,
    schemes: Sequence[str] | None = None,
    modes: Sequence[str] = DEFAULT_MODES,
    peers: bool = True,
    bandwidth: bool = True,
    model: str | None = "small",
    seed: int = 0,
    ckpt: str | None = None,
    model_tokens: int = 512,
    new_tokens: int = 128,
    generate: bool = True,
    layer: bool = True,
    device: str = "cpu",
    generate_via: str = "own",
    kv: bool = True,
    kv_configs: Sequence[Any] | None = None,
    kv_contexts: Sequence[int] = (1024, 4096),
    kv_new_tokens: int = 16,
    llama_cpp_types: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Measure every scheme × mode per layer, the peers, fake-quant bandwidth and a whole model; return records.

    ``shape`` is (in_features, out_features); ``schemes`` defaults to every registered scheme; the whole model is
    ``ckpt`` (a qbench or transformers checkpoint) when given, else the ``model`` preset (None: no whole-model
    figures): prefill on ``model_tokens`` tokens and, with ``generate``, ``new_tokens`` tokens of greedy
    generation (``repeats`` capped at 3 there: one call generates them all; our models decode with their own
    KV cache, or exported to transformers with ``generate_via="transformers"``). ``layer=False`` skips the
    per-layer and bandwidth figures. ``device`` ("cpu", "cuda", "cuda:N") holds every tensor and model (peers
    that have no kernel there record the error). ``torch.set_num_threads(threads)`` holds
    inside and the previous count is restored. Records carry ``ms`` (median), ``ms_min``, ``speedup`` and
    ``speedup_best`` vs fp32 of the same kind, ``weight_bytes``, ``bytes_vs_fp32`` and ``error`` (why a candidate
    did not run: no real kernel, peer not installed); bandwidth records add ``gb_per_s`` and ``vs_copy``.

    ``kv``: the KV-cache section (``qbench.studies.kvspeed.kv_generation_records``, records of kind ``kv``) —
    generation through the packed cache of each of ``kv_configs`` (default ``kvspeed.default_kv_configs()``) vs
    the float cache, after a prefill of each of ``kv_contexts`` tokens, ``kv_new_tokens`` decode steps timed.
    A preset is built (randomly initialised, seed 0) with its context raised to the longest prefill plus the new
    tokens when it is shorter; a checkpoint keeps its own context (longer prefills are recorded as errors).
    ``llama_cpp_types`` (e.g. ``("F32", "Q8_0")``): the generation figure adds the same model generated by
    llama.cpp at each type (``qbench.studies.llamacpp``), timed with qbench's rows.
    Every record carries ``threads``, ``cpu``, ``torch``, ``git_commit`` and ``seed``.
    """
    if schemes is None:
        from qbench.quant.schemes import SCHEMES

        schemes = [s for s in SCHEMES.names() if SCHEMES.get(s).method != "gguf"]  # llama.cpp: --llama-cpp
    from qbench.eval.load import check_device

    device = str(check_device(device))
    if generate_via not in GENERATE_VIA:
        raise unknown_choice("generation path", generate_via, GENERATE_VIA)
    if min(threads, tokens, repeats, model_tokens, new_tokens, kv_new_tokens, *kv_contexts) < 1:
        raise UserError(
            f"threads, tokens, repeats, model tokens, new tokens and KV contexts must be ≥ 1, got {threads}, "
            f"{tokens}, {repeats}, {model_tokens}, {new_tokens}, {kv_new_tokens}, {list(kv_contexts)}"
        )
    if kv and (model or ckpt):
        from qbench.studies.kvspeed import default_kv_configs

        kv_configs = (
            list(kv_configs) if kv_configs else default_kv_configs()
        )  # bad configs fail before timing
    if generate and model and not ckpt:  # a preset's context is known without building it
        from models import preset_config

        check_generation_fits(model, preset_config(model).context, new_tokens)
    net = None
    if model or ckpt:
        # before anything is measured: a checkpoint's context is known once it is loaded, and a generation it
        # cannot hold is refused then, not minutes later as an error in every row
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
            net, name, context, vocab = _load_model(model, ckpt)
        if generate:
            check_generation_fits(name, context, new_tokens)
        net = net.to(device)
    common = {
        **measured_where(threads, device, seed),
        "shape": list(shape),
        "tokens": tokens,
        "repeats": repeats,
        "malloc_env": all(v in os.environ for v in MALLOC_ENV),
    }
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            records = []
            if layer:
                records += _layer_records(tuple(shape), tokens, repeats, schemes, modes, peers, common)
            if layer and bandwidth:
                weight = torch.randn(shape[1], shape[0], device=device)
                records += _measure(_bandwidth_candidates(weight), repeats, "copy (clone)", common)
            if layer:
                from qbench.studies.overhead import call_overhead_records

                records += call_overhead_records(common)
            if net is not None:
                records += _model_records(
                    net, name, context, vocab, model_tokens, repeats, schemes, modes, common
                )
                if generate:
                    records += _generate_records(
                        net,
                        name,
                        vocab,
                        new_tokens,
                        min(repeats, 3),
                        schemes,
                        common,
                        generate_via,
                        llama_cpp_types,
                        ckpt,
                    )
                if kv:
                    records += _kv_records(
                        net, name, model, ckpt, kv_configs, kv_contexts, kv_new_tokens, repeats, seed, common
                    )
    finally:
        torch.set_num_threads(previous_threads)
    return records


def _kv_records(
    net: nn.Module,
    name: str,
    preset: str | None,
    ckpt: str | None,
    configs: Sequence[Any],
    contexts: Sequence[int],
    new_tokens: int,
    repeats: int,
    seed: int,
    common: dict[str, Any],
) -> list[dict]:
    """The KV-cache section: a preset rebuilt with a context that holds the longest prefill (weights do not
    change the speed), a checkpoint as loaded."""
    from qbench.studies.kvspeed import kv_generation_records

    needed = max(contexts) + new_tokens
    if ckpt is None and net.config.context < needed:
        from models import build, preset_config

        net = build(preset_config(preset, context=needed), seed=0).eval().to(common["device"])
    extra = {k: v for k, v in common.items() if k not in ("shape", "tokens", "repeats", "seed")}
    return kv_generation_records(net, name, configs, contexts, new_tokens, min(repeats, 3), seed, extra)


def measured_where(threads: int, device: str, seed: int) -> dict[str, Any]:
    """What every timing record says of where it was made: threads, torch, CPU, device, the C kernels' build, the
    git commit and the seed."""
    from models.io import git_commit

    return {
        "threads": threads,
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "device": device,
        "native_isa": _native_isa(),
        "git_commit": git_commit(),
        "seed": seed,
    }


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), so every record says where it was measured."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("model name")), "")
    except OSError:
        line = ""
    import platform

    return line.split(":", 1)[1].strip() if ":" in line else platform.processor() or "unknown"


def _native_isa() -> str | None:
    from qbench.quant.kernels import native
    from qbench.quant.kernels.build import ISA_ENV, isa_target

    if not native.available():
        return None
    isa = f"{native.isa()} + AVX-512 VNNI" if native.vnni() else native.isa()
    target = isa_target()  # a lower build than this CPU's, named so the figure is not read as this CPU's best
    return isa if target == "native" else f"{isa} ({ISA_ENV}={target})"


# ---------------------------------------------------------------------------------------------- table


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_speed_table(records: Sequence[dict[str, Any]], tablefmt: str = "simple") -> str:
    """A text table (``tabulate`` format name) grouped by kind: time, speed-up vs fp32, storage, bandwidth."""
    from tabulate import tabulate

    sections = []
    for kind, title in (
        ("layer", "per layer"),
        ("bandwidth", "fake-quant bandwidth"),
        ("overhead", "per-call overhead at decode"),
        ("model", "whole model, prefill"),
        ("generate", "whole model, generation"),
        ("kv", "KV cache, generation"),
    ):
        rows = [r for r in records if r["kind"] == kind]
        if not rows:
            continue
        if kind == "kv":
            sections += _kv_sections(rows, tablefmt)
            continue
        if kind == "overhead":
            from qbench.studies.overhead import overhead_table

            r0 = rows[0]
            head = (
                f"per-call overhead at decode: {r0['shape'][0]}→{r0['shape'][1]}, 1 row, {r0['threads']} thread(s), "
                f"{r0['cpu']}, median of {r0['calls']} interleaved calls (overhead = layer − its bound C call)\n"
            )
            sections.append(head + ("\n" if tablefmt == "github" else "") + overhead_table(rows, tablefmt))
            continue
        head = _section_title(title, rows[0]) + ("\n" if tablefmt == "github" else "")  # md: a blank line
        if kind == "bandwidth":
            table = [
                [
                    r["name"],
                    _fmt(r["ms"], ".3f"),
                    _fmt(r.get("gb_per_s"), ".1f"),
                    _fmt(r.get("vs_copy") and 100 * r["vs_copy"], ".0f"),
                ]
                for r in rows
            ]
            sections.append(
                head + tabulate(table, ["candidate", "ms", "GB/s", "% of copy"], tablefmt=tablefmt)
            )
            continue
        table = [
            [
                r["name"],
                r["backend"] or "",
                _fmt(r["ms"], ".2f"),
                _fmt(r["speedup"], ".2f"),
                _fmt(r.get("speedup_best"), ".2f"),
                _fmt(r["weight_bytes"] and r["weight_bytes"] / 2**20, ".2f"),
                _fmt(r["bytes_vs_fp32"], ".3f"),
                *(
                    [
                        _fmt(r.get("tokens_per_s"), ".1f"),
                        _fmt(r.get("linear_share") and 100 * r["linear_share"], ".0f"),
                    ]
                    if kind == "generate"
                    else []
                ),
                _short(r["error"] or _other_engine(r, rows[0])),
            ]
            for r in rows
        ]
        headers = [
            "candidate",
            "backend",
            "ms (median)",
            "speed-up",
            "speed-up (min)",
            "MiB",
            "× fp32 bytes",
            *(["tokens/s (best)", "% linear kernels"] if kind == "generate" else []),
            "note",
        ]
        sections.append(head + tabulate(table, headers, tablefmt=tablefmt))
        if kind == "generate" and any(r.get("llama_cpp_type") for r in rows):
            sections.append(_llama_cpp_section(rows, tablefmt))
    return "\n\n".join(sections)


def _llama_cpp_section(rows: Sequence[dict[str, Any]], tablefmt: str) -> str:
    """Each llama.cpp type beside the qbench row of matched bits: tokens/s (best of the same run) and the ratio."""
    from tabulate import tabulate

    by_name = {r["name"]: r for r in rows}
    table = []
    for r in rows:
        if not r.get("llama_cpp_type"):
            continue
        ours = by_name.get(r.get("qbench_match") or "", {})
        types = r.get("gguf_tensor_types") or {}
        table.append(
            [
                r["llama_cpp_type"],
                ", ".join(f"{k} {v}" for k, v in sorted(types.items(), key=lambda kv: -kv[1])),
                _fmt(r.get("tokens_per_s"), ".1f"),
                r.get("qbench_match") or "",
                _fmt(ours.get("tokens_per_s"), ".1f"),
                _fmt(r.get("qbench_vs_llama_cpp"), ".2f"),
                _short(r["error"]),
            ]
        )
    r0 = rows[0]
    head = (
        f"llama.cpp at matched bits: {r0['model']}, same prompt ids, {r0['new_tokens']} new tokens, "
        f"{r0['threads']} thread(s) each, {r0['cpu']}\n" + ("\n" if tablefmt == "github" else "")
    )
    headers = [
        "llama.cpp",
        "tensor types",
        "tokens/s",
        "qbench match",
        "qbench tokens/s",
        "qbench / llama.cpp",
        "note",
    ]
    return head + tabulate(table, headers, tablefmt=tablefmt)


def _kv_sections(rows: Sequence[dict[str, Any]], tablefmt: str) -> list[str]:
    """One table per context: each cache's bytes and decode tokens/s with their ratios to the float cache."""
    from tabulate import tabulate

    out = []
    for context in dict.fromkeys(r["context"] for r in rows):
        group = [r for r in rows if r["context"] == context]
        first = group[0]
        title = (
            f"KV cache, generation: {first['model']}, prefill {context} tokens then {first['new_tokens']} decode "
            f"steps timed, batch 1, packed cache (codes + scales, dequantised on read) vs the "
            f"{first.get('float_dtype', 'float')} cache"
        )
        head = _section_title(title, {**first, "kind": "kv"}) + ("\n" if tablefmt == "github" else "")
        table = [
            [
                r["cache"],
                _fmt(r["cache_bytes"] and r["cache_bytes"] / 2**20, ".2f"),
                _fmt(r["bytes_vs_float"], ".3f"),
                _fmt(r["ms"], ".1f"),
                _fmt(r.get("tokens_per_s"), ".1f"),
                _fmt(r["speedup"], ".2f"),
                _fmt(r.get("speedup_best"), ".2f"),
                {True: "yes", False: "no", None: "-"}[r.get("tokens_equal_float")],
                _short(r["error"]),
            ]
            for r in group
        ]
        headers = [
            "cache",
            "MiB",
            "× float bytes",
            "ms (median)",
            "tokens/s (best)",
            "speed vs float",
            "speed vs float (min)",
            "same tokens",
            "note",
        ]
        out.append(head + tabulate(table, headers, tablefmt=tablefmt))
    return out


def _other_engine(rec: dict[str, Any], first: dict[str, Any]) -> str | None:
    """A generation row's decode engine where it is not the one the section's title names (the first row's)."""
    engine = rec.get("decode")
    return None if engine is None or engine == first.get("decode") else f"decode: {engine}"


def _short(note: str | None, width: int = 60) -> str:
    return "" if not note else note if len(note) <= width else note[: width - 1] + "…"


def _section_title(title: str, rec: dict[str, Any]) -> str:
    if rec["kind"] == "kv":  # the title says the shape
        title, shape = title.split(": ", 1)
    else:
        shape = f"{rec['shape'][0]}→{rec['shape'][1]}, {rec['tokens']} tokens"
    if rec["kind"] == "model":
        shape = f"{rec['model']}, {rec['model_tokens']} tokens"
    if rec["kind"] == "generate":
        shape = (
            f"{rec['model']}, {rec['new_tokens']} new tokens after {rec['prompt_tokens']}, batch 1, KV cache"
            f" ({rec['via']})"
        )
        if rec.get("decode"):  # records before the runtime: every step the model's forward
            shape += f", decode steps: {rec['decode']}"
    on_cpu = rec.get("device", "cpu") == "cpu"  # the C kernels are CPU-only
    if rec["kind"] in ("model", "generate") and rec.get("native_isa") and on_cpu:
        shape += f", C kernels: {rec['native_isa']}"
    malloc = "" if rec.get("malloc_env") else " (MALLOC_* env not set: timings include page faults)"
    cpu = f", {rec['cpu']}" if rec.get("cpu") else ""
    if not on_cpu:
        cpu = f", {rec['device']}"
    return (
        f"{title}: {shape}, {rec['threads']} thread(s){cpu}, {rec['repeats']} interleaved repeats{malloc}\n"
    )
