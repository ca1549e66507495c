"""Data-parallel training with torchrun and DistributedDataParallel (gloo on CPU, nccl on CUDA).

One machine, K processes (CPU: K processes share the cores; CUDA: one GPU each)::

    torchrun --standalone --nproc_per_node K -m trainers --preset tiny --recipe paper --out ckpts/tiny_paper

Several machines (run the same command on every node; ``--node_rank`` 0..N-1, the endpoint is node 0's
address and a free port; every node must see the same output folder, e.g. a shared file system, for resume)::

    torchrun --nnodes N --nproc_per_node K --node_rank R \
             --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id RUN_NAME \
             -m trainers --preset gpt2-130m --recipe paper --out /shared/ckpts/gpt2_paper

What each rank does (see ``trainers.loop``):

- every rank builds the same model from the same seed (DDP also broadcasts rank 0's weights when it wraps);
- the global batch of a step is the same as for one process (``trainers.batches``): rank r takes the r-th
  contiguous slice of it, so the batch size must be divisible by processes × gradient-accumulation steps;
- DDP all-reduces (averages) the gradients during ``backward``, so every rank's optimiser — OrthoAdam
  included: it only ever sees the averaged gradient — takes the same step and the replicas stay equal;
- the reported loss is the mean over ranks; only rank 0 evaluates, probes, logs and writes checkpoints.

Without torchrun (no ``RANK``/``WORLD_SIZE`` in the environment) everything runs in one process, no process
group is created and the model is not wrapped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.errors import UserError


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: its rank among ``world_size`` processes and the device it trains on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False  # True when setup() created the process group (so teardown() destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    """True when the environment has torchrun's RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: this rank's CUDA device when there is one, else the CPU; otherwise torch's device name."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def setup(device: str = "auto") -> DistContext:
    """Join torchrun's process group (when launched by it) and pick this rank's device."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistContext(device=resolve_device(device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = resolve_device(device, local_rank)
    owns = not dist.is_initialized()
    if owns:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev, owns_group=owns)


def teardown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """The model DDP-wrapped for a multi-process run, else the model itself."""
    if not ctx.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def all_reduce_mean(t: Tensor, ctx: DistContext) -> Tensor:
    """The mean of ``t`` over ranks (``t`` itself in one process)."""
    if not ctx.distributed:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / ctx.world_size


def all_true(flag: bool, ctx: DistContext) -> bool:
    """True when ``flag`` holds on every rank (so all ranks take the same branch)."""
    if not ctx.distributed:
        return flag
    t = torch.tensor([0 if flag else 1], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item()) == 0
