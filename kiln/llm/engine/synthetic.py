"""An engine core over an in-memory, random-weight Llama of a given shape.

For GPU benchmarks and tests where no checkpoint can travel (an 8B one is
16 GB): the same model class, finishing, KV pool, runner, CUDA graphs and
core as a loaded model, with weights drawn from N(0, 0.02) (norms 1)
directly on the device, in the model dtype. Token ids only: no tokenizer.
"""
from __future__ import annotations

import contextlib

import torch

from kiln.config import EngineConfig
from kiln.llm.device import require_device
from kiln.llm.engine.builder import decide_num_blocks, finish_model, resolve_dtype
from kiln.llm.engine.core import EngineCore
from kiln.llm.engine.messages import EngineCoreRequest
from kiln.llm.models.arch import LlamaArch, RopeScaling
from kiln.llm.models.llama import LlamaModel
from kiln.llm.runner.cuda_graphs import build_cuda_graphs
from kiln.llm.runner.model_runner import DTYPES, ModelRunner, kv_dtype
from kiln.llm.sampling_params import SamplingParams

# The published configurations (config.json) of two Llama models.
LLAMA_SHAPES = {
    "Llama-3.2-1B": LlamaArch(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=True, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "Llama-3.1-8B": LlamaArch(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=False, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
}


@contextlib.contextmanager
def _default(device: torch.device, dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old)


@torch.inference_mode()
def random_llama(arch: LlamaArch, max_positions: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> LlamaModel:
    """A LlamaModel of `arch` with random weights, allocated on `device` in `dtype`."""
    with _default(device, dtype):
        model = LlamaModel(arch, max_positions=max_positions)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    return model


def synthetic_engine_core(arch: LlamaArch, config: EngineConfig) -> EngineCore:
    """An EngineCore as build_engine_core makes it, over random weights.
    `config.model.max_model_len` must be set (there is no checkpoint to read it from)."""
    device = require_device(config.model.device)
    config = resolve_dtype(config, None)
    max_model_len = config.model.max_model_len
    if max_model_len is None:
        raise ValueError("synthetic_engine_core needs max_model_len")
    model = random_llama(arch, max_model_len, DTYPES[config.model.dtype], device, config.model.seed)
    model = finish_model(model, config)
    num_blocks = decide_num_blocks(model, config, max_model_len)
    max_model_len = min(max_model_len, num_blocks * config.cache.block_size)
    runner = ModelRunner(model, num_blocks, config.cache.block_size, device, config.model.seed, kv_dtype(config))
    runner.cuda_graphs = build_cuda_graphs(runner, config, max_model_len)
    return EngineCore(config, runner, num_blocks, max_model_len)


def generate(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Run `prompts` to completion on `core`; the output token ids of each, in order."""
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"s{i}", list(prompt), params))
        out[f"s{i}"] = []
    while core.has_unfinished():
        for o in core.step().outputs:
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"s{i}"] for i in range(len(prompts))]
