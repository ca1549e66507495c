"""The training loop: warmup + cosine, clipping, accumulation, autocast, eval, probes, checkpoints, resume.

    from trainers.loop import TrainConfig, train
    summary = train(TrainConfig(preset="tiny", recipe="paper", steps=500), "ckpts/tiny_paper")

One optimiser step ("step") consumes the global batch: ``batch_size`` windows of ``context`` predicted tokens
(``trainers.batches``), split over processes (``trainers.distributed``) and ``grad_accum`` micro-batches. The
loss is the mean cross-entropy over the global batch's predicted tokens. Step ``s`` (1-based) uses

    lr(s) = lr · s / W                                                  for s ≤ W (linear warmup)
    lr(s) = lr_min + ½ (lr − lr_min) (1 + cos(π (s − W) / (S − W)))    after, with lr_min = lr · min_lr_ratio

(S = total steps, W = warmup steps; default W = S // 20). Gradients are clipped to a global 2-norm ``clip``
(``clip <= 0``: no clipping); ``grad_norm`` in the log is the norm before clipping.

Logged to ``<out>/metrics.jsonl``, one JSON object per step: step, tokens (predicted tokens so far), lr, loss,
grad_norm, tokens_per_s (all processes), step_s (seconds of the whole step), optim_s (seconds of
``optimizer.step()`` within it), mfu (model FLOPs utilisation, ``trainers.throughput``: 6·N + 12·L·d·T FLOPs per
token over the device's peak; null on a CPU); every ``eval_every`` steps val_loss (mean cross-entropy over the fixed validation windows); every
``probe_every`` steps ``probe``: the outlier/attention statistics of
``models.stats.OutlierAccumulator.summary()`` on the fixed probe batch, computed in float32 — the emergence
curve. Step 0 (the initialised model) gets val_loss and probe too.

Speed: ``compile=True`` runs the training forward/backward through ``torch.compile`` (evaluation, probes and
checkpoints use the plain model); AdamW/SGD take torch's fused step on CUDA and the foreach step on the CPU
(bit-identical to the single-tensor step there); bf16 autocast on CUDA (``dtype``). ``data`` may name a
token-file folder made by ``qbench data prepare`` (``trainers.tokenfiles``): windows then come in a
non-repeating order.

Determinism: on the CPU with a fixed thread count, a run stopped (``stop_at``) or killed and then resumed ends
with weights bit-identical to an uninterrupted run (the data order is a function of (seed, step), the optimiser
state is saved exactly, and nothing else is random). On CUDA bf16 autocast is used and exactness is not claimed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import PRESETS, build, get_preset, preset_config
from models.checkpoint import check_tokenizer_fits, load_checkpoint
from models.config import ModelConfig
from models.errors import UserError, unknown_choice
from models.observe import observe
from models.stats import OutlierAccumulator
from trainers import distributed, state
from trainers.batches import WindowSampler, probe_windows, shard_rows, validation_windows
from trainers.optim.registry import OPTIMIZERS, build_optimizer, optimizer_param_groups, optimizer_settings
from trainers.recipes import RECIPES
from trainers.throughput import describe as describe_throughput
from trainers.throughput import mfu
from trainers.tokenfiles import TokenFiles, TokenFileSampler, is_tokenfiles

DEFAULT_STEPS = (
    500  # ~1 M predicted tokens at batch 16 x 128: where outliers emerge on `tiny` (results/emergence/)
)
DTYPES = ("auto", "float32", "bfloat16")
# Fields that may differ when resuming: they change what is logged or saved, not the training trajectory.
RESUMABLE_CHANGES = frozenset(
    {"eval_every", "eval_tokens", "probe_every", "probe_batch", "ckpt_every", "device"}
)


class TrainingDiverged(UserError):
    """The loss or the gradient norm stopped being finite; the last good checkpoint is kept."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (written into every checkpoint's provenance).

    ``switches`` are ``ModelConfig`` overrides applied after the recipe's (``attn``, ``norm``, ``n_layer``, ...);
    ``optim`` overrides the recipe's optimiser; ``context`` overrides the preset's (the model's and the windows').
    ``steps`` or ``tokens`` (predicted tokens; rounded up to whole steps) sets the schedule's length.
    ``dtype``: ``auto`` = bf16 autocast on CUDA, float32 on the CPU; ``bfloat16`` is CUDA-only.
    ``compile``: train through ``torch.compile`` (same mathematics, other rounding: not bit-equal to eager).
    """

    preset: str = "tiny"
    recipe: str = "vanilla"
    switches: dict[str, Any] = field(default_factory=dict)
    optim: str | None = None
    lr: float = 4e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    steps: int | None = None
    tokens: int | None = None
    batch_size: int = 16
    grad_accum: int = 1
    context: int | None = None
    clip: float = 1.0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    seed: int = 0
    data: str = "embedded"
    bos: bool = True
    eval_every: int = 100
    eval_tokens: int = 16384
    probe_every: int = 100
    probe_batch: int = 8
    ckpt_every: int = 500
    dtype: str = "auto"
    device: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "preset", PRESETS.canonical(self.preset))
        object.__setattr__(self, "recipe", RECIPES.canonical(self.recipe))
        if self.optim is not None:
            object.__setattr__(self, "optim", OPTIMIZERS.canonical(self.optim))
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        object.__setattr__(self, "switches", dict(self.switches))
        _validate(self)
        self.model_config()  # bad switch names or values fail here, before any work

    def model_config(self) -> ModelConfig:
        switches = {**RECIPES.get(self.recipe).model_switches(), **self.switches}
        if self.context is not None:
            switches["context"] = self.context
        return preset_config(self.preset, **switches)

    @property
    def optimizer(self) -> str:
        return self.optim or RECIPES.get(self.recipe).optim

    @property
    def window(self) -> int:
        return self.model_config().context

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.window

    @property
    def total_steps(self) -> int:
        if self.tokens is not None:
            return max(1, math.ceil(self.tokens / self.tokens_per_step))
        return self.steps if self.steps is not None else DEFAULT_STEPS

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else self.total_steps // 20

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise unknown_choice("training config field", key, known)
        return cls(**data)


def _validate(cfg: TrainConfig) -> None:
    positive = (
        "batch_size",
        "grad_accum",
        "eval_every",
        "eval_tokens",
        "probe_every",
        "probe_batch",
        "ckpt_every",
    )
    for name in positive:
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            raise UserError(f"{name} must be a positive integer, got {getattr(cfg, name)!r}")
    for name in ("steps", "tokens", "context"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise UserError(f"{name} must be a positive integer, got {getattr(cfg, name)!r}")
    if cfg.steps is not None and cfg.tokens is not None:
        raise UserError("give steps or tokens, not both")
    if not cfg.lr > 0 or not 0 <= cfg.min_lr_ratio <= 1:
        raise UserError(
            f"need lr > 0 and 0 <= min_lr_ratio <= 1, got lr={cfg.lr}, min_lr_ratio={cfg.min_lr_ratio}"
        )
    if cfg.warmup is not None and cfg.warmup < 0:
        raise UserError(f"warmup must be >= 0, got {cfg.warmup}")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise UserError(f"betas must be two numbers in [0, 1), got {cfg.betas}")
    if cfg.dtype not in DTYPES:
        raise unknown_choice("dtype", cfg.dtype, DTYPES)
    if cfg.batch_size % cfg.grad_accum:
        raise UserError(f"batch size {cfg.batch_size} is not divisible by grad_accum {cfg.grad_accum}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimiser step ``step`` (1-based): linear warmup, then cosine to lr·min_lr_ratio."""
    total, warmup = cfg.total_steps, cfg.warmup_steps
    if step <= warmup:
        return cfg.lr * step / warmup
    lr_min = cfg.lr * cfg.min_lr_ratio
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr_min + 0.5 * (cfg.lr - lr_min) * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------------------------
# Evaluation and probes


