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

# The demo's training budget (``qbench.studies.demo.DemoConfig.steps``), which ``qbench recipes`` trains every
# remedy at too: optimiser steps of 16 windows × 128 tokens (300 = 0.61 M tokens). 300, not the 500 it was: the
# whole demo then fits 15 minutes on 2 cores (training was 14.3 of its 19.7 min at 500 on a Zen 4 VM), and its
# finding is already there — the vanilla model's raw kurtosis peaks at steps 200–300 (41 first token, 27 other
# tokens at 300 against the paper recipe's 2.1 and 2.6; results/demo/emergence.json of the 500-step run).
DEMO_STEPS = 300
DEMO_LONG_STEPS = 2000  # ``--long``: 2000 steps (4.1 M tokens), the whole cosine schedule, Llama style

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
