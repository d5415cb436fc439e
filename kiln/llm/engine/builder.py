"""Builds an engine core from config: weights -> model -> KV pool -> core."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from kiln.config import EngineConfig
from kiln.errors import ConfigError
from kiln.llm.device import require_device
from kiln.llm.engine.activation_profile import measure_activation_peak
from kiln.llm.engine.core import EngineCore
from kiln.llm.engine.heap import trim_heap
from kiln.llm.engine.kv_sizing import (
    MemoryReader,
    available_memory_bytes,
    blocks_for,
    check_pool_fits,
    kv_pool_bytes,
)
from kiln.llm.engine.loop import memory_bytes
from kiln.llm.engine.progress import Progress
from kiln.llm.models import registry
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.models.default_model import resolve_model_path
from kiln.llm.models.dtype_choice import DtypeChoice, checkpoint_dtype, choose_dtype, choose_kv_dtype
from kiln.llm.models.llama import LlamaModel
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.parallel.executor import ParallelRunner
from kiln.llm.parallel.layout import check_splittable
from kiln.llm.parallel.shard_builder import kv_bytes_per_block_per_rank
from kiln.llm.parallel.weights import DictReader, open_weights
from kiln.llm.quant.int4_lanes import keep_prefill_copies
from kiln.llm.quant.int8_activations import use_int8_activations
from kiln.llm.quant.q8_0_head import Q8_0Weight
from kiln.llm.runner.cuda_graphs import build_cuda_graphs
from kiln.llm.runner.model_runner import DTYPES, ModelRunner, kv_bytes_per_block, kv_dtype
from kiln.llm.spec_decode.draft_model import DraftModelProposer, truncated_model
from kiln.llm.spec_decode.ngram import NgramProposer
from kiln.llm.spec_decode.proposer import Proposer
from kiln.llm.structured.backend import GrammarBackend
from kiln.llm.structured.matchers import StructuredOutputs

log = logging.getLogger(__name__)


def build_model(checkpoint: Checkpoint, config: EngineConfig, max_model_len: int) -> LlamaModel:
    model = registry.build_model(checkpoint.arch, max_model_len)
    model.load_weights(checkpoint.weights, checkpoint.source, checkpoint.quantized)
    return finish_model(model, config, checkpoint.stored_head)


def finish_model(model: LlamaModel, config: EngineConfig, stored_head: Q8_0Weight | None = None) -> LlamaModel:
    """A loaded model, finished as the config asks (LlamaModel.finish); a dtype
    left "auto" is decided here (build_engine_core decides and logs it first)."""
    device = require_device(config.model.device)
    if config.model.dtype == "auto":
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, dtype=dtype_for(config, None).dtype))
    m = config.model
    model.finish(device, DTYPES[m.dtype], m.quantization, m.quant_group_size, kv_cache_dtype=kv_dtype(config),
                 stored_head=stored_head)
    if keep_prefill_copies(model, m.int4_prefill_weights, available_memory_bytes(device)):
        # Gathered again: a copy in lane layout is one of the fused decode layer's tensors.
        model.fused_layers = model.gather_fused_layers()
    if m.int4_activations == "int8":
        switched = use_int8_activations(model)
        # Gathered again: the fused decode layer's int4 projections now take int8 activations too.
        model.fused_layers = model.gather_fused_layers()
        log.info("int4 activations int8: %d int4 projections and Q8_0 heads switched", switched)
    return model


def dtype_for(config: EngineConfig, stored: torch.dtype | None) -> DtypeChoice:
    """The model dtype `config` asks for, `auto` decided: float32 whatever the
    CPU under `--int4-activations int8` (linear_w4a8 takes fp32 activations;
    EngineConfig refuses the option with an explicit 16-bit dtype), else
    choose_dtype's choice."""
    if config.model.dtype == "auto" and config.model.int4_activations == "int8":
        return DtypeChoice("float32", "auto with --int4-activations int8: linear_w4a8 takes float32 activations")
    return choose_dtype(config.model.dtype, config.model.device, stored)


def resolve_dtype(config: EngineConfig, stored: torch.dtype | None, gguf: bool = False) -> EngineConfig:
    """`config` with its model dtype and its KV pool's decided (`--dtype auto`
    and `--kv-cache-dtype auto` resolved, see dtype_choice; `gguf`: the
    checkpoint is a GGUF file) and logged; everything after this reads
    concrete dtypes.
    A pre-quantized checkpoint's kept int4 projections take the same choice:
    in bfloat16 they compute with their weights rounded to bf16 at every row
    count, one chain per output up to INT4_BF16_DEQUANT_MIN_ROWS rows
    (kiln/llm/quant/int4_cpu.py), in float32 with the stored weights."""
    choice = dtype_for(config, stored)
    kv = choose_kv_dtype(config.cache.kv_cache_dtype, choice.dtype, config.model.device, gguf)
    log.info("model dtype %s (%s); KV pool %s (%s)", choice.dtype, choice.reason, kv.dtype, kv.reason)
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, dtype=choice.dtype),
        cache=dataclasses.replace(config.cache, kv_cache_dtype=kv.dtype),
    )


