"""The engine on CUDA: decode CUDA graphs give the eager path's tokens; the
Triton backend gives the torch reference's tokens; an fp8 KV pool runs end
to end. Random-weight models built in memory (kiln.llm.engine.synthetic)."""
import pytest
import torch

from kiln.config import EngineConfig
from kiln.llm.engine.synthetic import generate, synthetic_engine_core
from kiln.llm.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def engine(arch, **options):
    options = {"device": "cuda", "dtype": "bfloat16", "max_model_len": 512, "num_blocks": 256, **options}
    return synthetic_engine_core(arch, EngineConfig.from_flat(**options))


def prompts(n):
    return [[(7 * i + j) % 500 + 1 for j in range(20 + 13 * i)] for i in range(n)]


def count_replays(core):
    graphs = core.runner.cuda_graphs
    calls = {"replayed": 0}
    original = graphs.logits

    def counted(inputs):
        out = original(inputs)
        calls["replayed"] += out is not None
        return out

    graphs.logits = counted
    return calls


def test_graphs_are_captured_and_replay_the_eager_tokens_at_a_captured_size(tiny_arch):
    graphed = engine(tiny_arch)
    assert graphed.runner.cuda_graphs is not None and 8 in graphed.runner.cuda_graphs.graphs
    calls = count_replays(graphed)
    eager = engine(tiny_arch, enable_cuda_graphs=False)
    assert eager.runner.cuda_graphs is None
    assert generate(graphed, prompts(8), GREEDY) == generate(eager, prompts(8), GREEDY)
    assert calls["replayed"] >= GREEDY.max_tokens - 2


def test_a_padded_graph_step_matches_the_eager_step(tiny_arch):
    from kiln.llm.request import Request
    from kiln.llm.runner.inputs import build_inputs
    from kiln.llm.scheduler.output import ScheduledChunk

    core = engine(tiny_arch)
    runner = core.runner
    for cache in runner.kv_caches:
        cache.normal_()
    # decodes: each request's last token is its one generated token
    chunks = [ScheduledChunk(Request(f"r{i}", list(range(1, 39 + 9 * i)), GREEDY, output_token_ids=[39 + 9 * i]),
                             38 + 9 * i, 1, list(range(8 * i, 8 * i + 8))) for i in range(5)]
    before = [c.clone() for c in runner.kv_caches]
    inputs = build_inputs(chunks, 16, runner.device)
    with torch.inference_mode():
        replayed = runner.cuda_graphs.logits(inputs)  # 5 rows padded to 8
        after_graph = [c.clone() for c in runner.kv_caches]
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, build_inputs(
            chunks, 16, runner.device).meta)
        eager = runner.model.compute_logits(hidden[inputs.sample_rows])
    torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)
    written = inputs.meta.slot_mapping
    for old, new in zip(before, after_graph, strict=True):
        untouched = torch.ones(old.shape[1], dtype=torch.bool, device=old.device)
        untouched[written] = False
        assert torch.equal(old[:, untouched], new[:, untouched])  # padded rows wrote nothing


def test_triton_and_torch_reference_backends_agree(tiny_arch, monkeypatch):
    triton_core = engine(tiny_arch, dtype="float32")
    monkeypatch.setenv("KILN_ATTENTION", "torch")
    torch_core = engine(tiny_arch, dtype="float32")
    assert torch_core.runner.cuda_graphs is None  # graphs need the Triton backend
    assert generate(triton_core, prompts(6), GREEDY) == generate(torch_core, prompts(6), GREEDY)


def test_fp8_kv_pool_runs_end_to_end(tiny_arch):
    fp8 = engine(tiny_arch, kv_cache_dtype="fp8_e4m3")
    assert all(c.dtype == torch.float8_e4m3fn for c in fp8.runner.kv_caches)
    out = generate(fp8, prompts(4), GREEDY)
    ref = generate(engine(tiny_arch), prompts(4), GREEDY)
    assert all(len(o) == GREEDY.max_tokens and all(0 <= t < tiny_arch.vocab_size for t in o) for o in out)
    # first tokens come from prefill, which reads the chunk's own unrounded keys
    assert [o[0] for o in out] == [r[0] for r in ref]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 over NCCL needs 2 GPUs")
def test_tensor_parallel_2_over_nccl_matches_one_gpu(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.llm.engine.builder import build_engine_core

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    outputs = []
    for tp in (1, 2):
        core, _ = build_engine_core(EngineConfig.from_flat(
            model=str(tmp_path), device="cuda", tensor_parallel_size=tp, num_blocks=128, max_model_len=256))
        try:
            outputs.append(generate(core, prompts(4), GREEDY))
        finally:
            core.shutdown()
    assert outputs[0] == outputs[1]
