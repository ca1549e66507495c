"""table.md of results/algorithms/calibration/ from the records of each model folder beside it, and the
qbench-vs-llm-compressor table of results/algorithms/llm-compressor/ from its records and llm-compressor's JSON.

    python results/algorithms/calibration/table.py        # rewrites both table.md files
    python results/algorithms/calibration/table.py DIR …  # DIR/calibration.md: every calibrated cell of an
                                                          # algorithms folder (old and new calibration beside)
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
CROSS = HERE.parent / "llm-compressor"


def records(folder: Path) -> list[dict]:
    out = []
    for path in sorted(glob.glob(str(folder / "**" / "*.json"), recursive=True)):
        r = json.loads(Path(path).read_text())
        if isinstance(r, dict) and "record_version" in r and r.get("mode") != "float":
            out.append(r)
    return out


def calibration_words(r: dict) -> str:
    """``documents 16 × 2048 (32,768), sequential`` — what the cell calibrated on, from the record."""
    scheme = r["scheme"]
    if scheme.get("algo") in (None, "rtn"):
        return "–"
    taken = r.get("calibrated") or {}
    sample = taken.get("sample", "first")
    sequential = "sequential" if taken.get("sequential") else "float inputs"
    return (
        f"{sample} {taken.get('windows')} × {taken.get('window')} ({taken.get('tokens', 0):,}), {sequential}"
    )


def layer_error(r: dict) -> str:
    le = (r.get("calibrated") or {}).get("layer_error") or {}
    if le.get("calibration") is None:
        return "–"
    held = "–" if le.get("held_out") is None else f"{le['held_out']:.3f}"
    return f"{le['calibration']:.3f} / {held}"


def row(r: dict) -> str:
    m = r["metrics"]
    if r.get("status") != "ok":
        return f"| {r['scheme']['name']} | {r['status']}: {r.get('error')} | | | | | |"
    ci = m["ppl_change_ci95"]
    quantise = r["wall_seconds"] - r["eval_seconds"]
    return (
        f"| `{r['scheme']['name']}` | {calibration_words(r)} | {m['ppl_change_pct']:+.2f} % "
        f"[{ci[0]:+.2f}, {ci[1]:+.2f}] | {m['kld_mean']:.4f} | {100 * m['top1_agreement']:.1f} % | "
        f"{layer_error(r)} | {quantise:,.0f} s |"
    )


def _order(r: dict) -> tuple:
    """Rows by format (the scheme name without its algorithm overrides), round-to-nearest first, then by name."""
    name = str(r["scheme"]["name"])
    base = name.split(":")[0]
    rest = ",".join(
        item
        for item in name.partition(":")[2].split(",")
        if item and item.split("=")[0] in ("a", "w", "group")
    )
    bits = r["scheme"].get("weight_bits") or 0
    return (bits, base, rest, r["scheme"].get("algo") not in (None, "rtn"), name)


def calibration_table(folder: Path) -> str:
    rs = [r for r in records(folder) if r["scheme"].get("method") != "gguf"]  # llama.cpp's: no calibration
    if not rs:
        return ""
    first = rs[0]
    p, model, env = first["protocol"], first["model"], first.get("env", {})
    software = env.get("software", {})
    head = (
        f"# {model['name']}: calibration and sequential GPTQ/AWQ\n\n"
        f"Float perplexity {first['metrics']['fp_perplexity']:.3f} on {p['tokens_scored']:,} tokens "
        f"({p['windows']} windows of {p['window']} tokens of the {p['split']} split of {p['corpus']}, "
        f"sample {p.get('sample')}). Change: perplexity against float with its paired 95 % interval (documents as "
        "clusters); layer error: mean over layers of the algorithm's output error / round-to-nearest's, on the "
        "calibration rows / on held-out rows; quantise: the cell's time minus its evaluation (calibration and "
        f"solve). {env.get('processor', '')}, {env.get('threads', '')} threads; torch {software.get('torch')}, "
        f"transformers {software.get('transformers')}; qbench {str(env.get('git_commit', ''))[:7]}.\n\n"
        "| scheme | calibration | change [95 % CI] | KLD | top-1 | layer error in / out | quantise |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    order = sorted(rs, key=_order)
    return head + "\n".join(row(r) for r in order) + "\n"


def cross_table() -> str:
    qb = {r["scheme"]["name"]: r for r in records(CROSS / "smollm2-135m")}
    tools = {}
    for path in sorted(CROSS.glob("llmc_*.json")):
        tools[path.stem.removeprefix("llmc_")] = json.loads(path.read_text())
    if not qb and not tools:
        return ""
    lines = [
        "# qbench vs llm-compressor on the same model, calibration windows and scored tokens\n",
        "int4 asymmetric weights, groups of 64 (SmolLM2's width 576 is no multiple of 128, which llm-compressor "
        "refuses), every linear but the head; the calibration and evaluation windows written by "
        "`scripts/crosscheck_inputs.py` and read by `scripts/llmcompressor_check.py` (its own virtual "
        "environment). Change and KLD against each tool's own float evaluation of the same windows.\n",
        "| tool | algorithm | float ppl | ppl | change | KLD | top-1 | quantise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in qb.items():
        m = r["metrics"]
        algo = r["scheme"].get("algo", "rtn")
        lines.append(
            f"| qbench | {algo} (`{name}`) | {m['fp_perplexity']:.4f} | {m['perplexity']:.4f} | "
            f"{m['ppl_change_pct']:+.2f} % | {m['kld_mean']:.4f} | {100 * m['top1_agreement']:.1f} % | "
            f"{r['wall_seconds'] - r['eval_seconds']:,.0f} s |"
        )
    lines += _tool_rows(tools)
    lines.append(
        "\n" + "| algorithm | llm-compressor / qbench perplexity, paired over the 16 windows [95 % CI] |"
    )
    lines.append("|---|---|")
    for recipe, t in tools.items():
        own = next((r for r in qb.values() if r["scheme"].get("algo") == recipe), None)
        if own is not None:
            lines.append(f"| {recipe} | {paired(own, t)} |")
    return "\n".join(lines) + "\n"


def paired(record: dict, tool: dict) -> str:
    """exp(mean over windows of the per-token NLL difference) with a t interval over the windows (each from its
    own document here): the two tools' perplexities on the very same windows, paired."""
    import math

    from qbench.eval.evidence import read, t_quantile

    path = next(
        Path(p)
        for p in glob.glob(str(CROSS / "**" / "*.json"), recursive=True)
        if json.loads(Path(p).read_text()).get("cell_id") == record["cell_id"]
    )
    evidence = read(path, record)
    if evidence is None:  # sidecars are not committed (results/algorithms/.gitignore)
        raise FileNotFoundError(f"{path}: its per-token evidence file is missing")
    ours = evidence["nll"].double().sum(1)
    theirs = tool["per_window"]["quant_nll_sum"]
    scored = tool["per_window"]["scored"]
    d = [(t - float(o)) / n for t, o, n in zip(theirs, ours, scored, strict=True)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    half = t_quantile(0.975, len(d) - 1) * sd / math.sqrt(len(d))
    return f"×{math.exp(mean):.4f} [×{math.exp(mean - half):.4f}, ×{math.exp(mean + half):.4f}]"


def _tool_rows(tools: dict) -> list[str]:
    lines = []
    for recipe, t in tools.items():
        lines.append(
            f"| llm-compressor {t.get('versions', {}).get('llmcompressor', '')} | {recipe} | "
            f"{t['float_ppl']:.4f} | {t['quant_ppl']:.4f} | {t['ppl_rel_change_pct']:+.2f} % | "
            f"{t['kld_mean']:.4f} | {100 * t['top1_agreement']:.1f} % | {t['times_s']['oneshot']:,.0f} s |"
        )
    return lines


def write(path: Path, text: str) -> None:
    if not text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    import sys

    if sys.argv[1:]:
        for folder in map(Path, sys.argv[1:]):
            write(folder / "calibration.md", calibration_table(folder))
    else:
        for folder in sorted(p for p in HERE.iterdir() if p.is_dir()):
            write(folder / "table.md", calibration_table(folder))
        try:
            write(CROSS / "table.md", cross_table())
        except FileNotFoundError as e:  # the paired column needs the sidecars of a fresh run of its commands
            print(f"kept {CROSS / 'table.md'}: {e} (rerun the commands of {CROSS / 'README.md'})")
