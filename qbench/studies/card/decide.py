"""Decisions on records, no sentences: the attention-sink reading, which format to repair and the size it must beat,
and the verdict (:class:`Verdict`: which format to recommend, which to avoid and why, whether the repair pays)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qbench.studies.card.plan import rtn_scheme
from qbench.studies.card.sizes import deployed_bytes, float_size

# Gu et al. 2024 ("When Attention Sink Emerges in Language Models", ICLR 2025) count a head as a sink when its mean
# attention weight on the first token exceeds ε = 0.3 (their Sink_ε: the share of such heads).
SINK_EPSILON = 0.3


# "No sink" up to this many times uniform attention's share: a randomly initialised gpt2-130m measures 1.0×, the
# sink-free demo models 0.7-1.6× (mean weight and top-1 share); a strict "above uniform" called the random one a sink.
SINK_CHANCE_MARGIN = 2.0


def sink_heads_share(head_mass: Sequence[Sequence[float]] | None) -> float | None:
    """Gu et al.'s Sink_ε: the share of (layer, head) pairs whose mean weight on key 0 exceeds :data:`SINK_EPSILON`
    (None without per-head weights)."""
    flat = [v for row in head_mass or () for v in row if v is not None]
    return sum(v > SINK_EPSILON for v in flat) / len(flat) if flat else None


def sink_verdict(
    mass: float | None, top1: float | None, chance: float | None, heads_share: float | None = None
) -> str | None:
    """``"sink"`` when some head puts more than :data:`SINK_EPSILON` of its attention on key 0 (``heads_share`` >
    0: Gu et al.'s criterion; without per-head weights, the mean weight over all heads reaching it); ``"no sink"``
    when both the mean weight and the top-1 share stay within :data:`SINK_CHANCE_MARGIN` × uniform causal
    attention's (``chance``); otherwise ``"weak"``: clearly above chance, no head a sink."""
    if chance is None or mass is None:
        return None
    if (heads_share or 0) > 0 or mass > SINK_EPSILON:
        return "sink"
    limit = SINK_CHANCE_MARGIN * chance
    if mass <= limit and (top1 is None or top1 <= limit):
        return "no sink"
    return "weak"


def repair_targets(
    formats: Sequence[Mapping[str, Any]],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    tolerance: float,
    metric: str = "ppl",
    source_bytes: int | None = None,
) -> list[Mapping[str, Any]]:
    """The formats a repair could pay for, in the order the card tries them: the formats decidedly beyond the
    tolerance that are smaller (deployed bytes) than what must be beaten (:func:`size_to_beat`), smallest first. A repair keeps layers in float, so it
    only adds bytes: a format not already smaller than the smallest passing one (or, with none, than the model in
    bf16 or a smaller block-quantised source file) could never pay, and the smallest candidate is the repair
    that would save the most if it reaches the tolerance."""
    from qbench.eval.evidence import BEYOND, decide

    limit, _ = size_to_beat(formats, fp, profile, tolerance, metric, source_bytes)
    sized = [(r, deployed_bytes(r["scheme"], fp, profile)) for r in formats if r.get("status") == "ok"]
    # decidedly beyond only: an undecided format may pass as it is (more tokens decide it: --resolve), and a
    # repair of a format that already lowers perplexity could only keep everything in float
    failing = [
        (b, i, r)
        for i, (r, b) in enumerate(sized)
        if b and decide(r, tolerance, metric).verdict == BEYOND and (limit is None or b < limit)
    ]
    return [x[2] for x in sorted(failing, key=lambda x: x[:2])]


def size_to_beat(
    formats: Sequence[Mapping[str, Any]],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    tolerance: float,
    metric: str = "ppl",
    source_bytes: int | None = None,
) -> tuple[int | None, str]:
    """(bytes, what) a repaired format must be smaller than to pay: the smallest of the formats within the
    tolerance, the whole model in bf16 (what a deployment falls back to; its own damage not measured here) and,
    for a source file whose weights are already block-quantised (a Q4_1 GGUF: ``source_bytes``), that file — it is
    the card's reference, so it has no damage of its own to beat."""
    options = [
        (b, f"`{r['scheme']['name']}`, which passes as it is")
        for r in formats
        if r.get("status") == "ok"
        and _within(r, tolerance, metric)
        and (b := deployed_bytes(r["scheme"], fp, profile))
    ]
    fp_bytes = fp.get("model_bytes") or 0
    if fp_bytes:
        options.append((fp_bytes * 2 // float_size(fp), "the model in bf16"))
    if source_bytes:
        options.append(
            (source_bytes, "the source file itself, already block-quantised (the card's reference)")
        )
    if not options:
        return None, "the model in bf16"
    return min(options, key=lambda o: o[0])


def worst_beyond(
    formats: Sequence[Mapping[str, Any]], tolerance: float, metric: str = "ppl"
) -> Mapping[str, Any] | None:
    """The format record decidedly beyond the tolerance with the largest perplexity change (NaN/inf first)."""
    from qbench.eval.evidence import BEYOND, decide

    beyond = [
        r
        for r in formats
        if r.get("status") == "nonfinite"
        or (r.get("status") == "ok" and decide(r, tolerance, metric).verdict == BEYOND)
    ]
    if not beyond:
        return None
    return max(beyond, key=lambda r: math.inf if r.get("status") != "ok" else r["metrics"]["ppl_change_pct"])


def _within(record: Mapping[str, Any], tolerance: float, metric: str = "ppl") -> bool:
    """Whether a record is *within* the tolerance of ``metric``: its 95 % interval's upper end ≤ tolerance
    (undecided is not)."""
    from qbench.eval.evidence import decide

    return decide(record, tolerance, metric).within


# ------------------------------------------------------------------------------------------------------- verdict
# The verdict reads the card's format rows (``build``'s, as card.json holds them): each row's ``verdict`` is already
# the evidence's three-way decision at the card's tolerance and metric, so nothing here compares a number with the
# tolerance again.

Row = Mapping[str, Any]  # one format row of card.json


@dataclass(frozen=True)
class Blamed:
    """A unit a sensitivity map blames for a format's damage, with the change it costs quantised alone (None: the
    perplexity turned NaN/inf)."""

    name: str
    ppl_change_pct: float | None


@dataclass(frozen=True)
class Avoid:
    """A format decidedly beyond the tolerance (or NaN/inf), with the units a sensitivity map of it blames: None
    when no map of it was measured (no unit is named on a guess), empty when mapped but no unit alone costs
    anything."""

    row: Row
    blamed: tuple[Blamed, ...] | None
    blamed_by: str | None  # the map's grouping (``type``, ``layer``…)


@dataclass(frozen=True)
class RepairTry:
    """Another format a repair was tried on, and whether it reached the tolerance (at ``weight_bytes``)."""

    scheme: str
    reached: bool
    weight_bytes: int | None


@dataclass(frozen=True)
class Repair:
    """The repair the card shows (``build``'s repair section): the units kept in float, what it reached, and whether
    it pays — within the tolerance *and* smaller than what must be beaten (``beat_bytes``, ``beat_what``: the
    size :func:`size_to_beat` named)."""

    scheme: str
    reached: bool
    pays: bool
    count: int
    weight_share_float: float
    quantised_ppl_change_pct: float | None
    ppl_change_pct: float | None
    ppl_change_ci95: Sequence[float] | None
    kld_mean: float | None
    weight_bytes: int | None
    bytes_vs_bf16: float | None
    minimised: bool
    beat_bytes: int | None
    beat_what: str | None
    command: str
    others: tuple[RepairTry, ...]  # every other format tried, in the order tried
    # on a card decided on kld or top1: the repaired and the fully quantised cell's decisions on that metric
    decision: Mapping[str, Any] | None = None
    quantised_decision: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class NoRepair:
    """Why no repair was tried: no format decidedly beyond the tolerance is smaller than ``bytes`` (``what``), and
    keeping layers in float only adds bytes."""

    bytes: int
    what: str


@dataclass(frozen=True)
class Rescue:
    """A post-training algorithm's row (GPTQ, AWQ, QuaRot) whose round-to-nearest row (``rtn``) is decidedly
    beyond the tolerance: ``rescued`` when the algorithm's row is within it."""

    row: Row
    rtn: Row
    rescued: bool


@dataclass(frozen=True)
class Verdict:
    """What the card decides of one model's formats: the format to recommend (None: nothing passes), the formats
    still undecided, those decidedly beyond (worst first) and each one's :class:`Avoid`, what the post-training
    algorithms rescued, and the repair or why none was tried."""

    recommended: Row | None
    undecided: tuple[Row, ...]
    beyond: tuple[Row, ...]
    avoid: tuple[Avoid, ...]
    rescues: tuple[Rescue, ...]
    repair: Repair | None
    no_repair: NoRepair | None


def verdict(
    formats: Sequence[Row],
    sens: Mapping[str, Any] | None,
    avoid_map: Mapping[str, Any] | None = None,
    beat: tuple[int | None, str] | None = None,
) -> Verdict:
    """The verdict of a model's format rows: recommended the smallest format within the tolerance (fewest model
    bytes; ties: the smaller change); every format decidedly beyond it to avoid, worst first, with the units its
    sensitivity map blames where one was measured (``avoid_map``, or ``sens``: the repair's map); the repair
    (``sens``: build's repair section) and whether it pays; or, with ``beat`` = :func:`size_to_beat`'s answer and
    no repair, whether none was tried because no failing format is smaller than the size to beat."""
    ok = [f for f in formats if f["within_tolerance"] and f["weight_bytes"]]
    smallest = min(ok, key=lambda f: (f["weight_bytes"], f["ppl_change_pct"])) if ok else None
    # measured and decidedly beyond (or NaN/inf): a row the model could not run (unsupported, error) is no failure
    beyond = [
        f
        for f in formats
        if (f["status"] == "ok" and f.get("verdict") == "beyond") or f["status"] == "nonfinite"
    ]
    beyond.sort(key=lambda f: -(math.inf if f["ppl_change_pct"] is None else f["ppl_change_pct"]))
    maps = {m["scheme"]: m for m in (avoid_map, sens) if m}
    repair = _repair(sens) if sens else None
    return Verdict(
        recommended=smallest,
        undecided=tuple(f for f in formats if f["status"] == "ok" and f.get("verdict") == "undecided"),
        beyond=tuple(beyond),
        avoid=tuple(_avoid(f, maps.get(f["scheme"])) for f in beyond),
        rescues=rescues(formats),
        repair=repair,
        no_repair=None if repair else _no_repair(beyond, beat),
    )


def _avoid(row: Row, mapped: Mapping[str, Any] | None) -> Avoid:
    """``row`` to avoid, with the 3 worst units its map blames: only those that cost something (a unit that lowers
    perplexity alone carries none of the damage; one that alone makes it NaN/inf, change None, is the worst)."""
    if not mapped:
        return Avoid(row, None, None)
    blamed = [
        Blamed(u["name"], u["ppl_change_pct"])
        for u in mapped["top"]
        if u.get("ppl_change_pct") is None or u["ppl_change_pct"] > 0
    ]
    return Avoid(row, tuple(blamed[:3]), mapped["by"])


def _repair(sens: Mapping[str, Any]) -> Repair:
    """The repair section ``sens`` (:func:`~.repair.repair_section`, which decided whether it pays) as typed."""
    r = sens["repair"]
    beat = r.get("beat") or {}
    return Repair(
        scheme=sens["scheme"],
        reached=r["reached"],
        pays=bool(r["pays"]),
        count=r["count"],
        weight_share_float=r["weight_share_float"],
        quantised_ppl_change_pct=r["quantised_ppl_change_pct"],
        ppl_change_pct=r["ppl_change_pct"],
        ppl_change_ci95=r.get("ppl_change_ci95"),
        kld_mean=r.get("kld_mean"),
        weight_bytes=r.get("weight_bytes"),
        bytes_vs_bf16=r.get("bytes_vs_bf16"),
        minimised=r.get("minimised", True),  # studies before the option always minimised
        beat_bytes=beat.get("bytes"),
        beat_what=beat.get("what"),
        command=sens["command"],
        others=tuple(
            RepairTry(t["scheme"], t["reached"], t.get("weight_bytes"))
            for t in sens.get("tries") or []
            if t["scheme"] != sens["scheme"]
        ),
        decision=r.get("decision"),
        quantised_decision=r.get("quantised_decision"),
    )


def _no_repair(beyond: Sequence[Row], beat: tuple[int | None, str] | None) -> NoRepair | None:
    """What :func:`repair_targets` found when it asked for no repair: a size to beat, and no measured failing
    format smaller than it (a NaN/inf row is no candidate: it has no measured change). None when some candidate
    was smaller (a repair was due) or nothing failed."""
    if not beat or not beat[0]:
        return None
    sized = [f for f in beyond if f["status"] == "ok" and f.get("weight_bytes")]
    if sized and all(f["weight_bytes"] >= beat[0] for f in sized):
        return NoRepair(beat[0], beat[1])
    return None


def rescues(formats: Sequence[Row]) -> tuple[Rescue, ...]:
    """Per post-training algorithm row whose round-to-nearest row was measured too and is decidedly beyond the
    tolerance: whether the algorithm rescues it (its row within). The rows hold canonical scheme names (the
    harness's: ``algo=rtn`` and ``rotate=none`` are dropped), so a row that is its own :func:`rtn_scheme` is
    round-to-nearest."""
    by_scheme = {f["scheme"]: f for f in formats}
    found = []
    for f in formats:
        base = rtn_scheme(f["scheme"])
        rtn = by_scheme.get(base) if base != f["scheme"] else None
        if rtn is None or f["status"] != "ok" or rtn["status"] != "ok" or rtn.get("verdict") != "beyond":
            continue
        found.append(Rescue(f, rtn, f.get("verdict") == "within"))
    return tuple(found)
