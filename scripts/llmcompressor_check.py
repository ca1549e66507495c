"""Cross-check qbench's GPTQ / AWQ against llm-compressor (vllm-project/llm-compressor) on the same tokens.

What it does
------------
Loads a transformers causal LM (Llama architecture; float32), scores the EVAL windows with the float model,
quantises the model in memory with llm-compressor's ``oneshot`` on exactly the CALIB windows, scores the same EVAL
windows again with the quantised model (as llm-compressor leaves it: compressed-tensors fake quantisation in each
Linear's forward), and writes one JSON record (atomically: temp file + rename):

- float and quantised token-level perplexity, exp(mean NLL over the scored positions), and the relative change in %;
- mean KL(float || quant) per scored position (nats, full-vocabulary float32 log-softmax) and top-1 agreement;
- per-window NLL sums (float and quant), per-window KL sums, top-1 agreements and scored counts, so a paired
  interval with windows as clusters can be computed later;
- wall times (load, float eval, oneshot, quant eval), versions, the modifier config used and the weight scheme that
  llm-compressor resolved onto the model, sha256 of CALIB / EVAL, their shapes, threads;
- a fake-quantisation check: each quantised Linear's effective weight, read back through its own forward on an
  identity matrix, must have at most 2^4 = 16 distinct values per group and equal a grid rebuilt from the
  module's stored scale / zero point.

Recipes (weight-only, asymmetric int4, group size 128 unless --group-size, every Linear except lm_head):

- ``gptq``: ``GPTQModifier(scheme="W4A16_ASYM", block_size=128, dampening_frac=0.01, actorder=None)``; llm-compressor's
  default calibration pipeline (sequential, layer by layer, error propagated through already-quantised layers).
- ``awq``: ``AWQModifier()`` (default Llama mappings, duo scaling, 20-point grid) followed by
  ``QuantizationModifier(scheme="W4A16_ASYM")`` -- the current (0.14) form of AWQ; the older
  ``AWQModifier(scheme=...)`` is a deprecated shim that builds the same pair.

Input files (safetensors):

- CALIB: ``ids`` (N, T) int64 -- the calibration windows, fed as a ``datasets.Dataset`` of ``input_ids`` with an
  all-ones ``attention_mask`` (num_calibration_samples=N, max_seq_length=T, no shuffling, batch size 1).
- EVAL: ``ids`` (M, T2) int64 and ``scored`` (M, T2) bool; position t (t >= 1) counts when scored[m, t], its NLL being
  -log p(ids[m, t] | ids[m, :t]) from the logits at t - 1. scored[:, 0] must be False.

Why a separate virtual environment
-----------------------------------
llm-compressor pins its own transformers (0.14.0.1: transformers >=5.15,<=5.17) and compressed-tensors (==0.19.0),
plus datasets, accelerate and auto-round; installing it into the project's venv would move the project's own
transformers (5.25) and its CI. So it lives in /work/llmc-venv and this script is run with that interpreter; it
imports nothing from qbench. Install (CPU; torch first and pinned, an unpinned torch pulls a multi-GB CUDA build):

    python3 -m venv /work/llmc-venv
    /work/llmc-venv/bin/pip install torch==2.13.0
    echo 'torch==2.13.0' > /work/llmc-venv/torch-constraint.txt
    /work/llmc-venv/bin/pip install -c /work/llmc-venv/torch-constraint.txt llmcompressor==0.14.0.1

Usage
-----
    /work/llmc-venv/bin/python scripts/llmcompressor_check.py --model DIR --calib CALIB.safetensors \\
        --eval EVAL.safetensors --recipe {gptq,awq} --output-path OUT.json [--threads N] [--batch-size B] \\
        [--group-size G]

Notes
-----
- CPU: llm-compressor runs on CPU (it warns "No accelerator available! Compressing model on CPU instead"). Its
  0.14.0.1 AWQ pins cached activations for faster host-to-device copies, which fails on a CPU-only torch; the
  script makes that pinning a no-op when there is no accelerator (no value changes; recorded as ``cpu_shims``).
- GPTQ here takes each group's scale / zero point from the memoryless min-max observer on the weight *before*
  the GPTQ sweep (llm-compressor's design), not from the error-updated columns when the sweep reaches the group.
- AWQ's default Llama mappings include v_proj -> o_proj; with grouped-query attention (SmolLM2: 3 KV heads) the
  shapes do not match and llm-compressor skips that mapping in every layer (it logs "30 mappings were skipped").
- Tied embeddings (SmolLM2) stay tied (oneshot's tie_word_embeddings=True); lm_head and the embedding are not
  quantised. Calibration forwards run with eager attention; the evaluation forwards use --attn-implementation.
- The quantised model is evaluated as llm-compressor leaves it in memory: each targeted Linear fake-quantises its
  weight in forward from its stored weight_scale / weight_zero_point (GPTQ also stores the dequantised weight;
  AWQ + QuantizationModifier stores the smoothed float weight); ``fake_quant_check`` verifies this.

Caveat: llm-compressor refuses group quantisation of a Linear whose input width is not a multiple of the group
size (compressed-tensors' forward cannot do a ragged last group). SmolLM2-135M's hidden size is 576 = 4.5 x 128, so
at g128 only its down_proj layers qualify; the script stops with a one-line error listing that and suggesting a
group size that divides every width (64 for SmolLM2).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

PROG = "llmcompressor_check"
WEIGHT_BITS = 4
KL_CHUNK = 256


class InputError(Exception):
    """Bad input: reported as one line, without a traceback."""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="transformers model folder (Llama architecture)")
    p.add_argument("--calib", required=True, help="safetensors with `ids` (N, T) int64")
    p.add_argument(
        "--eval", required=True, help="safetensors with `ids` (M, T2) int64 and `scored` (M, T2) bool"
    )
    p.add_argument("--recipe", required=True, choices=("gptq", "awq"))
    p.add_argument("--output-path", required=True, help="JSON file to write (atomically)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--batch-size", type=int, default=2, help="eval windows per forward, 1-4 (default 2)")
    p.add_argument("--group-size", type=int, default=128, help="weight group size (default 128)")
    p.add_argument(
        "--attn-implementation", default="sdpa", help="attention kernel for the eval forwards (default sdpa)"
    )
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if not 1 <= args.batch_size <= 4:
        p.error("--batch-size must be 1..4")
    if args.group_size < 1:
        p.error("--group-size must be >= 1")
    return args


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_file(path_str: str, what: str) -> Path:
    path = Path(path_str)
    if not path.is_file():
        raise InputError(f"{what} file not found: {path}")
    return path


def _load_tensors(path: Path, what: str, names: tuple[str, ...]) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(
            f"{what} {path}: not a readable safetensors file ({str(e).splitlines()[0]})"
        ) from None
    missing = [n for n in names if n not in tensors]
    if missing:
        raise InputError(f"{what} {path}: missing tensor(s) {missing}; it has {sorted(tensors)}")
    return {n: tensors[n] for n in names}


def _validate_inputs(
    calib: dict, ev: dict, vocab_size: int, max_pos: int | None, calib_path: Path, eval_path: Path
):
    import torch

    ids = calib["ids"]
    if ids.dtype != torch.int64:
        raise InputError(f"CALIB {calib_path}: `ids` must be int64, got {ids.dtype}")
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise InputError(f"CALIB {calib_path}: `ids` must be (N >= 1, T >= 2), got {tuple(ids.shape)}")
    e_ids, scored = ev["ids"], ev["scored"]
    if e_ids.dtype != torch.int64:
        raise InputError(f"EVAL {eval_path}: `ids` must be int64, got {e_ids.dtype}")
    if scored.dtype != torch.bool:
        raise InputError(f"EVAL {eval_path}: `scored` must be bool, got {scored.dtype}")
    if e_ids.ndim != 2 or e_ids.shape[0] < 1 or e_ids.shape[1] < 2:
        raise InputError(f"EVAL {eval_path}: `ids` must be (M >= 1, T2 >= 2), got {tuple(e_ids.shape)}")
    if scored.shape != e_ids.shape:
        raise InputError(
            f"EVAL {eval_path}: `scored` shape {tuple(scored.shape)} differs from `ids` shape {tuple(e_ids.shape)}"
        )
    if bool(scored[:, 0].any()):
        raise InputError(f"EVAL {eval_path}: `scored[:, 0]` must be False (position 0 has no context)")
    if int(scored.sum()) == 0:
        raise InputError(f"EVAL {eval_path}: no position is scored")
    for what, path, t in (("CALIB", calib_path, ids), ("EVAL", eval_path, e_ids)):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            raise InputError(
                f"{what} {path}: token ids span [{lo}, {hi}], outside the model's vocab [0, {vocab_size})"
            )
        if max_pos is not None and t.shape[1] > max_pos:
            raise InputError(
                f"{what} {path}: window length {t.shape[1]} exceeds max_position_embeddings {max_pos}"
            )


def _quantised_linears(model, group_size: int):
    """(name, module) of every nn.Linear the recipe targets (all but lm_head), and those whose input width is not a
    multiple of ``group_size`` (llm-compressor's group quantisation refuses them)."""
    import torch

    targets, bad = [], []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.split(".")[-1] != "lm_head":
            targets.append((name, m))
            cols = m.in_features
            if cols >= group_size and cols % group_size:
                bad.append((name, cols))
    return targets, bad


def _scheme(group_size: int):
    """The weight scheme: the W4A16_ASYM preset at g128 (as named), else the same args with another group size."""
    if group_size == 128:
        return "W4A16_ASYM", {"W4A16_ASYM": "preset (compressed_tensors.quantization.quant_scheme)"}
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=WEIGHT_BITS,
        type="int",
        symmetric=False,
        strategy="group",
        group_size=group_size,
        dynamic=False,
    )
    return QuantizationScheme(targets=["Linear"], weights=weights), {
        "explicit": weights.model_dump(mode="json")
    }


