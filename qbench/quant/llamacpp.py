"""llama.cpp as a quantisation backend: its own file types as cells (``--scheme gguf:q4_k_m``), quantised and
computed by llama.cpp itself.

    from qbench.quant import quantize
    q = quantize(model, "gguf:q4_k_m")      # a module whose logits llama.cpp computes; ``model`` is untouched
    q(input_ids=ids).logits                 # (B, T, V) float32

What a cell is (docs/schemes.md, "llama.cpp's formats"): the float model written as a float32 GGUF
(``models.gguf_export.write_gguf``, ids only — no tokenizer is needed, qbench feeds token ids), quantised by
llama.cpp's ``llama_model_quantize`` to the file type (llama.cpp chooses each tensor's type: the head, the token
embedding and some layers differ from the nominal type; :mod:`qbench.quant.gguf_types`), loaded by llama.cpp and
run by its kernels on the harness's windows: each window decoded as a fresh sequence (the KV cache cleared,
positions from 0, the window's own first token — qbench's BOS rule — fed as it is) with the logits of every
position returned. So the cell's perplexity, KL divergence and top-1 come from the same windows and the same
float reference as every other cell; the record's ``artifact`` names the file (bytes, bits per weight, sha256,
tensor types) and llama.cpp's version and build. The float32 file through the same path (``gguf:f32``) is the
consistency check: its distance from qbench's float cell is llama.cpp's arithmetic, not quantisation.

Both modes run llama.cpp's kernels (there is no fake emulation, as with bitsandbytes); its KV cache is float32
(llama.cpp's default float16 would add its own rounding), so ``--kv-bits`` does not apply and is refused; layer
exclusions and the other schemes' options cannot be expressed in a llama.cpp file type and are refused too.

Needs ``llama-cpp-python`` (``pip install 'qbench[llama-cpp]'``) and the ``gguf`` package, imported only here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.gguf_types import (
    GGUF_TYPES,
    TENSOR_TYPES,
    check_tensor_type,
    check_type,
    key_matches,
)
from qbench.quant.primitives import NonFiniteError


def require_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or a one-line error saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise UserError(
            "llama.cpp's formats need llama-cpp-python: pip install 'qbench[llama-cpp]' (pip builds llama.cpp "
            f"from source: a C compiler and CMake, ~5 minutes on 2 cores) ({e})"
        ) from None
    return llama_cpp


def llama_cpp_version() -> str:
    return f"llama-cpp-python {getattr(require_llama_cpp(), '__version__', '?')}"


def system_info() -> str:
    """llama.cpp's own account of the build (the ISA it compiled for, OpenMP, repacking)."""
    llama_cpp = require_llama_cpp()
    return llama_cpp.llama_print_system_info().decode().strip().rstrip("|").strip()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence llama.cpp's C-level logging (it writes straight to file descriptor 2, past Python's streams)."""
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def quantize_gguf(src: Path, dst: Path, type_name: str, threads: int = 1) -> Path:
    """``src`` (a float GGUF) quantised by llama.cpp's ``llama_model_quantize`` to ``type_name`` at ``dst``."""
    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = GGUF_TYPES[check_type(type_name)].ftype
    params.nthread = threads
    with quiet():
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantise {src.name} to {type_name} (status {status})")
    return dst


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def describe_file(path: Path, parameters: int) -> dict[str, Any]:
    """The artifact block of a cell's record: the file's bytes, bits per weight (file bits over the float
    model's parameters, as llama.cpp's ``quantize`` tool reports BPW), sha256 and tensor types."""
    from models.gguf_export import gguf_summary

    size = path.stat().st_size
    summary = gguf_summary(path)
    return {
        "format": "gguf",
        "file": path.name,
        "bytes": size,
        "bits_per_weight": round(8 * size / parameters, 4) if parameters else None,
        "sha256": sha256(path),
        "file_type": summary["file_type"],
        "tensor_types": summary["tensor_types"],
        "llama_cpp": llama_cpp_version(),
        "llama_cpp_system": system_info(),
    }


