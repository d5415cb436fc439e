"""Kiln on one CUDA GPU with random weights of real model shapes, as one Markdown table.

Per model (Llama-3.2-1B and Llama-3.1-8B shapes, bf16, built in memory by
kiln.llm.engine.synthetic: no files):

- batch-1 decode through the engine (CUDA graphs on): tokens/s, and the bytes
  a step reads (every weight but the embedding table, of which one row is
  read, plus the KV cache at the mean context) per step time, against the
  device-to-device copy bandwidth measured first (bytes read + written per
  second of a 2 GiB copy). The same for the captured graph replayed alone
  (no scheduler, no sampler, no host work).
- throughput at batch 64/128/256: B requests of --prompt-len random tokens
  and --gen-len output tokens each (greedy, ignore_eos), output tokens per
  second of wall time, prefill included; against vLLM (offline, dummy
  weights) when it is importable, else Hugging Face transformers'
  `generate` on a random LlamaForCausalLM of the same shape, one static
  batch of the same prompts (min_new_tokens = max_new_tokens).

    python3 bench/gpu_bench.py                      # both models (~4 min on an H200)
    python3 bench/gpu_bench.py --models Llama-3.2-1B --batches 64 --no-reference
    python3 bench/gpu_bench.py --fake               # the table from made-up figures (no GPU)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_MODELS = ("Llama-3.2-1B", "Llama-3.1-8B")


@dataclasses.dataclass
class Row:
    model: str
    measure: str
    kiln: float
    unit: str
    reference: float | None = None
    note: str = ""


@dataclasses.dataclass
class Report:
    device: str
    software: str
    copy_gbps: float
    reference_name: str
    rows: list[Row]
    notes: list[str] = dataclasses.field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated: " + ", ".join(DEFAULT_MODELS))
    p.add_argument("--batches", default="64,128,256", help="throughput batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=128, help="timed batch-1 decode steps")
    p.add_argument("--no-reference", action="store_true", help="skip vLLM / HF transformers")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--fake", action="store_true", help="print the table of a made-up report (no GPU needed)")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    unknown = [m for m in args.models if m not in DEFAULT_MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {DEFAULT_MODELS}")
    if min(args.batches, default=1) < 1 or args.prompt_len < 1 or args.gen_len < 2 or args.decode_steps < 1:
        p.error("batches, --prompt-len, --decode-steps must be positive and --gen-len at least 2")
    return args


# ---- the table ----------------------------------------------------------------


def render(report: Report) -> str:
    ref = report.reference_name
    lines = [
        f"Device: {report.device}; {report.software}; device-to-device copy {report.copy_gbps:,.0f} GB/s.",
        "",
        f"| model | measure | Kiln | {ref} | Kiln / {ref} | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        ref_cell = "-" if r.reference is None else f"{r.reference:,.1f}"
        ratio = "-" if not r.reference else f"{r.kiln / r.reference:.2f}x"
        lines.append(f"| {r.model} | {r.measure} ({r.unit}) | {r.kiln:,.1f} | {ref_cell} | {ratio} | {r.note} |")
    lines += [f"- {n}" for n in report.notes]
    return "\n".join(lines)


def fake_report() -> Report:
    rows = [
        Row("Llama-3.1-8B", "batch-1 decode", 190.0, "tok/s", 40.0),
        Row("Llama-3.1-8B", "batch-1 decode, bytes read / step time", 3000.0, "GB/s", note="70% of copy"),
        Row("Llama-3.1-8B", "throughput, batch 64", 5000.0, "tok/s", 2500.0),
    ]
    return Report("FAKE (no GPU)", "made-up figures", 4300.0, "HF transformers generate", rows, ["a note"])


# ---- measurements (need CUDA) ---------------------------------------------------


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    import torch

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    return 2 * gib * 2**30 / seconds / 1e9


def engine_config(args, **overrides):
    from kiln.config import EngineConfig

    options = dict(
        device="cuda", dtype="bfloat16", max_model_len=max(1024, args.prompt_len + args.gen_len + 64),
        kv_cache_memory_gib=12.0, max_num_seqs=max(256, *args.batches), max_num_batched_tokens=8192,
        enable_prefix_caching=False, cuda_graph_max_batch_size=256,
    )
    return EngineConfig.from_flat(**{**options, **overrides})


def read_bytes_per_step(model, arch, context: float) -> float:
    """Every weight a decode step reads (not the embedding table unless it is
    the LM head too) plus the KV cache at `context` tokens."""
    seen: dict[int, int] = {}
    for name, p in model.named_parameters():
        if name == "embed_tokens" and not arch.tie_word_embeddings:
            continue
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2  # bf16 pool
    return sum(seen.values()) + context * kv_per_token


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1000, (n, length), generator=g).tolist()


def kiln_batch1(core, arch, args, copy_gbps: float, name: str) -> list[Row]:
    import torch

    from kiln.llm.engine.messages import EngineCoreRequest
    from kiln.llm.sampling_params import SamplingParams

    warm = 5
    params = SamplingParams(max_tokens=args.decode_steps + warm + 2, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest("b1", random_prompts(1, args.prompt_len, arch.vocab_size, 1)[0], params))
    for _ in range(1 + warm):  # prefill, then warm decode steps
        core.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.decode_steps):
        core.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - started) / args.decode_steps
    context = args.prompt_len + warm + args.decode_steps / 2
    nbytes = read_bytes_per_step(core.runner.model, arch, context)
    rows = [Row(name, "batch-1 decode", 1 / step_s, "tok/s")]
    gbps = nbytes / step_s / 1e9
    rows.append(Row(name, "batch-1 decode step, bytes read / time", gbps, "GB/s",
                    note=f"{100 * gbps / copy_gbps:.0f}% of copy; {nbytes / 1e9:.2f} GB/step, {step_s * 1e3:.2f} ms"))
    graphs = core.runner.cuda_graphs
    if graphs is not None and 1 in graphs.graphs:
        graph, _ = graphs.graphs[1]  # its buffers still hold the last step: replays rewrite the same slot
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_s = start.elapsed_time(end) / 1e3 / 50
        g = nbytes / replay_s / 1e9
        rows.append(Row(name, "batch-1 graph replay alone, bytes read / time", g, "GB/s",
                        note=f"{100 * g / copy_gbps:.0f}% of copy; {replay_s * 1e3:.2f} ms"))
    while core.has_unfinished():
        core.step()
    return rows


def kiln_throughput(core, arch, batch: int, args) -> float:
    import torch

    from kiln.llm.engine.synthetic import generate
    from kiln.llm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(batch, args.prompt_len, arch.vocab_size, batch)
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = generate(core, prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    assert all(len(o) == args.gen_len for o in outputs)
    return batch * args.gen_len / elapsed


def hf_model(arch):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=4096, tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def hf_generate_tok_s(model, arch, batch: int, prompt_len: int, gen_len: int) -> float:
    import torch

    ids = torch.tensor(random_prompts(batch, prompt_len, arch.vocab_size, batch), device="cuda")
    with torch.inference_mode():
        warm = ids[:2, :16]
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                             min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    assert out.shape[1] == prompt_len + gen_len
    return batch * gen_len / elapsed


def vllm_tok_s(arch, batches: list[int], args) -> dict[int, float]:
    """vLLM offline with dummy (random) weights of the same shape; needs only a config.json."""
    import tempfile

    from vllm import LLM, SamplingParams, TokensPrompt

    directory = tempfile.mkdtemp(prefix="kiln-vllm-")
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta, max_position_embeddings=4096,
        tie_word_embeddings=arch.tie_word_embeddings, torch_dtype="bfloat16", hidden_act="silu",
    )
    Path(directory, "config.json").write_text(json.dumps(config))
    llm = LLM(model=directory, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=args.prompt_len + args.gen_len + 64, gpu_memory_utilization=0.5, max_num_seqs=max(batches))
    params = SamplingParams(max_tokens=args.gen_len, min_tokens=args.gen_len, ignore_eos=True, temperature=0.0)
    out = {}
    for batch in batches:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in random_prompts(batch, args.prompt_len, arch.vocab_size,
                                                                            batch)]
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        out[batch] = batch * args.gen_len / (time.perf_counter() - started)
    del llm
    return out


def free_cuda() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def run(args) -> Report:
    import torch

    from kiln.llm.engine.synthetic import LLAMA_SHAPES, synthetic_engine_core

    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device visible (use --fake to see the table)")
    import triton

    copy_gbps = copy_bandwidth()
    use_vllm = not args.no_reference and importlib.util.find_spec("vllm") is not None
    reference_name = "vLLM" if use_vllm else "HF transformers generate"
    notes = []
    if not args.no_reference and not use_vllm:
        notes.append("vLLM is not installed on this machine: the reference is HF transformers `generate`, one "
                     "static batch, bf16, SDPA attention, random weights of the same shape.")
    rows: list[Row] = []
    for name in args.models:
        arch = LLAMA_SHAPES[name]
        started = time.perf_counter()
        core = synthetic_engine_core(arch, engine_config(args))
        notes.append(f"{name}: engine built (random weights, Triton compile, "
                     f"{len(core.runner.cuda_graphs.sizes) if core.runner.cuda_graphs else 0} CUDA graphs) in "
                     f"{time.perf_counter() - started:.1f} s.")
        batch1 = kiln_batch1(core, arch, args, copy_gbps, name)
        rows += batch1
        warm = argparse.Namespace(**{**vars(args), "gen_len": 4})
        kiln_throughput(core, arch, min(args.batches), warm)  # first prefill launches compile their kernels
        kiln = {b: kiln_throughput(core, arch, b, args) for b in args.batches}
        del core
        free_cuda()
        reference: dict[int, float] = {}
        batch1_ref = None
        if use_vllm:
            try:
                reference = vllm_tok_s(arch, [1, *args.batches], args)
                batch1_ref = reference.pop(1)
            except Exception as e:  # reported, not fatal: Kiln's figures stand alone
                notes.append(f"{name}: vLLM failed ({type(e).__name__}: {e}); no reference figures.")
        elif not args.no_reference:
            try:
                model = hf_model(arch)
                batch1_ref = hf_generate_tok_s(model, arch, 1, args.prompt_len, min(args.gen_len, 64))
                batch1[0].note = f"HF: {min(args.gen_len, 64)} new tokens, prefill included"
                reference = {b: hf_generate_tok_s(model, arch, b, args.prompt_len, args.gen_len)
                             for b in args.batches}
                del model
            except Exception as e:  # reported, not fatal: Kiln's figures stand alone
                notes.append(f"{name}: HF transformers failed ({type(e).__name__}: {e}); no reference figures.")
            free_cuda()
        batch1[0].reference = batch1_ref
        for b in args.batches:
            rows.append(Row(name, f"throughput, batch {b}, {args.prompt_len} in / {args.gen_len} out", kiln[b],
                            "output tok/s", reference.get(b)))
    props = torch.cuda.get_device_properties(0)
    device = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
    software = f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}"
    return Report(device, software, copy_gbps, reference_name, rows, notes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = fake_report() if args.fake else run(args)
    print(render(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
