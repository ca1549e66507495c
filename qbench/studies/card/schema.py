"""The shape of ``card.json``, declared (lm-eval keeps its ``result_schema.py`` the same way), its version; :mod:`~.upgrade`
walks a card against it and brings a card of an earlier version to this one.

:class:`Card` is the top level; each model is a :class:`ModelSection` with its :class:`FormatRow` rows, its
:class:`KVSection` (:class:`KVRow` rows), its :class:`Verdict`, its :class:`SensitivitySection` (where it breaks
and the :class:`Repair`) and, with two models or more, the card's :class:`ComparisonRow` rows. A key every card of
this version holds is required; a key only some rows hold (a sweep's curve point, a KV row of the side by side) is
declared in a ``total=False`` class.

Versions: 1, the cards written before the shape was declared (keys were added while the version stayed 1, so an
early one may lack what the pages read); 2, the shape declared here.
"""

from __future__ import annotations

from typing import Any, TypedDict

from qbench.eval.tolerance import Decisions
from qbench.eval.tolerance import RowDecision as Decision  # a row's verdict on the card's metric
from qbench.studies.card.shapes import Kernels, LlamaCppRow, MixedPlan, _Evidence

CARD_VERSION = 2
READS = (1, 2)  # the card versions this qbench reads (:func:`upgrade`)


class MetricInfo(TypedDict):
    """``card["metrics"][key]``: a metric's registry entry (``qbench.eval.metric_registry``)."""

    label: str
    definition: str
    unit: str
    better: str


class Environment(TypedDict):
    """``qbench.eval.harness.environment``: where and with what a card (or a model's float record) was made."""

    software: dict[str, str]
    git_commit: str | None
    device: str
    cuda: str | None
    cuda_fp32_matmul: str | None
    threads: int
    platform: str
    processor: str | None


class GGUFSummary(TypedDict):
    """A GGUF source's header (``qbench.eval.gguf.gguf_summary``)."""

    architecture: str | None
    file_type: Any
    tensor_types: dict[str, int]
    tensors: int


class Identity(TypedDict):
    """What the model is: the float record's ``model`` block and the profile's architecture."""

    kind: str | None
    path: str | None
    fingerprint: str | None
    dtype: str | None
    gguf: GGUFSummary | None
    parameters: int | None
    family: str | None
    attention: str | None
    gate: str | None
    norm: str | None
    norm_position: str | None
    positions: str | None
    tied_head: bool
    sliding_window: int | None
    layers: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    d_model: int | None
    context: int | None


class _Sampled(TypedDict, total=False):
    sampled: dict[str, Any]  # qbench.eval.sampling.sampled_summary; absent: the first windows


class Protocol(_Sampled):
    """How the model was scored (the float record's protocol) and what its statistics were computed on."""

    corpus: str
    split: str | None
    tokens: int
    tokens_scored: int
    window: int
    windows: int
    start_token: str
    bos: bool
    tokenizer_fingerprint: str | None
    dtype: str | None
    outlier_windows: int | None
    seed: int | None
    corpus_description: str
    statistics_windows: int | None
    statistics_tokens: int | None


class FloatRow(TypedDict):
    """The float model's record."""

    perplexity: float
    model_bytes: int | None
    eval_seconds: float | None
    record: str | None
    cell_id: str | None


class OutlierSummary(TypedDict):
    kurtosis_first: float | None
    kurtosis_other: float | None
    max_abs: float | None
    first_token_top1_share: float | None
    first_token_mass: float | None
    massive_total: int | None
    max_input_crest: float | None
    max_weight_crest: float | None


class MassiveSite(TypedDict, total=False):
    """One massive activation (``qbench.eval.metrics``): where (window, position, channel), its value and token."""

    window: int
    position: int
    channel: int
    value: float
    token: str


class OutlierLayer(TypedDict):
    layer: int
    kurtosis_first: float | None
    kurtosis_other: float | None
    max_abs: float | None
    max_abs_first: float | None
    max_abs_other: float | None
    massive_count: int
    massive_channels: list[int]
    massive_positions: list[int]
    massive_position_kinds: dict[str, int]
    massive_sites: list[MassiveSite]
    median_abs: float | None
    top: list[float]


