"""Grammar state in the engine core: masks per row (plain and speculative),
applied for constrained rows only, drafts trimmed to the grammar, compile cache."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar

from kiln.errors import InvalidRequestError
from kiln.llm.request import Request
from kiln.llm.sampling.sampler import Sampler
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler.output import ScheduledChunk
from kiln.llm.spec_decode.verify import row_requests
from kiln.llm.structured.backend import GrammarBackend
from kiln.llm.structured.masks import unpack_bitmask
from kiln.llm.structured.matchers import StructuredOutputs
from kiln.llm.structured.spec import GrammarSpec
from kiln.llm.tokenizer import load_tokenizer

VOCAB = 49152
EOS = 2
SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                     "additionalProperties": False})


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    return GrammarBackend(str(tiny_llama_dir), VOCAB)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def constrained(rid: str, spec: GrammarSpec, output: list[int] | None = None) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(temperature=0.0, structured=spec), (EOS,),
                   output_token_ids=list(output or []))


def ready(structured: StructuredOutputs, *requests: Request) -> None:
    for r in requests:
        structured.submit(r)
    while structured.pending:
        structured.wait_pending(1.0)
        structured.take_ready()


def reference_mask(backend: GrammarBackend, spec: GrammarSpec, tokens: list[int]) -> torch.Tensor:
    matcher = xgrammar.GrammarMatcher(backend.compile(spec), override_stop_tokens=[EOS])
    for t in tokens:
        assert matcher.accept_token(t)
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, VOCAB)[0]


def test_step_masks_match_the_grammar_for_plain_and_speculative_rows(backend, tokenizer):
    spec = GrammarSpec("json", SCHEMA)
    text = tokenizer.encode('{"n": 12', add_special_tokens=False)
    structured = StructuredOutputs(backend)
    a = constrained("a", spec, text[:2])
    b = constrained("b", spec)
    ready(structured, a, b)
    structured.accept(a)
    drafts = text[2:]
    chunks = [ScheduledChunk(a, a.num_tokens - 1, 1 + len(drafts), [0], drafts), ScheduledChunk(b, 0, 3, [1])]
    masks = structured.start_step(chunks)
    bitmask, rows = masks.result()
    assert sorted(rows) == [("a", 2 + i) for i in range(len(drafts) + 1)] + [("b", 0)]
    for (rid, n_out), row in rows.items():
        tokens = (text[:n_out]) if rid == "a" else []
        assert torch.equal(unpack_bitmask(bitmask[row : row + 1], VOCAB)[0], reference_mask(backend, spec, tokens))
    # the matcher was rolled back: the next fill is for output text[:2] again
    assert torch.equal(structured.start_step(chunks[:1]).result()[0][0], bitmask[rows[("a", 2)]])


def test_masks_reach_every_row_the_sampler_and_verifier_see(backend):
    spec = GrammarSpec("regex", "[0-9]{2}")
    structured = StructuredOutputs(backend)
    a = constrained("a", spec)
    free = Request("free", [1, 2], SamplingParams(temperature=0.0), (EOS,))
    ready(structured, a)
    sampler = Sampler()
    sampler.constraints = structured.start_step([ScheduledChunk(a, 0, 3, [0]), ScheduledChunk(free, 0, 2, [1])])
    logits = torch.randn(2, VOCAB)
    processed = sampler.process(logits.clone(), [a, free])
    allowed = reference_mask(backend, spec, [])
    assert torch.equal(torch.isfinite(processed[0]), allowed)
    assert torch.equal(processed[1], logits[1])  # an unconstrained row is untouched
    token = sampler(logits.clone(), [a, free])[0].token_id
    assert allowed[token] and token == int(logits[0].masked_fill(~allowed, float("-inf")).argmax())
    # a speculative chunk's rows: row i follows the drafts before it
    digit = int(allowed.nonzero()[0])
    sampler.constraints = structured.start_step([ScheduledChunk(a, 2, 2, [0], [digit])])
    rows = row_requests([ScheduledChunk(a, 2, 2, [0], [digit])])
    processed = sampler.process(torch.randn(2, VOCAB), rows)
    assert torch.equal(torch.isfinite(processed[1]), reference_mask(backend, spec, [digit]))


def test_drafts_are_trimmed_at_the_first_token_the_grammar_refuses(backend, tokenizer):
    spec = GrammarSpec("regex", "[a-c]+x")
    structured = StructuredOutputs(backend)
    a = constrained("a", spec)
    ready(structured, a)
    ok = tokenizer.encode("ab", add_special_tokens=False)
    bad = tokenizer.encode("zz", add_special_tokens=False)
    assert structured.trim_drafts(a, ok + bad + ok) == ok
    before = structured.start_step([ScheduledChunk(a, 0, 3, [0])]).result()[0]
    assert torch.equal(unpack_bitmask(before, VOCAB)[0], reference_mask(backend, spec, []))


def test_accept_follows_the_output_and_reports_a_refused_token(backend, tokenizer):
    structured = StructuredOutputs(backend)
    a = constrained("a", GrammarSpec("regex", "[0-9]+"))
    ready(structured, a)
    a.output_token_ids += tokenizer.encode("12", add_special_tokens=False)
    assert structured.accept(a) is None and structured.consumed["a"] == a.num_output_tokens
    a.output_token_ids += tokenizer.encode("x", add_special_tokens=False)
    assert "rejected" in structured.accept(a)


def test_compiled_grammars_are_cached_and_bad_ones_fail_with_a_400(backend):
    spec = GrammarSpec("json", SCHEMA)
    assert backend.compile(spec) is backend.compile(GrammarSpec("json", SCHEMA))
    assert backend.compile_async(spec).result() is backend.compile(spec)
    with pytest.raises(InvalidRequestError, match="Unclosed"):
        backend.compile(GrammarSpec("regex", "[0-9"))
    structured = StructuredOutputs(backend)
    r = constrained("r", GrammarSpec("regex", "(a"))
    structured.submit(r)
    structured.wait_pending(5.0)
    ready_now, failed = structured.take_ready()
    assert ready_now == [] and failed[0][0] is r and "parenthesis" in failed[0][1]