class LlamaCppLM(nn.Module):
    """A causal LM whose logits llama.cpp computes from one GGUF file (module docstring).

    ``model(input_ids=ids)`` (or ``model(ids)``) returns an object with ``.logits``, (B, T, V) float32: each row
    decoded as a fresh sequence, every position's logits. The llama.cpp context is made on first use with room for
    the longest row seen (remade when a longer one comes). ``config`` is the float model's (the vocabulary the
    harness sizes its batches by); ``nbytes()`` the weights as llama.cpp holds them. The folder holding the file is
    removed by :meth:`close` (also on garbage collection)."""

    def __init__(self, path: Path, config: Any, threads: int, workdir: Path | None, artifact: dict[str, Any]):
        super().__init__()
        self.path = Path(path)
        self.config = config
        self.threads = threads
        self.qbench_artifact = artifact
        self._workdir = workdir
        self._llm: Any = None
        self._n_ctx = 0

    def _context(self, length: int) -> Any:
        if self._llm is None or length > self._n_ctx:
            llama_cpp = require_llama_cpp()
            if self._llm is not None:
                self._llm.close()
            with quiet():
                self._llm = llama_cpp.Llama(
                    model_path=str(self.path),
                    n_ctx=length,
                    n_batch=length,
                    n_ubatch=length,
                    n_threads=self.threads,
                    n_threads_batch=self.threads,
                    logits_all=True,
                    type_k=0,  # GGML_TYPE_F32: the cache adds no rounding of its own
                    type_v=0,
                    verbose=False,
                )
            self._n_ctx = length
        return self._llm

    @torch.no_grad()
    def forward(self, input_ids: Tensor | None = None, *args: Any, **kwargs: Any) -> SimpleNamespace:
        if input_ids is None:
            raise TypeError("LlamaCppLM needs input_ids")
        import numpy as np

        ids = input_ids.detach().to("cpu", torch.int64)
        if ids.dim() == 1:
            ids = ids[None]
        length = int(ids.shape[1])
        llm = self._context(length)
        out = []
        with quiet():  # llama.cpp's context warnings go to file descriptor 2, past Python's streams
            for row in ids.tolist():
                llm.reset()  # eval() then starts from position 0: the KV cache is cleared (llama_memory_clear)
                llm.eval(row)
                out.append(torch.from_numpy(np.array(llm.scores[:length], dtype=np.float32)))
        return SimpleNamespace(logits=torch.stack(out).to(input_ids.device))

    def nbytes(self) -> int:
        """The weights' bytes as llama.cpp holds them (``llama_model_size``)."""
        llama_cpp = require_llama_cpp()
        return int(llama_cpp.llama_model_size(self._context(max(self._n_ctx, 8)).model))

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __del__(self) -> None:
        try:  # noqa: SIM105 - not contextlib: at interpreter shutdown module globals may be gone
            self.close()
        except Exception:
            pass

    def __deepcopy__(self, memo: dict) -> LlamaCppLM:
        raise UserError(
            "a llama.cpp cell cannot be copied or changed further (its weights are llama.cpp's file): "
            "KV-cache quantisation (--kv-bits) and other transforms do not apply to gguf:* schemes"
        )

    def extra_repr(self) -> str:
        return f"{self.path.name}, threads={self.threads}"


def quantize_llama_cpp(
    model: nn.Module,
    type_name: str,
    exclude: tuple[str, ...] = (),
    tensors: dict[str, str] | None = None,
) -> LlamaCppLM:
    """``model`` written as a float32 GGUF, quantised by llama.cpp to ``type_name`` (F32: as written) and loaded
    by llama.cpp: the module a ``gguf:*`` cell scores. ``model`` is not modified. A model llama.cpp cannot run
    (``write_gguf`` names why) and layer exclusions are refused in one line.

    ``tensors`` (``{"ffn_down": "Q6_K", "blk.0": "Q8_0"}``, keys as :func:`~qbench.quant.gguf_types.key_matches`
    reads them): a mixed file instead — each named tensor in its own ggml type by :func:`quantize_tensor`, every
    other 2-D tensor in the float ``type_name`` (F32, F16, BF16), norms float32. A key that names no tensor, or a
    tensor two keys name, is refused."""
    name = check_type(type_name)
    label = f"gguf:{name.lower()}" + (":…" if tensors else "")
    if tuple(exclude):
        raise UserError(f"{label}: llama.cpp chooses every tensor's type itself; --exclude does not apply")
    require_llama_cpp()
    from models.gguf_export import write_gguf

    for pname, p in model.named_parameters():  # llama.cpp's quantiser fails on them without saying where
        if not torch.isfinite(p).all():
            raise NonFiniteError(f"{label}: the float weights hold NaN or inf (first in {pname})")
    workdir = Path(tempfile.mkdtemp(prefix="qbench-gguf-"))
    try:
        threads = max(torch.get_num_threads(), 1)
        if tensors:
            quantize, used = mixed_quantizer(tensors, name)
            path = write_gguf(
                model,
                workdir / "model-mixed.gguf",
                None,
                placeholder_vocab=True,
                quantize=quantize,
                separate_head="output" in tensors,
            )
            check_all_used(tensors, used)
        else:
            f32 = write_gguf(model, workdir / "model-F32.gguf", None, placeholder_vocab=True)
            try:
                path = (
                    f32
                    if name == "F32"
                    else quantize_gguf(f32, workdir / f"model-{name}.gguf", name, threads)
                )
            except RuntimeError as err:  # recorded as the cell's one-line reason, the grid goes on
                raise UserError(str(err)) from None
            if path != f32:
                f32.unlink()  # a 135M model's float32 file is 0.5 GB: only the cell's own file is kept
        parameters = sum(p.numel() for p in model.parameters())
        artifact = describe_file(path, parameters)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return LlamaCppLM(path, getattr(model, "config", None), threads, workdir, artifact)