class LinearInput(TypedDict):
    name: str
    lm_head: bool
    input_crest: float | None
    input_kurtosis: float | None
    input_absmax: float | None
    input_int8_sqnr_db: float | None
    weight_crest: float | None


class Outliers(TypedDict):
    """The outlier profile and the attention sink's reading (``build._outlier_profile``)."""

    sink_chance: float | None
    sink: str | None
    sink_heads_share: float | None
    sink_vs_chance: float | None
    sink_top1_vs_chance: float | None
    summary: OutlierSummary
    massive_threshold: dict[str, float] | None
    windows: int | None
    layers: list[OutlierLayer]
    linear: list[LinearInput]
    linear_worst: list[str]


class Attention(TypedDict):
    """The attention sink per layer and head: ``[layer][head]`` shares over the profile's windows."""

    windows: int
    top1_share: list[list[float]]
    mass: list[list[float]]


class FormatRow(_Evidence):
    """One deployable format (``build._format_row``): its quality, its size as deployed and its kernels' speed."""

    label: str
    scheme: str
    scheme_label: str | None
    quantised: str | None
    note: str | None
    error: str | None
    weight_bytes: int | None
    weight_bytes_rest_float: int | None
    bf16_model_bytes: int | None
    bytes_vs_bf16: float | None
    memory_bytes: int | None
    weight_bits: int | None
    speedup: float | None
    decode_speedup: float | None
    prefill_speedup: float | None
    speed_excludes: str | None
    cell_id: str | None


class KVWindow(TypedDict):
    """The window the KV rows were read at, and whether it is shorter than a deployed context."""

    context: int | None
    minimum: int
    window: int | None
    short: bool


class KVMemory(TypedDict):
    """The KV cache's size at the model's context (``sizes.kv_memory``, its per-row bytes in the rows)."""

    context: int
    batch: int
    bf16_bytes: int
    what: str


class KVScheme(TypedDict):
    scheme: str | None
    name: str | None
    options: dict[str, Any]
    causal: bool
    keys: str | None
    values: str | None


class FloatReads(TypedDict):
    keys: float
    values: float


class KVRow(_Evidence):
    """One KV-cache row (``build.kv_section``): float weights, the cache quantised."""

    bits: int | None
    keep_sinks: int
    label: str | None
    scheme: str | None
    scheme_name: str | None
    float_reads: FloatReads | None
    cache_bytes: int | None


class KVSkipped(TypedDict):
    label: str | None
    reason: str | None


class KVBreakingPoint(TypedDict):
    bits: int | None
    possible_bits: int | None
    lowest_swept: int | None


class KVSection(TypedDict):
    window: KVWindow
    memory: KVMemory | None
    schemes: list[KVScheme]
    rows: list[KVRow]
    skipped: list[KVSkipped]
    breaking_points: dict[str, KVBreakingPoint]  # by curve: "kv kivi", "kv kivi +1 sink", …


class _CurvePoint(TypedDict):
    ppl_change_pct: float | None
    status: str


class CurvePoint(_CurvePoint, total=False):
    """One width of a breaking-point curve; a sweep's point also holds its ratio, verdict and interval."""

    ppl_ratio: float | None
    verdict: str | None
    ppl_change_ci95: list[float] | None
    decision: Decision | None  # on a card decided on kld or top1: the value and interval the pages show


class BreakingPoint(TypedDict):
    family: str
    axis: str
    bits: int | None
    text: str
    curve: dict[str, CurvePoint]  # by width ("8", "4", …), widest first


class SensitiveUnit(TypedDict):
    """A unit quantised alone, the rest float."""

    name: str
    ppl: float | None
    ppl_change_pct: float | None
    status: str | None
    input_crest: float | None
    input_kurtosis: float | None
    max_abs: float | None
    weight_crest: float | None


class Beat(TypedDict):
    """What a repair must be smaller than to pay (``decide.size_to_beat``)."""

    bytes: int | None
    what: str


class _Decided(TypedDict, total=False):
    decision: Decision  # on a card decided on kld or top1: the repaired cell's decision on that metric
    quantised_decision: Decision  # and the fully quantised cell's


class Repair(_Decided):
    """The repair the card shows: the fewest units kept in float that bring the format within the tolerance."""

    reached: bool
    minimised: bool
    exclude: list[str]
    count: int
    weight_share_float: float
    quantised_ppl_change_pct: float | None
    ppl: float | None
    ppl_change_pct: float | None
    ppl_change_ci95: list[float] | None
    kld_mean: float | None
    top1_agreement: float | None
    tolerance_pct: float
    weight_bytes: int | None
    bytes_vs_bf16: float | None
    pays: bool
    beat: Beat


