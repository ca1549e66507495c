"""Reading a ``card.json`` of any version this qbench knows: :func:`upgrade` brings a version-1 card to
:data:`~.schema.CARD_VERSION` (filling what it lacks from what it holds) or refuses it in one line, and
:func:`missing_keys`, :func:`unknown_keys` and :func:`mistyped_keys` walk a card against :mod:`~.schema`'s shape."""

from __future__ import annotations

import copy
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Union

from qbench.studies.card.schema import CARD_VERSION, READS, Card

# ------------------------------------------------------------------------------------------- walking a card


def _typed_dict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def _walk(value: Any, tp: Any, path: str) -> Iterator[tuple[str, str]]:
    """("missing" | "unknown" | "mistyped", path) for every required key ``value`` lacks, every key ``tp`` does
    not declare and every value of another structure (a list where a mapping is declared, or the reverse),
    recursively through TypedDicts, lists, ``dict[str, X]`` and ``X | None``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            return
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        shaped = [a for a in options if _typed_dict(a) or typing.get_origin(a) in (list, dict)]
        if len(shaped) == 1:
            yield from _walk(value, shaped[0], path)
        return
    if _typed_dict(tp):
        if not isinstance(value, Mapping):
            yield "mistyped", path
            return
        hints = typing.get_type_hints(tp)
        for key in sorted(tp.__required_keys__ - set(value)):
            yield "missing", f"{path}.{key}" if path else key
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in hints:
                yield "unknown", where
            else:
                yield from _walk(item, hints[key], where)
    elif origin in (list, dict) and not isinstance(value, list if origin is list else Mapping):
        yield "mistyped", path
    elif origin is list:
        (item_type,) = typing.get_args(tp)
        for i, item in enumerate(value):
            yield from _walk(item, item_type, f"{path}.{i}")
    elif origin is dict:
        _, item_type = typing.get_args(tp)
        for key, item in value.items():
            yield from _walk(item, item_type, f"{path}.{key}")


def mistyped_keys(card: Mapping[str, Any], tp: Any = Card) -> list[str]:
    """The paths of the values ``card`` holds in another structure than the shape's (a mapping for a list…)."""
    return [path for kind, path in _walk(card, tp, "") if kind == "mistyped"]


def missing_keys(card: Mapping[str, Any], tp: Any = Card) -> list[str]:
    """The paths (``models.0.formats.3.bytes_vs_bf16``) of the required keys ``card`` lacks."""
    return [path for kind, path in _walk(card, tp, "") if kind == "missing"]


def unknown_keys(card: Mapping[str, Any], tp: Any = Card) -> list[str]:
    """The paths of the keys ``card`` holds that the shape does not declare."""
    return [path for kind, path in _walk(card, tp, "") if kind == "unknown"]


# ------------------------------------------------------------------------------------------------ upgrade


def _versions() -> str:
    return f"{READS[0]}–{READS[-1]}" if len(READS) > 1 else str(READS[0])


def upgrade(card: Mapping[str, Any], source: str | Path | None = None) -> dict[str, Any]:
    """``card`` at :data:`CARD_VERSION` (a copy; ``card`` is not changed). A version-1 card gets what it lacks of
    today's shape (:func:`_fill_v1`) and version 2; nothing else in it changes. Refused with a one-line
    :class:`~models.errors.UserError` naming ``source`` (the file): a card of a version this qbench does not know
    (newer, or none written), and a version-1 card of a shape too early to fill (a key it lacks that cannot be
    filled, or one today's shape no longer has) — that one names the command that builds it again."""
    from models.errors import UserError

    where = str(source) if source is not None else "card.json"
    version = card.get("card_version") if isinstance(card, Mapping) else None
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise UserError(
            f"{where}: card_version {version!r} is not a version number; this qbench reads card versions "
            f"{_versions()}"
        )
    if version is None:
        raise UserError(
            f"{where}: no card_version (not a qbench card.json, or not one this qbench wrote); this qbench reads "
            f"card versions {_versions()}"
        )
    if version not in READS:
        newer = " (written by a newer qbench: upgrade qbench to read it)" if version > CARD_VERSION else ""
        raise UserError(
            f"{where}: card version {version}{newer}; this qbench reads card versions {_versions()}"
        )
    out = copy.deepcopy(dict(card))
    if version == 1:
        _fill_v1(out)
        wrong = [
            *(f"lacks {k}" for k in missing_keys(out)),
            *(f"holds {k}" for k in unknown_keys(out)),
            *(f"holds {k} in another structure" for k in mistyped_keys(out)),
        ]
        if wrong:
            more = f" and {len(wrong) - 1} more key(s)" if len(wrong) > 1 else ""
            again = f"`{out['command']}`" if out.get("command") else "`qbench card` and the same options"
            raise UserError(
                f"{where}: a version-1 card of an earlier shape (it {wrong[0]}{more}) that this qbench cannot "
                f"re-render: build it again with {again} (the cells on disk are reused)"
            )
        out["card_version"] = CARD_VERSION
    return out


