"""Outlier and attention statistics of a forward pass — the definitions, in one place (docs/metrics.md).

Pure tensor functions plus an accumulator, so the trainer's probes and qbench's evaluation compute the same
numbers. Inputs come from ``models.observe`` (our models) or forward hooks (transformers models):

- hidden states: each block's output, the residual stream, (B, T, C) per layer — not the embeddings and not
  after the final norm;
- attention: the probabilities on the real keys, (B, nh, T, T) per layer, as computed (under softmax-1 or a
  learned sink the rows sum to less than 1 and are reported unnormalised).

Definitions (per layer l, then summarised over layers):
- raw kurtosis of token t: κ = mean_c((x_c − μ)^4) / (mean_c((x_c − μ)^2))^2 over the C channels; a Gaussian
  gives 3. Never "excess" kurtosis.
  kurtosis_first  = mean_l [ mean over sequences of κ at t = 0 ]          (the paper's E_m[κ_{m,1}])
  kurtosis_other  = mean_l [ mean over sequences and t ≥ 1 of κ ]         (the paper's E_m[κ_{m,>1}])
  kurtosis_max    = max_l  of the larger of the two per-layer means above
- max |activation| of token t: m_t = max_c |x_c|.
  max_abs_first / max_abs_other = mean_l of the per-layer mean of m_t over t = 0 / t ≥ 1; max_abs = global max.
- first-token attention over all (layer, head, query q ≥ 1) triples of every sequence (query 0 can only see
  itself, so it is excluded): first_token_top1_share = the share whose largest weight is on key 0 and is
  non-zero (a softmax-1 row whose weights all underflow to 0 attends nowhere, not to key 0; ``argmax`` would
  return 0 for it);
  first_token_mass = the mean weight on key 0.
  Chance (``uniform_first_key_share``): uniform causal attention over a T-position window gives both
  (H_T − 1)/(T − 1) (0.0349 at T = 128); a mass at or below it is no sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def raw_kurtosis(x: Tensor) -> Tensor:
    """Raw (Pearson) kurtosis over the last dimension, in float64: (...,) from (..., C)."""
    x = x.double()
    centred = x - x.mean(-1, keepdim=True)
    m2 = centred.pow(2).mean(-1)
    m4 = centred.pow(4).mean(-1)
    return m4 / m2.pow(2).clamp_min(torch.finfo(torch.float64).tiny)


def uniform_first_key_share(window: int) -> float:
    """``first_token_mass`` (and ``first_token_top1_share``, ties broken at random) under uniform causal attention
    over ``window`` positions: query q ≥ 1 sees q + 1 keys, so the mean over q = 1 … T − 1 of 1/(q + 1), which is
    (H_T − 1)/(T − 1) with H_T the T-th harmonic number. The baseline a sink share is read against: at or below it,
    the first token gets no more attention than any other."""
    if window < 2:
        raise ValueError(f"a window of {window} position(s) has no query q ≥ 1")
    return sum(1.0 / (q + 1) for q in range(1, window)) / (window - 1)


@dataclass
class _LayerSums:
    kurt_first: float = 0.0
    kurt_other: float = 0.0
    maxabs_first: float = 0.0
    maxabs_other: float = 0.0
    max_abs: float = 0.0
    n_first: int = 0
    n_other: int = 0


@dataclass
class OutlierAccumulator:
    """Streams hidden states and attention probabilities of many batches into the statistics above."""

    layers: list[_LayerSums] = field(default_factory=list)
    top1_hits: int = 0
    key0_mass: float = 0.0
    n_queries: int = 0

    def add_hidden(self, hidden: list[Tensor]) -> None:
        if not self.layers:
            self.layers = [_LayerSums() for _ in hidden]
        for sums, h in zip(self.layers, hidden, strict=True):  # h: (B, T, C)
            kurt = raw_kurtosis(h)  # (B, T)
            maxabs = h.detach().abs().amax(-1).double()  # (B, T)
            sums.kurt_first += kurt[:, 0].sum().item()
            sums.maxabs_first += maxabs[:, 0].sum().item()
            sums.n_first += h.size(0)
            if h.size(1) > 1:
                sums.kurt_other += kurt[:, 1:].sum().item()
                sums.maxabs_other += maxabs[:, 1:].sum().item()
                sums.n_other += kurt[:, 1:].numel()
            sums.max_abs = max(sums.max_abs, maxabs.max().item())

    def add_attention(self, attention: list[Tensor]) -> None:
        for probs in attention:  # (B, nh, T, T)
            rows = probs[:, :, 1:, :].detach()  # queries q >= 1
            key0 = rows[..., 0]
            self.top1_hits += int(((key0 > 0) & (key0 >= rows.amax(-1))).sum())
            self.key0_mass += rows[..., 0].double().sum().item()
            self.n_queries += rows[..., 0].numel()

    def per_layer(self) -> dict[str, list[float]]:
        """Per-layer means (for plots): kurtosis and max |activation|, first token and others."""
        div = lambda a, n: a / n if n else float("nan")  # noqa: E731
        return {
            "kurtosis_first": [div(s.kurt_first, s.n_first) for s in self.layers],
            "kurtosis_other": [div(s.kurt_other, s.n_other) for s in self.layers],
            "max_abs_first": [div(s.maxabs_first, s.n_first) for s in self.layers],
            "max_abs_other": [div(s.maxabs_other, s.n_other) for s in self.layers],
            "max_abs": [s.max_abs for s in self.layers],
        }

    def summary(self) -> dict[str, float]:
        layer = self.per_layer()
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        out = {
            "kurtosis_first": mean(layer["kurtosis_first"]),
            "kurtosis_other": mean(layer["kurtosis_other"]),
            "kurtosis_max": max(
                (max(a, b) for a, b in zip(layer["kurtosis_first"], layer["kurtosis_other"], strict=True)),
                default=float("nan"),
            ),
            "max_abs_first": mean(layer["max_abs_first"]),
            "max_abs_other": mean(layer["max_abs_other"]),
            "max_abs": max(layer["max_abs"], default=float("nan")),
        }
        if self.n_queries:
            out["first_token_top1_share"] = self.top1_hits / self.n_queries
            out["first_token_mass"] = self.key0_mass / self.n_queries
        return out
