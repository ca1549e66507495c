"""Write a float32 GGUF (llama.cpp's format) of a GPT-2- or Llama-family model, with the ``gguf`` package, and
read any GGUF's header (:func:`gguf_summary`: architecture, file type, tensor types).

What llama.cpp needs of each architecture was read from its loader (``src/models/gpt2.cpp``, ``llama.cpp`` and
``llama-model.cpp``'s ``create_tensor_qkv`` in ggml-org/llama.cpp):

- ``gpt2``: ``token_embd``, ``position_embd`` (``n_ctx_train`` rows), per block ``attn_norm`` (+bias), a fused
  ``attn_qkv`` (+bias), ``attn_output`` (+bias), ``ffn_norm`` (+bias), ``ffn_up``/``ffn_down`` (+bias), then
  ``output_norm`` (+bias) and ``output`` (omitted when tied: llama.cpp reuses ``token_embd``). Every bias is
  required: a model without biases gets zeros. transformers' GPT-2 stores these projections as ``Conv1D``
  (in, out); GGUF wants them as (out, in) row-major, i.e. transposed.
- ``llama``: separate ``attn_q``/``attn_k``/``attn_v`` (biases optional), ``attn_output``, ``ffn_gate``/``ffn_up``/
  ``ffn_down``, RMS norms. llama.cpp's llama graph applies RoPE to *consecutive pairs* of a head's channels
  (``LLAMA_ROPE_TYPE_NORM``) while transformers' Llama rotates the two *halves* of the head: the rows of ``W_q``
  and ``W_k`` are reordered within each head (row ``j`` of the first half goes to ``2j``, of the second half to
  ``2j + 1``), which makes the two graphs compute the same attention scores.

Only what llama.cpp computes is exported: softmax-1, the other attention remedies, output gates and rope
scalings have no GGUF graph and are refused in one line. One difference is stated rather than refused: llama.cpp's
GPT-2 graph uses the tanh approximation of GELU (as the original GPT-2 did), while qbench's ``gpt2`` family uses
the exact erf GELU; the two differ by at most ~5e-4 per activation, recorded in the file's ``qbench.note``.

The vocabulary travels as a ``gpt2`` (byte-level BPE) tokenizer: tokens in id order, merges, token types. A model
without a byte-level BPE tokenizer can only be written with ``placeholder_vocab=True`` (token strings ``<id>``,
no merges: llama.cpp then runs the model on token ids, as ``qbench speed`` does, but cannot tokenise text), and
the file says so in ``qbench.vocab``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.errors import UserError

GGUF_ARCHITECTURES = ("gpt2", "llama")
# transformers' attention implementations whose function is plain softmax attention
_PLAIN_ATTENTION = (None, "sdpa", "eager", "flash_attention_2", "flex_attention")


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:
        raise UserError(
            f"reading or writing a .gguf file needs the gguf package: pip install 'qbench[gguf]' ({e})"
        ) from None
    return gguf


def _as_hf(model: torch.nn.Module, tokenizer: Any | None) -> Any:
    """A transformers model of the same function: ours converted by ``models.hf.to_hf_model``, theirs as given."""
    from models.transformer import Transformer

    if isinstance(model, Transformer):
        from models.hf import to_hf_model

        return to_hf_model(model, tokenizer)
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise UserError(
            f"cannot write a GGUF of a {type(model).__name__}: give a qbench or transformers model"
        )
    return model


def _check_exportable(hf: Any) -> str:
    """The GGUF architecture of ``hf``'s config, or a one-line refusal naming what llama.cpp cannot compute."""
    config = hf.config
    family = getattr(config, "model_type", None)
    if family not in GGUF_ARCHITECTURES:
        raise UserError(
            f"no GGUF converter for model type {family!r}: qbench writes {list(GGUF_ARCHITECTURES)} "
            "(the families it exports); convert others with llama.cpp's convert_hf_to_gguf.py"
        )
    attn = getattr(config, "_attn_implementation", None)
    if getattr(config, "qbench_gate", None) or attn not in _PLAIN_ATTENTION:
        what = (
            f"output-gated attention ({config.qbench_gate})" if getattr(config, "qbench_gate", None) else attn
        )
        raise UserError(
            f"cannot write a GGUF of a model with {what} attention: llama.cpp computes plain softmax attention, "
            "so the file would be a different model"
        )
    if family == "llama":
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type != "default":
            raise UserError(
                f"cannot write a GGUF of a Llama model with rope_type {rope_type!r}: qbench's converter writes "
                "plain RoPE only (use llama.cpp's convert_hf_to_gguf.py)"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UserError(
                f"cannot write a GGUF of a Llama model with hidden_act {config.hidden_act!r} (silu only)"
            )
    return family


def _pairs_from_halves(weight: Tensor, heads: int) -> Tensor:
    """Reorder each head's rows from transformers' rotate-half layout to llama.cpp's consecutive pairs."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _gpt2_tensors(hf: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    c = hf.config
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    out: dict[str, Tensor] = {
        "token_embd.weight": sd["transformer.wte.weight"],
        "position_embd.weight": sd["transformer.wpe.weight"],
        "output_norm.weight": sd["transformer.ln_f.weight"],
        "output_norm.bias": sd["transformer.ln_f.bias"],
    }
    if not c.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {
        "ln_1": "attn_norm",
        "attn.c_attn": "attn_qkv",
        "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm",
        "mlp.c_fc": "ffn_up",
        "mlp.c_proj": "ffn_down",
    }
    for i in range(c.n_layer):
        for theirs, gguf_name in names.items():
            w = sd[f"transformer.h.{i}.{theirs}.weight"]
            if "." in theirs:  # a Conv1D (in, out): GGUF holds (out, in)
                w = w.t().contiguous()
            out[f"blk.{i}.{gguf_name}.weight"] = w
            out[f"blk.{i}.{gguf_name}.bias"] = sd[f"transformer.h.{i}.{theirs}.bias"]
    d_ff = c.n_inner or 4 * c.n_embd
    meta = {
        "context_length": c.n_positions,
        "embedding_length": c.n_embd,
        "feed_forward_length": d_ff,
        "block_count": c.n_layer,
        "head_count": c.n_head,
        "layer_norm_eps": c.layer_norm_epsilon,
        "note": (
            "llama.cpp's GPT-2 graph uses tanh-approximate GELU"
            + (
                ""
                if c.activation_function in ("gelu_new", "gelu_pytorch_tanh")
                else "; the model: exact GELU"
            )
        ),
    }
    return out, meta


def _llama_tensors(hf: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    c = hf.config
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    out: dict[str, Tensor] = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
    }
    if not c.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(c.num_hidden_layers):
        for theirs, gguf_name in names.items():
            for kind in ("weight", "bias"):
                t = sd.get(f"model.layers.{i}.{theirs}.{kind}")
                if t is None:
                    continue
                if gguf_name in ("attn_q", "attn_k"):
                    t = _pairs_from_halves(t, heads if gguf_name == "attn_q" else kv_heads)
                out[f"blk.{i}.{gguf_name}.{kind}"] = t
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    meta = {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "block_count": c.num_hidden_layers,
        "head_count": heads,
        "head_count_kv": kv_heads,
        "key_length": head_dim,
        "value_length": head_dim,
        "rope_dimension_count": head_dim,
        "rope_freq_base": float(theta if theta is not None else getattr(c, "rope_theta", 10000.0)),
        "layer_norm_rms_eps": c.rms_norm_eps,
    }
    return out, meta


def _vocab(tokenizer: Any | None, rows: int, placeholder: bool) -> dict[str, Any]:
    """tokens (id order, padded to the embedding's ``rows``), token types, merges, pre-tokenizer, special ids."""
    spec = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        if spec.get("model", {}).get("type") != "BPE" or not _byte_level(spec):
            spec = None
    if spec is None:
        if not placeholder:
            kind = (
                "no tokenizer"
                if tokenizer is None
                else f"a {type(tokenizer).__name__} that is not byte-level BPE"
            )
            raise UserError(
                f"cannot write the GGUF's vocabulary: the model has {kind}; qbench writes byte-level BPE "
                "(gpt2-style) vocabularies only"
            )
        return {"vocab": "placeholder"}
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    types = {i: 1 for i in by_id}
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = 3 if added.get("special") else 4  # CONTROL / USER_DEFINED
    if max(by_id) >= rows:
        raise UserError(f"the tokenizer has id {max(by_id)} but the model's embedding has {rows} rows")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(rows)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return {
        "tokens": tokens,
        "types": [types.get(i, 5) for i in range(rows)],  # 5: UNUSED (spare embedding rows)
        "merges": merges,
        # GPT-2's own regex, or llama.cpp's default BPE split for anything else (tokenising text only: token ids
        # fed directly are unaffected)
        "pre": "gpt-2" if spec.get("pre_tokenizer", {}).get("type") == "ByteLevel" else "default",
        "vocab": "tokenizer",
        "eos": getattr(tokenizer, "eos_token_id", None),
        "bos": getattr(tokenizer, "bos_token_id", None),
    }


def _byte_level(spec: dict[str, Any]) -> bool:
    """Whether a tokenizer.json splits bytes GPT-2 style (a ByteLevel pre-tokenizer, alone or in a sequence)."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(p.get("type") == "ByteLevel" for p in parts)


_EMBEDDINGS = ("token_embd.weight", "position_embd.weight", "output.weight")


def write_gguf(
    model: torch.nn.Module,
    path: str | Path,
    tokenizer: Any | None = None,
    *,
    placeholder_vocab: bool = False,
    name: str | None = None,
    quantize: Any = None,
    separate_head: bool = False,
) -> Path:
    """Write ``model`` (ours, or transformers' GPT-2 / Llama) as a float32 GGUF at ``path``; returns the path.

    Every refusal (an architecture or attention llama.cpp has no graph for, a vocabulary that cannot be written)
    happens before the first byte; the file appears only complete (written beside it, then renamed).

    ``quantize(gguf_name, tensor)``: called for every 2-D tensor, returns None (written float32) or (a llama.cpp
    block type name, its bytes rows × bytes-per-row) written as that type (``qbench.quant.llamacpp.pack_blocks``);
    the file type is then that type's when every linear took it, else GUESSED (a mix). ``separate_head``: write ``output.weight`` even for tied
    embeddings (a quantised head beside a float embedding).
    """
    gguf = _import_gguf()
    path = Path(path)
    hf = _as_hf(model, tokenizer)
    family = _check_exportable(hf)
    tensors, meta = (_gpt2_tensors if family == "gpt2" else _llama_tensors)(hf)
    if separate_head and "output.weight" not in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"].clone()
    packed = {}
    if quantize is not None:  # every block computed before the first byte: a refusal leaves no file
        for tensor_name, tensor in tensors.items():
            if tensor.dim() == 2 and (done := quantize(tensor_name, tensor)) is not None:
                packed[tensor_name] = done
    rows = tensors["token_embd.weight"].shape[0]
    vocab = _vocab(tokenizer, rows, placeholder_vocab)
    note = meta.pop("note", None)

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), family)
    try:
        writer.add_name(name or getattr(hf.config, "name_or_path", None) or family)
        first = next(iter(packed.values()), None)
        kinds = {t for t, _ in packed.values()}
        # float linears beside quantised ones make a mix too (the embeddings and head float are a type's own)
        kinds |= {
            "F32" for n, t in tensors.items() if t.dim() == 2 and n not in packed and n not in _EMBEDDINGS
        }
        # one type throughout: its file type; a mix (or a type with no MOSTLY_ name, Q4_K) llama.cpp reads as
        # "guessed" and takes each tensor's own type from the tensor table
        ftype = (
            gguf.LlamaFileType.ALL_F32
            if first is None
            else gguf.LlamaFileType.__members__.get(f"MOSTLY_{first[0]}", gguf.LlamaFileType.GUESSED)
            if len(kinds) == 1
            else gguf.LlamaFileType.GUESSED
        )
        writer.add_file_type(ftype)
        for key, value in meta.items():
            getattr(writer, f"add_{key}")(value)
        writer.add_vocab_size(rows)
        if vocab["vocab"] == "placeholder":
            writer.add_tokenizer_model("none")  # llama.cpp's LLAMA_VOCAB_TYPE_NONE: ids only, no text
        else:
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(vocab["pre"])
            writer.add_token_list(vocab["tokens"])
            writer.add_token_types(vocab["types"])
            writer.add_token_merges(vocab["merges"])
        for key in ("eos", "bos"):
            if vocab.get(key) is not None:
                getattr(writer, f"add_{key}_token_id")(int(vocab[key]))
        writer.add_string("qbench.vocab", vocab["vocab"])
        if note:
            writer.add_string("qbench.note", note)
        for tensor_name, tensor in tensors.items():
            if tensor_name in packed:
                type_name, data = packed[tensor_name]
                writer.add_tensor(tensor_name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
            else:
                writer.add_tensor(tensor_name, tensor.contiguous().numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, path)
    return path


def tensor_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The GGUF tensor names ``write_gguf`` would write for ``model`` and their shapes as torch holds them (rows ×
    row length: ggml's ne1 × ne0), without writing anything; a model llama.cpp cannot run is refused as there."""
    hf = _as_hf(model, None)
    family = _check_exportable(hf)
    tensors, _ = (_gpt2_tensors if family == "gpt2" else _llama_tensors)(hf)
    return {name: tuple(t.shape) for name, t in tensors.items()}


def gguf_summary(path: Path) -> dict[str, Any]:
    """The file's architecture, declared file type and tensor types (``{"Q8_0": 14, "F32": 5}``), from its header."""
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    # A truncated or corrupt file fails anywhere in the reader's parsing: an IndexError or KeyError from a
    # short array, an OverflowError from a garbage length, not only the ValueError of a wrong magic.
    except (OSError, ValueError, IndexError, KeyError, TypeError, OverflowError, EOFError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path} is not a readable GGUF file (corrupt or truncated: {why})") from None

    def field(name: str) -> Any:
        f = reader.fields.get(name)
        return None if f is None else f.contents()

    file_type = field("general.file_type")
    with contextlib.suppress(
        ValueError
    ):  # a newer file type this gguf package does not name: keep the number
        file_type = gguf.LlamaFileType(file_type).name if file_type is not None else None
    counts = Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
    return {
        "architecture": field("general.architecture"),
        "file_type": file_type,
        "tensor_types": dict(sorted(counts.items())),
        "tensors": len(reader.tensors),
    }
