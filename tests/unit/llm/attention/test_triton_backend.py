"""TritonPagedAttention (interpreter) against TorchPagedAttention on one
mixed step built by the runner's own build_inputs: plain decodes with ragged
contexts, a 3-token decode-like chunk (rows sharing a table), a chunk after
a prefix-cache hit and a fresh prompt. The reference runs in fp32 on the
widened pool; the pools written by both must then agree exactly."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[cuda]' or triton)")

from kiln.llm.attention.backend import TorchPagedAttention  # noqa: E402
from kiln.llm.attention.triton_backend import TritonPagedAttention, TritonPlan  # noqa: E402
from kiln.llm.request import Request  # noqa: E402
from kiln.llm.runner.inputs import build_inputs  # noqa: E402
from kiln.llm.sampling_params import SamplingParams  # noqa: E402
from kiln.llm.scheduler.output import ScheduledChunk  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 8, 2, 32, 48


def mixed_step(block_size, generator):
    order = iter(torch.randperm(NUM_BLOCKS, generator=generator).tolist())
    chunks = []
    # (tokens so far, prompt tokens, start, count): decodes, a decode-like chunk, a prefix hit, a
    # prompt's short tail after a prefix hit (a prefill), a fresh prompt
    for i, (total, prompt, start, count) in enumerate([(130, 129, 129, 1), (7, 6, 6, 1), (300, 299, 299, 1),
                                                       (45, 42, 42, 3), (88, 88, 48, 40), (40, 40, 35, 5),
                                                       (70, 70, 0, 70)]):
        tokens = list(range(total))
        request = Request(f"r{i}", tokens[:prompt], SamplingParams(), output_token_ids=tokens[prompt:])
        blocks = [next(order) for _ in range(-(-total // block_size))]
        chunks.append(ScheduledChunk(request, start, count, blocks))
    return chunks


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_the_torch_reference_on_a_mixed_step(dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    chunks = mixed_step(block_size, g)
    inputs = build_inputs(chunks, block_size, torch.device("cpu"))
    tokens = inputs.input_ids.numel()
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    pool = torch.randn(2, NUM_BLOCKS * block_size, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    ref_pool = pool.float()

    out = TritonPagedAttention().forward(q, k, v, pool, inputs.meta)
    ref_inputs = build_inputs(chunks, block_size, torch.device("cpu"))
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), ref_pool, ref_inputs.meta)

    assert out.dtype == dtype and isinstance(inputs.meta.kernel_plan, TritonPlan)
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert torch.equal(pool.float(), ref_pool)


def test_the_plan_is_built_once_per_step():
    g = torch.Generator().manual_seed(0)
    inputs = build_inputs(mixed_step(16, g), 16, torch.device("cpu"))
    tokens = inputs.input_ids.numel()
    pool = torch.zeros(2, NUM_BLOCKS * 16, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    backend = TritonPagedAttention()
    args = (torch.randn(tokens, HEADS, HEAD_DIM).half(), torch.randn(tokens, KV_HEADS, HEAD_DIM).half(),
            torch.randn(tokens, KV_HEADS, HEAD_DIM).half())
    first = backend.forward(*args, pool, inputs.meta)
    plan = inputs.meta.kernel_plan
    assert plan.num_decodes == 6 and plan.decode.block_tables.shape[0] == 6
    assert plan.prefill.max_q_len == 70 and plan.prefill.prefix_lens.tolist() == [48, 35, 0]  # the tail: a prefill
    second = backend.forward(*args, pool, inputs.meta)  # layer 2: same plan object, same result
    assert inputs.meta.kernel_plan is plan and torch.equal(first, second)


def test_an_engine_generates_the_same_tokens_with_either_backend():
    """Chunked prefills (a 32-token budget), prefix-cache hits (shared
    prompt heads), decodes: fp32, so both backends compute the same sums up
    to rounding order, and greedy tokens must agree."""
    from kiln.config import EngineConfig
    from kiln.llm.engine.synthetic import generate, synthetic_engine_core
    from kiln.llm.models.arch import LlamaArch

    arch = LlamaArch(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                     tie_word_embeddings=True)
    config = EngineConfig.from_flat(
        dtype="float32", max_model_len=128, num_blocks=40, max_num_batched_tokens=32, seed=3
    )
    shared = list(range(10, 50))
    prompts = [shared + [1, 2, 3], shared + [4], list(range(60, 65)), shared[:20] + [9] * 15]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for backend in (TorchPagedAttention, TritonPagedAttention):
        core = synthetic_engine_core(arch, config)
        model = core.runner.model
        model.fused_layers = None  # Kiln's fused CPU decode layer would bypass the backend
        for layer in model.layers:
            layer.self_attn.backend = backend()
        outputs.append(generate(core, prompts, params))
        assert core.scheduler.stats().prefix_cache_hits > 0
    assert outputs[0] == outputs[1]


def test_fp32_queries_attend_to_fresh_keys_as_a_16_bit_pool_rounds_them():
    """An fp32 model over a float16 pool: every prefill row (a fresh prompt,
    chunks after a prefix hit) sees its chunk's own keys and values rounded as
    the pool stores them, as the torch backend does (`as_stored`) and as a
    later chunk reads them back; unrounded, rows were up to 1e-3 apart. (Not
    bf16 here: Triton's interpreter truncates fp32 to bf16 where a GPU and
    torch round to nearest, so the two pools would differ.)"""
    pool_dtype = torch.float16
    g = torch.Generator().manual_seed(3)
    chunks = mixed_step(16, g)
    inputs = build_inputs(chunks, 16, torch.device("cpu"))
    tokens = inputs.input_ids.numel()
    q, k, v = (torch.randn(tokens, n, HEAD_DIM, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    pool = torch.randn(2, NUM_BLOCKS * 16, KV_HEADS, HEAD_DIM, generator=g).to(pool_dtype)
    ref_pool = pool.clone()

    out = TritonPagedAttention().forward(q, k, v, pool, inputs.meta)
    ref = TorchPagedAttention().forward(q, k, v, ref_pool, build_inputs(chunks, 16, torch.device("cpu")).meta)

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, ref_pool)
