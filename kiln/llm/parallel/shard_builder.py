"""Build this rank's model shard and its stage runner (driver and workers alike)."""
from __future__ import annotations

import torch

from kiln.config import EngineConfig
from kiln.llm.models.arch import LlamaArch
from kiln.llm.parallel.layout import TensorSplit, stage_layers
from kiln.llm.parallel.model import ShardedLlamaModel
from kiln.llm.parallel.stage import StageRunner
from kiln.llm.parallel.state import ParallelState
from kiln.llm.parallel.weights import WeightReader
from kiln.llm.runner.model_runner import DTYPES, kv_dtype


def build_stage(
    config: EngineConfig,
    arch: LlamaArch,
    reader: WeightReader,
    state: ParallelState,
    num_blocks: int,
    max_model_len: int,
) -> StageRunner:
    torch.manual_seed(config.model.seed)
    model = ShardedLlamaModel(arch, max_model_len, state)
    model.load_weights(reader)
    model.finish(state.device, DTYPES[config.model.dtype], kv_dtype(config))
    return StageRunner(model, state, num_blocks, config.cache.block_size, kv_dtype(config))


def kv_bytes_per_block_per_rank(arch: LlamaArch, config: EngineConfig) -> int:
    """The largest per-rank KV footprint of one block: every rank's pool has
    the same number of blocks, so the fullest rank decides how many fit."""
    p = config.parallel
    dtype = kv_dtype(config)
    most = 0
    for pp in range(p.pipeline_parallel_size):
        lo, hi = stage_layers(arch.num_layers, p.pipeline_parallel_size, pp)
        for tp in range(p.tensor_parallel_size):
            kv_heads = TensorSplit(arch, tp, p.tensor_parallel_size).num_kv_heads
            most = max(most, (hi - lo) * kv_heads)
    return 2 * most * config.cache.block_size * arch.head_dim * torch.finfo(dtype).bits // 8