def autocast_for(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (dtype auto/bfloat16); nothing on the CPU (bfloat16 there is an error)."""
    if cfg.dtype == "bfloat16" and device.type != "cuda":
        raise UserError("dtype bfloat16 (autocast) is CUDA-only; use float32 or auto on the CPU")
    if device.type == "cuda" and cfg.dtype in ("auto", "bfloat16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean next-token cross-entropy (logits in float32)."""
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch: int, autocast) -> float:
    """Mean cross-entropy per predicted token over all windows (x, y), in chunks of ``batch`` windows."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        with autocast:
            total += lm_loss(model, xb, yb).item() * yb.numel()
    model.train(was_training)
    return total / y.numel()


@torch.no_grad()
def probe(model: nn.Module, x: Tensor) -> dict[str, float]:
    """Outlier and attention statistics (models.stats) of one float32 forward pass over the probe batch."""
    was_training = model.training
    model.eval()
    acc = OutlierAccumulator()
    with observe(model, hidden=True, attention=True) as obs:
        model(x.to(next(model.parameters()).device))
    acc.add_hidden(obs.hidden)
    acc.add_attention(obs.attention)
    model.train(was_training)
    return acc.summary()


# ------------------------------------------------------------------------------------------------------------
# The run


@dataclass
class Data:
    tokenizer: Any
    sampler: WindowSampler | TokenFileSampler
    val: tuple[Tensor, Tensor]
    probe: Tensor
    info: dict[str, Any]


@dataclass
class Run:
    cfg: TrainConfig
    out: Path
    ctx: distributed.DistContext
    data: Data
    model: nn.Module  # the bare model: evaluation, probes, checkpoints
    ddp: nn.Module  # what the training step calls (DDP-wrapped under torchrun)
    optimizer: torch.optim.Optimizer
    names: list[str]
    step: int = 0
    wall_s: float = 0.0  # elapsed time of all sessions, evaluation and checkpoints included
    train_s: float = 0.0  # time in training steps only (the tokens/s denominator)
    last: dict[str, Any] = field(default_factory=dict)  # latest train_loss / val_loss
    log: MetricsLog | None = None
    optim_s: float = 0.0  # time in optimizer.step() (OrthoAdam's share of a step = optim_s / train_s)
    # FLOPs per token and the peak the MFU divides by (trainers.throughput)
    throughput: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.step * self.cfg.tokens_per_step


class MetricsLog:
    """Append-only JSONL on rank 0; ``offset()`` is what a checkpoint records, truncation happens on resume."""

    def __init__(self, path: Path, truncate_to: int | None) -> None:
        if truncate_to is None:
            path.write_text("")
        elif path.exists() and path.stat().st_size > truncate_to:
            with open(path, "r+b") as f:
                f.truncate(truncate_to)
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run, closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, allow_nan=True) + "\n")
        self._f.flush()

    def offset(self) -> int:
        self._f.flush()
        return self._f.tell()

    def close(self) -> None:
        self._f.close()


def train(
    cfg: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    stop_at: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train (or continue training) ``cfg`` into ``out_dir``; return the training summary.

    ``resume``: continue from the checkpoint in ``out_dir`` (a fresh start when there is none). ``stop_at``:
    end after that step with a checkpoint, exactly as an interruption would. ``overwrite``: delete a previous
    run in ``out_dir`` first. A folder holding another run is refused unless one of the two is given.
    ``progress``: a rich progress bar (default: when stderr is a terminal; otherwise one line per evaluation).
    """
    ctx = distributed.setup(cfg.device)
    try:
        run = _start(cfg, Path(out_dir), resume, overwrite, ctx)
        try:
            return _loop(run, stop_at, progress)
        finally:
            if run.log is not None:
                run.log.close()
    finally:
        distributed.teardown(ctx)


