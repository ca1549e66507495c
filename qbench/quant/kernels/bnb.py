"""bitsandbytes as a real-quantisation backend: LLM.int8 (``Linear8bitLt``) and NF4 (``Linear4bit``).

bitsandbytes is optional (``pip install 'qbench[bnb]'``) and imported only inside these functions.

- ``llm-int8``: ``Linear8bitLt(threshold=6.0, has_fp16_weights=False)``. Weights int8 absmax per output row;
  activations int8 absmax per row, except input columns holding any |x| ≥ threshold, which are multiplied in
  float16 (the outlier decomposition of Dettmers et al. 2022). bitsandbytes casts activations to float16 first, so
  values beyond ±65504 overflow — a limit of the method as implemented, relevant for massive activations.
  The outlier columns are chosen over all rows of one call, so a batch of sequences would share them and a cell
  would change with ``--batch-size``; the layer is therefore called once per sequence, like the
  per-sequence activation scales of the other schemes.
- ``bnb-nf4``: ``Linear4bit(quant_type="nf4")``, blocks of 64 weights with an absmax each, NormalFloat-4 codebook,
  weight-only (activations stay in ``compute_dtype``) — except on CPUs with AVX512-BF16: there bitsandbytes
  (0.45+, ``backends/cpu/ops.py``) repacks the weight on the first inference forward and its CPU ``gemv_4bit``
  casts the activations *and the block absmax* to bf16 and computes in bf16 (relative error ~3e-3 against the
  float32 product), whatever ``compute_dtype`` says. :func:`nf4_compute_dtype` tells which, and the layer's
  name in records says it (``bnb-nf4 (bf16 compute)``).

bitsandbytes quantises a weight only when the parameter is moved with ``.to(device)`` (or on a forward in eval
mode): we build on the CPU, move to the weight's device — which quantises — and return the layer in eval mode,
so what we report as storage is what actually sits in memory.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.kernels.base import LayerInputs, RealLinear
from qbench.quant.schemes import QuantScheme

_CAST_WARNING = "inputs will be cast from"


def import_bnb() -> ModuleType:
    """``bitsandbytes``, or a :class:`UserError` saying how to install it."""
    try:
        import bitsandbytes
    except ImportError as err:
        raise UserError(
            "the llm-int8 and bnb-nf4 schemes need bitsandbytes: pip install 'qbench[bnb]' "
            f"(import failed: {err})"
        ) from err
    _silence_cast_warning()
    return bitsandbytes


def bnb_available() -> bool:
    try:
        import_bnb()
    except UserError:
        return False
    return True


class _DropCastWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _CAST_WARNING not in record.getMessage()


def _silence_cast_warning() -> None:
    """MatMul8bitLt logs "inputs will be cast … to float16" on *every* fp32 call; drop just that message."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropCastWarning) for f in logger.filters):
        logger.addFilter(_DropCastWarning())


