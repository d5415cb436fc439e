"""One rank's part of a Llama model: a pipeline stage's layers, each holding
only this TP rank's heads and MLP columns.

Built at shard size (never the full model first) and loaded slice by slice
from a WeightReader. The first stage owns the embedding; the last stage owns
the final norm and the LM head. `forward` takes token ids on the first stage
and the previous stage's hidden states elsewhere.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from kiln.llm.attention.backend import AttentionBackend, TorchPagedAttention
from kiln.llm.attention.metadata import AttentionMetadata
from kiln.llm.attention.selector import install_attention_backend
from kiln.llm.layers.linear import pack_for_prefill
from kiln.llm.layers.norm import RMSNorm
from kiln.llm.layers.rotary import RotaryEmbedding
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.llama import LlamaAttention, LlamaLayer
from kiln.llm.models.mlp import LlamaMLP
from kiln.llm.parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from kiln.llm.parallel.layout import TensorSplit, stage_layers
from kiln.llm.parallel.state import ParallelState
from kiln.llm.parallel.weights import WeightReader


class ShardedAttention(LlamaAttention):
    qkv_proj: ColumnParallelLinear  # sharded before load; quantization does not apply with TP
    o_proj: RowParallelLinear

    def __init__(self, arch: LlamaArch, backend: AttentionBackend, split: TensorSplit, state: ParallelState):
        nn.Module.__init__(self)
        self.arch, self.backend = arch, backend
        self.qkv_bias = self.q_norm = self.k_norm = None  # only Llama's layer is sharded (check_family_shardable)
        self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads
        kv = split.kv_rows()
        self.qkv_proj = ColumnParallelLinear(arch.hidden_size, [split.q_rows(), kv, kv])
        self.o_proj = RowParallelLinear(split.q_rows(), arch.hidden_size)
        self.reduce = state.all_reduce

    def load(self, reader: WeightReader, prefix: str) -> None:
        self.qkv_proj.load(reader, [f"{prefix}self_attn.{n}_proj.weight" for n in "qkv"])
        self.o_proj.load(reader, f"{prefix}self_attn.o_proj.weight")


class ShardedMLP(LlamaMLP):
    gate_up_proj: ColumnParallelLinear
    down_proj: RowParallelLinear

    def __init__(self, arch: LlamaArch, split: TensorSplit, state: ParallelState):
        nn.Module.__init__(self)
        cols = split.intermediate
        self.inter = cols[1] - cols[0]
        self.gate_up_proj = ColumnParallelLinear(arch.hidden_size, [cols, cols])
        self.down_proj = RowParallelLinear(cols, arch.hidden_size)
        self.reduce = state.all_reduce

    def load(self, reader: WeightReader, prefix: str) -> None:
        self.gate_up_proj.load(reader, [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"])
        self.down_proj.load(reader, f"{prefix}mlp.down_proj.weight")


class ShardedLayer(LlamaLayer):
    """A decoder layer holding this rank's heads and MLP columns."""

    self_attn: ShardedAttention
    mlp: ShardedMLP

    def __init__(self, arch: LlamaArch, backend: AttentionBackend, split: TensorSplit, state: ParallelState):
        super().__init__(arch, backend, ShardedAttention(arch, backend, split, state), ShardedMLP(arch, split, state))

    def load(self, reader: WeightReader, prefix: str) -> None:
        self.self_attn.load(reader, prefix)
        self.mlp.load(reader, prefix)
        self.input_layernorm.weight.data.copy_(reader.read(prefix + "input_layernorm.weight"))
        self.post_attention_layernorm.weight.data.copy_(reader.read(prefix + "post_attention_layernorm.weight"))


class ShardedLlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, max_positions: int, state: ParallelState):
        super().__init__()
        self.arch, self.state = arch, state
        split = TensorSplit(arch, state.tp_rank, state.tp_size)
        self.split = split
        self.first_layer, last = stage_layers(arch.num_layers, state.pp_size, state.pp_rank)
        backend = TorchPagedAttention()
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        h, v = arch.hidden_size, arch.vocab_size
        self.embed = VocabParallelEmbedding(split.vocab, v, h, state) if state.is_first_stage else None
        self.layers = nn.ModuleList(ShardedLayer(arch, backend, split, state) for _ in range(self.first_layer, last))
        # The last stage's: the final norm and this rank's LM head rows.
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if state.is_last_stage:
            self.norm = RMSNorm(h, arch.rms_norm_eps)
            tied = self.embed if (arch.tie_word_embeddings and self.embed is not None) else None
            self.lm_head = ParallelLMHead(split.vocab, v, h, tied_to=tied)

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.parameters()).dtype

    def finish(
        self, device: torch.device, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None
    ) -> ShardedLlamaModel:
        """The loaded shard on `device` in `dtype` with the attention backend for
        the device and KV pool dtype, fp32 CPU projections packed for prefill."""
        self.to(device=device, dtype=dtype).eval()
        install_attention_backend(self, device, kv_cache_dtype or dtype)
        pack_for_prefill(self)
        return self

    @property
    def decoder_layers(self) -> list[ShardedLayer]:
        """`layers`, typed (an nn.ModuleList yields plain Modules)."""
        return cast("list[ShardedLayer]", list(self.layers))

    def load_weights(self, reader: WeightReader) -> None:
        a = self.arch
        if self.embed is not None:
            self.embed.load(reader, "model.embed_tokens.weight")
        for offset, layer in enumerate(self.decoder_layers):
            layer.load(reader, f"model.layers.{self.first_layer + offset}.")
        if self.norm is not None and self.lm_head is not None:
            self.norm.weight.data.copy_(reader.read("model.norm.weight"))
            name = "model.embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"
            self.lm_head.load(reader, name)


    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: token ids [T] on the first stage, hidden states [T, H] elsewhere.
        Returns hidden states [T, H] (normed on the last stage)."""
        if self.embed is not None:
            x = self.embed(x)
        rope = self.rotary.tables(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=False):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x) if self.norm is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns, float32 [rows, V / tp] (last stage only)."""
        if self.lm_head is None:
            raise RuntimeError(f"pipeline stage {self.state.pp_rank} holds no LM head")
        return self.lm_head(hidden)


def resident_weight_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind a module's parameters
    (a tied weight counts once; a view counts its whole storage)."""
    seen: dict[int, int] = {}
    for t in module.parameters():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def gather_weight_bytes(module: nn.Module) -> list[int]:
    """All ranks call this together; every rank gets every rank's resident weight bytes."""
    mine = torch.tensor([resident_weight_bytes(module)], dtype=torch.int64)
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(t.item()) for t in everyone]