def _start(cfg: TrainConfig, out: Path, resume: bool, overwrite: bool, ctx: distributed.DistContext) -> Run:
    saved = _prepare_output(cfg, out, resume, overwrite, ctx)
    data = load_data(cfg, ctx)
    if saved:
        _check_same_text(out, data.info)
    model = _model(cfg, out if saved else None, ctx.device)
    optimizer = build_optimizer(
        cfg.optimizer,
        optimizer_param_groups(cfg.optimizer, model, cfg.weight_decay),
        cfg.lr,
        cfg.weight_decay,
        cfg.betas,
        cfg.seed,
        **optimizer_options(cfg.optimizer, ctx.device),
    )
    names = state.param_names(model, optimizer)
    wrapped = distributed.wrap(model, ctx)
    step_model = torch.compile(wrapped) if cfg.compile else wrapped
    run = Run(cfg, out, ctx, data, model, step_model, optimizer, names)
    mc = cfg.model_config()
    bf16 = ctx.device.type == "cuda" and cfg.dtype in ("auto", "bfloat16")  # autocast_for's rule
    run.throughput = describe_throughput(model, mc.n_layer, mc.d_model, cfg.window, ctx.device, bf16)
    if saved:
        state.unflatten_optimizer(optimizer, names, state.read_optimizer_tensors(out), saved["optimizer"])
        run.step, run.wall_s, run.train_s = saved["step"], saved["wall_s"], saved["train_s"]
        run.optim_s = saved.get("optim_s", 0.0)
        run.last = saved.get("last", {})
    if ctx.is_main:
        run.log = MetricsLog(out / state.METRICS_FILE, saved["metrics_offset"] if saved else None)
    return run