# ------------------------------------------------------------------ one tensor in a ggml type (mixed files)


def quantize_tensor(weight: Tensor, type_name: str, name: str = "the tensor") -> Any:
    """``weight`` (rows × n: ggml's ne0 is n) in ggml type ``type_name`` as llama.cpp's own quantiser writes it
    (``ggml_quantize_chunk``, no importance matrix, as ``llama_model_quantize`` without ``--imatrix``): a uint8
    array of rows × row bytes. Rows that are not whole blocks of the type are refused in one line."""
    import numpy as np

    type_name = check_tensor_type(type_name)
    t = TENSOR_TYPES[type_name]
    w = np.ascontiguousarray(weight.detach().to("cpu", torch.float32).numpy())
    n = w.shape[1]
    if n % t.block:
        ok = [k for k, v in TENSOR_TYPES.items() if n % v.block == 0]
        raise UserError(
            f"{name}: rows of {n} weights are not whole blocks of {t.block} ({type_name}); types that fit: "
            f"{', '.join(ok)}"
        )
    from qbench.quant.kernels.ggml import quantize_rows, requires_imatrix

    if requires_imatrix(t.ggml):
        raise UserError(f"{type_name} needs an importance matrix, which qbench does not compute")
    return quantize_rows(t.ggml, w)


def mixed_quantizer(tensors: dict[str, str], base: str) -> tuple[Any, dict[str, list[str]]]:
    """(``write_gguf``'s ``quantize`` callback for a mixed file, the tensors each key matched, filled as it runs):
    a named tensor in its type, any other 2-D tensor in ``base`` (F32: written as it is)."""
    used: dict[str, list[str]] = {k: [] for k in tensors}

    def quantize(tensor_name: str, tensor: Tensor) -> tuple[str, Any] | None:
        keys = [k for k in tensors if key_matches(k, tensor_name)]
        if len(keys) > 1:
            raise UserError(f"{tensor_name} is named by {' and '.join(keys)}: give each tensor one type")
        for k in keys:
            used[k].append(tensor_name)
        type_name = tensors[keys[0]] if keys else base
        if type_name == "F32":
            return None
        return type_name, quantize_tensor(tensor, type_name, tensor_name)

    return quantize, used


def check_all_used(tensors: dict[str, str], used: dict[str, list[str]]) -> None:
    """A key that named no tensor of the model did not apply: an error, not a silent float tensor."""
    unused = [k for k, names in used.items() if not names]
    if unused:
        raise UserError(
            f"{', '.join(unused)} names no tensor of this model (its GGUF has token_embd, output unless tied, "
            "blk.N.attn_q/attn_k/attn_v/attn_output/ffn_gate/ffn_up/ffn_down, or for GPT-2 attn_qkv and "
            "position_embd)"
        )


# ------------------------------------------------------------------------ a qbench scheme written as GGUF

# The llama.cpp block types whose arithmetic a qbench weight grid has (ggml-common.h): one scale per 32 weights
# of a row, stored as fp16. (bits, symmetric) -> type. Q8_0: x̂ = d·q, q ∈ [−127, 127] (qbench's int8 absmax
# codes); Q4_0: x̂ = d·(q − 8), q ∈ [0, 15] (qbench's int4 absmax codes −7 … 7, shifted by 8); Q4_1:
# x̂ = d·q + m, q ∈ [0, 15] (qbench's zero-point codes u with scale s and zero z: d = s, m = −s·z).
EXPORT_TYPES = {(8, True): "Q8_0", (4, True): "Q4_0", (4, False): "Q4_1"}
EXPORT_BLOCK = 32


