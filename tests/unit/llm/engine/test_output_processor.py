"""OutputProcessor on a byte-level tokenizer with known pieces: incremental
detokenization (a character split across tokens is held back), stop strings
found across token boundaries (held back while they might start), logprobs
passed through, and a request finished by a stop string aborted in the core."""
from __future__ import annotations

from kiln.config import EngineConfig
from kiln.llm.engine.core import EngineCore
from kiln.llm.engine.messages import EngineCoreOutput, EngineCoreRequest
from kiln.llm.engine.output_processor import OutputProcessor
from kiln.llm.outputs import TokenLogprob
from kiln.llm.sampling_params import SamplingParams
from tests.unit.llm.engine.fakes import ByteTokenizer, ScriptedRunner, as_runner

EOS = 0
PIECES = {
    EOS: b"</s>", 1: b"He", 2: b"llo", 3: b" w", 6: b"\xc3", 7: b"\xa9",  # 6 + 7 = "é"
    8: b"xx E", 9: b"N", 10: b"D yy", 11: b"!",
}
TOKENIZER = ByteTokenizer(PIECES, special=frozenset({EOS}))
# "xx E" + "N" + "D yy": the stop string "END" spans three tokens
STOP_STRING_PIECES = [EngineCoreOutput("r", [8]), EngineCoreOutput("r", [9]), EngineCoreOutput("r", [10])]


def processor(rid="r", **params) -> OutputProcessor:
    proc = OutputProcessor(TOKENIZER)
    proc.add(rid, "prompt", [11, 11], SamplingParams(max_tokens=10, **params))
    return proc


def feed(proc, *outputs):
    """Process one core output per step; (deltas, final RequestOutput, abort lists)."""
    deltas, aborts, last = [], [], None
    for out in outputs:
        results, to_abort = proc.process([out])
        aborts.append(to_abort)
        if results:
            (last,) = results
            deltas.append(last.delta_text)
    return deltas, last, aborts


def test_text_streams_incrementally_and_holds_back_a_split_character():
    proc = processor()
    deltas, last, aborts = feed(
        proc, EngineCoreOutput("r", [1]), EngineCoreOutput("r", [2, 6]), EngineCoreOutput("r", [7]),
        EngineCoreOutput("r", [3], finish_reason="length"),
    )
    assert deltas == ["He", "", "lloé", " w"]
    assert last.finished and last.outputs[0].text == "Helloé w" == TOKENIZER.decode([1, 2, 6, 7, 3])
    assert last.outputs[0].token_ids == [1, 2, 6, 7, 3] and last.outputs[0].finish_reason == "length"
    assert aborts == [[], [], [], []]
    assert proc.states == {}  # finished: forgotten


def test_an_incomplete_character_is_flushed_when_the_request_ends():
    deltas, last, _ = feed(processor(), EngineCoreOutput("r", [1]), EngineCoreOutput("r", [6], finish_reason="length"))
    assert deltas == ["He", "\ufffd"] and last.outputs[0].text == "He\ufffd"


def test_a_stop_string_across_tokens_ends_the_request_and_asks_for_its_abort():
    proc = processor(stop=["END"])
    deltas, last, aborts = feed(proc, *STOP_STRING_PIECES)
    # "xx E" and "xx EN" might still begin "END": the last two characters wait
    assert deltas == ["xx", " ", ""]
    assert last.finished and last.outputs[0].text == "xx "
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", "END")
    assert last.outputs[0].token_ids == [8, 9, 10]
    assert aborts == [[], [], ["r"]]
    # a token the core made before the abort reached it is dropped
    assert proc.process([EngineCoreOutput("r", [11])]) == ([], [])


def test_include_stop_str_in_output_keeps_the_stop_string():
    proc = processor(stop=["END"], include_stop_str_in_output=True)
    deltas, last, _ = feed(proc, *STOP_STRING_PIECES)
    assert deltas == ["xx", " ", "END"] and last.outputs[0].text == "xx END"


def test_a_stop_token_is_reported_but_not_printed():
    deltas, last, _ = feed(
        processor(), EngineCoreOutput("r", [1]), EngineCoreOutput("r", [EOS], finish_reason="stop", stop_token_id=EOS)
    )
    assert deltas == ["He", ""] and last.outputs[0].text == "He"
    assert (last.outputs[0].stop_reason, last.outputs[0].token_ids) == (EOS, [1, EOS])


