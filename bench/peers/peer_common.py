"""Helpers shared by bench/compare.py and the peer runner scripts.

Standard library only: the runners execute inside the peers' own venvs
(bench/peers/envs/<peer>), which have nothing of Kiln's.

Workload file (JSON), written by compare.py, read by every runner:

    {"items": [{"prompt_token_ids": [...], "max_tokens": N}, ...],
     "batch1": {"prompts": [[...], [...], [...], [...]], "decode_tokens": 128}}
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / "bench" / "peers" / "envs"


def load_workload(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def batch1_decode(gen: Callable[[list[int], int], int], prompts: list[list[int]], decode_tokens: int) -> dict:
    """Batch-1 decode speed by difference, the same way for every engine.

    gen(prompt_ids, max_tokens) runs one request alone (greedy, exact length)
    and returns the number of tokens produced. Time(prompt, 1) is prefill
    plus one token; time(prompt', 1 + N) is the same plus N decode steps.
    Each pair uses two different prompts of the same length, so no prefix
    cache can skip the second prefill. Best of len(prompts)//2 pairs.
    """
    pairs = []
    for i in range(0, len(prompts) - 1, 2):
        t0 = time.perf_counter()
        n1 = gen(prompts[i], 1)
        t1 = time.perf_counter()
        nn = gen(prompts[i + 1], 1 + decode_tokens)
        t2 = time.perf_counter()
        assert n1 == 1 and nn == 1 + decode_tokens, (n1, nn)
        short, long = t1 - t0, t2 - t1
        # long <= short only happens when the machine is too noisy to measure: no figure then.
        rate = decode_tokens / (long - short) if long > short else None
        pairs.append({"prefill_plus_1_s": short, "total_s": long, "decode_tok_per_s": rate})
    valid = [p["decode_tok_per_s"] for p in pairs if p["decode_tok_per_s"] is not None]
    return {
        "decode_tok_per_s": max(valid) if valid else None,
        "decode_tokens": decode_tokens,
        "prompt_len": len(prompts[0]),
        "pairs": pairs,
    }


def find_preload_libs(venv: Path) -> list[str]:
    """tcmalloc and Intel OpenMP libraries vLLM's CPU backend asks to preload, if present."""
    found = []
    patterns = {
        "tcmalloc": [
            "lib/libtcmalloc_minimal.so*",
            "lib/libtcmalloc.so*",
            "lib/python3*/site-packages/**/libtcmalloc*.so*",
        ],
        "iomp": ["lib/libiomp5.so", "lib/python3*/site-packages/**/libiomp5.so"],
    }
    system = {
        "tcmalloc": [
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
        ],
        "iomp": [],
    }
    for kind, pats in patterns.items():
        hit = None
        for pat in pats:
            matches = sorted(glob.glob(str(venv / pat), recursive=True))
            if matches:
                hit = matches[0]
                break
        if hit is None:
            hit = next((p for p in system[kind] if os.path.exists(p)), None)
        if hit:
            found.append(hit)
    return found


def vllm_env(venv: Path, preload: bool = True, threads_bind: str | None = None, kv_gib: float = 4) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind or f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.pop("PYTHONPATH", None)
    if preload:
        libs = find_preload_libs(venv)
        if libs:
            env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env