def _build_recipe(recipe: str, group_size: int):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier

    scheme, scheme_note = _scheme(group_size)
    if group_size == 128:
        qkw = {"targets": ["Linear"], "ignore": ["lm_head"], "scheme": scheme}
    else:
        qkw = {"ignore": ["lm_head"], "config_groups": {"group_0": scheme}}
    if recipe == "gptq":
        mods = [GPTQModifier(block_size=128, dampening_frac=0.01, actorder=None, **qkw)]
    else:
        mods = [AWQModifier(), QuantizationModifier(**qkw)]
    described = []
    for m in mods:
        try:
            cfg = m.model_dump(mode="json", exclude_none=False)
        except Exception:  # some fields (sentinels, tensors) do not serialise; fall back to repr
            cfg = repr(m)
        described.append({"class": f"{type(m).__module__}.{type(m).__name__}", "config": cfg})
    return mods, {"modifiers": described, "scheme": scheme_note}


def _cpu_shims() -> list[str]:
    """Work around llm-compressor assuming an accelerator. 0.14.0.1's AWQ pins its cached CPU activations
    (``IntermediatesCache.pin_memory``, only to speed host-to-device copies), which raises "Cannot access
    accelerator device when none is available" on a CPU-only torch. Pinning changes no value, so on a machine
    without an accelerator it is made a no-op. Returns what was patched (recorded in the JSON)."""
    import torch

    if torch.accelerator.is_available():
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not hasattr(IntermediatesCache, "pin_memory"):
        return []

    def _no_pin(self, batch_index, input_names=None):
        return None

    IntermediatesCache.pin_memory = _no_pin
    return [
        "llmcompressor.pipelines.cache.IntermediatesCache.pin_memory -> no-op (no accelerator; pinning is a "
        "transfer-speed optimisation only)"
    ]