def _prepare_output(
    cfg: TrainConfig, out: Path, resume: bool, overwrite: bool, ctx: distributed.DistContext
) -> dict[str, Any] | None:
    """Check ``out`` against the request; return the trainer state to resume from, or None for a fresh start."""
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        state.recover(out)
        if overwrite and not resume:
            state.clear_run(out)
    distributed.barrier(ctx)
    if not state.has_state(out):
        if (out / "config.json").exists() and not overwrite:
            raise UserError(
                f"{out} holds a model checkpoint without trainer state; it cannot be resumed — "
                "choose another --out or pass --overwrite"
            )
        if resume and ctx.is_main:
            print(f"nothing to resume in {out}: starting a fresh run", file=sys.stderr)
        return None
    saved = state.read_state(out)
    previous = TrainConfig.from_dict(saved["config"])
    changed = sorted(k for k, v in cfg.to_dict().items() if previous.to_dict()[k] != v)
    if not resume:
        same = (
            "the same configuration" if not changed else f"a different configuration ({', '.join(changed)})"
        )
        raise UserError(
            f"{out} already holds a run of {same} at step {saved['step']}; "
            "pass --resume to continue it or --overwrite to start again"
        )
    blocking = [k for k in changed if k not in RESUMABLE_CHANGES]
    if blocking:
        diffs = "; ".join(f"{k}: {previous.to_dict()[k]!r} -> {cfg.to_dict()[k]!r}" for k in blocking)
        raise UserError(f"cannot resume {out} with a different configuration ({diffs})")
    return saved


