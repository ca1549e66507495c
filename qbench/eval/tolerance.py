"""What a tolerance applies to (``--metric``) and how it reads, with nothing else: the card's sentences
(``qbench.studies.card.words``) need them without the tensors :mod:`qbench.eval.evidence` computes with, so this
module imports no torch. :mod:`qbench.eval.evidence` re-exports every name here."""

from __future__ import annotations

# What a tolerance applies to (``--metric``), in that metric's unit, and its default.
METRICS = {
    "ppl": ("perplexity change", "%", 1.0),
    "kld": ("mean KL divergence from the float model", "nats", 0.01),
    "top1": ("tokens whose most likely next token changed", "%", 1.0),
}
DEFAULT_METRIC = "ppl"


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        from models.errors import unknown_choice

        raise unknown_choice("metric", metric, tuple(METRICS))
    return metric


def default_tolerance(metric: str) -> float:
    return METRICS[check_metric(metric)][2]


def tolerance_text(tolerance: float, metric: str = DEFAULT_METRIC) -> str:
    """A tolerance in words with its unit: ``1 %`` (perplexity change), ``KLD 0.01 nats``, ``1 % top-1 changed``."""
    if check_metric(metric) == "ppl":
        return f"{tolerance:g} %"
    if metric == "kld":
        return f"KLD {tolerance:g} nats"
    return f"{tolerance:g} % top-1 changed"
