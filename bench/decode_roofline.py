"""Batch-1 decode speed of float32, bfloat16, int8 and int4 SmolLM2 through
Kiln's engine, against the machine's memory bandwidth (gpt-fast style).

All engines are built up front and the repeats alternate between modes (a
shared box's load then hits every mode alike). Per mode: a 128-token prompt from the pydoc corpus, greedy, ignore_eos.
Decode tokens/s = (new_tokens - 1) / (t(new_tokens) - t(1)): the prefill and
the first token are timed separately and subtracted. Each figure is the
median of --repeats runs. Bytes per token = every weight a decode step
reads (all projections, norms, the LM head as the mode stores it; not the
embedding table, of which one row is read) plus the KV cache read at the
mean context, in the pool's dtype. Bandwidth = median of a large-tensor sum (read) benchmark,
taken at the start and again around every repeat: a shared VM's bandwidth drifts (a Zen 4 box
read 33-34 GB/s on two threads for two hours, then 34-65 GB/s from one minute to the next), so a
mode's % is the median over repeats of its rate in that repeat against the bandwidth read around it.
Optional: achieved GFLOP/s of a prefill chunk and of decode at batch 32.

    PYTHONPATH=. .venv/bin/python bench/decode_roofline.py [--repeats 5] [--modes fp32,bf16,int8,int4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import corpus_text  # noqa: E402

from kiln import LLM, SamplingParams  # noqa: E402
from kiln.llm.models.default_model import default_model_path  # noqa: E402
from kiln.llm.models.loader import load_checkpoint  # noqa: E402

# mode -> engine options. int8/int4 run their kernels in bfloat16 either way
# (kiln/llm/quant/base.py); the model dtype only sets the activations between
# layers and the KV cache.
MODES = {
    # The default load of the Q4_1 GGUF keeps its int4 projections: "float" makes fp32/bf16 what they say.
    "fp32": dict(dtype="float32", quantization="float"),
    "bf16": dict(dtype="bfloat16", quantization="float"),
    # What `kiln serve` runs: the stored Q4_1 projections kept int4 in `--dtype auto` (bf16 on
    # AVX512_BF16/AMX CPUs, fp32 elsewhere); in fp32 logits from the stored Q8_0 head
    # (-floathead: from its float copy, bit-identical, as before).
    "default": dict(),
    "default-floathead": dict(dtype="float32"),
    # The same kept int4 projections in an explicit dtype.
    "default-fp32": dict(dtype="float32"),
    "default-bf16": dict(dtype="bfloat16"),
    # The same with --int4-activations int8 (linear_w4a8: llama.cpp's numerics for Q4 files).
    "default-a8": dict(int4_activations="int8"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int4": dict(dtype="float32", quantization="int4"),
    "int8-bf16": dict(dtype="bfloat16", quantization="int8"),
    "int4-bf16": dict(dtype="bfloat16", quantization="int4"),
    # LM head variants (does quantizing the head pay?): swapped after load
    "int8-floathead": dict(dtype="float32", quantization="int8"),
    "int4-floathead": dict(dtype="float32", quantization="int4"),
    "int4-int4head": dict(dtype="float32", quantization="int4"),
}


def set_head(model, mode: str) -> None:
    if mode.endswith("-floathead"):
        model.quantize_head(None)
    elif mode.endswith("-int4head"):
        model.quantize_head("int4", 32)


def make_llm(checkpoint, kv_gib: float = 0.1, **options) -> LLM:
    return LLM(checkpoint=checkpoint, kv_cache_memory_gib=kv_gib, **options)


def weight_bytes_per_token(model) -> int:
    """Bytes of everything a decode step reads except the KV cache and the
    embedding table (one row)."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name in ("embed_tokens", "lm_head") or "rotary" in name:
            continue
        total += t.numel() * t.element_size()
    head = model.logits_head
    if head is None:
        total += model.lm_head.numel() * model.lm_head.element_size()
    return total


def kv_bytes_per_token(model, pool: torch.Tensor, context: int) -> int:
    """Keys and values one decode step reads at `context` tokens, in the pool's dtype (float16 for a GGUF
    file in float32 on CPU under `--kv-cache-dtype auto`, not the model's)."""
    a = model.arch
    return 2 * a.num_layers * context * a.num_kv_heads * a.head_dim * pool.element_size()


def matmul_flops_per_token(model) -> int:
    a = model.arch
    per_layer = (
        a.hidden_size * (a.q_size + 2 * a.kv_size) + a.q_size * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
    )
    return 2 * (a.num_layers * per_layer + a.vocab_size * a.hidden_size)


def attention_flops(model, context: int) -> int:
    a = model.arch
    return 4 * a.num_layers * a.num_heads * a.head_dim * context


def timed_generate(llm, prompts, max_tokens) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed


def read_GBps(x: torch.Tensor, sums: int = 3) -> float:
    """Median read rate of `sums` passes of x.sum()."""
    rates = []
    for _ in range(sums):
        t = time.perf_counter()
        x.sum()
        rates.append(x.nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


def memory_bandwidth(repeats: int, gib: float = 1.0) -> dict:
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    sums, copies = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        sums.append(x.nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        y.copy_(x)
        copies.append(2 * x.nbytes / (time.perf_counter() - t) / 1e9)
    return {
        "read_sum_GBps": statistics.median(sums),
        "copy_rw_GBps": statistics.median(copies),
        "read_sum_all": sums,
        "copy_all": copies,
        "tensor_gib": gib,
        "threads": torch.get_num_threads(),
    }


def setup_mode(checkpoint, mode, kv_gib):
    llm = make_llm(checkpoint, kv_gib, **MODES[mode])
    set_head(llm.engine.core.runner.model, mode)
    # The KV pool faulted in, as an idle engine does (runner/kv_warm.py): else the
    # first repeats write never-used blocks and take first-touch page faults.
    while llm.engine.core.runner.warm_kv_pool():
        pass
    return llm


def decode_step_seconds(llm, prompt, new_tokens) -> float:
    t1 = timed_generate(llm, [prompt], 1)
    tn = timed_generate(llm, [prompt], new_tokens)
    return (tn - t1) / (new_tokens - 1)


def summarize(llm, mode, steps, args, repeat_bw) -> dict:
    """repeat_bw[r]: the read bandwidth around repeat r (see main)."""
    model = llm.engine.core.runner.model
    step = statistics.median(steps)
    mean_ctx = args.prompt_len + args.new_tokens // 2
    pool = llm.engine.core.runner.kv_caches[0]
    wbytes, kvbytes = weight_bytes_per_token(model), kv_bytes_per_token(model, pool, mean_ctx)
    pcts = [100 * (wbytes + kvbytes) / s / 1e9 / bw for s, bw in zip(steps, repeat_bw, strict=True)]
    return {
        "mode": mode,
        "options": MODES[mode],
        "decode_tok_per_s": 1 / step,
        "decode_tok_per_s_all": [1 / s for s in steps],
        "weight_bytes_per_token": wbytes,
        "kv_bytes_per_token_mean_ctx": kvbytes,
        "achieved_GBps": (wbytes + kvbytes) / step / 1e9,
        "pct_of_read_bandwidth": statistics.median(pcts),
        "pct_of_read_bandwidth_all": pcts,
        "decode_b1_GFLOPps": (matmul_flops_per_token(model) + attention_flops(model, mean_ctx)) / step / 1e9,
    }


def flops_figures(llm, ids, args) -> dict:
    model = llm.engine.core.runner.model
    long_prompt = ids[1000 : 1000 + args.prefill_len]
    t = timed_generate(llm, [long_prompt], 1)
    prefill_flops = (
        matmul_flops_per_token(model) - 2 * model.arch.vocab_size * model.arch.hidden_size
    ) * args.prefill_len
    prefill_flops += attention_flops(model, args.prefill_len // 2) * args.prefill_len
    prompts = [ids[2000 + 64 * i : 2064 + 64 * i] for i in range(32)]
    step32 = (timed_generate(llm, prompts, 17) - timed_generate(llm, prompts, 1)) / 16
    return {
        "prefill_tokens": args.prefill_len,
        "prefill_GFLOPps": prefill_flops / t / 1e9,
        "decode_b32_tok_per_s": 32 / step32,
        "decode_b32_GFLOPps": 32 * (matmul_flops_per_token(model) + attention_flops(model, 72)) / step32 / 1e9,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--modes", default="fp32,bf16,int8,int4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--flops", action="store_true", help="also prefill chunk and batch-32 decode GFLOP/s")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--kv-gib", type=float, default=0.1, help="KV pool per engine (all modes are held at once)")
    ap.add_argument("--out", default="bench/results/decode_roofline.json")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(str(args.model or default_model_path()))
    bw = memory_bandwidth(max(5, args.repeats))
    print(json.dumps({k: v for k, v in bw.items() if not k.endswith("_all")}), flush=True)
    # Every engine is built first and the repeats go round-robin over the
    # modes, so load from other processes on the box hits all modes alike.
    modes = args.modes.split(",")
    llms = {mode: setup_mode(checkpoint, mode, args.kv_gib) for mode in modes}
    ids = llms[modes[0]].tokenizer.encode(corpus_text(), add_special_tokens=False)
    prompt = ids[: args.prompt_len]
    for llm in llms.values():
        timed_generate(llm, [prompt], 4)  # warm-up
    steps = {mode: [] for mode in modes}
    probe = torch.ones(2**28, dtype=torch.float32)  # 1 GiB, read before and after every repeat
    repeat_bw = []
    for r in range(args.repeats):
        before = read_GBps(probe)
        for mode in modes:
            steps[mode].append(decode_step_seconds(llms[mode], prompt, args.new_tokens))
        repeat_bw.append((before + read_GBps(probe)) / 2)
        rates = {m: round(1 / s[-1], 2) for m, s in steps.items()}
        print(f"repeat {r}:", rates, f"read {repeat_bw[-1]:.1f} GB/s", flush=True)
    del probe
    bw["read_sum_per_repeat"] = repeat_bw
    results = []
    for mode in modes:
        r = summarize(llms[mode], mode, steps[mode], args, repeat_bw)
        if args.flops:
            r.update(flops_figures(llms[mode], ids, args))
        print(
            json.dumps(
                {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if not k.endswith("_all")}
            ),
            flush=True,
        )
        results.append(r)
    by = {r["mode"]: r["decode_tok_per_s"] for r in results}
    ratios = {f"{m}_vs_{base}": by[m] / by[base] for m in by for base in ("bf16", "fp32") if base in by and m != base}
    print(json.dumps({k: round(v, 2) for k, v in ratios.items()}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "bandwidth": bw,
                "modes": results,
                "ratios": ratios,
                "threads": torch.get_num_threads(),
                "args": vars(args),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
