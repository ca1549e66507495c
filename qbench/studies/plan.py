"""``qbench plan``: a mixed-precision llama.cpp file under a size budget, chosen from measured damage and then
measured against its promise.

Which tensors deserve more bits for a given file size? Tools answer with heuristics (llama.cpp's ``_M`` mixes give
some ``attn_v`` and ``ffn_down`` a step up) or with proxies; this study measures instead, in four steps:

1. **Units and candidates.** The model's GGUF tensors grouped into units (``by="type"``: each kind of tensor
   across the blocks — ``attn_q`` … ``ffn_down`` — plus ``token_embd``, which is also the head when tied, and
   ``output`` when untied; ``by="block"``: ``blk.N`` plus the same two). A candidate type (:data:`PLAN_TYPES`,
   ggml's per-tensor types) is kept for a unit only where every row of it is whole blocks of the type (the
   k-quants need rows of 256·k: on a 576-wide model only ``ffn_down`` takes them).
2. **Damage.** One llama.cpp cell per (unit, type): that unit alone in the type, every other tensor float32
   (``gguf:f32:<unit>=<type>``, written by llama.cpp's own per-tensor quantiser, :mod:`qbench.quant.llamacpp`),
   scored on the harness's windows: the mean KL divergence from qbench's float model (nats per token).
3. **Solve.** The plan minimises the sum of its units' damages — the *promise*: to first order the damages of
   small perturbations add — subject to the file's bytes (the units' exact bytes in their types plus the rest of
   the file, measured) fitting the budget: a multiple-choice knapsack, solved exactly by dynamic programming over
   bytes in steps of 1/:data:`DP_STEPS` of the budget (costs rounded up, so a plan never exceeds it).
4. **Measure.** The plan is written (``gguf:f32:<every unit>=<its type>``) and scored like any cell: its change
   with interval, KL divergence and top-1 against what it promised, and against llama.cpp's uniform file types
   on the same tokens (``against``), paired per token with the nearest one at or above its size.

A budget is bits per weight (``4.5``: file bits over the model's parameters, as llama.cpp's quantize tool and
every ``gguf:*`` record count them), a size (``95MB``, ``90MiB``), a llama.cpp file type (``q4_k_m``: the size of
that type's file of this model, measured as a cell) or a fraction of one (``0.9*q4_k_m``). Sizes are those of the
cells' files (token ids only); the GGUF written for a plan (``plan-<budget>.gguf``, with the model's tokenizer so
llama.cpp runs it as it is) is larger by the vocabulary.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from models.errors import UserError
from models.io import atomic_write_json, atomic_write_text

BY = ("type", "block")
# candidate ggml types, widest first; F16 is the float a llama.cpp user keeps
PLAN_TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "IQ4_NL", "Q4_0", "Q3_K", "Q2_K")
AGAINST = (
    "Q8_0",
    "Q6_K",
    "Q5_K_M",
    "Q4_K_M",
    "Q4_0",
    "Q3_K_M",
    "Q2_K",
)  # uniform file types on the same tokens
DP_STEPS = 20000
GGUF_ALIGNMENT = 32  # gguf-py's default: each tensor's data starts at a multiple of it
_SIZE = re.compile(r"^([0-9]*\.?[0-9]+)\s*(MB|MIB|GB|GIB)$")
_FRACTION = re.compile(r"^([0-9]*\.?[0-9]+)\s*\*\s*([A-Z0-9_]+)$|^([A-Z0-9_]+)\s*\*\s*([0-9]*\.?[0-9]+)$")


# ------------------------------------------------------------------------------------------ budgets


@dataclass(frozen=True)
class Budget:
    """One ``--budget`` item: ``text`` as given; exactly one of ``bits`` (per weight), ``size`` (bytes) or
    ``file_type`` (llama.cpp's, times ``fraction``)."""

    text: str
    bits: float | None = None
    size: int | None = None
    file_type: str | None = None
    fraction: float = 1.0

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9.]+", "-", self.text.lower()).strip("-")

    def bytes(self, parameters: int, type_bytes: Mapping[str, int]) -> int:
        """The budget in file bytes: ``type_bytes`` the measured file sizes of llama.cpp's types."""
        if self.bits is not None:
            return int(self.bits * parameters / 8)
        if self.size is not None:
            return self.size
        return int(self.fraction * type_bytes[self.file_type])