def _fill_v1(card: dict[str, Any]) -> None:
    """What a version-1 card lacks of version 2, filled in place from what it holds:

    - ``device`` absent: the card's ``env.device`` (the environment was taken on the card's device);
    - per model, ``outliers.sink_top1_vs_chance`` absent: the top-1 share on key 0 over its chance level
      (``outliers.summary.first_token_top1_share / outliers.sink_chance``), as ``build._outlier_profile``;
    - per model with a sensitivity section, its repair (:func:`_fill_repair`): ``minimised``, ``pays``,
      ``beat`` and ``bytes_vs_bf16`` where absent; the section's ``tries`` absent (a card before repairs were
      tried in turn): the one repair as its one try; the verdict's repair gets the section's ``minimised``,
      ``pays``, ``beat`` and ``bytes_vs_bf16`` where it lacks them;
    - then any other key version 2 requires and declares nullable: None — what the pages read for it when absent
      (they read such keys with ``.get``), so the pages say what they said of the card before.
    """
    if "device" not in card and isinstance(card.get("env"), Mapping) and card["env"].get("device"):
        card["device"] = card["env"]["device"]
    for m in card.get("models") or []:
        if not isinstance(m, dict):
            continue
        o = m.get("outliers")
        if isinstance(o, dict) and "sink_top1_vs_chance" not in o:
            top1 = (o.get("summary") or {}).get("first_token_top1_share")
            chance = o.get("sink_chance")
            o["sink_top1_vs_chance"] = top1 / chance if chance and top1 is not None else None
        sens = m.get("sensitivity")
        if not isinstance(sens, dict) or not isinstance(sens.get("repair"), dict):
            continue
        repair = sens["repair"]
        _fill_repair(repair, m.get("formats") or [])
        if "tries" not in sens:
            sens["tries"] = [
                {
                    "scheme": sens.get("scheme"),
                    **{
                        k: repair.get(k)
                        for k in ("reached", "count", "quantised_ppl_change_pct", "ppl_change_pct")
                    },
                    "weight_bytes": repair.get("weight_bytes"),
                    "pays": repair["pays"],
                }
            ]
        shown = (m.get("verdict") or {}).get("repair")
        if isinstance(shown, dict):
            for key in ("minimised", "pays", "beat", "bytes_vs_bf16"):
                shown.setdefault(key, repair[key])
    _fill_nulls(card, Card)


def _fill_nulls(value: Any, tp: Any) -> None:
    """Every required key ``value`` lacks whose declared type admits None set to None, recursively."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is not None:
            options = [a for a in typing.get_args(tp) if a is not type(None)]
            shaped = [a for a in options if _typed_dict(a) or typing.get_origin(a) in (list, dict)]
            if len(shaped) == 1:
                _fill_nulls(value, shaped[0])
    elif _typed_dict(tp) and isinstance(value, dict):
        hints = typing.get_type_hints(tp)
        for key in tp.__required_keys__ - set(value):
            if _nullable(hints[key]):
                value[key] = None
        for key, item in value.items():
            if key in hints:
                _fill_nulls(item, hints[key])
    elif origin is list and isinstance(value, list):
        (item_type,) = typing.get_args(tp)
        for item in value:
            _fill_nulls(item, item_type)
    elif origin is dict and isinstance(value, dict):
        _, item_type = typing.get_args(tp)
        for item in value.values():
            _fill_nulls(item, item_type)


def _nullable(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _fill_repair(repair: dict[str, Any], formats: list[Mapping[str, Any]]) -> None:
    """A version-1 repair's missing keys, from the section and the model's format rows:

    - ``minimised``: True (the studies before the option always minimised; ``build._sensitivity_section`` reads
      them so);
    - ``pays`` (a section built before the size to beat was computed for it): as ``words.verdict_of`` decides it
      for such a section — reached, and smaller than the smallest format within the tolerance (fewest bytes;
      ties: smaller change), of any size when no format is within; a repair that holds its ``beat`` (none was
      written without ``pays``) pays as ``build._repair_section`` decides: reached, and smaller than that;
    - ``beat``: what that rule measured it against — the smallest format within the tolerance (named as
      ``decide.size_to_beat`` names it), else no size (``bytes`` None);
    - ``bytes_vs_bf16``: its size over the model's bf16 size (the format rows' ``bf16_model_bytes``), None
      without either.
    """
    repair.setdefault("minimised", True)
    size = repair.get("weight_bytes")
    ok = [f for f in formats if f.get("within_tolerance") and f.get("weight_bytes")]
    smallest = min(ok, key=lambda f: (f["weight_bytes"], f["ppl_change_pct"])) if ok else None
    if "pays" not in repair:
        if isinstance(repair.get("beat"), Mapping):
            limit = repair["beat"].get("bytes")
            repair["pays"] = bool(
                repair.get("reached") and size is not None and (limit is None or size < limit)
            )
        else:
            beaten = smallest is None or (size is not None and size < smallest["weight_bytes"])
            repair["pays"] = bool(repair.get("reached") and beaten)
    if "beat" not in repair:
        repair["beat"] = (
            {"bytes": smallest["weight_bytes"], "what": f"`{smallest['scheme']}`, which passes as it is"}
            if smallest
            else {"bytes": None, "what": "the model in bf16"}
        )
    if "bytes_vs_bf16" not in repair:
        bf16 = next((f.get("bf16_model_bytes") for f in formats if f.get("bf16_model_bytes")), None)
        repair["bytes_vs_bf16"] = size / bf16 if size and bf16 else None
