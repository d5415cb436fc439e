"""Where a batch-1 decode step goes, op by op, in Kiln's fused decode layers.

Per mode (decode_roofline.py's modes, the KV pool faulted in first): a prompt
from the pydoc corpus, greedy, ignore_eos; `--new-tokens` tokens generated
under `kiln.llm.kernels.ops.decode_profile` (timers around each op of
decode_layer.cpp); a step's time is that run's minus a one-token run's (the
prefill and first token), over the decode steps. Prints per op the microseconds per step, its share
of the layers' time and, for the projections, the bytes they read per step
and the rate. "between ops" is a layer's time outside its timed ops
(allocations, views, dispatch); "outside the layers" is the step's time
outside DecodeStack.run (embedding, LM head, sampling, the engine's Python).
The timers themselves cost ~0.1 us per op (two clock reads).

    PYTHONPATH=. .venv/bin/python bench/decode_ops.py [--modes int8,bf16] [--threads 2] [--new-tokens 300]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_roofline import MODES, setup_mode, timed_generate  # noqa: E402
from workload import corpus_text  # noqa: E402

from kiln.errors import KilnError  # noqa: E402
from kiln.llm.kernels.ops import OpTime, decode_profile  # noqa: E402
from kiln.llm.models.default_model import default_model_path  # noqa: E402
from kiln.llm.models.loader import load_checkpoint  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def projection_bytes(model) -> dict[str, int]:
    """Bytes a one-row step reads of each projection, summed over the fused layers: the
    weights and their scales (the first two tensors), not a copy kept for many rows."""
    layers = model.fused_layers or []
    return {name: sum(t.nbytes for f in layers for t in getattr(f, name)[:2]) for name in PROJECTIONS}


def profile_mode(checkpoint, mode: str, prompt_len: int, new_tokens: int) -> dict:
    llm = setup_mode(checkpoint, mode, 0.25)  # with the KV pool faulted in (its first-touch faults: in kv_write)
    model = llm.engine.core.runner.model
    if model.fused_layers is None or model.fused_layers.stack is None:
        raise KilnError(f"mode {mode}: this model's decode steps do not run through the fused layers")
    prompt = llm.tokenizer.encode(corpus_text(), add_special_tokens=False)[:prompt_len]
    timed_generate(llm, [prompt], 8)  # warm-up
    first = timed_generate(llm, [prompt], 1)  # prefill and first token, subtracted below
    with decode_profile() as ops:
        total = timed_generate(llm, [prompt], new_tokens)
    steps = ops["layer"].calls / len(model.fused_layers)
    if steps == 0:
        raise KilnError(f"mode {mode}: no decode step ran through the fused layers")
    return summarize(mode, ops, steps, (total - first) / (new_tokens - 1), projection_bytes(model))


def summarize(mode: str, ops: dict[str, OpTime], steps: float, step_s: float, nbytes: dict[str, int]) -> dict:
    layers_s = ops["layer"].seconds / steps
    rows = {}
    for name, t in ops.items():
        if name == "layer" or t.calls == 0:
            continue
        row = {"us_per_step": 1e6 * t.seconds / steps, "share_of_layers": t.seconds / steps / layers_s}
        if name in nbytes and t.seconds > 0:
            row["GBps"] = nbytes[name] * steps / t.seconds / 1e9
        rows[name] = row
    timed = sum(ops[n].seconds for n in rows) / steps
    rows["between ops"] = {"us_per_step": 1e6 * (layers_s - timed), "share_of_layers": 1 - timed / layers_s}
    return {
        "mode": mode,
        "steps": steps,
        "step_us": 1e6 * step_s,
        "layers_us": 1e6 * layers_s,
        "outside_layers_us": 1e6 * (step_s - layers_s),
        "ops": rows,
    }


def print_table(r: dict) -> None:
    print(f"\n{r['mode']}: {r['steps']:.0f} decode steps; a step {r['step_us']:.0f} us = layers "
          f"{r['layers_us']:.0f} + outside the layers {r['outside_layers_us']:.0f}")
    print("| op | us per step | share of the layers | GB/s |\n|---|---|---|---|")
    for name, row in r["ops"].items():
        rate = f"{row['GBps']:.1f}" if "GBps" in row else ""
        print(f"| {name} | {row['us_per_step']:.0f} | {100 * row['share_of_layers']:.1f}% | {rate} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="int8,bf16", help=f"comma-separated, of {sorted(MODES)}")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=300)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--out", default="bench/results/decode_ops.json")
    args = ap.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    if args.new_tokens < 2 or args.prompt_len < 1:
        ap.error("--new-tokens must be >= 2 and --prompt-len >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(str(args.model or default_model_path()))
    results = []
    for mode in args.modes.split(","):
        results.append(profile_mode(checkpoint, mode, args.prompt_len, args.new_tokens))
        print_table(results[-1])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "args": vars(args),
                                          "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
