"""table.md of results/algorithms/quarot-kv/: each KV-cache cell beside the same cache rotated (``--kv-rotate``),
from the records of each model folder beside this script; the rotated cell's perplexity paired against the
unrotated one's on the same tokens.

    python results/algorithms/quarot-kv/table.py          # rewrites every MODEL/table.md here
"""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent


def records(folder: Path) -> dict[str, tuple[Path, dict]]:
    out = {}
    for path in sorted(glob.glob(str(folder / "**" / "*.json"), recursive=True)):
        r = json.loads(Path(path).read_text())
        if isinstance(r, dict) and "record_version" in r:
            out[r["scheme"]["name"]] = (Path(path), r)
    return out


def paired(a: tuple[Path, dict], b: tuple[Path, dict]) -> str:
    """ppl(a) / ppl(b) − 1 with its 95 % interval, documents as clusters (qbench's own paired rule)."""
    from qbench.eval.evidence import paired_metrics, read
    from qbench.eval.sampling import window_documents

    ta, tb = read(*a), read(*b)
    if ta is None or tb is None:
        return "–"
    m = paired_metrics(ta["nll"], tb["nll"], window_documents(a[1]["protocol"]))
    lo, hi = m["ppl_change_ci95"]
    verdict = "better" if hi < 0 else "worse" if lo > 0 else "undecided"
    return f"{100 * math.expm1(m['ln_ppl_ratio']):+.2f} % [{lo:+.2f}, {hi:+.2f}] ({verdict})"


def cell(r: dict) -> str:
    m = r["metrics"]
    if r.get("status") != "ok":
        return f"{r['status']}"
    lo, hi = m["ppl_change_ci95"]
    return f"{m['ppl_change_pct']:+.2f} % [{lo:+.2f}, {hi:+.2f}], KLD {m['kld_mean']:.4f}"


def table(folder: Path) -> str:
    rs = records(folder)
    rotated = {name: rec for name, rec in rs.items() if (rec[1].get("kv") or {}).get("rotate")}
    if not rotated:
        return ""
    first = next(iter(rs.values()))[1]
    p, env = first["protocol"], first.get("env", {})
    software = env.get("software", {})
    lines = [
        f"# {first['model']['name']}: QuaRot's rotated KV cache (`--kv-rotate`)",
        "",
        f"Float perplexity {first['metrics']['fp_perplexity']:.3f} on {p['tokens_scored']:,} tokens ({p['windows']} "
        f"windows of {p['window']} tokens of the {p['split']} split of {p['corpus']}, sample {p.get('sample')}). "
        "Each row: the cache as it is and the same cache storing keys (after RoPE) and values rotated by a head-dim "
        "Hadamard matrix; change against the float model with its paired 95 % interval (documents as clusters), "
        "KLD in nats; rotated vs plain: the rotated cell's perplexity paired against the plain one's on the same "
        f"tokens. {env.get('processor', '')}, {env.get('threads', '')} threads; torch {software.get('torch')}; "
        f"qbench {str(env.get('git_commit', ''))[:7]}.",
        "",
        "| weights | KV cache | plain | rotated | rotated vs plain |",
        "|---|---|---|---|---|",
    ]
    for name, rec in rotated.items():
        plain_name = name.removesuffix("-rot")
        plain = rs.get(plain_name)
        weights, _, kv = plain_name.rpartition("+")
        lines.append(
            f"| `{weights}` | {kv} ({rec[1]['kv']['scheme']}) | {cell(plain[1]) if plain else 'not run'} | "
            f"{cell(rec[1])} | {paired(rec, plain) if plain else '–'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from models.io import atomic_write_text

    for folder in sorted(p for p in HERE.iterdir() if p.is_dir()):
        text = table(folder)
        if text:
            atomic_write_text(folder / "table.md", text)
