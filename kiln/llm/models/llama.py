"""Kiln's Llama-family model: RMSNorm, RoPE (Llama-3 scaling), GQA, SwiGLU.

Projections are fused at load time (q|k|v and gate|up), so a layer runs two
input matmuls instead of five. Weights arrive under Hugging Face names and
each module knows where its pieces go (`load_weights`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.llm.attention.backend import AttentionBackend, TorchPagedAttention
from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.attention.selector import install_attention_backend
from kiln.llm.kernels import ops
from kiln.llm.kernels.ops import pack_linear_weight
from kiln.llm.layers.linear import Linear, pack_for_prefill, project
from kiln.llm.layers.norm import RMSNorm
from kiln.llm.layers.rotary import RotaryEmbedding
from kiln.llm.models import fused_decode
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.checkpoint import check_none_missing
from kiln.llm.quant.apply import HEAD_METHOD, quantize_linears, quantize_weight


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
        # A Linear until LlamaModel.finish may swap in a quantized module.
        self.qkv_proj: nn.Module = Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size)
        self.o_proj: nn.Module = Linear(arch.q_size, arch.hidden_size)
        self.backend = backend
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _no_reduce

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        d = self.arch.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, d)
        k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        q, k = RotaryEmbedding.rotate(q, k, *rope)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.reduce(self.o_proj(out.reshape(-1, q_size)))


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.inter = arch.intermediate_size
        self.gate_up_proj: nn.Module = Linear(arch.hidden_size, 2 * arch.intermediate_size)
        self.down_proj: nn.Module = Linear(arch.intermediate_size, arch.hidden_size)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _no_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.inter, dim=-1)
            act = F.silu(gate) * up
        return self.reduce(self.down_proj(act))


class LlamaLayer(nn.Module):
    def __init__(
        self, arch: LlamaArch, backend: AttentionBackend, self_attn: LlamaAttention | None = None,
        mlp: LlamaMLP | None = None,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn or LlamaAttention(arch, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp or LlamaMLP(arch)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
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
        # Set by `finish` (and `quantize_head`), never from outside:
        # a quantized copy of lm_head that computes the logits instead of it,
        self.logits_head: nn.Module | None = None
        # lm_head's oneDNN copy for steps with many sampled rows (see docs/benchmarks.md
        # (Where a 64-row decode step goes; 16-bit KV pool, huge pages, LM head)),
        self.lm_head_packed: torch.Tensor | None = None
        # each layer's tensors for decode-only steps in one kernel call per layer.
        self.fused_layers: list[fused_decode.FusedLayer] | None = None

    def finish(
        self, device: torch.device, dtype: torch.dtype, quantization: str | None = None, group_size: int = 32,
        head_quantization: str | None = HEAD_METHOD, kv_cache_dtype: torch.dtype | None = None,
    ) -> LlamaModel:
        """Make the loaded float32 model ready to serve, in place (returns self):
        moved to `device`; the attention backend chosen for the device and the
        KV pool's dtype (default: `dtype`); its Linears quantized with
        `quantization` and the LM head given a `head_quantization` copy (None:
        none, or a float head); cast to `dtype`; fp32 CPU projections packed for
        prefill; decode layers fused. Quantization precedes the cast, so codes
        come from the float32 weights."""
        self.to(device=device)
        install_attention_backend(self, device, kv_cache_dtype or dtype)
        if quantization is not None:
            quantize_linears(self, quantization, group_size)
            if head_quantization is not None:
                self.quantize_head(head_quantization, group_size)
        self.to(dtype=dtype).eval()
        pack_for_prefill(self)
        if self.logits_head is None:
            self.lm_head_packed = pack_linear_weight(self.lm_head)
        self.fused_layers = self.gather_fused_layers()
        return self

    def quantize_head(self, method: str | None, group_size: int = 32) -> None:
        """Compute logits through a `method`-quantized copy of the LM head (kept
        float if the kernel does not take its shape), or with None through the
        float head again (tied, or never quantized). The embedding table stays
        float for the token lookup; an untied float head is released."""
        if method is None:
            if self.lm_head.numel() == 0:
                raise ValueError("the untied float LM head was released when it was quantized")
            self.logits_head = None
            self.lm_head_packed = pack_linear_weight(self.lm_head)
            return
        head = quantize_weight(self.lm_head.detach(), method, group_size)
        if head is None:
            return
        self.logits_head = head
        self.lm_head_packed = None
        if self.lm_head is not self.embed_tokens:
            self.lm_head = nn.Parameter(torch.empty(0, device=self.lm_head.device), requires_grad=False)

    @property
    def decoder_layers(self) -> list[LlamaLayer]:
        """`layers`, typed (an nn.ModuleList yields plain Modules)."""
        return cast("list[LlamaLayer]", list(self.layers))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Returns final hidden states [T, hidden] (normed)."""
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.tables(positions)
        if self.fused_layers is not None and fused_decode.applies(meta, x.shape[0], x.dtype):
            return self.norm(fused_decode.run(self.fused_layers, self.arch, x, rope, kv_caches, meta))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=False):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    def gather_fused_layers(self) -> list[fused_decode.FusedLayer] | None:
        """Each layer's tensors for kiln::decode_layer, or None where it does not
        apply (see fused_decode). Call on the finished model: the lists alias
        the current weights."""
        if not fused_decode.supported(self.arch, self.embed_tokens):
            return None
        layers = []
        for layer in self.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            plain = (
                type(layer) is LlamaLayer and type(attn) is LlamaAttention and type(mlp) is LlamaMLP
                and type(attn.backend) is TorchPagedAttention
            )
            if not plain:
                return None
            fused = fused_decode.fused_layer(
                attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj,
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            )
            if fused is None:
                return None
            layers.append(fused)
        return layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        return project(hidden, self.lm_head, self.lm_head_packed).float()

    # ---- weights ----------------------------------------------------------
    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "") -> None:
        """Copy HF-named tensors into the (fused) parameters. Every parameter
        must be covered; other tensors are not read (a truncated draft model
        takes the first layers of a whole checkpoint)."""
        check_none_missing(self.arch, weights.keys(), source)
        a = self.arch
        self._copy(self.embed_tokens, weights["model.embed_tokens.weight"], "model.embed_tokens.weight", source)
        if not a.tie_word_embeddings:
            self._copy(self.lm_head, weights["lm_head.weight"], "lm_head.weight", source)
        self._copy(self.norm.weight, weights["model.norm.weight"], "model.norm.weight", source)
        for i, layer in enumerate(self.decoder_layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            self._copy(_float_weight(attn.qkv_proj), qkv, p + "self_attn.qkv", source)
            self._copy(_float_weight(attn.o_proj), weights[p + "self_attn.o_proj.weight"], p + "o_proj", source)
            gate_up = torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
            self._copy(_float_weight(mlp.gate_up_proj), gate_up, p + "mlp.gate_up", source)
            self._copy(_float_weight(mlp.down_proj), weights[p + "mlp.down_proj.weight"], p + "mlp.down_proj", source)
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


def _float_weight(projection: nn.Module) -> torch.Tensor:
    """The weight of a float projection: weights load before quantization."""
    if not isinstance(projection, Linear):
        raise ModelLoadError(f"cannot load weights into a {type(projection).__name__}: load before finish()")
    return projection.weight
