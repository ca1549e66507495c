"""qbench's decode runtime: greedy generation of a qbench :class:`models.Transformer` where a step is its linear
layers' kernels and little else.

Why: at one token, a gpt2-130m step with W4A8 linears spent ~4.2 ms in its linear kernels and ~3 ms in
everything between them (Zen 4, one thread) — norms of 5 aten ops each, attention of ~15 (views, RoPE's cat, the
cache slices, SDPA's flash kernel with its block buffers), module calls — so qbench's generation measured
torch's dispatcher more than its kernels, and trailed llama.cpp (whose whole Q4_0 step took 6.5 ms) for that
reason. The runtime keeps the model's own modules for every linear (so a quantised copy runs its real kernels
through their kept decode calls, ``qbench.quant.kernels.paths``) and the model's prefill (``model(prompt,
cache)``), and replaces the float work of a decode step with two foreign calls of the native library
(``native_decode.c``): ``qk_decode_norm`` — the residual add and the next norm in one pass — and
``qk_decode_attention`` — RoPE on the new query and key, the key and value written to the model's own
:class:`models.kvcache.KVCache`, single-query attention (softmax, softmax-1 or the learned sink) over every
cached position. Embeddings, the MLP's activation and the head's argmax stay torch.

Numbers: RoPE and the cache writes equal the model's bit for bit; the norms and attention equal torch's to float
rounding (another summation order, Cephes' expf), so logits differ from ``model.generate``'s by ~1e-6 relative
and greedy tokens agree except at near-ties (tests compare both with the eager step on every supported
configuration).

Serves (:func:`unsupported` says why not, and :func:`generate` then runs ``model.generate``): pre-norm models
with LayerNorm or RMSNorm, learned, rotary or no positions, softmax / softmax-1 / sink attention without a gate,
grouped-query attention, GELU or SwiGLU MLPs with fused or separate projections, OSP's projections; batch 1,
float32 on CPU with the native library built; no KV-cache quantisation, no observers or hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.kvcache import KVCache
from models.transformer import RMSNorm, Transformer

ATTENTION_KINDS = {"softmax": 0, "softmax1": 1, "sink": 2}  # qk_decode_attention's ``extra``

ENGINE = "qbench decode runtime (C norms and attention between the model's linears)"
EAGER = "model.generate (torch eager)"


def unsupported(model: nn.Module) -> str | None:
    """Why the runtime cannot decode ``model`` (a short phrase), or None when it can."""
    from qbench.quant.kernels import native

    if not isinstance(model, Transformer):
        return "not a qbench Transformer"
    if not native.available():
        return "native kernels not built or switched off"
    wte = model.transformer.wte.weight
    if wte.device.type != "cpu" or wte.dtype != torch.float32:
        return f"{wte.dtype} on {wte.device.type} (float32 on CPU only)"
    c = model.config
    for field, value, allowed in (
        ("norm_position", c.norm_position, ("pre",)),
        ("attn", c.attn, tuple(ATTENTION_KINDS)),
        ("gate", c.gate, ("none",)),
    ):
        if value not in allowed:
            return f"{field}={value}"
    norms = [model.transformer.ln_f] + [m for b in model.transformer.h for m in (b.ln_1, b.ln_2)]
    for norm in norms:
        if not isinstance(norm, (nn.LayerNorm, RMSNorm)) or (
            isinstance(norm, nn.LayerNorm) and norm.normalized_shape != (c.d_model,)
        ):
            return f"norm {type(norm).__name__}"
        if any(p.dtype != torch.float32 for p in norm.parameters()):
            return "a norm not in float32"
    for block in model.transformer.h:
        if block.attn.kv_transform is not None or block.attn.probs_hook is not None:
            return "a KV-cache scheme or an attention observer is attached"
    global_hooks = nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
    if global_hooks or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks are registered"
    return None


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _norm_args(norm: nn.Module) -> tuple[Any, ...]:
    """(w, w_len, b, eps, rms) of qk_decode_norm for a LayerNorm or RMSNorm; float32 CPU parameters (checked)."""
    if isinstance(norm, RMSNorm):
        w = norm.weight.detach()
        return _ptr(w), w.numel(), None, float(norm.eps), 1
    w = None if norm.weight is None else norm.weight.detach()
    b = None if norm.bias is None else norm.bias.detach()
    return _ptr(w), 0 if w is None else w.numel(), _ptr(b), float(norm.eps), 0


class DecodeRuntime:
    """The runtime bound to one model (module docstring); :meth:`generate` is ``model.generate``'s contract."""

    def __init__(self, model: Transformer) -> None:
        from models.errors import UserError
        from qbench.quant.kernels import native

        reason = unsupported(model)
        if reason is not None:
            raise UserError(f"the decode runtime does not serve this model: {reason}")
        self.model, self.lib = model, native.library()
        c = model.config
        self.d, self.nh, self.nkv, self.hs = c.d_model, c.n_head, c.kv_heads, c.head_dim
        self.kind, self.scale = ATTENTION_KINDS[c.attn], 1.0 / c.head_dim**0.5
        self.rope = c.pos == "rope"
        t = model.transformer
        self.norms = [_norm_args(b.ln_1) for b in t.h] + [_norm_args(t.ln_f)]
        self.post_norms = [_norm_args(b.ln_2) for b in t.h]
        # sink kind: the learned key/value per head, read by the kernel from these contiguous copies
        self.sinks = [
            (b.attn.sink_k.detach().contiguous(), b.attn.sink_v.detach().contiguous())
            if c.attn == "sink"
            else (None, None)
            for b in t.h
        ]

    def _calls(self, bind: bool) -> list[dict[str, Callable[[Tensor], Tensor]]]:
        """Per block, its linears by role: the modules themselves, or with ``bind`` each real layer's kept one-row
        kernel call (``paths.kept_decode_call``: its checks done now, once per generation, not once per token;
        the module where it keeps none — a float ``nn.Linear``, a layer on its torch path)."""
        from qbench.quant.kernels.paths import kept_decode_call

        def call(module: nn.Module) -> Callable[[Tensor], Tensor]:
            return (kept_decode_call(module) if bind else None) or module

        out = []
        for block in self.model.transformer.h:
            attn, mlp = block.attn, block.mlp
            roles = {"c_proj": attn.c_proj}
            for name in ("c_attn", "qkv_proj", "q_proj", "k_proj", "v_proj"):
                if name in attn._modules:
                    roles[name] = attn._modules[name]
            for name in ("c_fc", "gate_up_proj", "gate_proj", "up_proj", "down_proj"):
                if name in mlp._modules:
                    roles[name] = mlp._modules[name]
            roles["mlp_out"] = mlp.c_proj if mlp.kind == "gelu" else mlp.down_proj
            out.append({role: call(module) for role, module in roles.items()})
        return out

    def _qkv(self, calls: dict[str, Callable], h: Tensor) -> tuple[tuple[int, int, int], tuple[Tensor, ...]]:
        """Pointers to the new token's q, k, v, and the tensors that hold them (kept alive for the call)."""
        fused = calls.get("c_attn") or calls.get("qkv_proj")
        if fused is not None:
            qkv = fused(h)
            base = qkv.data_ptr()
            k = base + 4 * self.nh * self.hs
            return (base, k, k + 4 * self.nkv * self.hs), (qkv,)
        q, k, v = calls["q_proj"](h), calls["k_proj"](h), calls["v_proj"](h)
        return (q.data_ptr(), k.data_ptr(), v.data_ptr()), (q, k, v)

    @staticmethod
    def _mlp(calls: dict[str, Callable], h: Tensor) -> Tensor:
        if "c_fc" in calls:
            return calls["mlp_out"](F.gelu(calls["c_fc"](h)))
        if "gate_up_proj" in calls:
            gate, up = calls["gate_up_proj"](h).chunk(2, dim=-1)
            return calls["mlp_out"](F.silu(gate) * up)
        return calls["mlp_out"](F.silu(calls["gate_proj"](h)) * calls["up_proj"](h))

    def step(self, token: int, cache: KVCache, calls: list[dict[str, Callable]] | None = None) -> Tensor:
        """Logits (1, 1, V) of one new token at position ``cache.pos``, appended to ``cache`` (B = 1, filled by
        the model's prefill); ``calls``: :meth:`_calls`' linears (default: the modules)."""
        model, t, lib, pos = self.model, self.model.transformer, self.lib, cache.pos
        if pos + 1 > model.config.context:
            raise ValueError(f"sequence length {pos + 1} exceeds the model's context {model.config.context}")
        calls = calls or self._calls(bind=False)
        x = t.wte.weight[token].view(1, 1, self.d)
        if "emb_proj" in t:
            x = t.emb_proj(x)
        x = x + t.wpe.weight[pos] if "wpe" in t else x.clone()  # the residual stream, owned: updated in place
        h = torch.empty_like(x)
        cos = _ptr(model.rope_cos[pos]) if self.rope else None
        sin = _ptr(model.rope_sin[pos]) if self.rope else None
        threads = torch.get_num_threads()
        y = torch.empty(1, 1, self.nh * self.hs)
        lib.qk_decode_norm(x.data_ptr(), None, self.d, *self.norms[0], h.data_ptr())
        for i, layer in enumerate(calls):
            (q, k, v), _keep = self._qkv(layer, h)
            kc, vc = cache.buffers(i)
            sink_k, sink_v = self.sinks[i]
            lib.qk_decode_attention(
                q, k, v, self.nh, self.nkv, self.hs, kc.data_ptr(), vc.data_ptr(), kc.stride(1), pos, cos, sin,
                self.kind, _ptr(sink_k), _ptr(sink_v), self.scale, y.data_ptr(), threads,
            )  # fmt: skip
            o = layer["c_proj"](y)
            lib.qk_decode_norm(x.data_ptr(), o.data_ptr(), self.d, *self.post_norms[i], h.data_ptr())
            m = self._mlp(layer, h)
            lib.qk_decode_norm(x.data_ptr(), m.data_ptr(), self.d, *self.norms[i + 1], h.data_ptr())
        cache.pos += 1
        if "head_proj" in t:
            h = t.head_proj(h)
        return model.lm_head(h)

    @torch.inference_mode()
    def generate(self, prompt: Tensor, new_tokens: int) -> Tensor:
        """``new_tokens`` greedy tokens (1, new_tokens) after ``prompt`` (1, P): the prompt through the model's
        forward (its KV cache filled), every later token through :meth:`step`."""
        if prompt.dim() != 2 or prompt.size(0) != 1:
            raise ValueError(f"the decode runtime generates one sequence, got prompt {tuple(prompt.shape)}")
        cache = self.model.new_cache()
        logits = self.model(prompt, cache)
        out, calls = [], None
        for i in range(new_tokens):
            token = logits[:, -1:].argmax(-1)
            out.append(token)
            if i + 1 < new_tokens:
                logits = self.step(int(token), cache, calls)
                if calls is None:  # the first step ran each layer's forward, which kept its one-row call
                    calls = self._calls(bind=True)
        return torch.cat(out, dim=1)


def generator(
    model: nn.Module, prompt: Tensor, new_tokens: int, eager: str | None = None
) -> tuple[Callable[[], Tensor], str]:
    """A call making ``new_tokens`` greedy tokens after ``prompt``, and the engine of its decode steps: the runtime
    (built once, here) where it serves ``model`` and the prompt is one sequence, else ``model.generate`` with the
    reason — ``eager``, when given, is the caller's reason for the model's own step (the runtime's reference)."""
    reason = eager or (unsupported(model) if prompt.size(0) == 1 else "batch > 1")
    if reason is None:
        runtime = DecodeRuntime(model)
        return lambda: runtime.generate(prompt, new_tokens), ENGINE
    return lambda: model.generate(prompt, new_tokens), f"{EAGER}: {reason}"


def generate(model: nn.Module, prompt: Tensor, new_tokens: int) -> tuple[Tensor, str]:
    """Greedy tokens and the engine that made them (:func:`generator`, called once)."""
    call, engine = generator(model, prompt, new_tokens)
    return call(), engine
