"""llama.cpp (llama-cpp-python) on the shared workload: sequential, one request at a time.

Runs inside bench/peers/envs/llamacpp (needs only llama_cpp + the stdlib):

    bench/peers/envs/llamacpp/bin/python bench/peers/llamacpp_offline.py \
        --model SmolLM2-135M-Instruct.Q4_1.gguf --workload W.json --out R.json [--requests N] [--threads 2]

Same token ids as Kiln, greedy, exactly max_tokens per request: tokens come
from Llama.generate (which never stops on EOS itself), cut at max_tokens.
llama.cpp serves one sequence at a time here (the Python binding has no
continuous batching), so throughput = output tokens / wall time over the
requests run. Also reports batch-1 decode tok/s (peer_common.batch1_decode).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_common import batch1_decode, load_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=0, help="first N requests only (0 = all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-batch1", action="store_true")
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    wl = load_workload(args.workload)
    t0 = time.perf_counter()
    llm = Llama(
        model_path=args.model, n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.threads,
        n_threads_batch=args.threads, verbose=False, seed=0,
    )
    load_s = time.perf_counter() - t0

    def gen(ids: list[int], max_tokens: int) -> int:
        n = 0
        for _tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if n >= max_tokens:
                break
        return n

    result: dict = {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "model": args.model,
        "threads": args.threads,
        "load_s": load_s,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }
    items = wl["items"][: args.requests or None]
    gen(items[0]["prompt_token_ids"][:32], 4)  # warm-up
    if not args.skip_throughput:
        start = time.perf_counter()
        produced = sum(gen(it["prompt_token_ids"], it["max_tokens"]) for it in items)
        elapsed = time.perf_counter() - start
        expected = sum(it["max_tokens"] for it in items)
        assert produced == expected, (produced, expected)
        result["offline"] = {"requests": len(items), "output_tokens": produced, "seconds": elapsed,
                             "tok_per_s": produced / elapsed}
        print(f"llama.cpp offline: {produced} tokens in {elapsed:.1f}s = {produced / elapsed:.1f} tok/s "
              f"({len(items)} requests, sequential)", flush=True)
    if not args.skip_batch1 and wl.get("batch1"):
        b1 = batch1_decode(gen, wl["batch1"]["prompts"], wl["batch1"]["decode_tokens"])
        result["batch1"] = b1
        print(f"llama.cpp batch-1 decode: {b1['decode_tok_per_s'] or float('nan'):.1f} tok/s", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
