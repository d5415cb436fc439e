"""A pre-quantized checkpoint kept as stored vs dequantized vs re-quantized.

For one model (default: the installed SmolLM2 Q4_1 GGUF), in one process,
alternating the modes round by round: checkpoint load time (file -> Kiln
Checkpoint), the finished model's weight bytes (parameters + buffers), and
batch-1 greedy decode tokens/s. Modes are `--quantization` values:

    stored  (unset) projections the file stores as Q4_0/Q4_1/Q4_K/GPTQ/AWQ stay int4 as stored
    float   every weight dequantized to float32
    int4    dequantized, then quantized again by Kiln (fp16 scale/min, groups of 32)

    .venv/bin/python bench/prequantized.py [--model PATH] [--rounds 3] [--tokens 128]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig
from kiln.llm.engine.builder import build_model
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.models.default_model import default_model_path
from kiln.llm.models.loader import load_checkpoint

MODES = {"stored": None, "float": "float", "int4": "int4"}


def weight_bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_seconds(path: str) -> float:
    start = time.perf_counter()
    load_checkpoint(path)
    return time.perf_counter() - start


def model_bytes(ckpt: Checkpoint, quantization: str | None) -> int:
    config = EngineConfig.from_flat(model=ckpt.source, quantization=quantization)
    return weight_bytes(build_model(ckpt, config, 256))


def decode(ckpt: Checkpoint, quantization: str | None, tokens: int) -> float:
    """Batch-1 greedy decode tok/s for one mode."""
    llm = LLM(checkpoint=ckpt, quantization=quantization, max_num_seqs=1, kv_cache_memory_gib=0.25)
    prompt = [[1, 504, 3458, 282, 253, 1789]]
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))  # warm-up
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate(prompt, params)
    elapsed = time.perf_counter() - start
    produced = len(out[0].outputs[0].token_ids)
    llm.shutdown()
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or GGUF file (default: installed SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    path = args.model or str(default_model_path())
    loads = [load_seconds(path) for _ in range(args.rounds)]
    print(f"load_checkpoint {path}: best {min(loads):.2f} s, median {statistics.median(loads):.2f} s")
    ckpt = load_checkpoint(path)
    sizes = {mode: model_bytes(ckpt, q) for mode, q in MODES.items()}
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode, quantization in MODES.items():
            rates[mode].append(decode(ckpt, quantization, args.tokens))
    base = max(rates["float"])
    for mode in MODES:
        best = max(rates[mode])
        print(f"{mode:>6}: batch-1 decode best {best:.1f} tok/s ({best / base:.2f}x float), "
              f"weights {sizes[mode] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