def export_type(scheme: Any) -> str:
    """The llama.cpp type that holds ``scheme``'s weights exactly (but for its scales' fp16 rounding), or a
    one-line error naming what differs and the nearest scheme that has one."""
    from qbench.quant.granularity import PerGroup

    name = scheme.name
    what = []
    if scheme.method not in ("rtn",) or scheme.format != "int":
        what.append(
            f"method {scheme.method}, format {scheme.format} (only integer round-to-nearest grids are)"
        )
    if scheme.algo != "rtn" or scheme.rotate != "none" or scheme.weight_clip_rule != "none":
        what.append("a weight algorithm, rotation or clipped range (export writes round-to-nearest grids)")
    key = (scheme.weight_bits, scheme.weight_symmetric)
    if key not in EXPORT_TYPES:
        what.append(
            f"{scheme.weight_bits}-bit {'symmetric' if scheme.weight_symmetric else 'asymmetric'} weights"
        )
    if scheme.weight_granularity != PerGroup(EXPORT_BLOCK):
        what.append(f"weights {scheme.weight_granularity.label} (llama.cpp's blocks are 32 weights of a row)")
    if not what:
        return EXPORT_TYPES[key]
    bits = scheme.weight_bits if scheme.weight_bits in (4, 8) else 4
    sym = scheme.weight_symmetric if bits == 4 else True
    nearest = "absmax-fine:group=32" if bits == 8 else "absmax-w4a8-g32" if sym else "zeropoint-w4a8-g32"
    raise UserError(
        f"scheme {name!r} has no llama.cpp type with its arithmetic ({'; '.join(what)}); the nearest is "
        f"{EXPORT_TYPES[(bits, sym)]}: --scheme {nearest} (types written: Q8_0, Q4_0, Q4_1)"
    )


def _fp16(x: Tensor) -> Any:
    return x.to(torch.float16).numpy().view("uint8").reshape(*x.shape, 2)


def pack_blocks(weight: Tensor, scheme: Any) -> tuple[str, Any]:
    """(type name, the GGUF bytes of ``weight`` (rows × in) as llama.cpp's blocks): qbench's own codes and scales
    (``primitives.choose_qparams`` / ``quantize`` with the scheme's grid) laid out as ``block_q8_0`` / ``q4_0`` /
    ``q4_1``, the scales rounded to fp16 as llama.cpp stores them."""
    import numpy as np

    from qbench.quant.primitives import choose_qparams, quantize

    type_name = export_type(scheme)
    w = weight.detach().float().cpu()
    rows, cols = w.shape
    if cols % EXPORT_BLOCK:
        raise UserError(
            f"a row of {cols} weights is not whole blocks of {EXPORT_BLOCK}: llama.cpp cannot hold it"
        )
    qp = choose_qparams(w, scheme.weight_bits, scheme.weight_granularity, scheme.weight_symmetric)
    codes = quantize(w, qp, scheme.weight_bits, scheme.weight_granularity, scheme.weight_symmetric)
    blocks = cols // EXPORT_BLOCK
    q = codes.reshape(rows, blocks, EXPORT_BLOCK).to(torch.int16)
    d = _fp16(qp.scale.reshape(rows, blocks))
    if type_name == "Q8_0":
        body = q.to(torch.int8).numpy().view("uint8")
        out = np.concatenate([d, body], axis=-1)
    else:
        u = (q + 8 if type_name == "Q4_0" else q).to(torch.uint8).numpy()
        nibbles = (u[..., :16] & 0xF) | (u[..., 16:] << 4)  # ggml: the first 16 in low nibbles, the rest high
        parts = [d]
        if type_name == "Q4_1":  # m = −s·z: x̂ = s·(u − z) = d·u + m
            parts.append(_fp16(-(qp.scale * qp.zero_point.float()).reshape(rows, blocks)))
        out = np.concatenate([*parts, nibbles.astype(np.uint8)], axis=-1)
    return type_name, np.ascontiguousarray(out.reshape(rows, -1))


__all__ = [
    "EXPORT_TYPES",
    "LlamaCppLM",
    "check_all_used",
    "check_type",
    "describe_file",
    "export_type",
    "llama_cpp_version",
    "mixed_quantizer",
    "pack_blocks",
    "quantize_gguf",
    "quantize_llama_cpp",
    "quantize_tensor",
    "require_llama_cpp",
    "system_info",
]
