"""Gemma 2 and Gemma 3: Llama's attention and gated MLP with Gemma's layer.

What differs from LlamaModel, all read from the arch: embeddings scaled by
sqrt(hidden); every RMSNorm multiplies by (1 + w), folded into w when the
weights load (the family's WeightMap adds 1), so the norms are Kiln's
RMSNorm and its kernel; "sandwich" norms (the attention output and the MLP
output are normed before their residual adds, and the MLP input has its own
norm); a GeGLU MLP (gelu_tanh); attention with query_pre_attn_scalar's
scale, sliding-window layers (alternating in Gemma 2, five of six in Gemma
3, whose window layers also rotate with their own rope base) and, in Gemma
2, soft-capped attention scores and final logits. Gemma 3 adds q/k norms.

Kernels: RMSNorm (and the fused add + norm), rotary, the paged decode
attention (with window and soft-cap), GeGLU and the linear kernels all take
Kiln's CPU kernels; decode-only steps run each layer in one call
(`kiln::decode_layer` with the sandwich norms, GeGLU, scale and soft-cap:
kiln/llm/models/fused_decode.py), bit-identical to this forward.
"""
from __future__ import annotations

import torch

from kiln.llm.attention.backend import AttentionBackend
from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.layers.norm import RMSNorm
from kiln.llm.models import fused_decode
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.llama import LlamaAttention, LlamaLayer, LlamaModel, Rope
from kiln.llm.models.mlp import LlamaMLP


class GemmaLayer(LlamaLayer):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, layer: int):
        super().__init__(arch, backend, LlamaAttention(arch, backend, layer), LlamaMLP(arch))
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        h, x = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(attn), x)
        return x + self.post_feedforward_layernorm(self.mlp(h))

    def decode_norms(self) -> fused_decode.LayerNorms | None:
        if type(self) is not GemmaLayer:
            return None
        return fused_decode.LayerNorms(
            self.input_layernorm.weight, self.pre_feedforward_layernorm.weight,
            attn_out=self.post_attention_layernorm.weight, mlp_out=self.post_feedforward_layernorm.weight,
        )


class GemmaModel(LlamaModel):
    def make_layer(self, layer: int, backend: AttentionBackend) -> GemmaLayer:
        return GemmaLayer(self.arch, backend, layer)
