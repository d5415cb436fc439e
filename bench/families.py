"""Offline throughput of every model family next to Llama of the same size.

Builds a random-weight checkpoint of each family with transformers' own
classes (same hidden size, layers, heads and MLP width as the Llama; the
mixture-of-experts families with top-2 experts each half as wide, so their
active parameters per token equal the Llama's), then times Kiln's offline
generation on one workload of random token ids (greedy, ignore_eos),
alternating each family with the Llama in one process, round after round
(the machine is shared and noisy: the ratios of neighbouring runs are the
figure, the median of the rounds is reported).

    .venv/bin/python bench/families.py [--rounds 3] [--num-requests 32] [--families gemma2,mixtral]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kiln import LLM, SamplingParams
from kiln.llm.models.default_model import default_model_path
from kiln.llm.tokenizer import load_tokenizer

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 512, 4, 8, 4, 64, 1536, 8192
COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=1024,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
WINDOW = 128  # sliding window of the families that have one: shorter than most contexts here


def family_configs() -> dict[str, tuple[Any, Any]]:
    """family -> (config, model class) of transformers, equal in (active) parameters to the Llama."""
    import transformers as t

    moe = dict(num_experts_per_tok=2)
    return {
        "llama": (t.LlamaConfig(**COMMON), t.LlamaForCausalLM),
        "mistral": (t.MistralConfig(**COMMON, sliding_window=WINDOW), t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config(**COMMON), t.Qwen2ForCausalLM),
        "qwen3": (t.Qwen3Config(**COMMON), t.Qwen3ForCausalLM),
        "phi3": (t.Phi3Config(**COMMON, pad_token_id=0), t.Phi3ForCausalLM),
        "gemma2": (t.Gemma2Config(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM, pad_token_id=0),
                   t.Gemma2ForCausalLM),
        "gemma3": (t.Gemma3TextConfig(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM,
                                      pad_token_id=0), t.Gemma3ForCausalLM),
        "mixtral": (t.MixtralConfig(**{**COMMON, "intermediate_size": INTER // 2}, num_local_experts=8, **moe),
                    t.MixtralForCausalLM),
        "qwen3_moe": (t.Qwen3MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=INTER // 2,
                                       norm_topk_prob=True, **moe), t.Qwen3MoeForCausalLM),
    }


def build(directory: Path, config: Any, model_class: Any, tokenizer: Any) -> Path:
    """The checkpoint, with SmolLM2's tokenizer (the workload's ids are below VOCAB, so any fits)."""
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.hf.save_pretrained(directory)
    return directory


def active_params(llm: LLM) -> int:
    """Parameters one token's forward pass reads (a MoE layer: top-k of its experts)."""
    a = llm.engine.arch
    total = sum(p.numel() for p in llm.engine.core.runner.model.parameters())
    if a.moe is None:
        return total
    expert = 3 * a.hidden_size * a.moe.intermediate_size
    sparse = sum(a.is_moe_layer(i) for i in range(a.num_layers))
    return total - sparse * (a.moe.num_experts - a.moe.top_k) * expert


def workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for _ in range(n):
        length = int(torch.randint(64, 257, (1,), generator=g))
        prompts.append(torch.randint(3, VOCAB, (length,), generator=g).tolist())
        out = int(torch.randint(32, 97, (1,), generator=g))
        params.append(SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
    return prompts, params


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--families", default="", help="comma-separated (default: all)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="bench/results/families.json")
    args = ap.parse_args()
    configs = family_configs()
    wanted = [f for f in (args.families.split(",") if args.families else configs) if f != "llama"]
    prompts, params = workload(args.num_requests, seed=0)
    results: dict[str, Any] = {"args": vars(args), "threads": torch.get_num_threads(), "families": {}}
    tokenizer = load_tokenizer(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        options = dict(dtype=args.dtype, max_num_seqs=args.num_requests, kv_cache_memory_gib=0.5)
        engines = {
            name: LLM(str(build(Path(tmp) / name, *configs[name], tokenizer)), **options) for name in ["llama", *wanted]
        }
        for llm in engines.values():  # warm-up
            llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0))
        llama = engines["llama"]
        print(f"threads={torch.get_num_threads()} requests={len(prompts)} llama active params={active_params(llama)}")
        for name in wanted:
            ratios, rates = [], []
            for _ in range(args.rounds):
                base = timed(llama, prompts, params)
                rate = timed(engines[name], prompts, params)
                ratios.append(rate / base)
                rates.append((rate, base))
            entry = {
                "active_params": active_params(engines[name]), "ratio_median": statistics.median(ratios),
                "ratios": ratios, "tok_per_s": rates,
                "fused_decode": engines[name].engine.core.runner.model.fused_layers is not None,
            }
            results["families"][name] = entry
            print(f"{name:10s} active params {entry['active_params']:>9d}  tok/s vs llama "
                  + "  ".join(f"{r:.0f}/{b:.0f}" for r, b in rates) + f"  ratio {entry['ratio_median']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