def nf4_compute_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a bitsandbytes ``Linear4bit`` computes in for inference input on its device.

    bitsandbytes' CPU path (``Linear4bit.forward``): when ``support_avx512bf16_for_cpu`` (the CPU has AVX512-BF16
    and the library was built with it) the weight is repacked for ``gemv_4bit``, whose CPU kernel converts the
    input and the absmax to bf16; otherwise the weight is dequantised to ``compute_dtype`` and multiplied."""
    on_cpu = layer.weight.device.type == "cpu"
    if on_cpu and getattr(layer, "support_avx512bf16_for_cpu", False):
        return torch.bfloat16
    return layer.compute_dtype or torch.float32


def nf4_cpu_compute_dtype() -> torch.dtype:
    """What an NF4 layer of a shape bitsandbytes repacks (out % 32 = 0, in % blocksize = 0) computes in on this
    CPU: bf16 where bitsandbytes has its AVX512-BF16 kernel, else float32 (``compute_dtype``)."""
    from bitsandbytes.functional import has_avx512bf16

    import_bnb()
    return torch.bfloat16 if has_avx512bf16() else torch.float32


def _restore_nf4_absmax(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """After ``Linear4bit`` saved its state: bitsandbytes 0.50 un-repacks a CPU-repacked NF4 weight for saving but
    leaves its absmax in the repacked layout — bf16, (in / blocksize, out) — unless the statistics are nested. The
    saved state and the layer's own next forward then read scrambled block scales (relative error 0.29
    measured). Put it back as it was before repacking: flat, block order, float32 (of the bf16 values the kernel
    computed with, so the next repacking reproduces them exactly)."""
    state = getattr(module.weight, "quant_state", None)
    if state is None or getattr(state, "packing_format_for_cpu", False) or state.absmax.dim() != 2:
        return
    state.absmax = state.absmax.T.reshape(-1).float().contiguous()
    if prefix + "weight.absmax" in state_dict:
        state_dict[prefix + "weight.absmax"] = state.absmax.detach()


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


class BnbLinear(RealLinear):
    """A bitsandbytes layer with qbench's reporting (``extra_repr``, ``nbytes``); forward is the layer's own."""

    def __init__(self, layer: nn.Module, method: str, per_sequence: bool = False) -> None:
        super().__init__()
        self.layer, self.method, self.per_sequence = layer.eval(), method, per_sequence
        self.in_features, self.out_features = layer.in_features, layer.out_features
        if isinstance(layer, import_bnb().nn.Linear4bit):
            layer.register_state_dict_post_hook(_restore_nf4_absmax)

    @property
    def compute_dtype(self) -> torch.dtype:
        """What bitsandbytes computes in: bf16 or ``compute_dtype`` for NF4 (:func:`nf4_compute_dtype`); fp16 for
        LLM.int8 (its outlier columns and its casts)."""
        if isinstance(self.layer, import_bnb().nn.Linear4bit):
            return nf4_compute_dtype(self.layer)
        return torch.float16

    @property
    def kernel_name(self) -> str:
        """The name records carry (``apply.real_kernels``): the method and the compute dtype."""
        kind = "bnb-nf4" if self.method.startswith("nf4") else "llm-int8"
        return f"BnbLinear {kind} ({dtype_name(self.compute_dtype)} compute)"

    def _forward(self, x: Tensor) -> Tensor:
        # bitsandbytes casts the layer's bias *in place* to the input's (or compute) dtype on every call: one bf16
        # call would leave a bf16-rounded bias behind for every later float32 call. Keep the stored one.
        bias = self.layer.bias
        kept = None if bias is None else bias.data
        try:
            return self._call_layer(x)
        finally:
            if kept is not None:
                bias.data = kept

    def _call_layer(self, x: Tensor) -> Tensor:
        if not self.per_sequence or x.dim() < 3 or x.shape[0] == 1:
            return self.layer(x)
        # (B, T, in): one call per sequence
        return torch.cat([self.layer(x[i : i + 1]) for i in range(x.shape[0])])

    def _load_from_state_dict(
        self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool, missing: list, unexpected: list,
        errors: list,
    ) -> None:  # fmt: skip
        """Load a state dict saved from a built layer: bitsandbytes' own loading expects a layer that was never
        quantised (NF4: ``Params4bit.from_prequantized``; LLM.int8: its row scales ``SCB`` move off the weight on
        the first forward, after which its loader refuses them). The inner layer's load then copies the rest."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        bnb, p = import_bnb(), prefix + "layer."
        if isinstance(self.layer, bnb.nn.Linear4bit) and p + "weight" in state_dict:
            stats = {
                k[len(p) + 7 :]: state_dict.pop(k) for k in list(state_dict) if k.startswith(p + "weight.")
            }
            weight = bnb.nn.Params4bit.from_prequantized(
                state_dict[p + "weight"], stats, device=self.layer.weight.device, module=self.layer
            )
            self.layer.weight = weight
            state_dict[p + "weight"] = weight  # the inner load copies it onto itself
        elif isinstance(self.layer, bnb.nn.Linear8bitLt) and p + "SCB" in state_dict:
            scb = state_dict.pop(p + "SCB")
            state_dict.pop(p + "weight_format", None)
            target = getattr(self.layer.weight, "SCB", None)
            target = self.layer.state.SCB if target is None else target
            with torch.no_grad():
                target.copy_(scb)

    def nbytes(self) -> int:
        """Quantised weight + its statistics (row scales for int8, block absmax for NF4) + bias."""
        weight = self.layer.weight
        tensors = [weight.data, self.layer.bias]
        # Linear8bitLt: one float32 scale per output row, on the weight until the first forward moves it to .state
        state8 = getattr(self.layer, "state", None)
        tensors.append(
            getattr(weight, "SCB", None)
            if getattr(weight, "SCB", None) is not None
            else getattr(state8, "SCB", None)
        )
        state = getattr(weight, "quant_state", None)  # Linear4bit: QuantState with absmax (+ nested state)
        if state is not None:
            tensors += [state.absmax, getattr(state, "code", None)]
            nested = getattr(state, "state2", None)
            if nested is not None:
                tensors += [nested.absmax, nested.code]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.layer.in_features}, out_features={self.layer.out_features}, "
            f"bias={self.layer.bias is not None}, bitsandbytes {self.method}, "
            f"{dtype_name(self.compute_dtype)} compute, {self.nbytes() / 2**20:.2f} MiB"
        )

    def train(self, mode: bool = True) -> BnbLinear:
        # Linear8bitLt runs a float path in training mode; this backend is for evaluation only
        return super().train(False)


