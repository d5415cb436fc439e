"""Cost of the grammar mask: output tokens/s with and without a JSON schema.

Same chat prompts, greedy, exactly --max-tokens output tokens per request in
both arms: unconstrained runs with ignore_eos; constrained runs follow a
schema of at least 50 nested objects (tests/integration/llm/structured_schemas.py's
"person"), so no request can finish before --max-tokens. At batch 1 and 32 (all
requests submitted at once). The arms alternate, --repeats rounds; each cell
is the median. Reported: output tok/s of each arm and constrained/unconstrained.

    .venv/bin/python bench/structured_outputs.py [--max-tokens 64] [--batches 1 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln import LLM, SamplingParams  # noqa: E402
from kiln.llm.structured.spec import GrammarSpec  # noqa: E402
from tests.integration.llm.structured_schemas import SCHEMAS  # noqa: E402

PEOPLE = {"type": "array", "items": SCHEMAS["person"], "minItems": 50}
TOPICS = ["engineers", "painters", "sailors", "farmers", "doctors", "poets", "pilots", "chefs"]


def prompts(llm: LLM, n: int) -> list[list[int]]:
    texts = [f"List fictional {TOPICS[i % len(TOPICS)]} as JSON (#{i})." for i in range(n)]
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def tok_per_s(llm: LLM, batch: list[list[int]], max_tokens: int, constrained: bool) -> float:
    spec = GrammarSpec("json", json.dumps(PEOPLE)) if constrained else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not constrained, structured=spec)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == max_tokens * len(batch), "a request finished early: lengths differ between the arms"
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the installed SmolLM2")
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory_gib=1.0) if args.model else LLM(kv_cache_memory_gib=1.0)
    tok_per_s(llm, prompts(llm, 2), 8, True)  # warm-up: tokenizer info, compile, kernels
    print(f"{'batch':>5} {'plain tok/s':>12} {'json tok/s':>11} {'ratio':>6}")
    for batch_size in args.batches:
        batch = prompts(llm, batch_size)
        plain, constrained = [], []
        for _ in range(args.repeats):
            plain.append(tok_per_s(llm, batch, args.max_tokens, False))
            constrained.append(tok_per_s(llm, batch, args.max_tokens, True))
        a, b = statistics.median(plain), statistics.median(constrained)
        print(f"{batch_size:>5} {a:>12.1f} {b:>11.1f} {b / a:>6.3f}", flush=True)


if __name__ == "__main__":
    main()
