"""The resolution table of results/resolution/README.md, from the records (the quick card's at 4,096 tokens)."""

import glob
import json
from pathlib import Path

from qbench.eval.evidence import decide

CARD = "results/cards/smollm2-135m-quick/SmolLM2-135M-Instruct.Q4_1/"
RES = "results/resolution/smollm2-135m-sampled/SmolLM2-135M-Instruct.Q4_1/"
cells = {}
for path in glob.glob(CARD + "*.json") + glob.glob(RES + "*.json"):
    r = json.loads(Path(path).read_text())
    if (
        "metrics" not in r
        or r["mode"] == "float"
        or r.get("status") != "ok"
        or (r["scheme"]["name"] == "fp" and not r.get("kv"))
    ):
        continue
    kv = r.get("kv")
    name = r["scheme"]["name"] if not kv else f"KV {kv.get('label') or kv.get('bits')}"
    cells.setdefault(name, {})[(r["protocol"]["tokens_scored"], r["protocol"]["window"])] = r


def cell(r):
    m, p = r["metrics"], r["protocol"]
    ci = m["ppl_change_ci95"]
    v = decide(r, 1.0).verdict
    v = f"**{v}**" if v == "undecided" else v
    return (
        f"{m['ppl_change_pct']:+.2f} % [{ci[0]:+.2f}, {ci[1]:+.2f}] {v}; KLD {m['kld_mean']:.4f}; "
        f"top-1 {100 * m['top1_agreement']:.1f} % ({p['windows']} × {p['window']}, {m['interval']['clusters']} documents)"
    )


for name, by in cells.items():
    print(name, " | ".join(f"{t}: {cell(r)}" for (t, w), r in sorted(by.items())))