class RepairTry(TypedDict):
    """One format a repair was tried on, in turn, until one paid."""

    scheme: str
    reached: bool
    count: int
    quantised_ppl_change_pct: float | None
    ppl_change_pct: float | None
    weight_bytes: int | None
    pays: bool


class SensitivitySection(TypedDict):
    """Where a format breaks (units quantised alone) and its repair (``build._repair_section``)."""

    scheme: str
    by: str
    output: str | None
    top: list[SensitiveUnit]
    units: int
    correlation: dict[str, float | None]
    repair: Repair
    command: str
    tries: list[RepairTry]


class MappedUnit(TypedDict):
    name: str
    ppl_change_pct: float | None


class AvoidMap(TypedDict):
    """Which units carry a failing format's damage (``build._map_section``)."""

    scheme: str
    by: str
    output: str | None
    top: list[MappedUnit]
    units: int


class Recommended(TypedDict):
    label: str
    scheme: str
    ppl_change_pct: float | None
    weight_bytes: int | None
    bytes_vs_bf16: float | None


class AvoidRow(TypedDict):
    label: str
    scheme: str
    ppl_change_pct: float | None
    ppl_change_ci95: list[float] | None
    kld_mean: float | None
    top1_agreement: float | None
    status: str
    blamed: list[MappedUnit] | None
    blamed_by: str | None


class VerdictRepair(Repair):
    """The verdict's repair: the section's, with the format it repairs and the command that makes it."""

    scheme: str
    command: str


class Command(TypedDict):
    what: str
    command: str


class Verdict(TypedDict):
    """``words.verdict_of``: the decisions and the lines that say them."""

    recommended: Recommended | None
    avoid: list[AvoidRow]
    undecided: list[str]
    beyond: list[str]
    repair: VerdictRepair | None
    lines: list[str]
    commands: list[Command]


class _ModelSection(TypedDict):
    """One model's page (``build.build_card``)."""

    name: str
    source: str
    identity: Identity
    protocol: Protocol
    fp: FloatRow
    env: Environment | None
    outliers: Outliers
    attention: Attention
    formats: list[FormatRow]
    kv: KVSection
    breaking_points: list[BreakingPoint]
    sensitivity: SensitivitySection | None
    speed_measured: bool
    avoid_map: AvoidMap | None
    window_nll: dict[str, list[float]]  # by cell id: per-window mean NLL (the comparison's paired intervals)
    kernels: Kernels | None
    verdict: Verdict
    not_measured: list[str]


class ModelSection(_ModelSection, total=False):
    decisions: Decisions  # its verdicts and the false within calls they could make (cards before: none)
    llama_cpp: list[LlamaCppRow]  # llama.cpp's file types (cards without --llama-cpp rows: none)
    mixed_plan: MixedPlan  # qbench plan at the smallest passing type's size (--mixed-plan; else none)


class _ComparisonRow(TypedDict):
    section: str  # float | formats | kv | breaking points | outliers
    row: str
    scheme: str | None
    values: dict[str, float | str | None]  # by model name
    more_robust: str | None


class ComparisonRow(_ComparisonRow, total=False):
    """One row of the side by side (``build._comparison``); what a section's rows add beside the values."""

    perplexity: dict[str, float | None]  # formats, kv
    below_others_float: dict[str, list[str]] | None  # formats
    better_to_ship: str | None  # float, formats
    missing: list[str]  # kv: the models whose budget had no such row
    decision: dict[str, Decision | None]  # formats, kv on a card on kld or top1: each model's decision


class Card(TypedDict):
    """``card.json``: the settings (``measure.run_card``'s), then what ``build.build_card`` computed."""

    card_version: int
    budget: str
    budget_contents: str
    tolerance_pct: float
    metric: str
    resolve_tokens: int | None
    command: str | None
    seed: int
    output_path: str
    wall_seconds: float
    device: str
    metrics: dict[str, MetricInfo]
    models: list[ModelSection]
    comparison: list[ComparisonRow] | None
    comparison_lines: list[str]
    env: Environment
    created_utc: str