def _check_same_text(out: Path, info: dict[str, Any]) -> None:
    """Refuse to resume a run on training text other than what it trained on so far: the same ``--data`` name can
    name other text (the embedded corpus became pieces, with another split; a local file edited), and a resumed or
    reused run would then mix the two and say it trained on one."""
    try:
        before = json.loads((out / "config.json").read_text())["provenance"]["training"]["data"]["train"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # a checkpoint that does not say: nothing to compare
    now = info.get("train") or {}
    if before.get("corpus_fingerprint") and before["corpus_fingerprint"] != now.get("corpus_fingerprint"):
        raise UserError(
            f"cannot resume {out}: it trained on {before.get('corpus')!r} text that has changed since "
            f"(corpus fingerprint {before['corpus_fingerprint'][:12]}… → {str(now.get('corpus_fingerprint'))[:12]}…; "
            "the embedded corpus as runs before pieces read it is 'embedded-whole'); train it again (--overwrite "
            "or another --out), or repeat the old run with --data embedded-whole in another --out"
        )


def optimizer_options(name: str, device: torch.device) -> dict[str, Any]:
    """torch's fastest exact step for torch's optimisers: fused on CUDA, foreach (multi-tensor) on the CPU.

    OrthoAdam keeps its own per-parameter loop (its rotations need scratch space per tensor). RMSprop has no
    fused kernel, so it takes foreach on CUDA too.
    """
    if name in (
        "orthoadam",
        "muon",
    ):  # muon: torch's Muon has no foreach/fused step; its AdamW half picks its own
        return {}
    if device.type == "cuda" and name in ("adamw", "sgd", "sgd-momentum"):
        return {"fused": True}
    return {"foreach": True}


def load_data(cfg: TrainConfig, ctx: distributed.DistContext) -> Data:
    """Tokenizer, training sampler, validation windows and probe batch (rank 0 tokenises; others wait)."""
    from models.tokenizer import load_tokenizer, separator_id
    from trainers.data import stream_info, token_stream

    tok = load_tokenizer(get_preset(cfg.preset).tokenizer)
    check_tokenizer_fits(tok, cfg.model_config())
    if is_tokenfiles(cfg.data):
        return load_token_files(cfg, ctx, tok)
    if ctx.is_main:  # builds the token cache once
        token_stream(cfg.data, "train", tok), token_stream(cfg.data, "validation", tok)
    distributed.barrier(ctx)
    train_ids, val_ids = token_stream(cfg.data, "train", tok), token_stream(cfg.data, "validation", tok)
    bos = separator_id(tok) if cfg.bos else None
    ctx_len = cfg.window
    val = validation_windows(val_ids, ctx_len, bos, cfg.eval_tokens)
    info = {
        "corpus": str(cfg.data),
        "tokenizer": get_preset(cfg.preset).tokenizer,
        "bos_id": bos,
        "train": _stream_summary(stream_info(cfg.data, "train", tok)),
        "validation": _stream_summary(stream_info(cfg.data, "validation", tok)),
        "validation_windows": len(val[0]),
        "validation_tokens": val[1].numel(),
        "probe_windows": cfg.probe_batch,
    }
    sampler = WindowSampler(train_ids, ctx_len, cfg.seed, bos)
    return Data(tok, sampler, val, probe_windows(val_ids, ctx_len, bos, cfg.probe_batch), info)


def load_token_files(cfg: TrainConfig, ctx: distributed.DistContext, tok) -> Data:
    """:func:`load_data` for a prepared token-file folder: non-repeating windows, its own validation slice."""
    from models.tokenizer import separator_id, tokenizer_fingerprint

    files = TokenFiles.open(cfg.data)
    files.check_tokenizer(tokenizer_fingerprint(tok), get_preset(cfg.preset).tokenizer)
    bos = separator_id(tok) if cfg.bos else None
    sampler = TokenFileSampler(files.train(), cfg.window, cfg.seed, bos)
    epochs = sampler.epochs(cfg.total_steps, cfg.batch_size)
    if epochs > 1 and ctx.is_main:
        print(
            f"note: {cfg.total_steps} steps × {cfg.batch_size} windows are {epochs:.2f} passes over the token "
            f"files' {sampler.windows:,} windows; prepare more tokens to avoid repeats",
            file=sys.stderr,
        )
    val_ids = files.validation()
    val = validation_windows(val_ids, cfg.window, bos, cfg.eval_tokens)
    info = {
        "corpus": str(cfg.data),
        "tokenizer": get_preset(cfg.preset).tokenizer,
        "bos_id": bos,
        **files.summary(),
        "train_windows": sampler.windows,
        "epochs": epochs,
        "validation_windows": len(val[0]),
        "validation_tokens": val[1].numel(),
        "probe_windows": cfg.probe_batch,
    }
    return Data(tok, sampler, val, probe_windows(val_ids, cfg.window, bos, cfg.probe_batch), info)


def _stream_summary(meta: dict[str, Any]) -> dict[str, Any]:
    keys = ("corpus", "corpus_fingerprint", "tokens", "documents", "bytes", "tokenizer_fingerprint")
    return {k: meta.get(k) for k in keys}


def _model(cfg: TrainConfig, resume_from: Path | None, device: torch.device) -> nn.Module:
    """A fresh model from (config, seed), or the checkpoint's weights when resuming."""
    if resume_from is None:
        return build(cfg.model_config(), seed=cfg.seed).to(device).train()
    ckpt = load_checkpoint(resume_from, tokenizer=False)
    if ckpt.config != cfg.model_config():
        raise UserError(f"{resume_from}'s model config differs from the run's: not the same run")
    return ckpt.model.to(device).train()


# ------------------------------------------------------------------------------------------------------------
# Steps


def train_step(run: Run, step: int) -> dict[str, float]:
    """One optimiser step on the global batch of ``step``; returns loss (mean over ranks), grad norm, timings."""
    cfg, ctx = run.cfg, run.ctx
    t0 = time.perf_counter()
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=ctx.device)
    autocast = autocast_for(cfg, ctx.device)
    for micro in range(cfg.grad_accum):
        rows = shard_rows(cfg.batch_size, ctx.world_size, ctx.rank, cfg.grad_accum, micro)
        x, y = (t.to(ctx.device) for t in run.data.sampler.batch(step, cfg.batch_size, rows))
        sync = micro == cfg.grad_accum - 1 or not ctx.distributed
        with contextlib.nullcontext() if sync else run.ddp.no_sync():
            with autocast:
                loss = lm_loss(run.ddp, x, y) / cfg.grad_accum
            loss.backward()
        loss_sum += loss.detach()
    params = [p for p in run.model.parameters() if p.grad is not None]
    grad_norm = _grad_norm(params, cfg.clip)
    loss_mean = distributed.all_reduce_mean(loss_sum, ctx).item()
    _check_finite(run, step, loss_mean, grad_norm)
    t1 = time.perf_counter()
    run.optimizer.step()
    if ctx.device.type == "cuda":  # kernels run asynchronously: time the step, not its launch
        torch.cuda.synchronize(ctx.device)
    t2 = time.perf_counter()
    return {"loss": loss_mean, "grad_norm": grad_norm, "step_s": t2 - t0, "optim_s": t2 - t1}