def decide_max_model_len(checkpoint: Checkpoint, config: EngineConfig) -> int:
    native = checkpoint.arch.max_position_embeddings
    wanted = config.model.max_model_len or native
    if wanted > native:
        raise ConfigError(
            f"max_model_len {wanted} exceeds the model's context length {native}", param="max_model_len"
        )
    budget = config.scheduler.max_num_batched_tokens
    if config.scheduler.enable_chunked_prefill or wanted <= budget:
        return wanted
    # Without chunked prefill a request's tokens (its prompt, or prompt and output
    # when a preempted request is recomputed) go through in one step, so a longer
    # one would wait in the queue forever, and every request behind it too.
    if config.model.max_model_len is not None:
        raise ConfigError(
            f"max_model_len {wanted} exceeds max_num_batched_tokens {budget} with enable_chunked_prefill off: "
            "a longer request could never be scheduled; raise max_num_batched_tokens, lower max_model_len, "
            "or keep chunked prefill on",
            param="max_model_len",
        )
    log.info("enable_chunked_prefill off: max_model_len %d (max_num_batched_tokens), not the model's %d",
             budget, native)
    return budget


def decide_num_blocks(
    model: LlamaModel, config: EngineConfig, max_model_len: int, available: MemoryReader | None = None
) -> int:
    """`num_blocks` if set, else as many as the pool's budget holds (kv_sizing;
    `available`: reads free memory, injectable for tests)."""
    cache = config.cache
    per_block = kv_bytes_per_block(model, cache.block_size, kv_dtype(config))
    device = torch.device(config.model.device)
    if cache.num_blocks is None and cache.kv_cache_memory_gib is None:
        return blocks_for(kv_pool_bytes(cache, device, available), per_block)
    num_blocks = cache.num_blocks or blocks_for(kv_pool_bytes(cache, device, available), per_block)
    check_pool_fits(num_blocks * per_block, device, available)
    return num_blocks


def fit_context(config: EngineConfig, max_model_len: int, num_blocks: int) -> int:
    """The context length the pool can hold: a request may never need more blocks than
    exist, or it could wait forever. A length the user asked for is an error when the pool
    is smaller (it was lowered in silence: /v1/models said 16 for --max-model-len 400);
    the model's own length is lowered, and the log says so."""
    pool_tokens = num_blocks * config.cache.block_size
    if max_model_len <= pool_tokens:
        return max_model_len
    if config.model.max_model_len is not None:
        raise ConfigError(
            f"max_model_len {max_model_len} needs {max_model_len} tokens of KV cache, but the pool holds "
            f"{pool_tokens} ({num_blocks} blocks of {config.cache.block_size}): raise --kv-cache-memory-gib or "
            "--num-blocks, or lower --max-model-len", param="max_model_len",
        )
    log.warning("max_model_len lowered from %d to %d: the KV pool holds %d tokens", max_model_len, pool_tokens,
                pool_tokens)
    return pool_tokens


def build_proposer(
    config: EngineConfig, checkpoint: Checkpoint, runner: ModelRunner, num_blocks: int, max_model_len: int
) -> Proposer | None:
    spec = config.spec
    if spec.spec_method == "ngram":
        return NgramProposer(spec.ngram_min_n, spec.ngram_max_n)
    if spec.spec_method != "draft":
        return None
    if spec.draft_model:
        draft_checkpoint = load_checkpoint(spec.draft_model)
        if draft_checkpoint.arch.vocab_size != checkpoint.arch.vocab_size:
            raise ConfigError(
                f"draft model vocabulary ({draft_checkpoint.arch.vocab_size}) differs from the target's "
                f"({checkpoint.arch.vocab_size})",
                param="draft_model",
            )
        draft = build_model(draft_checkpoint, config, max_model_len)
    else:
        if spec.draft_num_layers > checkpoint.arch.num_layers:
            raise ConfigError(f"draft_num_layers ({spec.draft_num_layers}) exceeds the model's "
                              f"{checkpoint.arch.num_layers} layers", param="draft_num_layers")
        draft = truncated_model(checkpoint, spec.draft_num_layers, max_model_len)
        draft = finish_model(draft, config)
    # The draft pool mirrors the target's block count: whatever fits one fits the other.
    return DraftModelProposer(
        draft, num_blocks, config.cache.block_size, runner.device, runner.sampler, kv_dtype(config)
    )


def structured_outputs(checkpoint: Checkpoint) -> StructuredOutputs:
    """Grammar state over the checkpoint's tokenizer (read on the first structured request)."""
    return StructuredOutputs(GrammarBackend(checkpoint.tokenizer_path, checkpoint.arch.vocab_size))