def bnb_int8_linear(weight: Tensor, bias: Tensor | None = None, threshold: float = 6.0) -> BnbLinear:
    """LLM.int8 from an (out, in) float weight: ``Linear8bitLt(threshold, has_fp16_weights=False)``, eval mode."""
    bnb = import_bnb()
    out_features, in_features = weight.shape
    layer = bnb.nn.Linear8bitLt(
        in_features, out_features, bias=bias is not None, has_fp16_weights=False, threshold=threshold
    )
    layer.weight = bnb.nn.Int8Params(
        weight.detach().float().cpu().clone(), requires_grad=False, has_fp16_weights=False
    )
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().float().cpu().clone(), requires_grad=False)
    return BnbLinear(layer.to(weight.device), f"llm-int8 (threshold {threshold})", per_sequence=True)


def bnb_nf4_linear(
    weight: Tensor,
    bias: Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    blocksize: int = 64,
) -> BnbLinear:
    """NF4 weight-only from an (out, in) float weight: ``Linear4bit(quant_type="nf4")``, eval mode."""
    bnb = import_bnb()
    out_features, in_features = weight.shape
    layer = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=False,
        quant_type="nf4",
    )
    layer.weight = bnb.nn.Params4bit(
        weight.detach().float().cpu().clone(),
        requires_grad=False,
        quant_type="nf4",
        blocksize=blocksize,
        compress_statistics=False,
        module=layer,
    )
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().float().cpu().clone(), requires_grad=False)
    if (out_features % 32 or in_features % blocksize) and getattr(layer, "support_avx512bf16_for_cpu", False):
        # bitsandbytes 0.50 repacks NF4 weights for its CPU kernel on the first eval forward, asserting
        # out_features % 32 == 0 and reshaping the absmax to (out, in / blocksize) (a RuntimeError for a
        # ragged last block); other shapes must take its generic dequantise-and-matmul path
        layer.support_avx512bf16_for_cpu = False
    return BnbLinear(layer.to(weight.device), f"nf4 (blocks of {blocksize})")


def build_bnb(
    weight: Tensor,
    bias: Tensor | None,
    scheme: QuantScheme,
    inputs: LayerInputs,
) -> nn.Module:
    """The registry's builder for bitsandbytes' schemes (``registry.REAL_KERNELS``)."""
    if inputs.input_scale is not None or inputs.rotation is not None or inputs.weight_qparams is not None:
        raise UserError(
            f"scheme {scheme.name!r}: bitsandbytes layers take no input scale, rotation or given weight grid"
        )
    if scheme.method == "llm-int8":
        return bnb_int8_linear(weight, bias, threshold=float(scheme.param("threshold")))
    return bnb_nf4_linear(weight, bias, blocksize=int(scheme.param("blocksize")))