def _grad_norm(params: list[Tensor], clip: float) -> float:
    if clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip).item()
    return torch.nn.utils.get_total_norm([p.grad for p in params]).item()


def _check_finite(run: Run, step: int, loss: float, grad_norm: float) -> None:
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    if state.has_state(run.out):
        kept = f"the last good checkpoint (step {state.read_state(run.out, verify=False)['step']}) is kept"
    else:
        kept = "no checkpoint had been written yet"
    raise TrainingDiverged(
        f"training diverged at step {step}: loss {loss}, grad norm {grad_norm}; {kept} in {run.out}; "
        "try a lower --lr, a longer --warmup or a smaller --clip"
    )


def _loop(run: Run, stop_at: int | None, progress: bool | None) -> dict[str, Any]:
    cfg, total = run.cfg, run.cfg.total_steps
    end = total if stop_at is None else max(run.step, min(stop_at, total))
    bar = Progress(total, run.step, enabled=progress, quiet=not run.ctx.is_main)
    t_start, wall_start = time.perf_counter(), run.wall_s
    if run.step == 0 and run.ctx.is_main:
        run.log.write(_observe(run, {"step": 0, "tokens": 0}, 0))
    try:
        while run.step < end:
            step = run.step + 1
            stats = train_step(run, step)
            run.step, run.train_s = step, run.train_s + stats["step_s"]
            run.optim_s += stats["optim_s"]
            run.wall_s = wall_start + time.perf_counter() - t_start
            record = {"step": step, "tokens": run.tokens, "lr": lr_at(step, cfg), **stats}
            record["tokens_per_s"] = cfg.tokens_per_step / stats["step_s"]
            record["mfu"] = run_mfu(run, record["tokens_per_s"])
            run.last["train_loss"] = stats["loss"]
            if run.ctx.is_main:
                run.log.write(_observe(run, record, step))
                if step % cfg.ckpt_every == 0 or step == end:
                    save(run)
            bar.update(step, record, run.last.get("val_loss"))
    finally:
        bar.close()
    distributed.barrier(run.ctx)  # other ranks return only once rank 0's checkpoint is on disk
    return summary(run)


