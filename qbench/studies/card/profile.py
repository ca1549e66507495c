"""What a card measures beyond the harness's cells: the architecture, the attention per head and the massive
activations (``profile.json``), and the real kernels' speed (``speed.json``, ``layer_speed.json``)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from models.errors import UserError
from qbench.studies.card.config import CardConfig, profile_path
from qbench.studies.card.plan import PROFILE_VERSION, rtn_scheme
from qbench.studies.card.sizes import linear_shapes


def architecture(lm: Any) -> dict[str, Any]:
    """What kind of transformer it is: attention kind, norm, positions, tied head, sliding window, sizes."""
    model = lm.model
    config = (lm.description.get("config") or {}) if lm.description.get("kind") == "qbench" else None
    names = {type(m).__name__ for m in model.modules()}
    modules = dict(model.named_modules())
    out: dict[str, Any] = {"parameters": lm.description.get("parameters")}
    if config:
        out.update(
            family=config.get("family"),
            attention=config.get("attn"),
            gate=config.get("gate", "none"),
            norm=config.get("norm"),
            norm_position=config.get("norm_position"),
            positions=config.get("pos"),
            tied_head=bool(config.get("tie_embeddings")),
            sliding_window=None,
            layers=config.get("n_layer"),
            heads=config.get("n_head"),
            kv_heads=config.get("n_kv_head") or config.get("n_head"),  # grouped-query attention: fewer
            head_dim=config["d_model"] // config["n_head"] if config.get("n_head") else None,
            d_model=config.get("d_model"),
            context=config.get("context"),
        )
        return out
    hf = getattr(model, "config", None)
    norm = (
        "rmsnorm"
        if any("RMSNorm" in n for n in names)
        else "layernorm"
        if any("LayerNorm" in n for n in names)
        else None
    )
    rope = any("Rotary" in n for n in names) or hasattr(hf, "rope_theta")
    learned = any(k.endswith(("wpe", "position_embeddings", "embed_positions")) for k in modules)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    tied = head is not None and emb is not None and head.weight is emb.weight
    from models.hf import HF_ATTENTION_KINDS, ungated
    from qbench.quant.kv import KV_PREFIX

    gated, impl = ungated(str(getattr(hf, "_attn_implementation", None) or "sdpa"))
    impl = impl.removeprefix(KV_PREFIX)  # a quantised cache sits inside the gate, around the attention
    out.update(
        family=getattr(hf, "model_type", None),
        attention=HF_ATTENTION_KINDS.get(impl, "softmax"),
        gate=getattr(hf, "qbench_gate", "none") if gated else "none",
        norm=norm,
        norm_position=None,
        positions="rope" if rope else "learned" if learned else None,
        tied_head=bool(tied),
        sliding_window=getattr(hf, "sliding_window", None)
        if getattr(hf, "use_sliding_window", True)
        else None,
        layers=getattr(hf, "num_hidden_layers", None),
        heads=getattr(hf, "qbench_gate_heads", None) if gated else getattr(hf, "num_attention_heads", None),
        d_model=getattr(hf, "hidden_size", None),
        context=getattr(hf, "max_position_embeddings", None),
    )
    heads = getattr(hf, "num_attention_heads", None) or getattr(hf, "n_head", None)
    width = getattr(hf, "hidden_size", None) or getattr(hf, "n_embd", None)
    out.update(  # the attention cache's geometry (grouped-query models store fewer key/value heads)
        kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or (width // heads if heads and width else None),
    )
    return out


def profile_record(evaluation: Any, fp: dict[str, Any], device: str) -> tuple[dict[str, Any], bool]:
    """The per-head attention sink, the massive activations' sites and the architecture of the float model, on the
    float record's outlier windows: read from ``<model>/profile.json`` when it was made for this float record
    (its ``cell_id``), else computed and written atomically. Returns (record, reused)."""
    from models.io import atomic_write_json
    from qbench.eval.harness import environment
    from qbench.eval.metrics import attention_sink_and_massive_sites

    path = profile_path(evaluation.spec.output_path, evaluation.name)
    try:
        existing = json.loads(path.read_text())
    except (OSError, ValueError):
        existing = None
    if (
        isinstance(existing, dict)
        and existing.get("fp_cell_id") == fp["cell_id"]
        and existing.get("profile_version") == PROFILE_VERSION
    ):
        return existing, True
    lm, windows = evaluation.lm, evaluation.windows
    n = evaluation.spec.protocol.outlier_windows
    start = time.perf_counter()
    record = {
        "profile_version": PROFILE_VERSION,
        "fp_cell_id": fp["cell_id"],
        "model": fp["model"],
        "protocol": fp["protocol"],
        "architecture": architecture(lm),
        **dict(
            zip(
                ("attention_per_head", "massive_sites"),
                attention_sink_and_massive_sites(lm.model, windows, lm.tokenizer, n, device=device),
                strict=True,
            )
        ),
        "linear_shapes": linear_shapes(lm.model),
        "env": environment(device),
        "wall_seconds": 0.0,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    record["wall_seconds"] = round(time.perf_counter() - start, 3)
    atomic_write_json(path, record)
    return record, False


def speed_record(
    cfg: CardConfig, lm: Any, fp: dict[str, Any], schemes: Sequence[str]
) -> dict[str, Any] | None:
    """The real kernels' whole-model prefill speed-up against float32 (``full`` budget): read from
    ``<model>/speed.json`` when it exists for these weights, else measured with ``run_speed`` (``full`` only)."""
    from models.io import atomic_write_json
    from qbench.quant.apply import real_kernel_problem
    from qbench.quant.schemes import get_scheme

    path = Path(cfg.output_path) / lm.name / "speed.json"
    try:
        existing = json.loads(path.read_text())
        if existing.get("fingerprint") == fp["model"].get("fingerprint"):
            return existing
    except (OSError, ValueError, AttributeError):
        pass
    if not cfg.plan.speed:
        return None
    from qbench.eval.harness import environment
    from qbench.studies.speed import run_speed

    real = [s for s in schemes if real_kernel_problem(get_scheme(s)) is None]
    error = None
    try:
        records = run_speed(
            schemes=real,
            modes=("real",),
            peers=False,
            layer=False,
            generate=False,
            kv=False,  # the card shows prefill speed-ups only: KV-cache generation would be timed and dropped
            ckpt=lm.source,
            model=None,
            model_tokens=512,
            repeats=5,
            device=cfg.device,
        )
    except (UserError, RuntimeError, ValueError) as e:  # a model the speed study cannot load: no speed-ups
        records, error = [], f"{type(e).__name__}: {e}"
    record = {
        "fingerprint": fp["model"].get("fingerprint"),
        "error": error,
        "what": "whole-model prefill of 512 tokens, real kernels vs float32 (qbench.studies.speed.run_speed)",
        "records": records,
        "env": environment(cfg.device),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_json(path, record)
    return record


LAYER_SPEED_VERSION = 1


def layer_speed_record(
    cfg: CardConfig, lm: Any, fp: Mapping[str, Any], profile: Mapping[str, Any], schemes: Sequence[str]
) -> dict[str, Any] | None:
    """The real kernels' decode and prefill speed-ups on the model's own linear shapes (every budget; a few
    seconds: ``qbench.studies.layerspeed``), read from ``<model>/layer_speed.json`` when it was measured on this
    CPU for these shapes and schemes, else measured and written atomically. None when no format has a real
    kernel."""
    from models.io import atomic_write_json
    from qbench.quant.apply import real_kernel_problem
    from qbench.quant.schemes import get_scheme
    from qbench.studies.layerspeed import layer_speed
    from qbench.studies.speed import cpu_name

    real = list(dict.fromkeys(rtn_scheme(s) for s in schemes))
    real = [s for s in real if real_kernel_problem(get_scheme(s)) is None]
    if not real:
        return None
    heads = {
        n for n, v in ((fp.get("linear_ranges") or {}).get("per_layer") or {}).items() if v.get("lm_head")
    }
    shapes = {n: v for n, v in (profile.get("linear_shapes") or {}).items() if n not in heads}
    if not shapes:
        return None
    key = {
        "version": LAYER_SPEED_VERSION,
        "cpu": cpu_name(),
        "device": cfg.device,
        "shapes": sorted(map(list, {tuple(v) for v in shapes.values()})),
        "schemes": real,
    }
    path = Path(cfg.output_path) / lm.name / "layer_speed.json"
    try:
        existing = json.loads(path.read_text())
        if existing.get("key") == key:
            return existing
    except (OSError, ValueError, AttributeError):
        pass
    record = {"key": key, **layer_speed(shapes, real, device=cfg.device, seed=cfg.seed)}
    atomic_write_json(path, record)
    return record
