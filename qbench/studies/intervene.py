"""``qbench intervene``: does the model depend on its massive activations? (Sun et al., 2024, Section 3)

    intervene(lm, Protocol(tokens=8192), mode="zero")   # or mode="mean"

1. Find the sites: ``qbench.eval.metrics.massive_activations`` over the first ``n_windows`` windows gives, per
   layer (block output), the channels holding a massive activation (|x| > 100 and > 1000 × the layer's median
   |x|). A site is one (layer, channel); its threshold is that layer's max(100, 1000 × median), and its mean is
   the signed mean of the massive values at that site over those windows (the positions where they occur —
   the first token, delimiters).
2. Intervene (every forward pass checked to have run the hook of each layer with sites, else a one-line
   error): a forward hook on each decoder layer with sites rewrites, in every forward pass, the
   activations of its site channels whose |x| exceeds the site's threshold — the tokens where the activation
   is massive, found anew in each window — with 0 (``zero``) or with the site's mean (``mean``). All other
   activations are untouched. The residual stream carries a massive activation from the block that creates
   it onwards; once that block's output is edited later blocks usually no longer see a massive value, so in
   effect this is Sun et al.'s edit at the layer where the activations first appear (plus any layer that
   re-creates them).
3. Measure: token-level perplexity (``qbench.eval.metrics.perplexity``) on the protocol's windows, without and
   with the intervention. Sun et al. report that zeroing destroys LLaMA-2 while mean-filling does not: the
   massive activations act as fixed biases.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError, unknown_choice
from models.observe import EveryLayer
from qbench.eval.adapters import (
    SUPPORTED_LAYOUTS,
    context_length,
    decoder_layers,
    forward_observed,
    observe_any,
)
from qbench.eval.harness import environment
from qbench.eval.load import LoadedModel
from qbench.eval.metrics import (
    MASSIVE_ABS,
    MASSIVE_RATIO,
    Protocol,
    Windows,
    make_windows,
    massive_activations,
    perplexity,
    protocol_record,
)
from qbench.studies.inspection import delimiter_ids

MODES = ("zero", "mean")


@dataclass(frozen=True)
class Site:
    layer: int
    channel: int
    threshold: float  # |x| above which an activation of this layer is massive: max(100, 1000 × median |x|)
    mean: float  # signed mean of the massive values at this site over the detection windows
    count: int  # massive values at this site in the detection windows


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise unknown_choice("intervention (--set)", mode, MODES)
    return mode


@torch.no_grad()
def find_sites(
    model: nn.Module,
    windows: Windows,
    n_windows: int,
    device: str = "cpu",
    delimiters: set[int] | None = None,
) -> tuple[dict[str, Any], list[Site]]:
    """``massive_activations`` of the first ``n_windows`` windows, and its (layer, channel) sites with their means."""
    found = massive_activations(model, windows, n_windows, device=device, delimiter_ids=delimiters)
    if found["total"] == 0:
        return found, []
    with observe_any(model) as obs:
        forward_observed(model, windows.ids[:n_windows].to(device), obs)
    sites = []
    for layer in found["layers"]:
        threshold = max(MASSIVE_ABS, MASSIVE_RATIO * layer["median"])
        hidden = obs.hidden[layer["layer"]].float()  # (B, T, C)
        for channel in layer["channels"]:
            column = hidden[..., channel]
            massive = column[column.abs() > threshold]
            sites.append(Site(layer["layer"], channel, threshold, massive.mean().item(), massive.numel()))
    return found, sites


class _Editor:
    """Forward hooks that overwrite the massive activations at the sites, counting how many they overwrite."""

    def __init__(self, sites: list[Site], mode: str) -> None:
        self.by_layer: dict[int, list[Site]] = defaultdict(list)
        for site in sites:
            self.by_layer[site.layer].append(site)
        self.mode = mode
        self.edited = 0

    def _edit(self, hidden: Tensor, sites: list[Site]) -> Tensor:
        hidden = hidden.clone()  # (B, T, C); never write into a tensor another module may hold
        for site in sites:
            column = hidden[..., site.channel]
            massive = column.abs() > site.threshold
            self.edited += int(massive.sum())
            fill = 0.0 if self.mode == "zero" else site.mean
            hidden[..., site.channel] = torch.where(massive, torch.full_like(column, fill), column)
        return hidden

    def hook(self, layer: int, ran: EveryLayer):
        def edit(_module: nn.Module, _args: tuple, output: Tensor | tuple) -> Tensor | tuple:
            ran.hit(layer)
            if isinstance(output, tuple):  # transformers layers may return (hidden, extras...)
                return (self._edit(output[0], self.by_layer[layer]), *output[1:])
            return self._edit(output, self.by_layer[layer])

        return edit


@contextmanager
def intervention(model: nn.Module, sites: list[Site], mode: str) -> Iterator[_Editor]:
    """Inside the block, every forward pass of ``model`` has the massive activations at ``sites`` overwritten."""
    editor = _Editor(sites, check_mode(mode))
    layers = decoder_layers(model)
    # Every forward pass must run each edited layer's hook: otherwise the edit silently did nothing.
    ran = EveryLayer(model, sorted(editor.by_layer), "the massive-activation intervention", SUPPORTED_LAYOUTS)
    handles = [layers[index].register_forward_hook(editor.hook(index, ran)) for index in editor.by_layer]
    handles.extend(ran.attach(model))
    try:
        yield editor
    finally:
        for handle in handles:
            handle.remove()


def _change(before: float, after: float) -> dict[str, float | None]:
    ratio = after / before if math.isfinite(before) and before > 0 and math.isfinite(after) else None
    return {"ppl_ratio": ratio, "ppl_change_pct": None if ratio is None else (ratio - 1) * 100}


def _intervened_perplexity(
    model: nn.Module, windows: Windows, sites: list[Site], mode: str, batch_size: int, device: str
) -> tuple[dict[str, float], int, str]:
    """(perplexity with the sites overwritten, how many activations were overwritten, what was done)."""
    with intervention(model, sites, mode) as editor:
        after = perplexity(model, windows, batch_size, device)
    fill = "0" if mode == "zero" else "their mean"
    return after, editor.edited, f"set {editor.edited} massive activations at {len(sites)} sites to {fill}"


def intervene(
    lm: LoadedModel, protocol: Protocol, mode: str = "zero", n_windows: int = 8, device: str = "cpu"
) -> dict[str, Any]:
    """Perplexity of ``lm`` before and after setting its massive activations to 0 or their mean (module docstring).

    Returns ``perplexity`` (float model), ``intervened_perplexity``, ``ppl_ratio`` (after / before),
    ``ppl_change_pct``, ``sites`` (layer, channel, threshold, mean, count), ``edited_activations`` (how many
    activations the hooks overwrote during the perplexity run), the massive-activation report, and a ``note``.
    With no massive activations nothing is edited and the perplexity is reported unchanged.
    """
    check_mode(mode)
    if n_windows < 1:
        raise UserError(f"--windows must be at least 1, got {n_windows}")
    start, model = time.perf_counter(), lm.model
    windows = make_windows(lm.tokenizer, protocol, context_length(model, protocol.window))
    found, sites = find_sites(model, windows, n_windows, device, delimiter_ids(lm.tokenizer))
    before = perplexity(model, windows, protocol.batch_size, device)
    if sites:
        after, edited, note = _intervened_perplexity(model, windows, sites, mode, protocol.batch_size, device)
    else:
        after, edited = before, 0
        note = (
            f"no massive activations (|x| > {MASSIVE_ABS:g} and > {MASSIVE_RATIO:g} × the layer median) in "
            f"{found['windows']} windows: nothing to intervene on, perplexity unchanged"
        )
    return {
        "model": {"name": lm.name, **lm.description},
        "mode": mode,
        "perplexity": before["perplexity"],
        "intervened_perplexity": after["perplexity"],
        **_change(before["perplexity"], after["perplexity"]),
        "tokens": before["tokens"],
        "sites": [asdict(site) for site in sites],
        "edited_activations": edited,
        "note": note,
        "massive_activations": found,
        "protocol": protocol_record(protocol, windows, lm.tokenizer, lm.description.get("dtype")),
        "env": environment(device),
        "wall_seconds": round(time.perf_counter() - start, 3),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
