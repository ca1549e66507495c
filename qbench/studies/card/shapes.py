"""Parts of ``card.json``'s shape declared apart from :mod:`~.schema`, which imports them: what every measured row
holds (:class:`_Evidence`, with ``--resolve``'s :class:`ResolveStep`), the llama.cpp rows (:class:`LlamaCppRow`,
``rows.llama_cpp_row``) and the real kernels' speed (:class:`Kernels`)."""

from __future__ import annotations

from typing import Any, TypedDict

from qbench.eval.tolerance import RowDecision as Decision
from qbench.eval.tolerance import Sequential


class _ResolveStep(TypedDict):
    """One evaluation of a row ``--resolve`` re-evaluated (``qbench.studies.resolve``)."""

    tokens_scored: int | None
    verdict: str
    value: float | None
    ci95: list[float] | None


class ResolveStep(_ResolveStep, total=False):
    sequential: Sequential | None  # the look: rule, alpha spent, interval decided on (cards before: none)


class _Evidence(TypedDict):
    """What every measured row holds beside its change (``qbench.eval.evidence.row_fields``)."""

    perplexity: float | None
    ppl_change_pct: float | None
    status: str | None
    verdict: str
    within_tolerance: bool
    decision: Decision
    ppl_change_ci95: list[float] | None
    kld_mean: float | None
    kld_p99: float | None
    top1_agreement: float | None
    tokens_to_decide: int | None
    tokens_scored: int | None
    resolved: list[ResolveStep] | None
    record: str | None


class LlamaCppRow(_Evidence):
    """One llama.cpp file type (``rows.llama_cpp_row``): its quality, its file and its speed through llama.cpp."""

    type: str
    scheme: str
    error: str | None
    bytes: int | None
    bits_per_weight: float | None
    tensor_types: dict[str, int] | None
    llama_cpp: str | None
    tokens_per_second: float | None
    cell_id: str | None


class KernelRatios(TypedDict, total=False):
    decode: float | None
    prefill: float | None
    error: str | None


class KernelShape(TypedDict):
    out_in: list[int]
    layers: int


class Kernels(TypedDict, total=False):
    """The linear layers' real kernels against float32 (``qbench.studies.layerspeed``, its records left out)."""

    key: dict[str, Any]
    what: str
    prefill_tokens: int
    fp32_ms: dict[str, float | None]
    shapes: list[KernelShape]
    schemes: dict[str, KernelRatios]
    threads: int
    torch: str
    cpu: str | None
    device: str
    native_isa: str | None
    git_commit: str | None
    seed: int


class MixedPlanRow(TypedDict):
    """One budget of the card's mixed-precision plan (``build.mixed_plan_section``)."""

    budget: str
    budget_bytes: int
    error: str | None
    plan: dict[str, str] | None
    promised_kld: float | None
    promised_bytes: int | None
    kld_mean: float | None
    ppl_change_pct: float | None
    ppl_change_ci95: list[float] | None
    top1_agreement: float | None
    bytes: int | None
    nearest: str | None
    vs_nearest: str | None
    vs_nearest_ci95: list[float] | None
    gguf: str | None


class MixedPlan(TypedDict):
    """``qbench plan`` on the card (``--mixed-plan``): its folder, its plans, or why none was made."""

    skipped: str | None
    output: str | None
    plans: list[MixedPlanRow]
