"""Kiln's Llama-family model: RMSNorm, RoPE (Llama-3 scaling), GQA, SwiGLU.

Projections are fused at load time (q|k|v and gate|up), so a layer runs two
input matmuls instead of five. Weights arrive under Hugging Face names and
each module knows where its pieces go (`load_weights`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.llm.attention.backend import AttentionBackend, TorchPagedAttention
from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.kernels import ops
from kiln.llm.layers.linear import Linear, project
from kiln.llm.layers.norm import RMSNorm
from kiln.llm.layers.rotary import RotaryEmbedding
from kiln.llm.models import fused_decode
from kiln.llm.models.arch import LlamaArch


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class LlamaAttention(nn.Module):
    """Head counts and the output reduction are attributes, so a
    tensor-parallel subclass (kiln.llm.parallel.model) can hold a subset of
    the heads and sum its partial output across ranks."""

    def __init__(self, arch: LlamaArch, backend: AttentionBackend):
        super().__init__()
        self.arch = arch
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.qkv_proj = Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size)
        self.o_proj = Linear(arch.q_size, arch.hidden_size)
        self.backend = backend
        self.reduce = _no_reduce

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata):
        d = self.arch.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, d)
        k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        q, k = RotaryEmbedding.apply(q, k, *rope)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.reduce(self.o_proj(out.reshape(-1, q_size)))


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.inter = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size)
        self.reduce = _no_reduce

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        act = ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.inter, dim=-1)
            act = F.silu(gate) * up
        return self.reduce(self.down_proj(act))


class LlamaLayer(nn.Module):
    def __init__(self, arch, backend, self_attn: LlamaAttention | None = None, mlp: LlamaMLP | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn or LlamaAttention(arch, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp or LlamaMLP(arch)

    def forward(self, x, rope, kv_cache, meta):
        attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        h, x = self.post_attention_layernorm.add_forward(attn, x)
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, max_positions: int, backend: AttentionBackend | None = None):
        super().__init__()
        self.arch = arch
        backend = backend or TorchPagedAttention()
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.embed_tokens = _weight(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(arch, backend) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = self.embed_tokens if arch.tie_word_embeddings else _weight(arch.vocab_size, arch.hidden_size)
        # Set by weight-only quantization: a quantized copy of lm_head used for logits.
        self.logits_head: nn.Module | None = None
        # Set once the model is finished (engine builder): lm_head's oneDNN copy
        # for steps with many sampled rows (a 64-row decode: 35 vs 50 ms).
        self.lm_head_packed: torch.Tensor | None = None
        # Set once the model is finished (engine builder): decode-only steps in one kernel call per layer.
        self.fused_layers: list[fused_decode.FusedLayer] | None = None

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata):
        """Returns final hidden states [T, hidden] (normed)."""
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.tables(positions)
        if self.fused_layers is not None and fused_decode.applies(meta, x.shape[0], x.dtype):
            return self.norm(fused_decode.run(self, x, rope, kv_caches, meta))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=False):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        return project(hidden, self.lm_head, self.lm_head_packed).float()

    # ---- weights ----------------------------------------------------------
    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "") -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter
        must be covered, and no unexpected tensor may be left over."""
        expected = _expected_names(self.arch)
        missing = sorted(expected - weights.keys())
        if missing:
            raise ModelLoadError(f"{source}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        a = self.arch
        self._copy(self.embed_tokens, weights["model.embed_tokens.weight"], "model.embed_tokens.weight", source)
        if not a.tie_word_embeddings:
            self._copy(self.lm_head, weights["lm_head.weight"], "lm_head.weight", source)
        self._copy(self.norm.weight, weights["model.norm.weight"], "model.norm.weight", source)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = [weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            self._copy(layer.self_attn.qkv_proj.weight, torch.cat(attn), p + "self_attn.qkv", source)
            self._copy(layer.self_attn.o_proj.weight, weights[p + "self_attn.o_proj.weight"], p + "o_proj", source)
            gate_up = torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
            self._copy(layer.mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up", source)
            self._copy(layer.mlp.down_proj.weight, weights[p + "mlp.down_proj.weight"], p + "mlp.down_proj", source)
            input_norm = weights[p + "input_layernorm.weight"]
            self._copy(layer.input_layernorm.weight, input_norm, p + "input_layernorm", source)
            self._copy(
                layer.post_attention_layernorm.weight,
                weights[p + "post_attention_layernorm.weight"],
                p + "post_attention_layernorm",
                source,
            )

    @staticmethod
    def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, source: str) -> None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{source}: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(tensor)


def _expected_names(arch: LlamaArch) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not arch.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
    ]
    for i in range(arch.num_layers):
        names.update(f"model.layers.{i}.{n}.weight" for n in per_layer)
    return names
