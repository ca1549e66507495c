"""``qbench inspect``: one model's outliers, attention sink and massive activations, as JSON and figures.

    inspect_model(lm, Protocol(tokens=4096), "inspect/gpt2")  # -> metrics.json + three PNGs

``metrics.json`` holds the outlier/attention summary and per-layer curves (definitions in ``models.stats``), the
massive activations (``qbench.eval.metrics.massive_activations``), the protocol and the environment. The figures:

- ``attention.png``: window 0's attention averaged over all layers and heads (the paper's Figure 1);
- ``activations.png``: |activation| over tokens × channels of window 0 in the block whose output holds the
  largest |activation| over the inspected windows (Sun et al.'s Figure 1);
- ``layers.png``: kurtosis (first token vs others) and max |activation| per layer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from models.errors import UserError
from models.io import atomic_write_json
from qbench.eval.adapters import context_length, forward_observed, observe_any
from qbench.eval.harness import environment
from qbench.eval.load import LoadedModel
from qbench.eval.metrics import (
    Protocol,
    Windows,
    delimiter_ids,
    make_windows,
    massive_activations,
    outlier_metrics,
    protocol_record,
)

# Sun et al.: massive activations sit on the starting token and on delimiters
# ---------------------------------------------------------------------------------------------- one window


class _LayerMean(list):
    """A stand-in for ``Observation.attention`` that keeps only the running sum over layers of the head mean.

    Attention maps of every layer are (B, nh, T, T); holding them all for a large model costs tens of GB, so
    each one is reduced to (T, T) as it arrives.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total: Tensor | None = None
        self.layers = 0

    def append(self, probs: Tensor) -> None:  # type: ignore[override]
        mean = probs[0].float().mean(0).cpu()  # (T, T): window 0, mean over heads
        self.total = mean if self.total is None else self.total + mean
        self.layers += 1

    def extend(self, many) -> None:  # type: ignore[override]
        for probs in many:
            self.append(probs)


@torch.no_grad()
def observe_window(
    model: torch.nn.Module, ids: Tensor, device: str = "cpu"
) -> tuple[np.ndarray, list[Tensor]]:
    """One window (T,) -> (its (T, T) attention averaged over layers and heads, each block's output (T, C))."""
    with observe_any(model, attention=True) as obs:
        obs.attention = attention = _LayerMean()
        forward_observed(model, ids[None].to(device), obs)
    if attention.total is None:
        raise RuntimeError("the forward pass produced no attention probabilities")
    mean = (attention.total / attention.layers).numpy()
    return mean, [h[0].float().cpu() for h in obs.hidden]


# ------------------------------------------------------------------------------------------------- inspect


def write_figures(
    lm: LoadedModel, protocol: Protocol, windows: Windows, per_layer: dict, out_dir: Path, device: str = "cpu"
) -> dict[str, Path]:
    """The three PNGs of the module docstring; the activation figure shows the block with the largest max |x|."""
    from qbench.studies import plots

    attention, hidden = observe_window(lm.model, windows.ids[0], device)
    peak = int(np.argmax(per_layer["max_abs"]))
    label = f"{lm.name}: window 0 of {protocol.corpus}/{protocol.split}"
    return {
        "attention": plots.plot_attention(
            attention,
            out_dir / "attention.png",
            f"{label}\nattention averaged over {len(hidden)} layers and all heads",
        ),
        "activations": plots.plot_activations(
            hidden[peak].abs().numpy(),
            out_dir / "activations.png",
            f"{label}: |activation| at the output of block {peak} (largest max |activation|)",
            token_labels=[lm.tokenizer.decode([i]) for i in windows.ids[0].tolist()],
        ),
        "layers": plots.plot_layer_curves(
            per_layer, out_dir / "layers.png", f"{lm.name}: per-layer outliers"
        ),
    }


def inspect_model(
    lm: LoadedModel, protocol: Protocol, out_dir: str | Path, n_windows: int = 8, device: str = "cpu"
) -> dict[str, Any]:
    """Compute the statistics of ``lm`` on the first ``n_windows`` windows, write metrics.json and the figures.

    Returns the metrics dict (as written) with ``plots``: the PNG paths.
    """
    if n_windows < 1:
        raise UserError(f"--windows must be at least 1, got {n_windows}")
    out_dir, start = Path(out_dir), time.perf_counter()
    windows = make_windows(lm.tokenizer, protocol, context_length(lm.model, protocol.window))
    outliers = outlier_metrics(lm.model, windows, n_windows, attention=True, device=device)
    per_layer = outliers.pop("per_layer")
    massive = massive_activations(
        lm.model, windows, n_windows, device=device, delimiter_ids=delimiter_ids(lm.tokenizer)
    )
    paths = write_figures(lm, protocol, windows, per_layer, out_dir, device)
    record = {
        "model": {"name": lm.name, **lm.description},
        "protocol": protocol_record(protocol, windows, lm.tokenizer, lm.description.get("dtype")),
        "outliers": outliers,
        "outliers_per_layer": per_layer,
        "peak_layer": int(np.argmax(per_layer["max_abs"])),
        "massive_activations": massive,
        "plots": {k: p.name for k, p in paths.items()},
        "env": environment(device),
        "wall_seconds": round(time.perf_counter() - start, 3),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_json(out_dir / "metrics.json", record)
    return {**record, "plots": {k: str(p) for k, p in paths.items()}}
