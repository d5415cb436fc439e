"""Kiln's configuration: a tree of frozen dataclasses, validated once.

Unknown keys are an error (`EngineConfig.from_dict`), and every range check
lives here so the rest of the code may trust its config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
QUANTIZATIONS = (None, "int8", "int4")
QUANT_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # path to a HF dir or GGUF file; None = installed SmolLM2
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None = the model's own context length
    seed: int = 0
    quantization: str | None = None  # weight-only: None | "int8" (per channel) | "int4" (group-wise)
    quant_group_size: int = 32  # int4 group length along the input dimension
    # CUDA only: decode steps of up to cuda_graph_max_batch_size sequences
    # replay captured CUDA graphs (the batch padded to the next captured size).
    enable_cuda_graphs: bool = True
    cuda_graph_max_batch_size: int = 256

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}", param="quantization"
            )
        if self.quant_group_size not in QUANT_GROUP_SIZES:
            raise ConfigError(
                f"quant_group_size must be one of {QUANT_GROUP_SIZES}, got {self.quant_group_size!r}",
                param="quant_group_size",
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}", param="dtype")
        if self.device.split(":")[0] not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}", param="device")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be positive", param="max_model_len")
        if not 1 <= self.cuda_graph_max_batch_size <= 1024:
            raise ConfigError("cuda_graph_max_batch_size must be in [1, 1024]", param="cuda_graph_max_batch_size")


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gib: float = 1.0  # budget for the paged KV pool
    num_blocks: int | None = None  # overrides the memory budget (tests)
    enable_prefix_caching: bool = True
    # What the pool stores: "auto" = the model's dtype. A 16-bit pool halves
    # the bytes decode attention reads (keys and values are rounded once, when
    # written; attention still computes in the model's dtype). "fp8_e4m3"
    # (CUDA only) quarters an fp32 pool, with a per-tensor scale per layer.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
                param="kv_cache_dtype",
            )
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError("block_size must be a power of two up to 128", param="block_size")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError("kv_cache_memory_gib must be positive", param="kv_cache_memory_gib")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be positive", param="num_blocks")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 1024  # token budget per engine step
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be positive", param="max_num_batched_tokens")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be positive", param="max_num_seqs")


SPEC_METHODS = (None, "ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (off unless `spec_method` is set).

    Switch-off rule: drafts are proposed after a step only while at most
    `max_batch_for_speculation` requests are running; a larger batch decodes
    plainly (verification costs more than it saves once the step is
    compute-bound). The default, 8, keeps a verification step at most
    8 x (k + 1) = 40 rows for k = 4, where extra rows still cost little on
    CPU (measured: at 16 requests n-gram speculation lost 9-11 % throughput;
    docs/benchmarks.md). Per request,
    `SamplingParams.speculate=False` opts out.
    """

    spec_method: str | None = None  # None | "ngram" | "draft"
    num_speculative_tokens: int = 4  # k: drafts proposed per step and request
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    draft_model: str | None = None  # HF dir / GGUF sharing the target's vocabulary
    draft_num_layers: int = 1  # no draft_model: the target's first N layers + its LM head
    max_batch_for_speculation: int = 8

    def __post_init__(self) -> None:
        if self.spec_method not in SPEC_METHODS:
            raise ConfigError(
                f"spec_method must be one of {SPEC_METHODS}, got {self.spec_method!r}", param="spec_method"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in [1, 16]", param="num_speculative_tokens")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ConfigError("need 1 <= ngram_min_n <= ngram_max_n", param="ngram_min_n")
        if self.draft_num_layers < 1:
            raise ConfigError("draft_num_layers must be positive", param="draft_num_layers")
        if self.max_batch_for_speculation < 1:
            raise ConfigError("max_batch_for_speculation must be positive", param="max_batch_for_speculation")


WORKER_LAUNCHES = ("spawn", "env")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism (one process per rank; see docs/scaling.md).

    World size is `tensor_parallel_size * pipeline_parallel_size`; rank 0 is the
    driver (scheduler, sampler, and the first TP rank of the first stage).
    `worker_launch="spawn"` starts the other ranks on this machine (loopback);
    `"env"` joins ranks started elsewhere with the torchrun-style environment
    (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK; this process must be RANK 0).
    torch.distributed backend: gloo on CPU, NCCL (plus gloo for plans) on CUDA.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    worker_launch: str = "spawn"
    num_micro_batches: int | None = None  # per step with PP; None = pipeline_parallel_size
    dist_timeout_s: float = 300.0  # a collective that waits longer fails (backstop for hangs)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ConfigError(f"{name} must be an integer in [1, 64], got {value!r}", param=name)
        if self.worker_launch not in WORKER_LAUNCHES:
            raise ConfigError(
                f"worker_launch must be one of {WORKER_LAUNCHES}, got {self.worker_launch!r}", param="worker_launch"
            )
        if self.num_micro_batches is not None and not 1 <= self.num_micro_batches <= 256:
            raise ConfigError("num_micro_batches must be in [1, 256]", param="num_micro_batches")
        if not self.dist_timeout_s > 0:
            raise ConfigError("dist_timeout_s must be positive", param="dist_timeout_s")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.cache.kv_cache_dtype == "fp8_e4m3" and not self.model.device.startswith("cuda"):
            raise ConfigError(
                "kv_cache_dtype 'fp8_e4m3' needs --device cuda (Kiln's Triton attention kernels); "
                f"on {self.model.device!r} use float16, bfloat16 or float32",
                param="kv_cache_dtype",
            )
        if self.parallel.world_size > 1 and self.spec.spec_method is not None:
            raise ConfigError(
                "speculative decoding is not supported with tensor or pipeline parallelism yet; "
                "drop spec_method or use tensor_parallel_size=pipeline_parallel_size=1",
                param="spec_method",
            )
        # Weight-only quantization is a post-load transform of the single-process
        # model; the sharded build does not apply it yet, so refuse rather than
        # silently serve unquantized weights.
        if self.parallel.world_size > 1 and self.model.quantization is not None:
            raise ConfigError(
                "quantization is not supported with tensor or pipeline parallelism yet", param="quantization"
            )

    @classmethod
    def from_flat(cls, **options: Any) -> EngineConfig:
        """Build from flat keyword options (`dtype=..., block_size=...`).

        Each key must name a field of exactly one section; unknown keys raise.
        """
        sections = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "spec": SpecConfig,
            "parallel": ParallelConfig,
        }
        owners = {f.name: name for name, c in sections.items() for f in dataclasses.fields(c)}
        grouped: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in options.items():
            if key not in owners:
                raise ConfigError(f"unknown engine option {key!r}", param=key)
            grouped[owners[key]][key] = value
        return cls(**{name: sections[name](**kw) for name, kw in grouped.items()})
