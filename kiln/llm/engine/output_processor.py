"""API-side state per request: incremental detokenization and stop strings.

Stop strings are found here, in text; the request is then reported finished
and its id returned so the caller aborts it in the engine core.
While a request has stop strings, the last (longest stop - 1) characters are
held back from streamed deltas, since they might begin a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.llm.detokenizer import Decoder, IncrementalDetokenizer
from kiln.llm.engine.messages import EngineCoreOutput
from kiln.llm.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kiln.llm.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    text: str = ""  # text after stop-string truncation
    sent_chars: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why, when finish_reason is "error"
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # positions 1.. of the prompt, as they come
    stop_floor: int = 0  # a stop string must end after this many characters (those before min_tokens)


class OutputProcessor:
    def __init__(self, tokenizer: Decoder):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.states[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            IncrementalDetokenizer(self.tokenizer),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updates to deliver and the ids to abort in the core
        (finished here by a stop string)."""
        results, to_abort = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # already finished here (stop string) or dropped
            new_ids, new_logprobs = list(out.new_token_ids), out.new_logprobs
            if state.prompt_logprobs is not None and out.prompt_logprobs:
                state.prompt_logprobs.extend(out.prompt_logprobs)
            state.num_cached_tokens = out.num_cached_tokens
            skip_text = out.stop_token_id is not None and out.stop_token_id in new_ids[-1:]
            text_ids = new_ids[:-1] if skip_text else new_ids
            # A stop string in the last tokens wins over the core's finish (length,
            # a stop token after it), as in vLLM: the text ends before the string.
            checks_stops = bool(state.params.stop) and out.finish_reason in (None, "length", "stop")
            kept = self._add_text(state, text_ids, out.finish_reason is not None, checks_stops)
            if kept is not None:  # the tokens after the one that ended a stop string are not output
                new_ids = new_ids[:kept]
                new_logprobs = new_logprobs[:kept] if new_logprobs else new_logprobs
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_token_id
                state.error = out.error
            state.token_ids.extend(new_ids)
            if state.logprobs is not None and new_logprobs:
                state.logprobs.extend(new_logprobs)
            result = self._make_output(state, new_ids, new_logprobs)
            result.embedding = out.embedding
            results.append(result)
            if state.finish_reason is not None:
                del self.states[out.request_id]
        return results, to_abort

    def _add_text(self, state: RequestState, ids: list[int], finishing: bool, checks_stops: bool) -> int | None:
        """Detokenize `ids`; with stop strings to check, one token at a time (a draft's
        accepted tokens come several in a step), so that none counts before its token
        is past min_tokens and none after it is output. Returns how many of `ids` are
        kept when a stop string ended the request, else None."""
        if not checks_stops:
            state.detok.add(ids)
            if finishing:
                state.detok.finish()  # flush bytes held back for a partial character
            state.text = state.detok.text
            return None
        for i, token_id in enumerate(ids):
            state.detok.add([token_id])
            state.text = state.detok.text
            if self._check_stop_strings(state, len(state.token_ids) + i + 1):
                return i + 1
        if finishing:
            state.detok.finish()
            state.text = state.detok.text
            if self._check_stop_strings(state, len(state.token_ids) + len(ids)):  # the flushed characters
                return len(ids)
        return None

    def _check_stop_strings(self, state: RequestState, num_tokens: int) -> bool:
        """Whether the text of the first `num_tokens` output tokens ends in a stop string (it is then cut)."""
        stops = state.params.stop
        if not stops:
            return False
        if num_tokens <= state.params.min_tokens:
            # Up to min_tokens no stop string counts (as no stop token can be one of
            # them), nor later does one that ended in this text.
            state.stop_floor = len(state.text)
            return False
        # Only text near the end can contain a stop string that is new.
        window_start = max(0, state.sent_chars - max(len(s) for s in stops))
        best = None
        for stop in stops:
            at = state.text.find(stop, max(window_start, state.stop_floor - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        end = at + len(stop) if state.params.include_stop_str_in_output else at
        state.text = state.text[:end]
        state.finish_reason, state.stop_reason = "stop", stop
        return True

    def _make_output(self, state: RequestState, new_ids: list[int], new_logprobs) -> RequestOutput:
        finished = state.finish_reason is not None
        visible = len(state.text)
        if not finished and state.params.stop:
            visible = max(state.sent_chars, visible - (max(len(s) for s in state.params.stop) - 1))
        delta = state.text[state.sent_chars : visible]
        state.sent_chars = visible
        completion = CompletionOutput(
            index=0,
            text=state.text if finished else state.text[:visible],
            token_ids=list(state.token_ids),
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            logprobs=state.logprobs,
            error=state.error,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            delta_text=delta,
            delta_token_ids=new_ids,
            delta_logprobs=new_logprobs,
            prompt_logprobs=None if state.prompt_logprobs is None else [None, *state.prompt_logprobs],
        )