def _log_softmax_shifted(model, ids):
    import torch

    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return torch.log_softmax(out.logits[:, :-1].float(), dim=-1)  # (B, T2-1, V): row t predicts ids[:, t+1]


def _evaluate(model, ids, scored, batch_size: int, store, float_logp=None):
    """Score EVAL. Without ``float_logp``: float pass, log-probs of the scored positions written into ``store``
    (an (n_scored, V) float32 memmap, row order = scored positions in (window, position) order). With it: quant
    pass, KL(float || quant) and top-1 agreement against those rows."""
    import numpy as np
    import torch

    M = ids.shape[0]
    nll_sums, kl_sums, agree, counts = [], [], [], []
    row = 0
    with torch.no_grad():
        for b0 in range(0, M, batch_size):
            bid = ids[b0 : b0 + batch_size]
            bmask = scored[b0 : b0 + batch_size, 1:]
            logp = _log_softmax_shifted(model, bid)
            for i in range(bid.shape[0]):
                pos = bmask[i].nonzero().squeeze(-1)
                lp = logp[i, pos]  # (n, V)
                tgt = bid[i, 1:][pos]
                nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
                nll_sums.append(float(nll.double().sum()))
                counts.append(int(pos.numel()))
                n = lp.shape[0]
                if float_logp is None:
                    store[row : row + n] = lp.numpy()
                else:
                    kl_sum, n_agree = 0.0, 0
                    for c0 in range(0, n, KL_CHUNK):  # bounded memory: (KL_CHUNK, V) float32 at a time
                        lq = lp[c0 : c0 + KL_CHUNK]
                        lf = torch.from_numpy(np.asarray(float_logp[row + c0 : row + c0 + lq.shape[0]]))
                        kl_sum += float((lf.exp() * (lf - lq)).sum(-1).double().sum())
                        n_agree += int((lf.argmax(-1) == lq.argmax(-1)).sum())
                    kl_sums.append(kl_sum)
                    agree.append(n_agree)
                row += n
            del logp
    return nll_sums, counts, kl_sums, agree


