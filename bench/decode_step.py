"""Median decode-step time with B running requests (SmolLM2), per model dtype.

For each dtype an engine is built (one checkpoint load shared) and B
requests of 300-token prompts admitted; enough steps run to finish their
prefill (1024 prompt tokens per step), then 12 decode steps per engine are
timed, the engines taking turns step by step (a busy box's load hits every
dtype alike). Prints each dtype's median and the ratios to the first.
PROF=1 adds a torch profiler table over 5 more steps per dtype. Compare
kernels with KILN_KERNELS=0 / 1, ISA builds with KILN_ISA=avx2:

    .venv/bin/python bench/decode_step.py 32 1                          # B=32, 1 thread, float32
    .venv/bin/python bench/decode_step.py 8 2 --dtypes float32,bfloat16
    .venv/bin/python bench/decode_step.py 64 2 --quantization float      # the GGUF dequantized (as vLLM runs it)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.llm.engine.llm_engine import LLMEngine
from kiln.llm.kernels import isa
from kiln.llm.kernels.ops import loaded_library
from kiln.llm.models.default_model import default_model_path
from kiln.llm.models.loader import load_checkpoint

TIMED_STEPS = 12


def engine_in_decode(checkpoint, dtype: str, batch: int, quantization: str | None = None) -> LLMEngine:
    options = {} if quantization is None else {"quantization": quantization}
    config = EngineConfig.from_flat(model=checkpoint.source, dtype=dtype, kv_cache_memory_gib=2.0, **options)
    engine = LLMEngine(config, checkpoint)
    params = SamplingParams(max_tokens=TIMED_STEPS + 24, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(1000 + i, 1300 + i)), params)
    for _ in range(-(-batch * 300 // 1024) + 2):
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("batch", type=int)
    ap.add_argument("threads", type=int)
    ap.add_argument("--dtypes", default="float32", help="comma-separated model dtypes, timed in turn")
    ap.add_argument("--quantization", help="e.g. float (dequantize the GGUF; default: its stored int4 kept)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    checkpoint = load_checkpoint(str(default_model_path()))
    engines = {dtype: engine_in_decode(checkpoint, dtype, args.batch, args.quantization) for dtype in dtypes}
    times: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    for _ in range(TIMED_STEPS):
        for dtype, engine in engines.items():
            started = time.perf_counter()
            engine.step()
            times[dtype].append(time.perf_counter() - started)
    medians = {dtype: statistics.median(t) for dtype, t in times.items()}
    print(f"{isa.cpu_isa().describe()}; loaded build {loaded_library()}")
    for dtype in dtypes:
        print(f"KILN_KERNELS={os.environ.get('KILN_KERNELS', '1')} B={args.batch} threads={args.threads} "
              f"{dtype}: decode step median {medians[dtype] * 1e3:.1f} ms "
              f"({medians[dtypes[0]] / medians[dtype]:.2f}x of {dtypes[0]})")
    if os.environ.get("PROF"):
        from torch.profiler import ProfilerActivity, profile

        for dtype, engine in engines.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    engine.step()
            print(dtype)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
