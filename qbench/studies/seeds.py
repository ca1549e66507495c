"""Several training seeds of one panel (``qbench recipes --seeds N``, ``qbench demo --seeds N``): which runs they
are, and what of the panel's conclusions holds across them.

One seed per recipe cannot tell a remedy's effect from the run-to-run spread of training itself (processor
rounding alone moves these small runs by several percent: ``results/demo/README.md``). With N seeds every recipe is
trained N times — seeds ``seed, seed + 1, …`` — identically but for ``--seed`` (initialisation and data order),
and every table reports the mean ± sample standard deviation over seeds (n − 1 in the denominator; one seed has
no spread). A ranking or breaking point that is not the same on every seed is marked as such: a conclusion that
flips between seeds is not one this panel can draw.

Run folders: the panel's own ``--seed`` keeps the recipe's name (``ckpts/recipes/vanilla``), so a one-seed panel
is the first seed of a several-seed one and is reused; the others are ``<recipe>-seed<k>``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# What a seed summary reports of each float record (its outlier statistics), label -> field of record["outliers"]
OUTLIER_FIELDS = {
    "kurtosis max": "kurtosis_max",
    "max abs act": "max_abs",
    "first-token top-1": "first_token_top1_share",
}


@dataclass(frozen=True)
class SeededRun:
    """One training run of a several-seed panel."""

    recipe: str
    seed: int
    name: str  # its folder under the panel's checkpoint root, and the model name of its records
    lr: float | None = None  # its peak learning rate when the panel chose one per recipe (None: the panel's)


def seeded_runs(recipes: Sequence[str], seed: int, seeds: int) -> list[SeededRun]:
    """Every (recipe, seed) of a panel of ``seeds`` seeds from ``seed``: seed-major, so an interrupted panel has
    whole panels of the first seeds."""
    if seeds < 1:
        raise ValueError(f"seeds must be ≥ 1, got {seeds}")
    return [
        SeededRun(r, s, r if s == seed else f"{r}-seed{s}")
        for s in range(seed, seed + seeds)
        for r in recipes
    ]


def mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n − 1; None for one value) of finite ``values``."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _stat(values: Sequence[float | None]) -> dict[str, Any] | None:
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not finite:
        return None
    mean, sd = mean_sd(finite)
    return {"mean": mean, "sd": sd, "n": len(finite), "values": list(values)}


def _order(values: Mapping[str, float | None]) -> tuple[str, ...]:
    """Recipes from best (smallest value) to worst; a missing value ranks last."""
    return tuple(
        sorted(values, key=lambda r: (values[r] is None, values[r] if values[r] is not None else 0.0))
    )


def summarise(
    records: Iterable[Mapping[str, Any]],
    runs: Sequence[SeededRun],
    sweep: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The seed summary (``seeds.json``) of a panel's grid records and, when swept, its ``sweep.json``:

    - ``recipes``: per recipe its seeds and, as {mean, sd, n, values (per seed, in seed order)}, the float
      perplexity, each outlier statistic of :data:`OUTLIER_FIELDS`, and each quantised column's perplexity change
      (%) and mean KL divergence;
    - ``rankings``: per quantised column, the recipes ordered by their change on each seed and whether that order
      is the same on every seed (``stable``);
    - ``breaking_points``: per (recipe, family, axis), the breaking point on each seed and whether they agree.
    """
    from qbench.eval.report import cell_key

    by_name = {run.name: run for run in runs}
    seeds = sorted({run.seed for run in runs})
    recipes = list(dict.fromkeys(run.recipe for run in runs))
    cells: dict[tuple[str, str], dict[int, Mapping[str, Any]]] = {}
    for r in records:
        run = by_name.get(r["model"]["name"])
        if run is not None:
            cells.setdefault((run.recipe, cell_key(dict(r))), {})[run.seed] = r
    columns = list(dict.fromkeys(col for (_, col) in cells if col != "fp"))

    def per_seed(recipe: str, column: str, pick: Any) -> list[float | None]:
        got = cells.get((recipe, column), {})
        return [pick(got[s]) if s in got and got[s].get("status") == "ok" else None for s in seeds]

    def metric(key: str) -> Any:
        return lambda rec: (rec.get("metrics") or {}).get(key)

    out_recipes: dict[str, Any] = {}
    for recipe in recipes:
        entry: dict[str, Any] = {
            "seeds": seeds,
            "fp_perplexity": _stat(per_seed(recipe, "fp", metric("perplexity"))),
            "outliers": {
                label: _stat(per_seed(recipe, "fp", lambda rec, f=field: (rec.get("outliers") or {}).get(f)))
                for label, field in OUTLIER_FIELDS.items()
            },
            "columns": {
                col: {
                    "ppl_change_pct": _stat(per_seed(recipe, col, metric("ppl_change_pct"))),
                    "kld_mean": _stat(per_seed(recipe, col, metric("kld_mean"))),
                }
                for col in columns
            },
        }
        out_recipes[recipe] = entry
    rankings = {}
    for col in columns:
        changes = {recipe: per_seed(recipe, col, metric("ppl_change_pct")) for recipe in recipes}
        orders = [list(_order({r: changes[r][i] for r in recipes})) for i in range(len(seeds))]
        rankings[col] = {"per_seed": orders, "stable": all(o == orders[0] for o in orders)}
    points = []
    if sweep is not None:
        from qbench.studies.sweep import format_breaking_point

        found: dict[tuple[str, str, str], dict[int, str]] = {}
        for p in sweep.get("breaking_points", []):
            run = by_name.get(p["model"])
            if run is not None:
                found.setdefault((run.recipe, p["family"], p["axis"]), {})[run.seed] = format_breaking_point(
                    p
                )
        for (recipe, family, axis), values in found.items():
            shown = [values.get(s) for s in seeds]
            points.append(
                {
                    "recipe": recipe,
                    "family": family,
                    "axis": axis,
                    "per_seed": shown,
                    "stable": len(set(shown)) == 1 and None not in shown,
                }
            )
    return {"seeds": seeds, "recipes": out_recipes, "rankings": rankings, "breaking_points": points}


