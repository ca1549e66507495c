"""``qbench score``: how well does a model — anyone's — survive quantisation? One call, one number.

    result = score(lm, Protocol(tokens=8192))   # the paper's four schemes, fake-quant
    result["robustness"]                         # 1.0 = no damage, lower is worse

The evaluation is the harness's (``qbench.eval.harness.ModelEvaluation``): the float baseline with its outlier,
attention and massive-activation statistics, then one fake-quant record per scheme, each written to
``output_path/<model>/`` in the grid's layout (so ``qbench compare`` reads them). This module only summarises.

The summary number (ours):

    robustness = fp_perplexity / geometric mean over the schemes of the quantised perplexities
               = exp(−mean_s log r_s),    r_s = quantised perplexity / fp perplexity (the ``ppl_ratio``)

- unit-free (a ratio of perplexities on the same tokens) and strictly decreasing in every r_s: worse damage
  under any scheme always lowers it;
- 1.0 = quantisation changes nothing; 0.5 = the schemes double perplexity on (geometric) average; a scheme
  whose quantised model produces NaN/inf counts as r_s = ∞, which makes robustness 0;
- it can exceed 1 slightly when quantisation noise happens to lower perplexity;
- the geometric mean weighs a ×2 under one scheme like a ×2 under another, whatever the baseline perplexity;
- schemes that cannot run here (status ``unsupported``, e.g. a missing backend) are left out and listed
  under ``skipped``; with none left the number is None.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from qbench.eval.harness import GridSpec, ModelEvaluation, expand_schemes
from qbench.eval.load import LoadedModel
from qbench.eval.metrics import Protocol
from qbench.quant import PAPER_SCHEMES
from qbench.quant.calibrate import CalibrationData
from qbench.quant.kv import KVConfig

DEFINITION = "fp_perplexity / geometric mean of the quantised perplexities = exp(-mean log ppl_ratio)"


def robustness(ratios: Iterable[float]) -> float | None:
    """exp(−mean log r) over the perplexity ratios r (∞ for a non-finite quantised model); None when empty."""
    ratios = list(ratios)
    if not ratios:
        return None
    if any(not math.isfinite(r) or r <= 0 for r in ratios):
        return 0.0  # a broken model under any scheme: nothing survives
    return math.exp(-sum(math.log(r) for r in ratios) / len(ratios))


def _scheme_entry(record: dict[str, Any]) -> dict[str, Any]:
    m = record["metrics"]
    return {
        "perplexity": m["perplexity"],
        "ppl_ratio": m["ppl_ratio"],
        "ppl_change_pct": m["ppl_change_pct"],
        "status": record["status"],
        "error": record.get("error"),
    }


def summarise(fp: dict[str, Any], records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The score of one model from its harness records: the float record and one record per scheme."""
    schemes = {r["scheme"]["name"]: _scheme_entry(r) for r in records}
    ratios, skipped = [], []
    for name, entry in schemes.items():
        if entry["status"] == "nonfinite":
            ratios.append(math.inf)
        elif entry["status"] == "ok" and entry["ppl_ratio"] is not None:
            ratios.append(entry["ppl_ratio"])
        else:
            skipped.append(name)
    massive = fp.get("massive_activations") or {}
    return {
        "model": fp["model"],
        "robustness": robustness(ratios),
        "robustness_definition": DEFINITION,
        "fp_perplexity": fp["metrics"]["fp_perplexity"],
        "schemes": schemes,
        "skipped": skipped,
        "outliers": fp["outliers"],
        "massive_activations": {
            "total": massive.get("total"),
            "layers": [layer["layer"] for layer in massive.get("layers", []) if layer["count"]],
            "max": max((layer["top"][0] for layer in massive.get("layers", [])), default=None),
        },
        "protocol": fp["protocol"],
        "env": fp["env"],
    }


def score(
    lm: LoadedModel,
    protocol: Protocol,
    schemes: Sequence[str] = PAPER_SCHEMES,
    output_path: str | Path | None = None,
    device: str = "cpu",
    exclude: Sequence[str] = (),
    attention: bool = True,
    kv: KVConfig | None = None,
    calibration: CalibrationData | None = None,
) -> dict[str, Any]:
    """Evaluate ``lm`` in float and under each scheme (fake-quant) and summarise (module docstring).

    With ``kv`` every scheme runs with that KV-cache quantisation (``<scheme>+kv4``; ``fp`` = the cache alone).
    ``calibration``: where calibrated schemes take their windows (default: the train split of the protocol's
    corpus, each scheme's windows).

    Records go to ``output_path`` in the grid's layout; with None they go to a temporary folder and are dropped.
    Returns the summary with ``robustness``, per-scheme ``perplexity``/``ppl_ratio``/``ppl_change_pct``/
    ``status``, the float model's outlier statistics and a digest of its massive activations.
    """
    names = expand_schemes(schemes)
    if output_path is None:
        with tempfile.TemporaryDirectory(prefix="qbench-score-") as tmp:
            return score(lm, protocol, names, tmp, device, exclude, attention, kv, calibration)
    spec = GridSpec(
        models=[lm.source],
        schemes=names,
        modes=["fake"],
        protocol=protocol,
        output_path=Path(output_path),
        dtype=lm.description.get("dtype", "float32"),
        device=device,
        exclude=tuple(exclude),
        attention=attention,
        kv=kv,
        calibration=calibration or CalibrationData(),
    )
    evaluation = ModelEvaluation(spec, lm.source, lm=lm)
    fp = evaluation.fp_record()
    records = []
    for name in names:
        record = evaluation.quantised_record(name, "fake")
        evaluation.write(evaluation.cell_path(name, "fake"), record)
        records.append(record)
    return summarise(fp, records)
