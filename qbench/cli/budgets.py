"""The default token budgets of the command line: one per kind of work, so two commands that do the same work score
the same tokens (and reuse each other's records) unless told otherwise.

Standard library only: the parser imports it, and ``qbench --help`` should not wait on anything heavier.
"""

from __future__ import annotations

# Whole-model evaluation of the models a user names (run, grid, score, sweep, inspect, intervene, emergence
# snapshots): ``qbench.eval.metrics.Protocol``'s own default, so the CLI and ``qbench.evaluate`` agree and
# ``score`` reuses the cells ``run`` wrote. 32 windows of a 1,024-token model: a steady perplexity on CPU in seconds
# to minutes per cell.
EVAL_TOKENS = 32768

# Per-unit studies (sensitivity: one evaluation per layer, ~200 of them for a 135 M model): small enough that the
# whole map takes about ten minutes on two CPU cores (the arithmetic is in ``qbench.cli.sensitivity``).
UNIT_TOKENS = 512

# The demo's recipe (``qbench.studies.demo.DemoConfig.eval_tokens``): its committed results were measured at this
# budget, and a default that differed would not reproduce them.
DEMO_TOKENS = 16384

# ``reproduce``: the paper's tables, at paper scale (``qbench.studies.reproduce.ReproduceConfig.eval_tokens``).
PAPER_TOKENS = 262144

# ``speed``: tokens per timed forward, the prefill shape of a kernel timing (not a perplexity budget).
TIMING_TOKENS = 512

# ``card --budget quick``: the fewest tokens a card scores (``qbench.studies.card.BUDGETS``; full takes the
# evaluation budget), so a first look at a model takes minutes.
CARD_QUICK_TOKENS = 4096

# ``card --budget standard``: every format, the KV rows at four widths and a sweep (~50 cells on one model) in about
# 25 minutes for a 124 M-parameter model on 2 CPU cores (measured: results/cards/gpt2-130m-random-standard/); at the
# demo's 16,384 tokens the same card would take about twice that.
CARD_STANDARD_TOKENS = 8192

BUDGETS = {
    "evaluation": EVAL_TOKENS,
    "per-unit study": UNIT_TOKENS,
    "demo": DEMO_TOKENS,
    "paper reproduction": PAPER_TOKENS,
    "timing": TIMING_TOKENS,
    "card quick": CARD_QUICK_TOKENS,
    "card standard": CARD_STANDARD_TOKENS,
}
