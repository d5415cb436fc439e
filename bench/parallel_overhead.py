"""What tensor parallelism costs on one machine: TP=1 vs TP=2 on SmolLM2-135M.

On a 2-core CPU box TP cannot speed anything up (the ranks share the cores);
this measures its overhead: step time for a decode batch and for one prefill
chunk, and on the driver (rank 0) the all-reduces per step, the bytes they
move and the time spent in them (two per layer: after o_proj and down_proj,
plus one for the vocab-parallel embedding), the logits gather, and the
step-plan broadcast size.

    PYTHONPATH=. .venv/bin/python bench/parallel_overhead.py [--model PATH] [--decode-batch 16]

Writes bench/results/parallel_overhead.json. Every rank runs 1 torch thread
(TP=2: two processes on the two cores); TP=1 is also timed with 2 threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.llm.engine.builder import build_engine_core
from kiln.llm.engine.messages import EngineCoreRequest
from kiln.llm.models.default_model import default_model_path
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.parallel.state import CommStats

RESULTS = Path(__file__).resolve().parent / "results"


def comm_delta(stats: CommStats | None, before: CommStats | None) -> dict:
    if stats is None:
        return {}
    d = {f.name: getattr(stats, f.name) - getattr(before, f.name) for f in dataclasses.fields(CommStats)}
    return d


def timed_steps(core, n: int, state) -> tuple[list[float], dict]:
    before = dataclasses.replace(state.stats) if state and state.stats else None
    times = []
    for _ in range(n):
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    return times, comm_delta(state.stats if state else None, before)


def run(checkpoint, args, tp: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = "1"  # spawned workers
    config = EngineConfig.from_flat(
        model=checkpoint.source,
        num_blocks=512,
        enable_prefix_caching=False,
        tensor_parallel_size=tp,
        max_num_batched_tokens=max(args.prefill_tokens, args.decode_batch * args.prompt_tokens),
    )
    core, _ = build_engine_core(config, checkpoint)
    state = getattr(core.runner, "state", None)
    if state is not None:
        state.stats = CommStats()
    try:
        layers = checkpoint.arch.num_layers
        out = {"tp": tp, "driver_threads": threads}
        # Decode: a batch of short prompts, prefilled, then timed decode steps.
        params = SamplingParams(max_tokens=args.decode_steps + 5, temperature=0.0, ignore_eos=True)
        for i in range(args.decode_batch):
            core.add_request(
                EngineCoreRequest(f"d{i}", [(i * 7 + j) % 1000 + 10 for j in range(args.prompt_tokens)], params)
            )
        core.step()  # the prefill of the whole batch
        core.step()  # first decode (warm-up)
        times, comm = timed_steps(core, args.decode_steps, state)
        out["decode"] = summarize(times, comm, args.decode_steps, layers, batch=args.decode_batch)
        while core.has_unfinished():
            core.step()
        # Prefill: one chunk of prefill_tokens, sampled once; fresh request each repeat.
        pre_times, pre_comm = [], []
        for r in range(args.prefill_repeats + 1):
            ids = [(r * 13 + j) % 1000 + 10 for j in range(args.prefill_tokens)]
            core.add_request(EngineCoreRequest(f"p{r}", ids, SamplingParams(max_tokens=1)))
            times, comm = timed_steps(core, 1, state)
            if r:  # the first one is warm-up
                pre_times += times
                pre_comm.append(comm)
        summed = {k: sum(c[k] for c in pre_comm) for k in pre_comm[0]} if pre_comm and pre_comm[0] else {}
        out["prefill"] = summarize(pre_times, summed, len(pre_times), layers, tokens=args.prefill_tokens)
        if state is not None:
            out["plan_bytes_last_step"] = core.runner.last_plan_bytes
            out["resident_weight_bytes_per_rank"] = core.runner.resident_weight_bytes()
        return out
    finally:
        core.shutdown()


def summarize(times: list[float], comm: dict, steps: int, layers: int, **shape) -> dict:
    out = {**shape, "step_ms_median": 1e3 * statistics.median(times), "step_ms_mean": 1e3 * statistics.mean(times)}
    if comm:
        out.update(
            all_reduces_per_step=comm["all_reduces"] / steps,
            all_reduce_bytes_per_step=comm["all_reduce_bytes"] / steps,
            all_reduce_ms_per_step=1e3 * comm["all_reduce_s"] / steps,
            all_reduce_ms_per_layer=1e3 * comm["all_reduce_s"] / steps / layers,  # 2 all-reduces per layer
            gather_bytes_per_step=comm["gather_bytes"] / steps,
            gather_ms_per_step=1e3 * comm["gather_s"] / steps,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the installed SmolLM2 GGUF")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model or default_model_path())
    runs = [run(checkpoint, args, 1, 1), run(checkpoint, args, 1, 2), run(checkpoint, args, 2, 1)]
    result = {
        "model": checkpoint.source,
        "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(), "torch": torch.__version__},
        "args": vars(args),
        "runs": runs,
        "loadavg_1m": os.getloadavg()[0],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "parallel_overhead.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
