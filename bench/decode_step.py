"""Median decode-step time with B running requests (SmolLM2, fp32).

B requests of 300-token prompts are admitted, enough steps run to finish
their prefill (1024 prompt tokens per step), then 12 decode steps are
timed. PROF=1 adds a torch profiler table over 5 more steps. Compare kernels with KILN_KERNELS=0 / 1:

    KILN_KERNELS=1 .venv/bin/python bench/decode_step.py 32 1   # B=32, 1 thread
"""
from __future__ import annotations

import os
import sys
import time

import torch

from kiln import LLM, SamplingParams


def main() -> None:
    batch, threads = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(threads)
    engine = LLM(dtype="float32", kv_cache_memory_gib=2.0).engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(1000 + i, 1300 + i)), params)
    for _ in range(-(-batch * 300 // 1024) + 2):
        engine.step()
    times = []
    for _ in range(12):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    times.sort()
    print(f"KILN_KERNELS={os.environ.get('KILN_KERNELS', '1')} B={batch} threads={threads}: "
          f"decode step median {times[len(times) // 2] * 1e3:.1f} ms")
    if os.environ.get("PROF"):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
