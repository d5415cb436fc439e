"""Kiln's decoder model: Llama (RMSNorm, RoPE, GQA, SwiGLU) and the families
that are Llama with options read from their `ModelArch`: q/k/v biases
(Qwen2), q/k norms (Qwen3), sliding windows (Mistral, Phi-3), partial rotary
and LongRoPE (Phi-3/4), mixture-of-experts MLPs (Mixtral, Qwen3-MoE; see
moe.py). Gemma's layer differs more and subclasses this (gemma.py).

Projections are fused at load time (q|k|v and gate|up), so a layer runs two
input matmuls instead of five. Weights arrive under the checkpoint's names
and the family's `WeightMap` says where each goes (`load_weights`).
Projections a pre-quantized checkpoint stores quantized arrive as such and
are installed as quantized modules (kiln.llm.quant.formats.stored).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.llm.attention.backend import AttentionBackend, TorchPagedAttention
from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.attention.options import AttentionOptions
from kiln.llm.attention.selector import install_attention_backend
from kiln.llm.kernels.ops import copy_for_many_rows
from kiln.llm.layers.linear import Linear, pack_for_prefill, project
from kiln.llm.layers.norm import RMSNorm
from kiln.llm.layers.rotary import RotaryEmbedding
from kiln.llm.models import fused_decode
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.families.common import llama_weight_map
from kiln.llm.models.mlp import LlamaMLP, no_reduce
from kiln.llm.models.moe import SparseMoeBlock
from kiln.llm.models.weight_arena import gather_weights
from kiln.llm.models.weight_map import WeightMap
from kiln.llm.quant.apply import HEAD_METHOD, quantize_linears, quantize_weight
from kiln.llm.quant.formats.stored import QuantizedWeight, StoredWeights, settle_prequantized
from kiln.llm.quant.int4_lanes import lay_out_lanes
from kiln.llm.quant.q8_0_head import Q8_0Weight

log = logging.getLogger(__name__)

Rope = tuple[torch.Tensor, torch.Tensor]


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def attention_options(arch: ModelArch, layer: int) -> AttentionOptions:
    scale = arch.query_scale
    if scale is not None and scale == arch.head_dim**-0.5:
        scale = None
    return AttentionOptions(scale, arch.window(layer), arch.attn_logit_softcap)


def layer_backend(backend: AttentionBackend, options: AttentionOptions) -> AttentionBackend:
    """`backend` for a plain layer; the torch reference with `options` for one
    that needs them (`install_attention_backend` later picks the device's)."""
    return backend if options == backend.options else TorchPagedAttention(options)


class LlamaAttention(nn.Module):
    """Head counts and the output reduction are attributes, so a
    tensor-parallel subclass (kiln.llm.parallel.model) can hold a subset of
    the heads and sum its partial output across ranks."""

    qkv_bias: nn.Parameter | None  # absent (None) unless the family has them
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    uses_local_rope = False  # rotated with the model's local (sliding-window) rope table

    def __init__(self, arch: ModelArch, backend: AttentionBackend, layer: int = 0):
        super().__init__()
        self.arch = arch
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        # A Linear until LlamaModel.finish may swap in a quantized module.
        self.qkv_proj: nn.Module = Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size)
        self.qkv_bias = _weight(arch.q_size + 2 * arch.kv_size) if arch.attention_bias else None
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.o_proj: nn.Module = Linear(arch.q_size, arch.hidden_size)
        self.uses_local_rope = arch.local_rope_theta is not None and arch.window(layer) > 0
        self.backend = layer_backend(backend, attention_options(arch, layer))
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = no_reduce

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d = self.arch.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, d)
        k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, d)).view(-1, self.num_heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(-1, self.num_kv_heads, d)
        q, k = RotaryEmbedding.rotate(q, k, *rope)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.reduce(self.o_proj(out.reshape(-1, q_size)))


class LlamaLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, backend: AttentionBackend, self_attn: LlamaAttention | None = None,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn or LlamaAttention(arch, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp or LlamaMLP(arch)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        h, x = self.post_attention_layernorm.add_forward(attn, x)
        return x + self.mlp(h)

    def decode_norms(self) -> fused_decode.LayerNorms | None:
        """This layer's norms as kiln::decode_layer applies them, or None if its
        forward is not the one the kernel computes (a subclass's own)."""
        if type(self) is not LlamaLayer:
            return None
        return fused_decode.LayerNorms(self.input_layernorm.weight, self.post_attention_layernorm.weight)


class LlamaModel(nn.Module):
    def __init__(
        self, arch: ModelArch, max_positions: int, backend: AttentionBackend | None = None,
        weight_map: WeightMap | None = None,
    ):
        """`weight_map`: the family's checkpoint naming (the registry passes it); Llama's by default."""
        super().__init__()
        self.arch = arch
        self._weight_map = weight_map or llama_weight_map(arch)
        backend = backend or TorchPagedAttention()
        rotary_dim = arch.rotary_dim or arch.head_dim
        self.rotary = RotaryEmbedding(rotary_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        # Gemma 3's sliding-window layers rotate with their own base, unscaled.
        self.local_rotary = (
            None if arch.local_rope_theta is None
            else RotaryEmbedding(rotary_dim, max_positions, arch.local_rope_theta, None)
        )
        self.embed_tokens = _weight(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(i, backend) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = self.embed_tokens if arch.tie_word_embeddings else _weight(arch.vocab_size, arch.hidden_size)
        # Set by `finish` (and `quantize_head`), never from outside:
        # a quantized copy of lm_head that computes the logits instead of it,
        self.logits_head: nn.Module | None = None
        # lm_head's oneDNN copy for steps with many sampled rows (see docs/benchmarks.md
        # (Where a 64-row decode step goes; 16-bit KV pool, huge pages, LM head)); the
        # float head stays too: the embedding lookup (tied) and steps of few rows read it,
        self.lm_head_packed: torch.Tensor | None = None
        # each layer's tensors for decode-only steps in one kernel call per layer.
        self.fused_layers: fused_decode.FusedLayers | None = None

    def make_layer(self, layer: int, backend: AttentionBackend) -> nn.Module:
        """Decoder layer `layer` (a subclass's family may build its own)."""
        arch = self.arch
        mlp = SparseMoeBlock(arch) if arch.is_moe_layer(layer) else LlamaMLP(arch)
        return LlamaLayer(arch, backend, LlamaAttention(arch, backend, layer), mlp)

    def finish(
        self, device: torch.device, dtype: torch.dtype, quantization: str | None = None, group_size: int = 32,
        head_quantization: str | None = HEAD_METHOD, kv_cache_dtype: torch.dtype | None = None,
        stored_head: Q8_0Weight | None = None,
    ) -> LlamaModel:
        """Make the loaded model ready to serve, in place (returns self):
        moved to `device`; the attention backend chosen for the device and the
        KV pool's dtype (default: `dtype`); projections quantized as
        `quantization` says; cast to `dtype`; a bf16 model's int4 projections in
        lane layout where the CPU has bf16 dot products; fp32 CPU projections
        packed for prefill; on CPU the weights moved into one allocation
        (weight_arena); decode layers fused.

        `quantization`: None keeps the projections a pre-quantized checkpoint
        stored quantized (load_weights installed them) and the rest float;
        "int4" also quantizes the float ones; "int8" quantizes every one
        (stored int4 dequantized first); "float" dequantizes every one. With
        "int8"/"int4" the LM head gets a `head_quantization` copy (None: none);
        with None, a head the checkpoint stored as Q8_0 (`stored_head`) computes
        the logits from its blocks (fp32 CPU models: bit-identical to the float head).
        Quantization precedes the cast, so codes come from the float32 weights."""
        settle_prequantized(self, device, keep=quantization in (None, "int4"))
        self.to(device=device)
        install_attention_backend(self, device, kv_cache_dtype or dtype)
        if quantization in ("int8", "int4"):
            quantize_linears(self, quantization, group_size)
            if head_quantization is not None:
                self.quantize_head(head_quantization, group_size)
        self.to(dtype=dtype).eval()
        lay_out_lanes(self, dtype)
        pack_for_prefill(self)
        if self.logits_head is None:
            head = stored_head.head(self.lm_head) if quantization is None and stored_head is not None else None
            if head is None or not head.takes_every_row:
                self.lm_head_packed = copy_for_many_rows(self.lm_head)
            if head is not None:
                head.packed = self.lm_head_packed
                self.logits_head = head
        if device.type == "cpu":
            gather_weights(self)
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
            self.lm_head_packed = copy_for_many_rows(self.lm_head)
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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        if self.arch.embed_scale is not None:  # rounded to the model's dtype first, as transformers does
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        return x

    def layer_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope, Rope]:
        """(embedded rows, rope tables, local rope tables) for the first layer."""
        rope = self.rotary.tables(positions)
        local = self.local_rotary.tables(positions) if self.local_rotary is not None else rope
        return self.embed(input_ids), rope, local

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Returns final hidden states [T, hidden] (normed)."""
        fused = self.fused_layers
        if fused is not None and fused_decode.applies(meta, input_ids.shape[0], fused.max_rows):
            if fused.whole_steps:
                return fused_decode.step(fused, input_ids, positions, kv_caches, meta)
            x, rope, local = self.layer_inputs(input_ids, positions)
            return self.norm(fused_decode.run(fused, self.arch, x, rope, kv_caches, meta, local))
        x, rope, local = self.layer_inputs(input_ids, positions)
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=False):
            x = layer(x, local if layer.self_attn.uses_local_rope else rope, kv_cache, meta)
        return self.norm(x)

    def gather_fused_layers(self) -> fused_decode.FusedLayers | None:
        """Each layer's tensors for kiln::decode_layer (a MoE layer: kiln::decode_attention
        and its MoE block), or None where it does not apply (see fused_decode).
        Call on the finished model: the lists alias the current weights."""
        if not fused_decode.supported(self.arch, self.embed_tokens):
            return None
        layers = []
        for layer in self.decoder_layers:
            attn, mlp, norms = layer.self_attn, layer.mlp, layer.decode_norms()
            if norms is None or not (type(attn) is LlamaAttention and type(attn.backend) is TorchPagedAttention):
                return None
            # A dense MLP's projections go to the kernel; a MoE block's experts to kiln::moe_experts.
            part = fused_decode.dense_mlp(mlp) or (mlp if type(mlp) is SparseMoeBlock else None)
            if part is None:
                return None
            fused = fused_decode.fused_layer(attn.qkv_proj, attn.o_proj, part, norms)
            if fused is None:
                return None
            q_norm = None if attn.q_norm is None else attn.q_norm.weight
            k_norm = None if attn.k_norm is None else attn.k_norm.weight
            gelu = getattr(mlp, "hidden_act", "silu") == "gelu_tanh"
            extended = fused_decode.with_extras(
                fused, attn.qkv_bias, q_norm, k_norm, attn.backend.options, gelu, attn.uses_local_rope
            )
            if extended is None:
                return None
            layers.append(extended)
        return fused_decode.FusedLayers(layers, self.arch, self.step_ends())

    def step_ends(self) -> fused_decode.StepEnds:
        """What forward computes around the layers, for fused_decode.step (aliases, not copies)."""
        local = self.local_rotary
        return fused_decode.StepEnds(
            self.embed_tokens, self.arch.embed_scale, self.norm.weight, self.norm.eps,
            (self.rotary.cos, self.rotary.sin), None if local is None else (local.cos, local.sin),
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of `hidden`'s rows."""
        return self.head_logits(hidden).float()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits in the head's own dtype (a bf16 model's: bf16; soft-capped ones
        float32), for the sampler, which widens only what it processes: a greedy
        argmax picks the same token from bf16 values as from their exact float32
        copy, and widening a batch's [rows, vocab] logits cost ~5 ms of a 64-row
        bf16 decode step on Zen 4 (page faults of a fresh 12 MB tensor each step)."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden)
        else:
            logits = project(hidden, self.lm_head, self.lm_head_packed)
        cap = self.arch.final_logit_softcap
        return logits if cap is None else torch.tanh(logits.float() / cap) * cap

    # ---- weights ----------------------------------------------------------
    def weight_map(self) -> WeightMap:
        """Where each parameter comes from in this model's checkpoints (its family's naming)."""
        return self._weight_map

    def load_weights(
        self, weights: dict[str, torch.Tensor], source: str = "",
        quantized: Mapping[str, QuantizedWeight] | None = None,
    ) -> None:
        """Copy checkpoint tensors into the (fused) parameters, as the family's
        WeightMap says; a projection whose pieces are all in `quantized` (a
        pre-quantized checkpoint's) gets the fused quantized module instead.
        Every parameter must be covered; other tensors are not read (a
        truncated draft model takes the first layers of a whole checkpoint)."""
        stored = StoredWeights(weights, quantized)
        plan = self.weight_map()
        missing = sorted(set(plan.checkpoint_shapes()) - stored.names())
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"{source}: missing weights {', '.join(missing[:5])}{more}")
        params = dict(self.named_parameters())
        unmapped = sorted(params.keys() - plan.keys())
        if unmapped:
            raise ModelLoadError(f"{source}: no checkpoint tensor maps to {', '.join(unmapped[:5])}")
        for name, src in plan.items():
            if self._load_prequantized(stored, name, src.names, src.offset, source):
                continue
            tensors = [stored.float(n) for n in src.names]
            tensor = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            if src.offset:
                tensor = tensor.float() + src.offset
            self._copy(_float_param(params, name), tensor, name, source)

    def _load_prequantized(
        self, stored: StoredWeights, param: str, names: tuple[str, ...], offset: float, source: str
    ) -> bool:
        """Load `param` from quantized checkpoint tensors if any of `names` is
        one and `param` is a projection's weight; False leaves it to the float copy."""
        if not param.endswith(".weight") or offset or not any(n in stored.quantized for n in names):
            return False
        owner_name = param.removesuffix(".weight")
        parent_name, _, attr = owner_name.rpartition(".")
        parent = self.get_submodule(parent_name) if parent_name else self
        if not isinstance(getattr(parent, attr, None), Linear):
            log.info("%s: %s is stored quantized but is not a projection here: dequantized to float",
                     source, owner_name)
            return False
        self._load_projection(parent, attr, stored.projection(names), param, source)
        return True

    @classmethod
    def _load_projection(
        cls, parent: nn.Module, attr: str, weight: torch.Tensor | QuantizedWeight, name: str, source: str
    ) -> None:
        target = _float_weight(getattr(parent, attr))
        if isinstance(weight, torch.Tensor):
            cls._copy(target, weight, name, source)
            return
        if tuple(weight.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{source}: weight {name} has shape {tuple(weight.shape)}, expected {tuple(target.shape)}"
            )
        setattr(parent, attr, weight.module())  # the float Linear (and its memory) goes

    @staticmethod
    def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, source: str) -> None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{source}: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(tensor)


def _float_param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
    """A float parameter of the model: weights load before quantization."""
    if name not in params:
        raise ModelLoadError(f"cannot load weight {name}: not a float parameter (load before finish())")
    return params[name]


def _float_weight(projection: nn.Module) -> torch.Tensor:
    """The weight of a float projection: weights load before quantization."""
    if not isinstance(projection, Linear):
        raise ModelLoadError(f"cannot load weights into a {type(projection).__name__}: load before finish()")
    return projection.weight