def _observe(run: Run, record: dict[str, Any], step: int) -> dict[str, Any]:
    """Add val_loss / probe statistics to the step's record when they are due (rank 0 only)."""
    cfg = run.cfg
    final = step == cfg.total_steps
    if step % cfg.eval_every == 0 or final:
        batch = cfg.batch_size // cfg.grad_accum
        record["val_loss"] = evaluate(run.model, *run.data.val, batch, autocast_for(cfg, run.ctx.device))
        run.last["val_loss"] = record["val_loss"]
    if step % cfg.probe_every == 0 or final:
        record["probe"] = probe(run.model, run.data.probe)
    return record


def save(run: Run) -> None:
    """An atomic checkpoint of the run at its current step (rank 0)."""
    record = {
        "step": run.step,
        "total_steps": run.cfg.total_steps,
        "tokens": run.tokens,
        "wall_s": run.wall_s,
        "train_s": run.train_s,
        "optim_s": run.optim_s,
        "lr": lr_at(run.step, run.cfg) if run.step else 0.0,
        "sampler": {"seed": run.cfg.seed, "next_step": run.step + 1},
        "metrics_offset": run.log.offset(),
        "last": run.last,
        "world_size": run.ctx.world_size,
        "config": run.cfg.to_dict(),
    }
    provenance = {"training": {**provenance_of(run), "summary": summary(run)}}
    state.write_checkpoint(
        run.out, run.model, run.data.tokenizer, provenance, run.optimizer, run.names, record
    )


def provenance_of(run: Run) -> dict[str, Any]:
    return {
        "config": run.cfg.to_dict(),
        "recipe": RECIPES.get(run.cfg.recipe).to_dict(),
        "optimizer": run.cfg.optimizer,
        "optimizer_settings": optimizer_settings(run.cfg.optimizer),
        "model": run.cfg.model_config().to_dict(),
        "data": run.data.info,
    }


def summary(run: Run) -> dict[str, Any]:
    return {
        "out_dir": str(run.out),
        "step": run.step,
        "total_steps": run.cfg.total_steps,
        "complete": run.step >= run.cfg.total_steps,
        "tokens": run.tokens,
        "train_loss": run.last.get("train_loss"),
        "val_loss": run.last.get("val_loss"),
        "wall_s": round(run.wall_s, 3),
        "train_s": round(run.train_s, 3),
        "tokens_per_s": run.tokens / run.train_s if run.train_s > 0 else None,
        "mfu": run_mfu(run, run.tokens / run.train_s) if run.train_s > 0 else None,
        "optim_share": run.optim_s / run.train_s if run.train_s > 0 else None,
        "parameters": run.model.num_parameters(),
        "world_size": run.ctx.world_size,
        "compiled": run.cfg.compile,
        "throughput": run.throughput,
    }


def run_mfu(run: Run, tokens_per_s: float) -> float | None:
    """MFU of ``tokens_per_s`` (all processes) over the peak of the run's devices (None on a CPU)."""
    t = run.throughput
    return mfu(tokens_per_s, t.get("flops_per_token", 0), t.get("peak_tflops"), run.ctx.world_size)


# ------------------------------------------------------------------------------------------------------------
# Progress display


class Progress:
    """A rich progress bar (loss, tokens/s, ETA) on a terminal; one plain line per evaluation otherwise."""

    def __init__(self, total: int, start: int, enabled: bool | None, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.enabled = (sys.stderr.isatty() if enabled is None else enabled) and not quiet
        self._bar = None
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            columns = (
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._bar = RichProgress(*columns, TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, record: dict[str, Any], val_loss: float | None) -> None:
        if self.quiet:
            return
        info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s"
        if val_loss is not None:
            info += f"  val {val_loss:.4f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif "val_loss" in record:
            print(f"step {step}/{self.total}  {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
