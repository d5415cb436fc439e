"""build_inputs: which rows are attended with the decodes and which as prefills."""
import pytest
import torch

from kiln.llm.parallel.plan import PlanChunk
from kiln.llm.request import Request
from kiln.llm.runner.inputs import build_inputs, is_decode_like
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler.output import ScheduledChunk

CPU = torch.device("cpu")


def request(prompt: int, generated: int) -> Request:
    return Request("r", list(range(prompt)), SamplingParams(), output_token_ids=list(range(prompt, prompt + generated)))


def test_generated_tokens_on_cached_context_are_decode_rows():
    decode = ScheduledChunk(request(40, 1), 40, 1, [0, 1, 2])
    verify = ScheduledChunk(request(40, 3), 42, 3, [3, 4, 5], draft_token_ids=[7, 8])
    assert is_decode_like(decode) and is_decode_like(verify)
    meta = build_inputs([decode, verify], 16, CPU).meta
    assert meta.num_decodes == 4 and not meta.prefills
    assert [g.context_lens.tolist() for g in meta.decode_groups] == [[41, 43, 44, 45]]


def test_a_prompts_tail_after_a_prefix_hit_is_a_prefill():
    """However few its tokens: the prefill kernel gives the prompt's rows the
    bits a prefill of the whole prompt gives them."""
    tail = ScheduledChunk(request(37, 0), 32, 5, [0, 1, 2])
    decode = ScheduledChunk(request(20, 1), 20, 1, [3, 4])
    assert tail.feeds_prompt and not is_decode_like(tail) and not decode.feeds_prompt
    meta = build_inputs([tail, decode], 16, CPU).meta
    assert meta.num_decodes == 1
    [prefill] = meta.prefills
    assert (prefill.q_start, prefill.q_len, prefill.ctx_len) == (1, 5, 37)
    assert prefill.block_table.tolist() == [0, 1, 2]


def test_a_chunk_reaching_past_the_prompt_counts_as_the_prompts():
    resumed = ScheduledChunk(request(30, 4), 28, 6, [0, 1, 2])  # prompt's last 2 tokens, then generated ones
    assert resumed.feeds_prompt and not is_decode_like(resumed)


def test_parallel_plans_carry_the_prompt_flag():
    tail = PlanChunk(0, [1, 2, 3], 32, 3, [0, 1, 2], True, feeds_prompt=True)
    decode = PlanChunk(1, [4], 40, 1, [3, 4, 5], True)
    assert not is_decode_like(tail) and is_decode_like(decode)
    meta = build_inputs([tail, decode], 16, CPU).meta
    assert meta.num_decodes == 1 and [p.q_len for p in meta.prefills] == [3]


def test_decode_tables_pad_every_group_to_the_widest():
    """Kernels that read exact contexts take all decode rows in one table."""
    chunks = [ScheduledChunk(request(n, 1), n, 1, list(range(10 * i, 10 * i + -(-(n + 1) // 16))))
              for i, n in enumerate([3, 40] + [20] * 15)]
    meta = build_inputs(chunks, 16, CPU).meta
    assert [g.num_seqs for g in meta.decode_groups] == [16, 1]
    tables, lens = meta.decode_tables()
    assert lens.tolist() == [4] + [21] * 15 + [41]
    assert tables.shape == (17, 3)
    assert tables[0].tolist() == [0, 0, 0] and tables[1].tolist() == [20, 21, 0] and tables[16].tolist() == [10, 11, 12]


def test_a_decode_groups_padding_mask_covers_each_rows_context():
    """Built on first use (the torch path's padded batch), from the group's tables and lengths."""
    short = ScheduledChunk(request(4, 1), 4, 1, [5])
    long = ScheduledChunk(request(19, 1), 19, 1, [2, 7])
    [group] = build_inputs([long, short], 16, CPU).meta.decode_groups
    assert "mask" not in vars(group)  # nothing built until asked
    mask = group.mask
    assert mask.shape == (2, 1, 1, 32) and mask.dtype == torch.bool
    assert mask[:, 0, 0].sum(1).tolist() == [5, 20] and mask[0, 0, 0, :5].all() and mask[1, 0, 0, :20].all()
    assert group.mask is mask


def test_a_step_sampling_every_row_in_order_needs_no_gather():
    """The runner hands the head the hidden states as they are when every row is
    sampled in order (decodes, verifications), else their sample rows."""
    decode = ScheduledChunk(request(40, 1), 40, 1, [0, 1, 2])
    verify = ScheduledChunk(request(40, 3), 42, 3, [3, 4, 5], draft_token_ids=[7, 8])
    every = build_inputs([decode, verify], 16, CPU)
    assert every.samples_every_row and every.sample_rows.tolist() == [0, 1, 2, 3]
    prompt = ScheduledChunk(request(20, 0), 0, 20, [6, 7])  # a whole prompt: its last row only
    partial = build_inputs([decode, prompt], 16, CPU)
    assert not partial.samples_every_row and partial.sample_rows.tolist() == [0, 20]
    unsampled = ScheduledChunk(request(40, 0), 0, 16, [8])  # a prompt's first chunk: not sampled
    assert not unsampled.sample and not build_inputs([decode, unsampled], 16, CPU).samples_every_row


def test_long_tensors_are_what_torch_tensor_makes():
    from kiln.llm.runner.inputs import long_tensor

    for values in ([], [7], [0, 5, 2**40, -3], [[1, 2], [3, 4], [5, 6]], [[]]):
        made, expected = long_tensor(values, CPU), torch.tensor(values, dtype=torch.long)
        assert made.dtype == torch.long and made.shape == expected.shape and torch.equal(made, expected)
    with pytest.raises(ValueError):
        long_tensor([[1, 2], [3], [4, 5, 6]], CPU)  # ragged, though 6 values would fill 3 x 2
