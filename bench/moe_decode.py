"""MoE decode next to Llama at equal active parameters, one thread: the
fused attention half (`kiln::decode_attention`, fused_decode.py) against
the eager layer it replaces, in one process.

The checkpoints of bench/families.py (Llama; Mixtral with 8 experts of half
the width, top-2). Per decode batch B, B random 96-token prompts, 64 greedy
tokens each (ignore_eos), timed whole (prefill included) as output tok/s.
Each round runs Llama, Mixtral with its fused layers switched off (the
module path: what MoE decode ran before), and Mixtral fused, back to back
(a busy box's load hits all three alike; the two Mixtral runs swap places
every other round); medians over the rounds. The two
Mixtral runs must produce the same tokens (the fused path is bit-identical).

`--steps N` times single engine steps instead, which a box whose load
changes by the second disturbs far less: per batch, B requests admitted to
the Llama and the Mixtral engine and prefilled, then N times: a Llama step,
a Mixtral step with its fused layers off, a Llama step, a Mixtral step with
them on (the two Mixtral modes share one engine: bit-identical, their steps
continue the same requests). Prints median decode-step times and tok/s.

    .venv/bin/python bench/moe_decode.py [--rounds 7] [--batches 1,16] [--threads 1] [--family mixtral]
    .venv/bin/python bench/moe_decode.py --steps 60
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from families import build, family_configs

from kiln import LLM, SamplingParams
from kiln.llm.models.default_model import default_model_path
from kiln.llm.tokenizer import load_tokenizer

PROMPT, OUTPUT = 96, 64


def run(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, [params] * len(prompts))
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def step_times(llama: LLM, moe: LLM, fused: list, batch: int, steps: int, g: torch.Generator) -> dict[str, float]:
    """Median decode-step seconds of llama / eager / fused (see --steps)."""
    model = moe.engine.core.runner.model
    params = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, 8192, (PROMPT,), generator=g).tolist()
        for llm in (llama, moe):
            llm.engine.add_request(f"b{batch}-{i}", prompt, params)
    for _ in range(-(-batch * PROMPT // 1024) + 2):  # prefill (1024-token step budget)
        llama.engine.step()
        moe.engine.step()
    times: dict[str, list[float]] = {"llama": [], "eager": [], "fused": []}
    for _ in range(steps):
        for name, llm in (("llama", llama), ("eager", moe), ("llama", llama), ("fused", moe)):
            model.fused_layers = None if name == "eager" else fused
            start = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - start)
    for llm in (llama, moe):
        while llm.engine.has_unfinished():
            llm.engine.step()
    model.fused_layers = fused
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--family", default="mixtral", help="a MoE family of bench/families.py")
    ap.add_argument("--steps", type=int, default=0, help="time N interleaved engine steps per batch instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    configs = family_configs()
    tokenizer = load_tokenizer(default_model_path())
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        options = dict(dtype="float32", max_num_seqs=max(batches), kv_cache_memory_gib=0.5)
        llama, moe = (LLM(str(build(Path(tmp) / n, *configs[n], tokenizer)), **options)
                      for n in ("llama", args.family))
        model = moe.engine.core.runner.model
        fused = model.fused_layers
        if fused is None:
            raise SystemExit(f"{args.family}: no fused decode layers (kernels not loaded?)")
        names = ("llama", "eager", "fused")

        def one(name: str, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
            model.fused_layers = None if name == "eager" else fused
            return run(llama if name == "llama" else moe, prompts)

        for name in names:  # warm-up
            one(name, [[5] * PROMPT])
        if args.steps:
            print(f"threads={torch.get_num_threads()} family={args.family} steps={args.steps} (median step ms)")
            print("batch  llama ms  eager ms  fused ms  llama tok/s  eager/llama  fused/llama  fused/eager")
            for b in batches:
                t = step_times(llama, moe, fused, b, args.steps, g)
                print(f"{b:5d}  {t['llama'] * 1e3:8.2f}  {t['eager'] * 1e3:8.2f}  {t['fused'] * 1e3:8.2f}  "
                      f"{b / t['llama']:11.1f}  {t['llama'] / t['eager']:10.2f}x  {t['llama'] / t['fused']:10.2f}x  "
                      f"{t['eager'] / t['fused']:10.2f}x", flush=True)
            return
        rates: dict[tuple[int, str], list[float]] = {(b, n): [] for b in batches for n in names}
        for r in range(args.rounds):
            for b in batches:
                prompts = [torch.randint(3, 8192, (PROMPT,), generator=g).tolist() for _ in range(b)]
                out: dict[str, list[list[int]]] = {}
                for name in names if r % 2 == 0 else ("llama", "fused", "eager"):  # neither Mixtral always second
                    rate, out[name] = one(name, prompts)
                    rates[b, name].append(rate)
                if out["eager"] != out["fused"]:
                    raise SystemExit(f"round {r} batch {b}: fused and eager Mixtral tokens differ")
                print(f"round {r} batch {b:2d}: " + "  ".join(f"{n} {rates[b, n][-1]:.1f}" for n in names),
                      flush=True)
    print(f"threads={torch.get_num_threads()} family={args.family} rounds={args.rounds} (medians, output tok/s)")
    print("batch  llama  eager/llama  fused/llama  fused/eager per round")
    for b in batches:
        base, eager, fast = (rates[b, n] for n in names)

        def median_ratio(xs: list[float], ys: list[float]) -> float:
            return statistics.median(x / y for x, y in zip(xs, ys, strict=True))

        per_round = " ".join(f"{f / e:.2f}" for f, e in zip(fast, eager, strict=True))
        print(f"{b:5d}  {statistics.median(base):5.1f}  {median_ratio(eager, base):.2f}x        "
              f"{median_ratio(fast, base):.2f}x        {per_round}")


if __name__ == "__main__":
    main()
