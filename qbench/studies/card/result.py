"""What :mod:`~.measure` hands :mod:`~.build` for one model: the records a card is a function of, and the two
fields read back from the records' files (:func:`window_nll`, :func:`stored_paths`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

Record = dict[str, Any]  # one harness record (``qbench.eval.harness``), as written to disk


@dataclass
class ModelResult:
    """One model's records. Every field is what a file under the card's folder holds, so a card can be built again
    from disk (``tests/qbench/cli/test_card.py``) without the model."""

    fp: Record  # the float record: perplexity, outliers, env
    profile: (
        Record  # ``profile.json``: architecture, attention per head, massive-activation sites, linear shapes
    )
    formats: list[Record]  # one record per format row (after --resolve: the deciding one)
    kv: list[Record]  # one record per KV row (or a skipped row's reason)
    source: str  # what --ckpt named
    sweep: Record | None = (
        None  # ``run_sweep``'s result (breaking points); None where the budget sweeps nothing
    )
    repairs: list[Record] = field(
        default_factory=list
    )  # sensitivity studies tried in turn, first that pays last
    avoid_map: Record | None = None  # the sensitivity map of the worst format (no repair)
    speed: list[Record] | Record | None = None  # ``speed.json`` (full budget)
    layer_speed: Record | None = None  # the real kernels' per-layer timings (full budget)
    source_bytes: int | None = (
        None  # a block-quantised source's file size (a GGUF): the size a repair must beat
    )
    window_nll: dict[str, list[float]] = field(default_factory=dict)  # cell id -> per-window mean NLL
    resolved: dict[str, list[Record]] = field(default_factory=dict)  # final cell id -> --resolve's steps
    paths: dict[str, str] | None = None  # cell id -> its record file, relative to the card's folder
    sensitivity: Record | None = None  # a card before repairs were tried in turn held one study here
    llama_cpp: list[Record] = field(default_factory=list)  # one gguf:<type> record per llama.cpp row
    llama_cpp_skipped: str | None = None  # why the budget's llama.cpp rows were not measured
    mixed_plan: Record | None = None  # ``qbench plan``'s plan.json (--mixed-plan), or why none was made

    @classmethod
    def from_mapping(cls, entry: Mapping[str, Any]) -> ModelResult:
        """From a dict with these keys (tests and scripts that assemble records by hand); unknown keys refused."""
        names = {f.name for f in fields(cls)}
        unknown = set(entry) - names
        if unknown:
            raise TypeError(f"ModelResult has no field(s) {sorted(unknown)}; fields: {sorted(names)}")
        return cls(**entry)


def window_nll(out: Path, records: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """{cell_id: mean NLL of each window} from the records' per-token sidecars (``qbench.eval.evidence``): what
    the side-by-side comparison pairs across models on the same windows. Records without a sidecar are left out."""
    from qbench.eval.evidence import read
    from qbench.eval.harness import stored_path

    found = {}
    for r in records:
        if r.get("status") != "ok" or not r.get("cell_id"):
            continue
        tensors = read(stored_path(out, r), r)
        if tensors is not None and "nll" in tensors:
            found[r["cell_id"]] = [round(v, 9) for v in tensors["nll"].double().mean(dim=1).tolist()]
    return found


def stored_paths(out: Path, records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """{cell_id: the record's file relative to ``out``}: the card names the record behind each row."""
    from qbench.eval.harness import stored_path

    return {r["cell_id"]: str(stored_path(out, r).relative_to(out)) for r in records}
