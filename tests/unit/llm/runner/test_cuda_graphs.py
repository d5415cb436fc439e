"""The CPU-side logic of decode CUDA graphs: which sizes are captured, how a
batch is padded, which steps qualify, what the persistent buffers hold, and
(Triton's interpreter, CPU tensors) that a model step read through padded
buffers gives the eager step's logits and KV writes. Capture and replay
themselves need a GPU: tests/gpu/test_cuda_graphs.py."""
import pytest
import torch

from kiln.llm.models.arch import LlamaArch
from kiln.llm.request import Request
from kiln.llm.runner.cuda_graphs import DecodeBuffers, capture_sizes, is_graph_step, padded_size
from kiln.llm.runner.inputs import build_inputs
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler.output import ScheduledChunk

BLOCK = 16
CPU = torch.device("cpu")


def chunk(i, total, start, count, first_block, draft=()):
    """Tokens from `start` on are generated ones (a decode's, a verification's), none when start is 0."""
    tokens = list(range(3, 3 + total))
    prompt = start or total
    request = Request(f"r{i}", tokens[:prompt], SamplingParams(), output_token_ids=tokens[prompt:])
    blocks = list(range(first_block, first_block + -(-(total + len(draft)) // BLOCK)))
    return ScheduledChunk(request, start, count, blocks, list(draft))


def decodes(contexts):
    """One decode chunk per context length (its new token included), disjoint blocks."""
    chunks, first = [], 1
    for i, n in enumerate(contexts):
        chunks.append(chunk(i, n, n - 1, 1, first))
        first += -(-n // BLOCK)
    return chunks


def test_capture_sizes_hold_every_power_of_two():
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert all(1 << k in sizes for k in range(9))
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1] and capture_sizes(3) == [1, 2, 3]


def test_padding_goes_to_the_next_captured_size():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 17, 63, 64)] == [1, 4, 8, 8, 16, 24, 64, 64]
    assert padded_size(65, sizes) is None


def test_padding_keeps_the_decode_kernel_split_count():
    pytest.importorskip("triton", reason="triton is not installed")
    from kiln.llm.attention.triton_decode import max_splits_for

    sizes = capture_sizes(256)
    for n in range(1, 257):
        for kv_heads, sms in ((8, 132), (2, 4), (1, 16)):
            assert max_splits_for(n, kv_heads, sms) == max_splits_for(padded_size(n, sizes), kv_heads, sms)


def test_only_plain_decode_steps_qualify():
    assert is_graph_step(build_inputs(decodes([5, 40, 17]), BLOCK, CPU))
    prefill = [*decodes([5]), chunk(9, 30, 0, 30, 20)]
    assert not is_graph_step(build_inputs(prefill, BLOCK, CPU))
    decode_like = [*decodes([5]), chunk(9, 30, 27, 3, 20)]  # 3 rows of one chunk, one sampled
    assert not is_graph_step(build_inputs(decode_like, BLOCK, CPU))
    spec = [*decodes([5]), chunk(9, 30, 29, 3, 20, draft=(7, 8))]
    assert not is_graph_step(build_inputs(spec, BLOCK, CPU))


def test_buffers_hold_the_step_and_inert_padding():
    contexts = [5, 40, 17, 33, 2]
    chunks = decodes(contexts)
    inputs = build_inputs(chunks, BLOCK, CPU)
    buffers = DecodeBuffers(max_batch=16, max_blocks_per_seq=8, device=CPU)
    buffers.block_tables.fill_(99)  # stale rows from an earlier, longer step
    buffers.load(inputs, batch=8)
    order = sorted(range(len(contexts)), key=lambda i: contexts[i])  # build_inputs sorts decodes by start
    n = len(contexts)
    assert buffers.input_ids[:n].tolist() == [chunks[i].token_ids()[0] for i in order]
    assert buffers.positions[:n].tolist() == [contexts[i] - 1 for i in order]
    assert torch.equal(buffers.slot_mapping[:n], inputs.meta.slot_mapping)
    assert buffers.context_lens[:n].tolist() == [contexts[i] for i in order]
    for row, i in enumerate(order):
        used = -(-contexts[i] // BLOCK)
        assert buffers.block_tables[row, :used].tolist() == chunks[i].block_ids[:used]
    assert buffers.slot_mapping[n:8].tolist() == [-1] * 3  # no KV write
    assert buffers.context_lens[n:8].tolist() == [0] * 3  # attention gives 0
    assert buffers.input_ids[n:8].tolist() == [0] * 3 and buffers.positions[n:8].tolist() == [0] * 3
    meta = buffers.metadata(8, BLOCK, num_kv_heads=2) if _has_triton() else None
    if meta is not None:
        assert meta.num_decodes == 8 and meta.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
        assert meta.kernel_plan.decode.block_tables.shape == (8, 8)


def _has_triton() -> bool:
    from kiln.llm.kernels.triton_env import triton_available

    return triton_available()


ARCH = LlamaArch(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
    tie_word_embeddings=True,
)


def test_a_padded_buffer_step_matches_the_eager_step(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    from kiln.llm.attention.triton_backend import TritonPagedAttention
    from kiln.llm.models.llama import LlamaModel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    model = LlamaModel(ARCH, max_positions=256, backend=TritonPagedAttention()).eval()
    for name, p in model.named_parameters():
        p.data.fill_(1.0) if "norm" in name else p.data.normal_(0, 0.1)
    contexts = [5, 40, 17]
    chunks = decodes(contexts)
    inputs = build_inputs(chunks, BLOCK, CPU)
    pool = [torch.randn(2, 8 * BLOCK, ARCH.num_kv_heads, ARCH.head_dim) for _ in range(ARCH.num_layers)]
    eager_pool = [p.clone() for p in pool]
    with torch.inference_mode():
        eager = model.compute_logits(model(inputs.input_ids, inputs.positions, eager_pool, inputs.meta))
        buffers = DecodeBuffers(max_batch=8, max_blocks_per_seq=256 // BLOCK, device=CPU)
        buffers.load(inputs, batch=4)
        meta = buffers.metadata(4, BLOCK, ARCH.num_kv_heads)
        padded = model.compute_logits(model(buffers.input_ids[:4], buffers.positions[:4], pool, meta))
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(pool, eager_pool, strict=True):
        assert torch.equal(a, b)  # the padded row wrote nothing