def parse_budget(text: str) -> Budget:
    """``4.5`` | ``95MB`` | ``90MiB`` | ``q4_k_m`` | ``0.9*q4_k_m``, or a one-line error saying which forms exist."""
    from qbench.quant.gguf_types import GGUF_TYPES, check_type

    raw = text.strip()
    up = raw.upper().replace(" ", "")
    forms = "bits per weight (4.5), a size (95MB, 90MiB), a llama.cpp file type (q4_k_m) or a fraction of one (0.9*q4_k_m)"
    try:
        bits = float(up)
    except ValueError:
        bits = None
    if bits is not None:
        if not 1.0 <= bits <= 32.0:
            raise UserError(f"--budget {raw}: {bits:g} bits per weight is outside 1 … 32; give {forms}")
        return Budget(raw, bits=bits)
    if m := _SIZE.match(up):
        scale = {"MB": 1e6, "MIB": 2**20, "GB": 1e9, "GIB": 2**30}[m.group(2)]
        return Budget(raw, size=int(float(m.group(1)) * scale))
    if m := _FRACTION.match(up):
        number, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        fraction = float(number)
        if not 0 < fraction <= 2:
            raise UserError(f"--budget {raw}: the fraction {fraction:g} is outside (0, 2]")
        return Budget(raw, file_type=check_type(name), fraction=fraction)
    if up in GGUF_TYPES:
        return Budget(raw, file_type=up)
    try:
        check_type(up)  # the did-you-mean of a misspelt type
    except UserError as err:
        raise UserError(f"--budget {raw}: not {forms} ({err})") from None
    raise AssertionError("unreachable")  # pragma: no cover


# ------------------------------------------------------------------------------------------ units


