"""Running a weight-rounding algorithm (GPTQ, ``gptq.py``; AWQ, ``awq.py``) over a model's target layers, and
saying how well its solution holds on tokens it did not see.

- **Statistics**: sequential by default (``qbench.quant.sequential``: each decoder block calibrated on the outputs
  of the quantised blocks before it, as GPTQModel and llm-compressor run both algorithms); ``sequential=false``
  takes every layer's statistics from the float model's inputs in one pass (``calibrate.input_statistics``,
  cached per model and windows, so a grid of float-input schemes computes them once).
- **GPTQ**: each layer's Hessian carried into the layer's transformed input space (H' = Mᵀ H M for x' = x · M,
  M = diag(1/s) · Rᵀ: SmoothQuant's scale, a Hadamard or QuaRot rotation), GPTQ on W' = R(W · diag(s)); the layer
  is then built from the weight the transforms map onto Ŵ' and GPTQ's grid, so fake and real layers round it onto
  exactly GPTQ's codes.
- **AWQ**: layers reading one input share one searched input scale (llm-awq's mappings; an ``o_proj`` of grouped-
  query attention gets none, :func:`grouped_query_output`) and each layer a clipped grid.
- **Layer error in and out of sample** (:func:`layer_errors`): for every layer, the output error of the algorithm's
  weight ‖(W − Ŵ)X‖²/n divided by round-to-nearest's (the same scheme, the same transforms) — on the calibration
  rows the solve saw and on held-out rows it did not (windows of the same text, disjoint from the calibration
  ones: ``qbench.eval.harness.calibration_sample``). A ratio below 1 in sample and near 1 out of sample is an
  over-fitted solve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.calibrate import check_calibration, input_statistics
from qbench.quant.clip import mse_weight_qparams
from qbench.quant.fake import FakeQuantLinear, pad_to_groups, transform_input, transform_weight
from qbench.quant.linears import is_linear, linear_weight
from qbench.quant.primitives import QParams
from qbench.quant.schemes import QuantScheme

# (layer name, layer, its input scale or None, (weight, grid or None)) -> the layer that replaces it
Build = Callable[[str, nn.Module, Tensor | None, tuple[Tensor, QParams | None]], nn.Module]

LAYER_ERROR = (
    "per layer: ||(W - W_algo) X||^2 / ||(W - W_rtn) X||^2 over the rows X (calibration: the rows the solve saw; "
    "held_out: windows it did not see), W_rtn round-to-nearest with the same transforms; mean over layers"
)


@dataclass
class Solution:
    """What the algorithm decided: each layer's input scale (AWQ's; SmoothQuant's passed through for GPTQ) and
    (weight to build the layer from, its grid or None for round-to-nearest's own), and the record's report."""

    scales: dict[str, Tensor] = field(default_factory=dict)
    weights: dict[str, tuple[Tensor, QParams | None]] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


def solve_layers(
    model: nn.Module,
    layers: dict[str, nn.Module],
    scheme: QuantScheme,
    calibration: Tensor | None,
    held_out: Tensor | None,
    scales: dict[str, Tensor],
    rotations: dict[str, nn.Module],
    build: Build,
) -> Solution:
    """GPTQ or AWQ of every layer in ``layers`` (module docstring). ``scales``: SmoothQuant's input scales (GPTQ
    keeps them); ``build``: the replacement a solved layer becomes (sequential runs propagate through it)."""
    why = f"scheme {scheme.name!r} (algo={scheme.algo})"
    calibration = check_calibration(calibration, why)
    solution = Solution(scales=dict(scales))
    sequential = bool(scheme.algo_params.get("sequential", False))

    def solve(part: dict[str, nn.Module], stats: dict[str, Any]) -> None:
        found = _solve(model, part, stats, scheme, scales, rotations)
        for name, (s, entry) in found.items():
            if s is not None:
                solution.scales[name] = s
            solution.weights[name] = entry

    if sequential:
        from qbench.quant.sequential import run_sequential

        def solve_block(part: dict[str, nn.Module], stats: dict[str, Any]) -> dict[str, nn.Module]:
            solve(part, stats)
            return {n: build(n, m, solution.scales.get(n), solution.weights[n]) for n, m in part.items()}

        stats, held, outside = run_sequential(model, layers, calibration, held_out, solve_block)
        if outside:  # an LM head: no block holds it, so it sees the float model's inputs
            rest = {n: layers[n] for n in outside}
            extra = _float_statistics(model, rest, calibration, why)
            solve(rest, extra)
            stats.update(extra)
            if held_out is not None and len(held_out):
                held.update(_float_statistics(model, rest, held_out, why))
    else:
        stats = _float_statistics(model, layers, calibration, why)
        held = (
            _float_statistics(model, layers, held_out, why) if held_out is not None and len(held_out) else {}
        )
        solve(layers, stats)
        outside = []
    solution.report = {
        "sequential": sequential,
        **({"float_input_layers": outside} if sequential and outside else {}),
        "layer_error": layer_errors(layers, scheme, scales, rotations, solution, stats, held),
    }
    return solution


def _float_statistics(
    model: nn.Module, layers: dict[str, nn.Module], windows: Tensor, why: str
) -> dict[str, Any]:
    """Each layer's statistics from the float model's inputs, every layer seen."""
    stats = input_statistics(model, layers, windows)
    missing = sorted(set(layers) - set(stats))
    if missing:
        raise UserError(f"{why}: layer {missing[0]!r} never ran during calibration; exclude it")
    return stats


def _solve(
    model: nn.Module,
    layers: dict[str, nn.Module],
    stats: dict[str, Any],
    scheme: QuantScheme,
    scales: dict[str, Tensor],
    rotations: dict[str, nn.Module],
) -> dict[str, tuple[Tensor | None, tuple[Tensor, QParams | None]]]:
    if scheme.algo == "gptq":
        return gptq_layers(layers, stats, scheme, scales, rotations)
    if scheme.algo == "awq":
        return awq_layers(model, layers, stats, scheme)
    raise ValueError(f"no solve for algo={scheme.algo!r}")


def inverse_transform(weight: Tensor, input_scale: Tensor | None, rotation: nn.Module | None) -> Tensor:
    """V with ``fake.transform_weight(V, s, R)`` = ``weight``: V = (weight · R) · diag(1/s) (R orthogonal)."""
    v = weight
    if rotation is not None:
        v = v @ rotation.matrix().to(v.device)  # transform_weight applies v ↦ v · Rᵀ
    return v / input_scale.float() if input_scale is not None else v


def transform_hessian(h: Tensor, input_scale: Tensor | None, rotation: nn.Module | None) -> Tensor:
    """The Hessian of the transformed input x' = x · M (``fake.transform_input``): H' = Mᵀ H M, H symmetric."""
    if input_scale is None and rotation is None:
        return h
    hm = transform_input(h, input_scale, rotation)  # H · M
    return transform_input(hm.t().contiguous(), input_scale, rotation)  # Mᵀ · H · M


def gptq_layers(
    layers: dict[str, nn.Module],
    stats: dict[str, Any],
    scheme: QuantScheme,
    scales: dict[str, Tensor],
    rotations: dict[str, nn.Module],
) -> dict[str, tuple[Tensor | None, tuple[Tensor, QParams]]]:
    """GPTQ of every layer: name -> (its SmoothQuant scale or None, (the weight to build the layer from, GPTQ's
    qparams))."""
    from qbench.quant.gptq import gptq_quantize

    params = scheme.algo_params
    out = {}
    transformed: dict[tuple[int, int, int], Tensor] = {}  # q/k/v share one H and rotation: carried over once
    for name, module in layers.items():
        weight = linear_weight(module)[0]
        s, r = scales.get(name), rotations.get(name)
        key = (id(stats[name]), id(s), id(r))
        if key not in transformed:
            transformed[key] = transform_hessian(stats[name].hessian.to(weight.device), s, r)
        result = gptq_quantize(
            transform_weight(weight, s, r),
            transformed[key],
            scheme.weight_bits,
            scheme.weight_granularity_for(weight.shape[1]),
            scheme.weight_symmetric,
            damp=float(params["damp"]),
            block=int(params["block"]),
            act_order=bool(params["act_order"]),
            name=name,
            weight_clip=scheme.weight_clip_rule,
        )
        out[name] = (s, (inverse_transform(result.weight, s, r), result.qparams))
    return out


def awq_layers(
    model: nn.Module, layers: dict[str, nn.Module], stats: dict[str, Any], scheme: QuantScheme
) -> dict[str, tuple[Tensor | None, tuple[Tensor, QParams | None]]]:
    """AWQ (``awq.py``): name -> (its searched input scale s or None, (its float weight, the clipped grid of
    W · diag(s), or None where no clipping is searched)); layers reading one input (one shared accumulator) share
    one s."""
    from qbench.quant.awq import clipped, search_clip, search_scale

    grid, clip = int(scheme.algo_params["grid"]), bool(scheme.algo_params["clip"])
    groups: dict[int, list[str]] = {}
    for name in layers:
        groups.setdefault(id(stats[name]), []).append(name)
    out = {}
    unscaled = {n for n in layers if grouped_query_output(model, n, layers[n])}
    for names in groups.values():
        acc = stats[names[0]]
        weights = {n: linear_weight(layers[n])[0] for n in names}
        dim = next(iter(weights.values())).shape[1]
        granularity = scheme.weight_granularity_for(dim)
        if set(names) <= unscaled:  # llm-awq's mapping: no scale it could not fold; the clipping still runs
            s = None
        else:
            s, _, _ = search_scale(
                list(weights.values()),
                acc.hessian,
                acc.abs_mean,
                scheme.weight_bits,
                granularity,
                scheme.weight_symmetric,
                grid,
            )
        h_s = acc.hessian.float() if s is None else acc.hessian.float() / (s.unsqueeze(0) * s.unsqueeze(1))
        for n, w in weights.items():
            w_s = w.float() if s is None else w.float() * s.to(w.device)
            qp = None  # not clipped: round-to-nearest's own grid of W · diag(s)
            if clip and clipped(n):
                qp = search_clip(w_s, h_s, scheme.weight_bits, granularity, scheme.weight_symmetric, grid)
            out[n] = (None if s is None else s.to(w.device), (w, qp))
    return out


def clipped_grids(
    layers: dict[str, nn.Module],
    scheme: QuantScheme,
    scales: dict[str, Tensor],
    rotations: dict[str, nn.Module],
) -> dict[str, tuple[Tensor, QParams]]:
    """Round-to-nearest with QuaRot's weight clipping search (``wclip=mse``, ``clip.mse_weight_qparams``): name ->
    (the layer's weight, the searched grid of its transformed weight R(W · diag(s)), ragged groups padded as
    ``fake.pad_to_groups``). No calibration: the search reads the weights alone."""
    out = {}
    for name, module in layers.items():
        weight = linear_weight(module)[0]
        w = transform_weight(weight, scales.get(name), rotations.get(name))
        granularity = scheme.weight_granularity_for(w.shape[1])
        qp = mse_weight_qparams(
            pad_to_groups(w, granularity), scheme.weight_bits, granularity, scheme.weight_symmetric
        )
        out[name] = (weight, qp)
    return out


def grouped_query_output(model: nn.Module, name: str, layer: nn.Module) -> bool:
    """Whether ``name`` is an attention output projection whose input is wider than its ``v_proj``'s output
    (grouped-query attention: n_kv_head < n_head). AWQ folds that layer's input scale into ``v_proj``, which
    cannot hold one scale per query-head channel, so llm-awq and AutoAWQ leave it unscaled; so does qbench."""
    parent_name, _, leaf = name.rpartition(".")
    if leaf not in ("o_proj", "c_proj", "out_proj", "dense"):
        return False
    parent = model.get_submodule(parent_name) if parent_name else model
    value = getattr(parent, "v_proj", None)
    if value is None or not is_linear(value):
        return False
    return linear_weight(value)[0].shape[0] != linear_weight(layer)[0].shape[1]


def _error(delta: Tensor, h: Tensor) -> float:
    """½ tr(Δ H Δᵀ) = ‖Δ X‖²/n for H = (2/n) X Xᵀ (``gptq.layer_error``), in float32."""
    return float(0.5 * ((delta @ h) * delta).sum())


def effective_weight(layer: FakeQuantLinear) -> Tensor:
    """The (out, in) weight a fake layer applies to its *raw* input: its rounded weight carried back through its
    input scale and rotation (x' = R(x / s), so y = x' Ŵ'ᵀ = x (Ŵ' R / s)ᵀ)."""
    return inverse_transform(layer.weight.detach().float(), layer.input_scale, layer.rotation)


def layer_errors(
    layers: dict[str, nn.Module],
    scheme: QuantScheme,
    scales: dict[str, Tensor],
    rotations: dict[str, nn.Module],
    solution: Solution,
    stats: dict[str, Any],
    held: dict[str, Any],
) -> dict[str, Any]:
    """The algorithm's layer error relative to round-to-nearest's, on the calibration rows and the held-out rows
    (module docstring; :data:`LAYER_ERROR`). Layers where round-to-nearest is exact (zero error) are left out."""
    from dataclasses import replace

    # the weights alone: activation quantisers (and their static scales) play no part in a weight error
    weights_only = replace(scheme, act_bits=None, out_bits=None, static=False)
    rtn_scheme = replace(weights_only, algo="rtn", algo_params={})
    per_layer: dict[str, list[float | None]] = {}
    for name, module in layers.items():
        weight = linear_weight(module)[0].detach().float()
        s, r = solution.scales.get(name), rotations.get(name)
        entry = solution.weights[name]
        algo = FakeQuantLinear(
            entry[0].float(), None, weights_only, input_scale=s, rotation=r, weight_qparams=entry[1]
        )
        rtn = FakeQuantLinear(weight, None, rtn_scheme, input_scale=scales.get(name), rotation=r)
        d_algo, d_rtn = effective_weight(algo) - weight, effective_weight(rtn) - weight
        ratios: list[float | None] = []
        for found in (stats, held):
            if name not in found:
                ratios.append(None)
                continue
            h = found[name].hessian.float().to(weight.device)
            base = _error(d_rtn, h)
            ratios.append(_error(d_algo, h) / base if base > 0 else None)
        if ratios[0] is not None:
            per_layer[name] = [round(x, 6) if x is not None else None for x in ratios]

    def mean(i: int) -> float | None:
        xs = [v[i] for v in per_layer.values() if v[i] is not None]
        return round(sum(xs) / len(xs), 6) if xs else None

    return {
        "definition": LAYER_ERROR,
        "calibration": mean(0),
        "held_out": mean(1),
        "layers": len(per_layer),
        "per_layer": per_layer,
    }