def test_a_stop_string_in_the_last_tokens_wins_over_the_length_finish():
    # The core ends the request at max_tokens with "D yy": the text still ends
    # before "END", finished by it, and nothing is left to abort.
    pieces = [*STOP_STRING_PIECES[:2], EngineCoreOutput("r", [10], finish_reason="length")]
    _, last, aborts = feed(processor(stop=["END"]), *pieces)
    assert (last.outputs[0].text, last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("xx ", "stop", "END")
    assert aborts == [[], [], []]
    # and over a stop token in the same step (a draft's accepted tokens come several at a time)
    _, last, _ = feed(processor(stop=["END"]), EngineCoreOutput("r", [8, 9, 10, EOS], finish_reason="stop",
                                                                 stop_token_id=EOS))
    assert (last.outputs[0].text, last.outputs[0].stop_reason) == ("xx ", "END")


def test_min_tokens_holds_off_stop_strings_as_it_holds_off_stop_tokens():
    # "END" is complete at the third token; with min_tokens 4 it does not count,
    # and an "END" ended before the fourth token never counts later either.
    pieces = [*STOP_STRING_PIECES, EngineCoreOutput("r", [1]), EngineCoreOutput("r", [2], finish_reason="length")]
    deltas, last, aborts = feed(processor(stop=["END"], min_tokens=4), *pieces)
    assert last.outputs[0].text == "xx END yyHello" and last.outputs[0].finish_reason == "length"
    assert "".join(deltas) == last.outputs[0].text and aborts == [[]] * 5
    # "D yy" ends the third token's text, so it is still held back at the fourth: not a stop either
    _, last, _ = feed(processor(stop=["D yy"], min_tokens=4), *pieces)
    assert last.outputs[0].text == "xx END yyHello" and last.outputs[0].finish_reason == "length"
    # as no stop token can be token min_tokens, no stop string can end in it (vLLM: checked
    # once the output is longer than min_tokens); one ending in the token after it counts
    _, last, _ = feed(processor(stop=["END"], min_tokens=3), *pieces)
    assert last.outputs[0].finish_reason == "length"
    _, last, aborts = feed(processor(stop=["END"], min_tokens=2), *STOP_STRING_PIECES)
    assert (last.outputs[0].text, last.outputs[0].stop_reason, aborts[-1]) == ("xx ", "END", ["r"])
    # one that begins by token min_tokens and ends after it counts too (vLLM looks back a stop's length)
    _, last, _ = feed(processor(stop=["yyHe"], min_tokens=3), *pieces)
    assert (last.outputs[0].text, last.outputs[0].stop_reason) == ("xx END ", "yyHe")


def test_stop_strings_in_a_step_of_several_tokens_count_token_by_token():
    # Speculative decoding hands several accepted tokens over at once: the tokens after
    # the one that ends a stop string are not output, and min_tokens holds per token.
    _, last, aborts = feed(processor(stop=["END"]), EngineCoreOutput("r", [8, 9, 10, 11, 1]))
    assert (last.outputs[0].text, last.outputs[0].token_ids, aborts) == ("xx ", [8, 9, 10], [["r"]])
    assert last.delta_token_ids == [8, 9, 10]
    several = [EngineCoreOutput("r", [8, 9, 10, 1]), EngineCoreOutput("r", [2], finish_reason="length")]
    _, last, aborts = feed(processor(stop=["END"], min_tokens=3), *several)
    assert (last.outputs[0].text, last.outputs[0].finish_reason, aborts) == ("xx END yyHello", "length", [[], []])


def test_logprobs_pass_through_and_accumulate():
    first = [TokenLogprob(1, -0.25, [(1, -0.25), (2, -2.0)])]
    second = [TokenLogprob(2, -1.0, [(2, -1.0), (3, -1.5)])]
    proc = processor(logprobs=1)
    results, _ = proc.process([EngineCoreOutput("r", [1], new_logprobs=first)])
    assert results[0].delta_logprobs == first
    results, _ = proc.process([EngineCoreOutput("r", [2], new_logprobs=second, finish_reason="length")])
    assert results[0].delta_logprobs == second
    assert results[0].outputs[0].logprobs == first + second
    # without logprobs asked, the completion carries none
    plain = processor()
    results, _ = plain.process([EngineCoreOutput("r", [1], finish_reason="length")])
    assert results[0].outputs[0].logprobs is None


def test_dropped_requests_get_no_more_outputs():
    proc = processor()
    proc.drop("r")
    assert proc.process([EngineCoreOutput("r", [1])]) == ([], [])


def test_the_core_aborts_a_request_its_stop_string_finished():
    """The LLMEngine loop: core step -> output processing -> abort what a stop string ended."""
    config = EngineConfig.from_flat(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    runner = ScriptedRunner({"r": [8, 9, 10, 11, 11]})
    core = EngineCore(config, as_runner(runner), 8, max_model_len=64)
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=["END"])
    core.add_request(EngineCoreRequest("r", [11, 11, 11], params, eos_token_ids=(EOS,)))
    proc = OutputProcessor(TOKENIZER)
    proc.add("r", None, [11, 11, 11], params)
    texts = []
    while core.has_unfinished():
        results, to_abort = proc.process(core.step().outputs)
        core.abort_requests(to_abort)
        texts += [r.outputs[0].text for r in results if r.finished]
    assert texts == ["xx "]
    assert runner.steps == [[("r", 0, 3)], [("r", 3, 1)], [("r", 4, 1)]]  # 2 of 5 max tokens never run
    assert runner.sampler.forgotten == ["r"]
    assert core.stats().kv_blocks_used == 0


def test_a_failed_request_says_why():
    # The core's reason reached streaming clients but not the offline LLM's outputs.
    _, last, _ = feed(processor(), EngineCoreOutput("r", [1]), EngineCoreOutput("r", [], finish_reason="error",
                                                                              error="OverflowError: seed"))
    completion = last.outputs[0]
    assert (completion.finish_reason, completion.error, completion.text) == ("error", "OverflowError: seed", "He")
