"""Which part of the model each rank owns. Pure arithmetic, no torch.distributed.

Ranks are laid out stage-major: rank = pp_rank * tp_size + tp_rank, so rank 0
(the driver) is TP rank 0 of the first pipeline stage.

Tensor parallelism splits attention by KV-head groups: a rank keeps some KV
heads and every query head that reads them, so attention needs no
communication. Counts need not divide evenly (SmolLM2: 9 query heads, 3 KV
heads on 2 ranks -> 6+3 query heads). With fewer KV heads than ranks, each KV
head is replicated on `tp // kv` ranks, which split its query heads.
The MLP's intermediate dimension is split into near-equal ranges; the
vocabulary into equal padded shards (so gathered logits line up).
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError
from kiln.llm.kv_cache.manager import cdiv
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.registry import family_of


def balanced(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when n items are split into near-equal parts."""
    return n * index // parts, n * (index + 1) // parts


@dataclass(frozen=True)
class TensorSplit:
    """What TP rank `rank` of `size` holds of each layer and of the vocabulary."""

    arch: LlamaArch
    rank: int = 0
    size: int = 1

    @property
    def kv_heads(self) -> tuple[int, int]:
        kv = self.arch.num_kv_heads
        if kv >= self.size:
            return balanced(kv, self.size, self.rank)
        head = self.rank // (self.size // kv)
        return head, head + 1

    @property
    def q_heads(self) -> tuple[int, int]:
        a = self.arch
        group = a.num_heads // a.num_kv_heads
        first, last = self.kv_heads
        if a.num_kv_heads >= self.size:
            return first * group, last * group
        sharers = self.size // a.num_kv_heads
        lo, hi = balanced(group, sharers, self.rank % sharers)
        return first * group + lo, first * group + hi

    @property
    def num_heads(self) -> int:
        lo, hi = self.q_heads
        return hi - lo

    @property
    def num_kv_heads(self) -> int:
        lo, hi = self.kv_heads
        return hi - lo

    @property
    def intermediate(self) -> tuple[int, int]:
        return balanced(self.arch.intermediate_size, self.size, self.rank)

    @property
    def vocab_shard_size(self) -> int:
        return cdiv(self.arch.vocab_size, self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """Rows of the embedding this rank holds; the last shard may run past
        vocab_size (those rows are zero padding)."""
        n = self.vocab_shard_size
        return self.rank * n, (self.rank + 1) * n

    def q_rows(self) -> tuple[int, int]:
        lo, hi = self.q_heads
        return lo * self.arch.head_dim, hi * self.arch.head_dim

    def kv_rows(self) -> tuple[int, int]:
        lo, hi = self.kv_heads
        return lo * self.arch.head_dim, hi * self.arch.head_dim


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Contiguous layers [start, end) of a pipeline stage; earlier stages take
    the remainder (stage 0 also sizes the KV pool, so it holds the most)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def check_splittable(arch: LlamaArch, tp_size: int, pp_size: int) -> None:
    """ConfigError (at start-up) unless the model can be split this way."""
    if tp_size * pp_size > 1:
        check_family_shardable(arch)
    kv, heads = arch.num_kv_heads, arch.num_heads
    if heads % kv:
        raise ConfigError(f"num_heads {heads} is not a multiple of num_kv_heads {kv}", param="tensor_parallel_size")
    if kv < tp_size:
        if tp_size % kv:
            raise ConfigError(
                f"tensor_parallel_size {tp_size} must be a multiple of the model's {kv} KV heads "
                "when it exceeds them (KV heads are replicated)",
                param="tensor_parallel_size",
            )
        if heads // kv < tp_size // kv:
            raise ConfigError(
                f"tensor_parallel_size {tp_size} leaves some rank without a query head", param="tensor_parallel_size"
            )
    if arch.intermediate_size < tp_size:
        raise ConfigError("tensor_parallel_size exceeds the MLP width", param="tensor_parallel_size")
    if pp_size > arch.num_layers:
        raise ConfigError(
            f"pipeline_parallel_size {pp_size} exceeds the model's {arch.num_layers} layers",
            param="pipeline_parallel_size",
        )


def check_family_shardable(arch: LlamaArch) -> None:
    """Only Llama's layer is sharded (ShardedLlamaModel): other families, and
    Llama-named ones with options it lacks (a sliding window), are refused."""
    family = family_of(arch)
    if not (family.tensor_parallel and arch.is_plain_llama):
        extra = " with a sliding window" if arch.has_sliding_window else ""
        raise ConfigError(
            f"tensor/pipeline parallelism is not supported for the {family.name} family{extra}; "
            "run it with tensor_parallel_size=1 and pipeline_parallel_size=1",
            param="tensor_parallel_size",
        )
