"""Every number a record holds, named once: the metric registry.

One entry per metric — its key in the record, the block it lives in, a one-line definition, its unit, which
direction is better and the table label — read by the comparison table (``report.py``), the sensitivity study's
per-unit statistics and ``docs/metrics.md`` (whose table is checked against this registry by the tests). The
definitions themselves are computed once, where ``computed_in`` says (``models.stats`` for the residual-stream
statistics, ``qbench.eval.metrics`` for perplexity, massive activations and linear-layer ranges).

Adding a metric: compute it where it belongs, add one :class:`Metric` here, and a row to docs/metrics.md; a table
that should show it lists its key (``COMPARE_COLUMNS``, ``UNIT_STATISTICS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.errors import unknown_choice


@dataclass(frozen=True)
class Metric:
    key: str  # the key inside the record block (``record[block][key]``; per-layer entries for ``linear``)
    block: str  # metrics | outliers | linear_ranges (per layer) | massive_activations
    label: str  # table header (no "|": it would split a markdown cell)
    definition: str  # one line; the full text is in docs/metrics.md
    unit: str  # "" (a pure number), "%", "dB", "×"
    better: str  # "lower" | "higher" | "none" (a description, not a score)
    computed_in: str  # the function that computes it


METRICS: tuple[Metric, ...] = (
    Metric(
        "perplexity",
        "metrics",
        "ppl",
        "token-level perplexity: exp(mean NLL per predicted token) on non-overlapping windows",
        "",
        "lower",
        "qbench.eval.metrics.perplexity",
    ),
    Metric(
        "ppl_change_pct",
        "metrics",
        "Δppl",
        "the quantised model's perplexity change against the float model on the same windows",
        "%",
        "lower",
        "qbench.eval.harness.ModelEvaluation.record",
    ),
    Metric(
        "kurtosis_first",
        "outliers",
        "κ first",
        "raw kurtosis across channels of the first token's block outputs, mean over layers",
        "",
        "lower",
        "models.stats.OutlierAccumulator",
    ),
    Metric(
        "kurtosis_other",
        "outliers",
        "κ other",
        "raw kurtosis across channels of the other tokens' block outputs, mean over tokens then layers",
        "",
        "lower",
        "models.stats.OutlierAccumulator",
    ),
    Metric(
        "max_abs",
        "outliers",
        "max abs act",
        "largest |activation| of any block output (residual stream)",
        "",
        "lower",
        "models.stats.OutlierAccumulator",
    ),
    Metric(
        "first_token_top1_share",
        "outliers",
        "1st-token top-1",
        "share of (layer, head, query ≥ 1) whose largest attention weight is on key 0",
        "%",
        "none",
        "models.stats.OutlierAccumulator",
    ),
    Metric(
        "first_token_mass",
        "outliers",
        "1st-token mass",
        "mean attention weight on key 0 over (layer, head, query ≥ 1), as computed (softmax-1 rows sum < 1)",
        "",
        "none",
        "models.stats.OutlierAccumulator",
    ),
    Metric(
        "input_crest",
        "linear_ranges",
        "input crest",
        "a linear layer's input max |x| / RMS(x): what one per-tensor scale must cover",
        "×",
        "lower",
        "qbench.eval.metrics.linear_ranges",
    ),
    Metric(
        "input_kurtosis",
        "linear_ranges",
        "input κ",
        "raw kurtosis across channels of a linear layer's input, per token, mean over tokens",
        "",
        "lower",
        "qbench.eval.metrics.linear_ranges",
    ),
    Metric(
        "input_absmax",
        "linear_ranges",
        "input max abs",
        "a linear layer's largest |input|",
        "",
        "lower",
        "qbench.eval.metrics.linear_ranges",
    ),
    Metric(
        "weight_crest",
        "linear_ranges",
        "weight crest",
        "a linear layer's weight max |w| / RMS(w)",
        "×",
        "lower",
        "qbench.eval.metrics.linear_ranges",
    ),
)

BY_KEY = {m.key: m for m in METRICS}

# What the comparison table shows beside the perplexities: the float model's outlier statistics.
COMPARE_COLUMNS = ("kurtosis_first", "kurtosis_other", "max_abs", "first_token_top1_share")
# The float model's statistics the sensitivity study puts beside each unit (its name -> the per-layer key).
UNIT_STATISTICS = {
    "input_crest": "input_crest",
    "input_kurtosis": "input_kurtosis",
    "max_abs": "input_absmax",
    "weight_crest": "weight_crest",
}


def metric(key: str) -> Metric:
    """The registered metric ``key`` (a one-line error with did-you-mean otherwise)."""
    if key not in BY_KEY:
        raise unknown_choice("metric", key, list(BY_KEY))
    return BY_KEY[key]


def format_value(key: str, value: float | None) -> str:
    """A metric's value as tables print it: shares as percentages, large numbers with thousands separators."""
    if value is None:
        return "-"
    if metric(key).unit == "%" and metric(key).block == "outliers":
        return f"{value:.1%}"  # stored as a fraction
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def markdown_table() -> str:
    """The registry as the table in docs/metrics.md (a test keeps the page equal to this)."""
    lines = [
        "| key | in the record | unit | better | definition | computed in |",
        "|---|---|---|---|---|---|",
    ]
    for m in METRICS:
        block = f"{m.block}.per_layer[layer]" if m.block == "linear_ranges" else m.block
        definition = m.definition.replace("|", "\\|")  # a bare | would split the markdown cell
        lines.append(
            f"| `{m.key}` | `{block}` | {m.unit or '–'} | {m.better} | {definition} | `{m.computed_in}` |"
        )
    return "\n".join(lines) + "\n"
