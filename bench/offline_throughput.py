"""Offline throughput: Kiln vs naive Hugging Face serving, same model, same dtype.

Workload (bench/workload.py): N requests (default 64), prompt lengths
uniform in [64, 512] tokens, outputs uniform in [32, 256] tokens, seed 0;
every request produces exactly its max_tokens (ignore_eos, greedy).

Naive HF = one request at a time through `LlamaForCausalLM.generate`, built
from the very weights Kiln loads. Serial serving has a flat per-request
rate, so by default it runs on the first `--hf-requests` requests only and
its tokens/s is compared with Kiln's on the full set (say so when quoting).
Each side runs in its own fresh process, so neither inherits the other's
threads, allocations or warm caches.

    .venv/bin/python bench/offline_throughput.py [--model PATH] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import make_workload  # noqa: E402

from kiln import LLM, SamplingParams  # noqa: E402
from kiln.llm.models.default_model import default_model_path  # noqa: E402
from kiln.llm.models.loader import load_checkpoint  # noqa: E402


def run_kiln(args, items) -> dict:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        **({} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}),
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_gib=args.kv_gib,
    )
    params = [SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True) for it in items]
    llm.generate([items[0].prompt_token_ids], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([it.prompt_token_ids for it in items], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(it.max_tokens for it in items)
    assert produced == expected, f"Kiln produced {produced} tokens, expected {expected}"
    return {"requests": len(items), "output_tokens": produced, "seconds": elapsed, "tok_per_s": produced / elapsed}


def hf_model_from_checkpoint(path: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = load_checkpoint(path)
    a = ckpt.arch
    config = LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta,
        max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings,
    )
    model = LlamaForCausalLM(config)
    model.load_state_dict(ckpt.dequantized_weights(), strict=False)
    if a.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def run_hf(args, items) -> dict:
    model = hf_model_from_checkpoint(args.model, getattr(torch, args.dtype))
    subset = items[: args.hf_requests]
    with torch.inference_mode():
        model.generate(torch.tensor([subset[0].prompt_token_ids]), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        produced = 0
        for it in subset:
            ids = torch.tensor([it.prompt_token_ids])
            out = model.generate(
                ids, max_new_tokens=it.max_tokens, min_new_tokens=it.max_tokens, do_sample=False, pad_token_id=0
            )
            produced += out.shape[1] - ids.shape[1]
        elapsed = time.perf_counter() - start
    return {"requests": len(subset), "output_tokens": produced, "seconds": elapsed, "tok_per_s": produced / elapsed}


def in_fresh_process(fn, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or GGUF file (default: installed SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-requests", type=int, default=8, help="requests run through naive HF (0 = skip)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: LLM's own")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/offline_throughput.json")
    args = ap.parse_args()
    args.model = args.model or str(default_model_path())
    from kiln.llm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(load_checkpoint(args.model).tokenizer_path)
    items = make_workload(tokenizer, args.num_requests, seed=args.seed)
    print(
        f"threads={torch.get_num_threads()} dtype={args.dtype} requests={len(items)} "
        f"prompt_tokens={sum(len(i.prompt_token_ids) for i in items)} output_tokens={sum(i.max_tokens for i in items)}"
    )
    kiln = in_fresh_process(run_kiln, args, items)
    print(f"kiln     : {kiln['output_tokens']} tokens in {kiln['seconds']:.1f}s = {kiln['tok_per_s']:.1f} tok/s")
    result = {"kiln": kiln, "args": vars(args), "cpu_count": os.cpu_count()}
    if args.hf_requests:
        hf = in_fresh_process(run_hf, args, items)
        print(
            f"naive HF : {hf['output_tokens']} tokens in {hf['seconds']:.1f}s = {hf['tok_per_s']:.1f} tok/s "
            f"({hf['requests']} requests)"
        )
        result["naive_hf"] = hf
        result["ratio"] = kiln["tok_per_s"] / hf["tok_per_s"]
        print(f"ratio    : {result['ratio']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