def _fmt(stat: Mapping[str, Any] | None, digits: int = 2, signed: bool = False) -> str:
    if not stat:
        return "-"
    sign = "+" if signed else ""
    text = f"{stat['mean']:{sign}.{digits}f}"
    if stat["sd"] is not None:
        text += f" ± {stat['sd']:.{digits}f}"
    if stat["n"] < len(stat["values"]):
        text += f" (n={stat['n']})"
    return text


def seeds_table(summary: Mapping[str, Any]) -> str:
    """The summary as markdown: mean ± sd per recipe, then the rankings and breaking points across seeds."""
    from tabulate import tabulate

    seeds = summary["seeds"]
    recipes = summary["recipes"]
    columns = list(next(iter(recipes.values()))["columns"]) if recipes else []
    headers = ["recipe", "float ppl", *OUTLIER_FIELDS, *(f"{c} Δppl %" for c in columns)]
    rows = []
    for recipe, entry in recipes.items():
        rows.append(
            [
                recipe,
                _fmt(entry["fp_perplexity"]),
                *(
                    _fmt(entry["outliers"][label], 3 if label.startswith("first") else 1)
                    for label in OUTLIER_FIELDS
                ),
                *(_fmt(entry["columns"][c]["ppl_change_pct"], signed=True) for c in columns),
            ]
        )
    text = (
        f"Mean ± sample sd over {len(seeds)} training seeds ({', '.join(map(str, seeds))}); "
        "Δppl: the quantised perplexity's change from the same seed's float model.\n\n"
        + tabulate(rows, headers, tablefmt="github")
    )
    ranks = summary["rankings"]
    if ranks:
        lines = []
        for col, r in ranks.items():
            if r["stable"]:
                lines.append(f"- `{col}`: the same order on every seed: {' < '.join(r['per_seed'][0])}")
            else:
                shown = "; ".join(
                    f"seed {s}: {' < '.join(o)}" for s, o in zip(seeds, r["per_seed"], strict=True)
                )
                lines.append(f"- `{col}`: **the order flips between seeds** ({shown})")
        text += "\n\nRanking by Δppl (best first):\n\n" + "\n".join(lines)
    points = summary["breaking_points"]
    if points:
        rows = [
            [
                p["recipe"],
                f"{p['family']}/{p['axis']}",
                " / ".join("-" if v is None else v for v in p["per_seed"]),
                "same" if p["stable"] else "**flips**",
            ]
            for p in points
        ]
        text += "\n\nBreaking points per seed (" + " / ".join(map(str, seeds)) + "):\n\n"
        text += tabulate(rows, ["recipe", "sweep", "bits per seed", "across seeds"], tablefmt="github")
    return text + "\n"


def seeds_section(
    runs: Sequence[SeededRun],
    records: Sequence[Mapping[str, Any]],
    sweep: Mapping[str, Any] | None,
    out: Any,
    command: str,
) -> str:
    """Write ``out/seeds.json`` (the summary, with the command that made it) and return table.md's section."""
    from pathlib import Path

    from models.io import atomic_write_json

    summary = summarise(records, runs, sweep)
    atomic_write_json(Path(out) / "seeds.json", {"command": command, **summary})
    return (
        "\n## Across seeds\n\n" + seeds_table(summary) + "\nEvery seed's own records are in the tables above "
        "(rows `<recipe>-seed<k>`); the summary is `seeds.json`.\n"
    )