def _fake_quant_check(model, group_size: int) -> dict:
    """Read each quantised Linear's effective weight back through its forward (identity input, so exact in fp32)
    and check it is on an int4 grid: <= 16 distinct values per group, equal to the grid rebuilt from the module's
    stored weight_scale / weight_zero_point. Also report whether the stored weight itself is already on the grid
    (GPTQ writes the dequantised weight; AWQ + QuantizationModifier keeps a float weight quantised in forward)."""
    import torch

    checked, max_distinct, max_rebuilt_err, stored_on_grid, changed_by_forward = 0, 0, 0.0, 0, 0
    mismatched, elements = 0, 0
    first = None
    qmin, qmax = -(2 ** (WEIGHT_BITS - 1)), 2 ** (WEIGHT_BITS - 1) - 1
    with torch.no_grad():
        for name, m in model.named_modules():
            if not isinstance(m, torch.nn.Linear) or getattr(m, "quantization_scheme", None) is None:
                continue
            if getattr(m.quantization_scheme, "weights", None) is None:
                continue
            cols = m.in_features
            eye = torch.eye(cols, dtype=m.weight.dtype)
            w_eff = m(eye).T.contiguous()  # (out, in): what the forward multiplies by
            if m.bias is not None:
                w_eff = w_eff - m.bias.unsqueeze(-1)
            g = group_size if cols >= group_size else cols
            groups = w_eff.view(w_eff.shape[0], -1, g)
            srt = groups.sort(-1).values
            distinct = 1 + (srt.diff(dim=-1) != 0).sum(-1)
            max_distinct = max(max_distinct, int(distinct.max()))
            scale = m.weight_scale.float()
            zp = m.weight_zero_point.float()
            w = m.weight.float().view(w_eff.shape[0], -1, g)
            q = torch.clamp(torch.round(w / scale.unsqueeze(-1) + zp.unsqueeze(-1)), qmin, qmax)
            rebuilt = ((q - zp.unsqueeze(-1)) * scale.unsqueeze(-1)).view_as(w_eff)
            diff = (rebuilt - w_eff).abs() / scale.repeat_interleave(g, dim=-1)
            max_rebuilt_err = max(max_rebuilt_err, float(diff.max()))
            mismatched += int((diff > 1e-3).sum())
            elements += diff.numel()
            on_grid = bool(torch.equal(m.weight, w_eff))
            stored_on_grid += on_grid
            changed_by_forward += not on_grid
            if first is None:
                first = {
                    "module": name,
                    "weight_shape": list(m.weight.shape),
                    "groups_per_row": groups.shape[1],
                    "distinct_values_per_group_max": int(distinct.max()),
                    "distinct_values_per_group_mean": float(distinct.float().mean()),
                }
            checked += 1
    return {
        "modules_checked": checked,
        "max_distinct_values_per_group": max_distinct,
        "max_abs_diff_vs_rebuilt_grid_in_scale_units": max_rebuilt_err,
        "elements_off_rebuilt_grid": mismatched,
        "elements_checked": elements,
        "modules_with_stored_weight_already_on_grid": stored_on_grid,
        "modules_quantised_only_in_forward": changed_by_forward,
        "example": first,
        # a rebuilt element may land one step off where w/scale + zp sits on a rounding tie (different op order)
        "passes": checked > 0 and max_distinct <= 2**WEIGHT_BITS and mismatched <= 1e-5 * max(elements, 1),
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "llmcompressor", "compressed-tensors", "accelerate", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _write_json_atomic(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the record ordinary permissions
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise InputError(f"model folder not found or has no config.json: {model_dir}")
    calib_path = _check_file(args.calib, "CALIB")
    eval_path = _check_file(args.eval, "EVAL")
    out_path = Path(args.output_path)
    if out_path.exists() and out_path.is_dir():
        raise InputError(f"--output-path is a directory: {out_path}")

    import torch

    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):  # already set once torch has run something in parallel
        torch.set_num_interop_threads(args.threads)

    calib = _load_tensors(calib_path, "CALIB", ("ids",))
    ev = _load_tensors(eval_path, "EVAL", ("ids", "scored"))

    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(f"model folder {model_dir}: cannot read config ({str(e).splitlines()[0]})") from None
    max_pos = getattr(config, "max_position_embeddings", None)
    _validate_inputs(calib, ev, config.vocab_size, max_pos, calib_path, eval_path)
    N, T = calib["ids"].shape
    M, T2 = ev["ids"].shape
    scored = ev["scored"]
    n_scored = int(scored.sum())

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=torch.float32,
        local_files_only=True,
        attn_implementation=args.attn_implementation,
    )
    model.eval()
    t_load = time.perf_counter() - t0

    targets, bad = _quantised_linears(model, args.group_size)
    if bad:
        widths = sorted({c for _, c in bad})
        all_widths = sorted({m.in_features for _, m in targets})
        ok = [g for g in (256, 128, 64, 32, 16) if all(w % g == 0 or w < g for w in all_widths)]
        raise InputError(
            f"llm-compressor cannot group-quantise {len(bad)} of {len(targets)} Linear layers at group size "
            f"{args.group_size}: input widths {widths} are not multiples of it (e.g. {bad[0][0]}); "
            f"compressed-tensors has no ragged last group. Use --group-size {ok[0] if ok else 'G'} "
            f"(divides every width {all_widths}) on both sides of the comparison"
        )

    def tied() -> bool:
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        return head is not None and emb is not None and head.weight.data_ptr() == emb.weight.data_ptr()

    tied_before = tied()
    ids = ev["ids"]
    V = model.get_output_embeddings().weight.shape[0]

    with tempfile.TemporaryDirectory(prefix="llmc_check_") as tmpd:
        import numpy as np

        store = np.lib.format.open_memmap(
            os.path.join(tmpd, "float_logp.npy"), mode="w+", dtype=np.float32, shape=(n_scored, V)
        )
        t0 = time.perf_counter()
        f_nll, f_counts, _, _ = _evaluate(model, ids, scored, args.batch_size, store)
        t_float_eval = time.perf_counter() - t0
        store.flush()

        from datasets import Dataset
        from llmcompressor import oneshot

        shims = _cpu_shims()
        modifiers, modifier_desc = _build_recipe(args.recipe, args.group_size)
        calib_ids = calib["ids"].tolist()
        ds = Dataset.from_dict({"input_ids": calib_ids, "attention_mask": [[1] * T for _ in range(N)]})
        t0 = time.perf_counter()
        model = oneshot(
            model=model,
            tokenizer=str(model_dir),
            dataset=ds,
            recipe=modifiers,
            num_calibration_samples=N,
            max_seq_length=T,
            shuffle_calibration_samples=False,
            batch_size=1,
        )
        t_oneshot = time.perf_counter() - t0
        model.eval()

        t0 = time.perf_counter()
        q_nll, q_counts, kl_sums, agree = _evaluate(
            model, ids, scored, args.batch_size, None, float_logp=store
        )
        t_quant_eval = time.perf_counter() - t0
        del store

    t0 = time.perf_counter()
    fq = _fake_quant_check(model, args.group_size)
    t_check = time.perf_counter() - t0

    resolved = None
    n_quant = 0
    for _, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is not None:
            n_quant += 1
            if resolved is None:
                resolved = s.model_dump(mode="json")
    assert f_counts == q_counts and sum(f_counts) == n_scored
    f_mean, q_mean = sum(f_nll) / n_scored, sum(q_nll) / n_scored
    f_ppl, q_ppl = math.exp(f_mean), math.exp(q_mean)
    return {
        "tool": PROG,
        "recipe": args.recipe,
        "model": str(model_dir.resolve()),
        "model_info": {
            "architectures": getattr(config, "architectures", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "intermediate_size": getattr(config, "intermediate_size", None),
            "num_hidden_layers": getattr(config, "num_hidden_layers", None),
            "vocab_size": V,
            "dtype": "float32",
            "attn_implementation": model.config._attn_implementation,
            "tied_embeddings_before_oneshot": tied_before,
            "tied_embeddings_after_oneshot": tied(),
        },
        "calib": {"path": str(calib_path.resolve()), "sha256": _sha256(calib_path), "N": N, "T": T},
        "eval": {"path": str(eval_path.resolve()), "sha256": _sha256(eval_path), "M": M, "T2": T2},
        "N": N,
        "T": T,
        "M": M,
        "T2": T2,
        "threads": args.threads,
        "eval_batch_size": args.batch_size,
        "group_size": args.group_size,
        "scored_tokens": n_scored,
        "float_ppl": f_ppl,
        "quant_ppl": q_ppl,
        "ppl_rel_change_pct": 100.0 * (q_ppl / f_ppl - 1.0),
        "float_mean_nll": f_mean,
        "quant_mean_nll": q_mean,
        "kld_mean": sum(kl_sums) / n_scored,
        "top1_agreement": sum(agree) / n_scored,
        "per_window": {
            "scored": f_counts,
            "float_nll_sum": f_nll,
            "quant_nll_sum": q_nll,
            "kld_sum": kl_sums,
            "top1_agree": agree,
        },
        "times_s": {
            "load": t_load,
            "float_eval": t_float_eval,
            "oneshot": t_oneshot,
            "quant_eval": t_quant_eval,
            "eval_total": t_float_eval + t_quant_eval,
            "fake_quant_check": t_check,
            "total": time.perf_counter() - t_start,
        },
        "versions": _versions(),
        "modifier_config": modifier_desc,
        "resolved_weight_scheme": resolved,
        "quantised_modules": n_quant,
        "target_linears": len(targets),
        "fake_quant_check": fq,
        "cpu_shims": shims,
        "calibration": {
            "num_calibration_samples": N,
            "max_seq_length": T,
            "shuffle_calibration_samples": False,
            "batch_size": 1,
            "pipeline": "llm-compressor default (independent: each modifier its inferred pipeline, sequential here)",
        },
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        record = run(args)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    _write_json_atomic(Path(args.output_path), record)
    print(
        f"{PROG}: {args.recipe}: float ppl {record['float_ppl']:.4f}, quant ppl {record['quant_ppl']:.4f} "
        f"({record['ppl_rel_change_pct']:+.2f} %), KLD {record['kld_mean']:.4f}, top-1 {record['top1_agreement']:.4f}, "
        f"{record['scored_tokens']} tokens; oneshot {record['times_s']['oneshot']:.1f} s, "
        f"eval {record['times_s']['eval_total']:.1f} s -> {args.output_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
