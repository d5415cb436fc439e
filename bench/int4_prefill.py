"""int4 prefill: the int4 kernel, kiln::linear_w4_panels (what Int4CpuLinear
runs above INT4_DEQUANT_MIN_ROWS rows, fp32) and widening the weight to fp32
and running oneDNN (what it ran there before the panels), per row count,
on the default model's (SmolLM2-135M Q4_1) int4 Linears; then whole
prompts through the engine, kept int4 against `--quantization float`. With
`--dtype bfloat16` (a CPU with bf16 dot products): also Kiln's bf16 kernel
(kiln::linear_w4_bf16: weights widened in registers up to 8 rows, a tile at
a time above), and widening to bf16 for oneDNN's bf16 GEMM
(Int4CpuLinear's paths for bf16 activations, split at
INT4_BF16_DEQUANT_MIN_ROWS), and bf16 engines.

Per row count M: the median over --repeats of one call of each path on
every int4 Linear shape of the model, summed over the shapes (one layer's
worth); the two paths alternate. Then prefill tok/s of --prompt-tokens
random tokens (max_tokens 1), the two engines alternating.

    PYTHONPATH=. .venv/bin/python bench/int4_prefill.py [--threads 1] [--rows 64,128,256,512,1024]
        [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln import LLM, SamplingParams
from kiln.llm.kernels import ops
from kiln.llm.quant.int4_cpu import Int4CpuLinear


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def widened(layer: Int4CpuLinear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        weight = ops.dequantize_w4(layer.codes, layer.scale_min, layer.group_size, torch.bfloat16)
        if weight is None:
            raise SystemExit("kernels unavailable")
        return torch.nn.functional.linear(x, weight)
    weight = ops.dequantize_w4(layer.codes, layer.scale_min, layer.group_size)
    packed = ops.pack_linear_weight(weight) if weight is not None else None
    if packed is None:
        raise SystemExit("kernels or oneDNN unavailable")
    return ops.linear_packed(x, packed)


def layer_shapes(llm: LLM) -> list[Int4CpuLinear]:
    """One Int4CpuLinear of each shape in the model."""
    found: dict[tuple[int, int], Int4CpuLinear] = {}
    for module in llm.engine.core.runner.model.modules():
        if isinstance(module, Int4CpuLinear):
            found.setdefault((module.out_features, module.in_features), module)
    return list(found.values())


def prefill_rate(llm: LLM, tokens: int, g: torch.Generator) -> float:
    prompt = torch.randint(100, 40000, (tokens,), generator=g).tolist()
    start = time.perf_counter()
    llm.generate([prompt], [SamplingParams(max_tokens=1, temperature=0.0)])
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="64,128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.dtype == "bfloat16" and not ops.bf16_dot_products():
        raise SystemExit("--dtype bfloat16 needs the avx512_bf16 kernel build (a CPU with AVX512_BF16)")
    stored = LLM(dtype=args.dtype, kv_cache_memory_gib=0.25)
    layers = layer_shapes(stored)
    if not layers:
        raise SystemExit("no int4 Linear in the default model (kernels not loaded?)")
    g = torch.Generator().manual_seed(0)
    print(f"threads={args.threads}  shapes={[(m.out_features, m.in_features) for m in layers]}")
    bf16 = args.dtype == "bfloat16"
    print(f"rows  int4 kernel ms  widened ({args.dtype})+oneDNN ms  kernel/widened"
          + ("  bf16 kernel ms  kernel/bf16" if bf16 else "  panels ms  panels/widened"))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, m.in_features, generator=g) for m in layers]
        kernel = sum(timed(lambda m=m, x=x: ops.linear_w4(x, m.codes, m.scale_min, m.group_size), args.repeats)
                     for m, x in zip(layers, xs, strict=True))
        wide = sum(timed(lambda m=m, x=x: widened(m, x.to(getattr(torch, args.dtype))), args.repeats)
                   for m, x in zip(layers, xs, strict=True))
        line = f"{rows:4d}  {kernel * 1e3:14.2f}  {wide * 1e3:17.2f}  {kernel / wide:14.2f}x"
        if bf16:
            xs16 = [x.bfloat16() for x in xs]
            bf16_kernel = sum(timed(lambda m=m, x=x: ops.linear_w4_bf16(x, m.codes, m.scale_min, m.group_size),
                              args.repeats) for m, x in zip(layers, xs16, strict=True))
            line += f"  {bf16_kernel * 1e3:14.2f}  {kernel / bf16_kernel:11.2f}x"
        else:
            panels = sum(timed(lambda m=m, x=x: ops.linear_w4_panels(x, m.codes, m.scale_min, m.group_size),
                               args.repeats) for m, x in zip(layers, xs, strict=True))
            line += f"  {panels * 1e3:9.2f}  {panels / wide:13.2f}x"
        print(line, flush=True)
    floats = LLM(quantization="float", dtype=args.dtype, kv_cache_memory_gib=0.25)
    for llm in (stored, floats):
        prefill_rate(llm, 64, g)
    rates: dict[str, list[float]] = {"kept int4": [], "float": []}
    for _ in range(args.rounds):
        for name, llm in (("kept int4", stored), ("float", floats)):
            rates[name].append(prefill_rate(llm, args.prompt_tokens, g))
    for name, values in rates.items():
        print(f"prefill {args.prompt_tokens} tokens, {name}: {statistics.median(values):.0f} tok/s "
              f"({', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