@dataclass(frozen=True)
class Unit:
    """A group of GGUF tensors that take one type: its key in a mixed scheme, the tensors and their shapes."""

    key: str
    tensors: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]

    @property
    def parameters(self) -> int:
        return sum(r * n for r, n in self.shapes)

    def fits(self, type_name: str) -> bool:
        from qbench.quant.gguf_types import TENSOR_TYPES

        return all(n % TENSOR_TYPES[type_name].block == 0 for _, n in self.shapes)

    def bytes(self, type_name: str) -> int:
        """The unit's bytes in the file: each tensor's data padded to GGUF's alignment (32 bytes)."""
        from qbench.quant.gguf_types import TENSOR_TYPES

        t = TENSOR_TYPES[type_name]
        return sum(
            -(-r * (n // t.block) * t.block_bytes // GGUF_ALIGNMENT) * GGUF_ALIGNMENT for r, n in self.shapes
        )


def units_of(shapes: Mapping[str, tuple[int, ...]], by: str) -> list[Unit]:
    """The planned units of a model whose GGUF holds ``shapes`` (name -> (rows, n)): every 2-D tensor in exactly
    one unit (``position_embd``, GPT-2's learned positions, too: a unit of its own)."""
    from models.errors import unknown_choice

    if by not in BY:
        raise unknown_choice("--by", by, BY)
    groups: dict[str, list[str]] = {}
    for name, shape in shapes.items():
        if len(shape) != 2:
            continue
        parts = name.removesuffix(".weight").split(".")
        key = parts[0] if parts[0] != "blk" else parts[2] if by == "type" else f"blk.{parts[1]}"
        groups.setdefault(key, []).append(name)
    return [Unit(k, tuple(v), tuple(tuple(shapes[n]) for n in v)) for k, v in groups.items()]


# ------------------------------------------------------------------------------------------ the solver


@dataclass(frozen=True)
class Choice:
    unit: str
    type: str
    bytes: int
    damage: float  # mean KL divergence of the unit alone in this type (nats per token)


def solve(options: Mapping[str, Sequence[Choice]], capacity: int) -> tuple[Choice, ...] | None:
    """The choice per unit of least total damage whose bytes sum to at most ``capacity`` (None: nothing fits).

    Exact multiple-choice knapsack by dynamic programming over bytes in :data:`DP_STEPS` steps of ``capacity``,
    each choice's bytes rounded *up* to a step, so the plan found never exceeds the budget (it may leave up to one
    step per unit unused). Ties in damage go to the smaller file."""
    if capacity <= 0:
        return None
    step = max(capacity / DP_STEPS, 1.0)
    slots = int(capacity // step)
    inf = math.inf
    best = [0.0] * (slots + 1)  # least damage using at most c steps, for the units so far
    back: list[list[int]] = []
    for unit in options:
        choices = options[unit]
        new = [inf] * (slots + 1)
        pick = [-1] * (slots + 1)
        costs = [math.ceil(c.bytes / step) for c in choices]
        for c in range(slots + 1):
            for i, choice in enumerate(choices):
                w = costs[i]
                if w <= c and best[c - w] < inf:
                    value = best[c - w] + choice.damage
                    if value < new[c] - 1e-15 or (
                        abs(value - new[c]) <= 1e-15 and choice.bytes < choices[pick[c]].bytes
                    ):
                        new[c], pick[c] = value, i
        best = new
        back.append(pick)
    if best[slots] == inf:
        return None
    plan = []
    c = slots
    for unit, pick in zip(reversed(list(options)), reversed(back), strict=True):
        choice = options[unit][pick[c]]
        plan.append(choice)
        c -= math.ceil(choice.bytes / step)
    return tuple(reversed(plan))


# ------------------------------------------------------------------------------------------ the study


@dataclass(frozen=True)
class PlanConfig:
    model: str
    budgets: tuple[str, ...]
    by: str = "type"
    types: tuple[str, ...] = PLAN_TYPES
    against: tuple[str, ...] = AGAINST
    output_path: Path = Path("results/plan")
    write_gguf: bool = True
    command: str = ""

    def parsed_budgets(self) -> list[Budget]:
        if not self.budgets:
            raise UserError(
                "--budget names nothing; give bits per weight (4.5), a size (95MB) or a type (q4_k_m)"
            )
        out = [parse_budget(b) for b in self.budgets]
        texts = [b.slug for b in out]
        repeated = next((t for i, t in enumerate(texts) if t in texts[:i]), None)
        if repeated is not None:
            raise UserError(f"--budget names {repeated!r} twice; give each once")
        return out

    def check(self) -> None:
        from models.errors import unknown_choice
        from qbench.quant.gguf_types import TENSOR_TYPES, check_tensor_type, check_type

        self.parsed_budgets()
        if self.by not in BY:
            raise unknown_choice("--by", self.by, BY)
        if not self.types:
            raise UserError(f"--types names nothing; choose from: {', '.join(TENSOR_TYPES)}")
        named = [check_tensor_type(t) for t in self.types]
        repeated = next((t for i, t in enumerate(named) if t in named[:i]), None)
        if repeated is not None:
            raise UserError(f"--types names {repeated} twice; give each once")
        for t in self.types:
            if check_tensor_type(t) == "F32":
                raise UserError("--types: F32 is the unplanned float; plan among F16 and the quantised types")
        for t in self.against:
            check_type(t)


@dataclass
class PlanResult:
    """What ``plan.json`` holds (``asdict``): every measured number with the cells it came from."""

    model: str
    parameters: int
    by: str
    units: list[dict[str, Any]]
    fixed_bytes: int  # the file's bytes outside the units (header, norms), measured from a damage cell's file
    against: list[dict[str, Any]]
    plans: list[dict[str, Any]]
    protocol: dict[str, Any] | None
    command: str
    environment: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0


def damage_scheme(unit: str, type_name: str) -> str:
    return f"gguf:f32:{unit}={type_name.lower()}"


def plan_scheme(plan: Sequence[Choice]) -> str:
    from qbench.quant.schemes import get_scheme

    return get_scheme("gguf:f32:" + ",".join(f"{c.unit}={c.type.lower()}" for c in plan)).name


def _cell(record: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if record is None:
        return None
    from qbench.studies.algorithms import cell_summary

    out = cell_summary(record)
    art = record.get("artifact") or {}
    out.update(
        bytes=art.get("bytes"),
        bits_per_weight=art.get("bits_per_weight"),
        tensor_types=art.get("tensor_types"),
    )
    out["tokens_per_second"] = record.get("tokens_per_second")
    return out


def run_plan(cfg: PlanConfig, spec_for: Any, on_record: Any = None, lm: Any = None) -> PlanResult:
    """Measure the damage cells and the uniform types, solve each budget, measure each plan; write ``plan.json``,
    ``table.md`` and (``write_gguf``) each plan's GGUF under ``cfg.output_path``. ``lm``: the model already
    loaded (``qbench card``'s), else loaded here; the cells' records go where ``spec_for``'s grid puts them."""
    from models.gguf_export import tensor_shapes
    from qbench.eval.harness import ModelEvaluation, environment, run_grid
    from qbench.quant.gguf_types import scheme_name
    from qbench.quant.llamacpp import require_llama_cpp

    start = time.perf_counter()
    cfg.check()
    budgets = cfg.parsed_budgets()
    require_llama_cpp()
    out = Path(cfg.output_path)
    if out.exists() and not out.is_dir():
        raise UserError(
            f"--output-path {out} is an existing file; give a folder for the records and the plan"
        )
    spec = spec_for([])
    evaluation = ModelEvaluation(spec, cfg.model, lm=lm)
    lm = evaluation.lm
    evaluation.check()
    shapes = tensor_shapes(lm.model)  # refuses a model llama.cpp has no graph for, before any cell runs
    units = units_of(shapes, cfg.by)
    parameters = sum(p.numel() for p in lm.model.parameters())
    types = [t.upper() for t in cfg.types]
    options_all = {u.key: [t for t in types if u.fits(t)] for u in units}
    empty = [k for k, v in options_all.items() if not v]
    if empty:
        raise UserError(
            f"--types {','.join(types)}: no type fits {', '.join(empty)} (rows not whole blocks of any); add F16 or a "
            "32-block type (Q8_0, Q4_0)"
        )
    needed_types = {b.file_type for b in budgets if b.file_type}
    against = list(dict.fromkeys([*cfg.against, *sorted(needed_types)]))
    damage_cells = [damage_scheme(u, t) for u, ts in options_all.items() for t in ts]
    first = [scheme_name(t) for t in against] + damage_cells
    loaded = {cfg.model: lm}
    records = run_grid(spec_for(first), on_record=on_record, loaded=loaded)
    by_scheme = {r["scheme"]["name"]: r for r in records}
    fp = by_scheme.get("fp")

    def ok(name: str) -> Mapping[str, Any] | None:
        r = by_scheme.get(name)
        return r if r is not None and r.get("status") == "ok" else None

    # the bytes outside the units, from one written file: its size less its units' exact bytes
    fixed = None
    unit_rows, options = [], {}
    for u in units:
        cands = []
        for t in options_all[u.key]:
            name = damage_scheme(u.key, t)
            r = by_scheme.get(name)
            cell = _cell(r)
            cands.append(
                {"type": t, "bytes": u.bytes(t), "scheme": r["scheme"]["name"] if r else name, "cell": cell}
            )
            if r is not None and ok(r["scheme"]["name"]) and fixed is None and cell["bytes"]:
                fixed = cell["bytes"] - sum(v.bytes(t if v.key == u.key else "F32") for v in units)
            if r is not None and ok(r["scheme"]["name"]) and cell["kld_mean"] is not None:
                options.setdefault(u.key, []).append(Choice(u.key, t, u.bytes(t), float(cell["kld_mean"])))
        unit_rows.append(
            {"unit": u.key, "tensors": len(u.tensors), "parameters": u.parameters, "candidates": cands}
        )
    missing = [u.key for u in units if u.key not in options]
    if missing or fixed is None:
        raise UserError(
            f"no damage cell of {', '.join(missing) or 'any unit'} was measured (their records under "
            f"{spec.output_path} say why); nothing to plan with"
        )
    against_rows = [dict(type=t, **(_cell(by_scheme.get(scheme_name(t))) or {})) for t in against]
    type_bytes = {r["type"]: r["bytes"] for r in against_rows if r.get("status") == "ok" and r.get("bytes")}
    for b in budgets:
        if b.file_type and b.file_type not in type_bytes:
            raise UserError(
                f"--budget {b.text}: the {b.file_type} cell was not measured (its record says why)"
            )
    solved = []
    for b in budgets:
        capacity = b.bytes(parameters, type_bytes)
        plan = solve({k: options[k] for k in options}, capacity - fixed)
        solved.append((b, capacity, plan))
    plan_cells = [plan_scheme(p) for _, _, p in solved if p is not None]
    if plan_cells:
        records = run_grid(spec_for(list(dict.fromkeys(plan_cells))), on_record=on_record, loaded=loaded)
        by_scheme.update({r["scheme"]["name"]: r for r in records})
    smallest = sum(min(c.bytes for c in cs) for cs in options.values())
    plans = [
        _plan_entry(b, capacity, plan, fixed, parameters, by_scheme, against_rows, spec, fp, smallest)
        for b, capacity, plan in solved
    ]
    if cfg.write_gguf:
        out.mkdir(parents=True, exist_ok=True)
        for entry, (_, _, plan) in zip(plans, solved, strict=True):
            if plan is not None:
                entry["gguf"] = _write_plan_gguf(lm, plan, out / f"plan-{entry['slug']}.gguf")
    result = PlanResult(
        model=lm.name,
        parameters=parameters,
        by=cfg.by,
        units=unit_rows,
        fixed_bytes=int(fixed),
        against=against_rows,
        plans=plans,
        protocol=None if fp is None else fp.get("protocol"),
        command=cfg.command,
        environment=environment(spec.device),
        wall_seconds=time.perf_counter() - start,
    )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plan.json", asdict(result))
    atomic_write_text(out / "table.md", render(asdict(result)))
    return result


def _plan_entry(
    budget: Budget,
    capacity: int,
    plan: tuple[Choice, ...] | None,
    fixed: int,
    parameters: int,
    by_scheme: Mapping[str, Mapping[str, Any]],
    against: Sequence[Mapping[str, Any]],
    spec: Any,
    fp: Mapping[str, Any] | None,
    smallest: int = 0,
) -> dict[str, Any]:
    from qbench.eval.sampling import window_documents
    from qbench.quant.gguf_types import scheme_name
    from qbench.studies.algorithms import paired_change_ci, token_nll

    entry: dict[str, Any] = {"budget": budget.text, "slug": budget.slug, "budget_bytes": capacity}
    if plan is None:
        entry["error"] = (
            f"nothing fits {capacity / 1e6:,.2f} MB: the rest of the file takes {fixed / 1e6:,.2f} MB and the "
            f"smallest type of every unit {smallest / 1e6:,.2f} MB more"
        )
        return entry
    promised_bytes = fixed + sum(c.bytes for c in plan)
    name = plan_scheme(plan)
    record = by_scheme.get(name)
    cell = _cell(record)
    entry.update(
        plan={c.unit: c.type for c in plan},
        scheme=name,
        promised_kld=sum(c.damage for c in plan),
        promised_bytes=promised_bytes,
        promised_bits_per_weight=8 * promised_bytes / parameters,
        cell=cell,
    )
    output_path = Path(spec.output_path)
    clusters = window_documents(fp["protocol"]) if fp else None
    nll = token_nll(output_path, record) if record is not None and record.get("status") == "ok" else None
    size = (cell or {}).get("bytes") or promised_bytes
    above = [a for a in against if a.get("bytes") and a["bytes"] >= size and a.get("status") == "ok"]
    nearest = min(above, key=lambda a: a["bytes"], default=None)
    vs = []
    for a in against:
        if a.get("status") != "ok":
            continue
        r = by_scheme.get(scheme_name(a["type"]))
        ci = (
            paired_change_ci(nll, token_nll(output_path, r), clusters)
            if nll is not None and r is not None
            else None
        )
        vs.append(
            {
                "type": a["type"],
                "bytes": a["bytes"],
                "ppl_ratio_ci95": ci,
                "verdict": None
                if ci is None
                else "better"
                if ci[1] < 0
                else "worse"
                if ci[0] > 0
                else "undecided",
            }
        )
    entry["vs"] = vs
    entry["nearest_at_or_above"] = None if nearest is None else nearest["type"]
    return entry


def _write_plan_gguf(lm: Any, plan: Sequence[Choice], path: Path) -> dict[str, Any]:
    """The plan as a GGUF llama.cpp runs as it is (the model's tokenizer written in), beside plan.json."""
    from models.gguf_export import write_gguf
    from qbench.quant.llamacpp import check_all_used, mixed_quantizer, sha256

    tensors = {c.unit: c.type for c in plan}
    quantize, used = mixed_quantizer(tensors, "F32")
    written = write_gguf(
        lm.model, path, lm.tokenizer, name=lm.name, quantize=quantize, separate_head="output" in tensors
    )
    check_all_used(tensors, used)
    return {"file": written.name, "bytes": written.stat().st_size, "sha256": sha256(written)}


# ------------------------------------------------------------------------------------------ the table


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2f} %"


def _ci(ci: Sequence[float] | None) -> str:
    return "" if not ci else f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"


def _mb(x: float | None) -> str:
    return "–" if not x else f"{x / 1e6:,.2f}"


def render(result: Mapping[str, Any]) -> str:
    """``table.md``: the damage map, the uniform types, and each plan against its promise and those types."""
    lines = [
        f"# Mixed-precision plan: {result['model']}",
        "",
        f"Command: `{result['command']}`" if result.get("command") else "",
        "",
        f"{result['parameters']:,} parameters; units by {result['by']}; damage = mean KL divergence (nats per token) "
        "from the float model with that unit alone in the type, every other tensor float32, run by llama.cpp; "
        f"file bytes outside the units {result['fixed_bytes']:,}.",
        "",
        "## Damage per unit",
        "",
    ]
    types = list(dict.fromkeys(c["type"] for u in result["units"] for c in u["candidates"]))
    lines += ["| unit | parameters | " + " | ".join(types) + " |", "|---|---:|" + "---:|" * len(types)]
    for u in result["units"]:
        by_t = {c["type"]: c for c in u["candidates"]}
        cells = []
        for t in types:
            c = by_t.get(t)
            if c is None:
                cells.append("does not fit")
            elif not c["cell"] or c["cell"].get("kld_mean") is None:
                cells.append(f"{(c['cell'] or {}).get('status') or 'not run'}")
            else:
                cells.append(f"{c['cell']['kld_mean']:.4g} ({c['bytes'] / 1e6:.2f} MB)")
        lines.append(f"| {u['unit']} | {u['parameters']:,} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## llama.cpp's uniform file types (same tokens)",
        "",
        "| type | MB | bits/weight | change [95 % CI] | KLD | top-1 |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for a in result["against"]:
        if a.get("status") != "ok":
            lines.append(f"| {a['type']} | – | – | {a.get('status')}: {a.get('error') or ''} | – | – |")
            continue
        lines.append(
            f"| {a['type']} | {_mb(a['bytes'])} | {a['bits_per_weight']:.3f} | {_pct(a['ppl_change_pct'])}"
            f"{_ci(a['ppl_change_ci95'])} | {a['kld_mean']:.4g} | {100 * a['top1_agreement']:.1f} % |"
        )
    lines += ["", "## Plans", ""]
    for p in result["plans"]:
        lines.append(f"### budget {p['budget']} ({_mb(p['budget_bytes'])} MB)")
        lines.append("")
        if p.get("error"):
            lines += [p["error"], ""]
            continue
        c = p.get("cell") or {}
        lines.append("Types: " + ", ".join(f"{k} {v}" for k, v in p["plan"].items()) + ".")
        lines.append("")
        measured_kld = c.get("kld_mean")
        lines += [
            "| | MB | bits/weight | KLD | change [95 % CI] | top-1 |",
            "|---|---:|---:|---:|---|---:|",
            f"| promised | {_mb(p['promised_bytes'])} | {p['promised_bits_per_weight']:.3f} | {p['promised_kld']:.4g} "
            "| – | – |",
        ]
        if c.get("status") == "ok":
            lines.append(
                f"| measured | {_mb(c['bytes'])} | {c['bits_per_weight']:.3f} | {measured_kld:.4g} | "
                f"{_pct(c['ppl_change_pct'])}{_ci(c['ppl_change_ci95'])} | {100 * c['top1_agreement']:.1f} % |"
            )
        else:
            lines.append(f"| measured | {c.get('status')}: {c.get('error') or ''} | | | | |")
        if p.get("vs"):
            lines += [
                "",
                "Paired with each uniform type on the same tokens (plan's perplexity / the type's − 1):",
                "",
            ]
            for v in p["vs"]:
                mark = (
                    " (nearest at or above the plan's size)"
                    if v["type"] == p.get("nearest_at_or_above")
                    else ""
                )
                lines.append(
                    f"- {v['type']} ({_mb(v['bytes'])} MB){mark}: {v['verdict'] or '–'}{_ci(v['ppl_ratio_ci95'])}"
                )
        if p.get("gguf"):
            lines += [
                "",
                f"Written: `{p['gguf']['file']}` ({_mb(p['gguf']['bytes'])} MB with the tokenizer).",
            ]
        lines.append("")
    return "\n".join(lines) + "\n"


__all__ = [
    "AGAINST",
    "BY",
    "PLAN_TYPES",
    "Budget",
    "Choice",
    "PlanConfig",
    "PlanResult",
    "Unit",
    "parse_budget",
    "render",
    "run_plan",
    "solve",
    "units_of",
]