def build_parallel_engine_core(config: EngineConfig, checkpoint: Checkpoint | None) -> tuple[EngineCore, Checkpoint]:
    """Rank 0 of a TP x PP group: spawns/joins the other ranks (see kiln.llm.parallel).

    Without a preloaded checkpoint the driver, like every worker, reads only
    its own slices (lazily); the Checkpoint it returns carries no weights."""
    started = time.perf_counter()
    p = config.parallel
    require_device(config.model.device)
    path = resolve_model_path(config)
    if checkpoint is None:
        arch, reader, tokenizer_path = open_weights(path)
        checkpoint = Checkpoint(arch=arch, weights={}, tokenizer_path=tokenizer_path, source=path)
    else:
        if checkpoint.quantized:
            log.info("tensor/pipeline parallelism runs float weights: the stored int4 projections are dequantized")
        reader = DictReader(checkpoint.dequantized_weights())
    check_splittable(checkpoint.arch, p.tensor_parallel_size, p.pipeline_parallel_size)
    config = resolve_dtype(config, checkpoint_dtype(checkpoint.weights), checkpoint.is_gguf)  # once, for every rank
    max_model_len = decide_max_model_len(checkpoint, config)
    cache = config.cache
    per_block = kv_bytes_per_block_per_rank(checkpoint.arch, config)
    num_blocks = cache.num_blocks or blocks_for(kv_pool_bytes(cache, torch.device(config.model.device)), per_block)
    max_model_len = fit_context(config, max_model_len, num_blocks)
    # The model path travels to the workers in the config, resolved here.
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=path))
    torch.manual_seed(config.model.seed)
    runner = ParallelRunner(config, checkpoint.arch, reader, num_blocks, max_model_len)
    core = EngineCore(config, runner, num_blocks, max_model_len)
    core.structured = structured_outputs(checkpoint)
    log.info(
        "parallel engine ready: %s, TP %d x PP %d, %d KV blocks, max_model_len %d, %.1fs",
        checkpoint.source, p.tensor_parallel_size, p.pipeline_parallel_size,
        num_blocks, max_model_len, time.perf_counter() - started,
    )
    return core, checkpoint


def build_engine_core(config: EngineConfig, checkpoint: Checkpoint | None = None) -> tuple[EngineCore, Checkpoint]:
    """The engine core, and its checkpoint's description without weights (the model holds
    them now, in its own layout): a checkpoint read here is released before this returns;
    one the caller passed in stays the caller's."""
    if config.parallel.world_size > 1:
        return build_parallel_engine_core(config, checkpoint)
    progress = Progress(log)
    require_device(config.model.device)  # before the (slow) checkpoint load
    if checkpoint is None:
        path = resolve_model_path(config)
        progress.begin("reading the checkpoint", path)
        checkpoint = load_checkpoint(path)
    config = resolve_dtype(config, checkpoint_dtype(checkpoint.weights), checkpoint.is_gguf)
    torch.manual_seed(config.model.seed)
    max_model_len = decide_max_model_len(checkpoint, config)
    progress.begin("building the model", "(weights to the serving layout, packing, fusing)")
    model = build_model(checkpoint, config, max_model_len)
    progress.begin("allocating the KV pool")
    num_blocks = decide_num_blocks(model, config, max_model_len)
    max_model_len = fit_context(config, max_model_len, num_blocks)
    runner = ModelRunner(
        model, num_blocks, config.cache.block_size, torch.device(config.model.device), config.model.seed,
        kv_dtype(config),
    )
    if config.cache.profile_activations:
        progress.begin("measuring the largest step's activations")
        runner.activations_peak_bytes = measure_activation_peak(
            model, min(config.scheduler.max_num_batched_tokens, max_model_len), config.scheduler.max_num_seqs,
            config.cache.block_size, runner.device,
        )
    progress.begin("finishing the engine")
    runner.proposer = build_proposer(config, checkpoint, runner, num_blocks, max_model_len)
    runner.cuda_graphs = build_cuda_graphs(runner, config, max_model_len)
    core = EngineCore(config, runner, num_blocks, max_model_len)
    core.structured = structured_outputs(checkpoint)
    described = checkpoint.without_weights()
    del checkpoint  # the last reference when read here: its tensors go now
    trim_heap()
    progress.end()
    memory = memory_bytes(runner)
    log.info(
        "engine ready: %s, %s, %d KV blocks of %d tokens, max_model_len %d, %.1fs (%s); memory: weights %.2f GiB, "
        "packed copies %.2f GiB, KV pool %.2f GiB, activations peak %s",
        described.source, config.model.dtype, num_blocks, config.cache.block_size, max_model_len,
        progress.total(), progress.summary(), memory["weights_bytes"] / 2**30, memory["packed_bytes"] / 2**30,
        memory["kv_cache_bytes"] / 2**30,
        f"{memory['activations_peak_bytes'] / 2**20:.0f} MiB" if memory["activations_peak_bytes"] else
        "not measured (--profile-activations)",
    )
    return core, described
