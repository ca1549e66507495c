"""The float model's logits of the scored windows, computed once per model and kept on disk.

Every quantised cell is compared token by token with the float model on the same windows (KL divergence, top-1
agreement: ``qbench.eval.evidence``). Computing the float logits beside each cell doubled its forward passes: on
2 CPU cores a SmolLM2-135M cell went from 12.7 s to 29.7 s (4,096 tokens). The float logits do not change between
cells — quantisation never mutates the float model — so they are computed once (by the float record's own pass
when it is evaluated, else by the first cell that needs them), written to a scratch file in float32 (exactly
what a fresh forward would give, so the divergences are the same numbers), and read back batch by batch.

Only on CPU (a GPU recomputes a window faster than it reads it back), and only when the scratch file fits
comfortably on the temporary disk (``tempfile.gettempdir()``, so ``TMPDIR`` moves it); otherwise the cell runs
the float model beside itself as before. The file is removed when the store is garbage-collected or the process
exits; it is a cache, never a result (records keep their own per-token evidence).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from qbench.eval.adapters import logits

# A quantised cell's evaluation time over the float model's: its own forward plus the token comparison with the
# stored float logits (measured 1.34×: SmolLM2-135M, 4,096 tokens, AMD EPYC AVX2, 2 cores; a float forward
# beside each cell with the float64 comparison it replaced: 2.31×). Progress estimates use it.
CELL_COST = 1.35

# the scratch file may take at most this share of the temporary disk's free space
DISK_SHARE = 0.5

_STORES: weakref.WeakKeyDictionary[nn.Module, dict[str, ReferenceLogits]] = weakref.WeakKeyDictionary()


def windows_key(ids: Tensor) -> str:
    """What identifies a set of input windows: their shape and a hash of their token ids."""
    digest = hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]
    return f"{tuple(ids.shape)}:{digest}"


class ReferenceLogits:
    """Float32 logits (windows × window × vocabulary) of ``model`` on ``ids``, filled window by window."""

    def __init__(self, model: nn.Module, ids: Tensor, width: int, directory: str) -> None:
        self._model = weakref.ref(model)  # the registry is keyed weakly on the model: never hold it here
        self.shape = (int(ids.size(0)), int(ids.size(1)), int(width))
        self.window_bytes = self.shape[1] * self.shape[2] * 4
        self.filled = torch.zeros(self.shape[0], dtype=torch.bool)
        self.directory = tempfile.mkdtemp(prefix="qbench-reference-", dir=directory)
        self.path = os.path.join(self.directory, "logits.f32")
        self._file = open(self.path, "w+b")  # noqa: SIM115 (held for the store's life, closed by its finaliser)
        self._file.truncate(self.shape[0] * self.window_bytes)  # sparse until written
        self.forward_passes = 0  # windows the float model was run for (tests: once per model)
        self._finalizer = weakref.finalize(self, _remove, self._file, self.directory)

    def close(self) -> None:
        """Remove the scratch file now (it is removed at garbage collection or exit otherwise)."""
        self._finalizer()

    def put(self, start: int, out: Tensor) -> None:
        """Keep ``out``, the float model's logits of windows ``start``…, where not kept yet."""
        for row in range(out.size(0)):
            index = start + row
            if not self.filled[index]:
                data = out[row].detach().to("cpu", torch.float32).contiguous()
                self._file.seek(index * self.window_bytes)
                self._file.write(data.numpy().tobytes())
                self.filled[index] = True

    def batch(self, start: int, batch: Tensor) -> Tensor:
        """The float logits of windows ``start`` … ``start + len(batch)`` (whose ids are ``batch``): read back, or
        computed now (and kept) when a window is not there yet."""
        rows = batch.size(0)
        if not bool(self.filled[start : start + rows].all()):
            model = self._model()
            if model is None:
                raise RuntimeError("the float model of this reference store no longer exists")
            out = logits(model, batch).float()
            self.forward_passes += rows
            self.put(start, out)
            return out
        self._file.flush()
        data = torch.empty((rows, *self.shape[1:]), dtype=torch.float32)
        self._file.seek(start * self.window_bytes)
        read = self._file.readinto(memoryview(data.numpy()).cast("B"))
        if (
            read != rows * self.window_bytes
        ):  # the scratch file was truncated under us: recompute, never guess
            self.filled[start : start + rows] = False
            return self.batch(start, batch)
        return data.to(batch.device)


def _remove(handle: Any, directory: str) -> None:
    handle.close()
    shutil.rmtree(directory, ignore_errors=True)


def reference_store(model: nn.Module, ids: Tensor, width: int, device: str) -> ReferenceLogits | None:
    """The store of ``model``'s float logits on windows ``ids`` — one per (model, windows), shared by every
    evaluation of that model in this process — or None where it does not pay (a GPU) or does not fit (more than
    :data:`DISK_SHARE` of the temporary disk's free space)."""
    if torch.device(device).type != "cpu":
        return None
    stores = _STORES.setdefault(model, {})
    key = windows_key(ids)
    if key in stores:
        return stores[key]
    directory = tempfile.gettempdir()
    need = int(ids.size(0)) * int(ids.size(1)) * int(width) * 4
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    if need > DISK_SHARE * free:
        return None
    stores[key] = ReferenceLogits(model, ids, width, directory)
    return stores[key]
