"""POST /v1/completions.

echo puts the prompt before each choice's text (and, with logprobs, its
tokens' logprobs before the generated ones: the first is null); with
max_tokens 0 and echo the request only scores its prompt. best_of samples
that many candidates per prompt and returns the n with the highest mean
token logprob (not with stream). prompt_logprobs (vLLM's extension) adds
each prompt position's logprobs to the choice.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.routed import ChosenLLM
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import InvalidRequestError
from kiln.frontends.limits import read_json_object
from kiln.frontends.openai.common import Usage, finish_fields, new_id, now_s, parse
from kiln.frontends.openai.logprobs import (
    TokenTexts,
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    prompt_logprobs_body,
)
from kiln.frontends.openai.params import check_n, check_work, resolve_max_tokens, sampling_params
from kiln.frontends.openai.protocol import CompletionRequest
from kiln.frontends.openai.streaming import stream_events
from kiln.frontends.openai.streams import (
    ClientGone,
    Submitted,
    close_all,
    collect_finals,
    run_to_end,
    submit_group,
    unless_disconnected,
)
from kiln.frontends.openai.structured import grammar_spec
from kiln.frontends.routing import report_target, route_key, with_target
from kiln.frontends.sse import SSEResponse
from kiln.llm.outputs import RequestOutput
from kiln.llm.tokenizer import Tokenizer


def split_prompts(prompt: str | list, field: str = "prompt") -> list[str | list[int]]:
    """One prompt or a batch: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError(f"{field} must not be empty", param=field)
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


def candidates_per_prompt(req: CompletionRequest, max_n: int) -> int:
    """How many engine requests each prompt gets: best_of if set, else n."""
    check_n(req.n, max_n)
    if req.best_of is None:
        return req.n
    if req.best_of < req.n:
        raise InvalidRequestError(f"best_of ({req.best_of}) must be at least n ({req.n})", param="best_of")
    if req.best_of > max_n:
        raise InvalidRequestError(f"best_of ({req.best_of}) exceeds this server's limit of {max_n} (max_n)",
                                  param="best_of")
    if req.stream and req.best_of > req.n:
        raise InvalidRequestError("best_of > n cannot be streamed", param="best_of")
    return req.best_of


def mean_logprob(out: RequestOutput) -> float:
    entries = out.outputs[0].logprobs or []
    return sum(e.logprob for e in entries) / len(entries) if entries else 0.0


def best_of(finals: list[RequestOutput], per_prompt: int, n: int) -> list[RequestOutput]:
    """The n candidates of each prompt with the highest mean token logprob (earlier first on ties)."""
    chosen = []
    for start in range(0, len(finals), per_prompt):
        group = finals[start : start + per_prompt]
        ranked = sorted(range(len(group)), key=lambda i: (-mean_logprob(group[i]), i))
        chosen += [group[i] for i in sorted(ranked[:n])]
    return chosen


class CompletionServing:
    def __init__(self, dataplane: DataPlane):
        self.dataplane = dataplane

    async def create(self, request: Request) -> Response:
        settings = self.dataplane.config
        req = parse(CompletionRequest, await read_json_object(request, settings.max_request_bytes))
        chosen = self.dataplane.choose_llm(req.model, route_key(request.headers, req.user))
        try:
            response = await self._create(request, req, chosen)
        except BaseException as exc:
            chosen.fail(exc)
            raise
        return with_target(response, chosen.target)

    def _submit(self, req: CompletionRequest, served: ServedLLM) -> Submitted:
        """Validate against the engine, admit and submit every choice of every prompt."""
        settings = self.dataplane.config
        engine = served.generation_engine()
        per_prompt = candidates_per_prompt(req, settings.max_n)
        texts = split_prompts(req.prompt)
        check_work(len(texts), per_prompt, settings.max_prompts_per_request)  # before any tokenizing
        structured = grammar_spec(req)
        spec = structured[1] if structured else None
        prompts = [engine.inputs.tokenize(p)[1] for p in texts]
        ranking = req.best_of is not None and req.best_of > req.n
        logprobs = req.logprobs if req.logprobs is not None or not ranking else 0
        prompt_logprobs = self._prompt_logprobs(req)
        params = [
            [
                sampling_params(
                    req,
                    max_tokens=resolve_max_tokens(
                        req.max_tokens, len(ids), engine.max_model_len, settings.max_tokens_limit
                    ),
                    logprobs=logprobs,
                    choice=i,
                    defaults=engine.generation_defaults,
                    structured=spec,
                    prompt_logprobs=prompt_logprobs,
                )
                for i in range(per_prompt)
            ]
            for ids in prompts
        ]
        served.admit(engine, len(prompts) * per_prompt)
        group_id = new_id("cmpl")
        streams = submit_group(engine, group_id, prompts, params, req.priority)
        return Submitted(group_id, streams, Usage(prompt_tokens=sum(len(ids) for ids in prompts)), engine)

    @staticmethod
    def _prompt_logprobs(req: CompletionRequest) -> int | None:
        """What the engine computes over the prompt: echo with logprobs (or scoring
        only, max_tokens 0) needs the prompt's logprobs too."""
        if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
            raise InvalidRequestError("max_tokens 0 is only allowed with echo (to score the prompt)",
                                      param="max_tokens")
        wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        if req.echo and req.max_tokens == 0 and not wanted:
            wanted = [0]
        return max(wanted) if wanted else None

    async def _create(self, request: Request, req: CompletionRequest, chosen: ChosenLLM) -> Response:
        group_id, raw_streams, usage, engine = self._submit(req, chosen.served)
        streams = chosen.track(raw_streams)
        chosen.shadow(lambda served: run_to_end(self._submit(req, served)))
        model = chosen.model_name(report_target(request.headers))
        head = {"id": group_id, "object": "text_completion", "created": now_s(), "model": model}
        view = ChoiceView(req, TokenTexts(engine.tokenizer), engine.tokenizer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = CompletionChunks(head, view, len(streams))
            events = stream_events(streams, chunks, usage, head, include_usage)
            return SSEResponse(events, on_close=lambda: close_all(streams))
        try:
            finals = await unless_disconnected(request, collect_finals(streams))
        except ClientGone:
            return Response(status_code=499)
        finally:
            close_all(streams)
        for out in finals:
            usage.add_final(out)
        per_prompt = len(finals) // len(split_prompts(req.prompt))
        if per_prompt > req.n:
            finals = best_of(finals, per_prompt, req.n)
        choices = [view.whole(i, out) for i, out in enumerate(finals)]
        return JSONResponse({**head, "choices": choices, "usage": usage.body()})


class ChoiceView:
    """A choice's text and logprobs as the request asked (echo, logprobs, prompt_logprobs)."""

    def __init__(self, req: CompletionRequest, texts: TokenTexts, tokenizer: Tokenizer):
        self.req = req
        self.texts = texts
        self.tokenizer = tokenizer

    @property
    def want_logprobs(self) -> bool:
        return self.req.logprobs is not None

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def whole(self, index: int, out: RequestOutput) -> dict:
        completion = out.outputs[0]
        text = completion.text
        logprobs = completion_logprobs(completion.logprobs or [], self.texts) if self.want_logprobs else None
        if self.req.echo:
            text = self.prompt_text(out) + text
            if logprobs is not None:
                logprobs = joined_logprobs(self.echoed(out), logprobs)
        return {"index": index, "text": text, "logprobs": logprobs, **self.extras(out), **finish_fields(out)}

    def echoed(self, out: RequestOutput) -> dict:
        return echo_logprobs(out.prompt_logprobs or [None], out.prompt_token_ids, self.texts)

    def extras(self, out: RequestOutput) -> dict:
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_body(out.prompt_logprobs or [None], self.texts)}


class CompletionChunks:
    """Builds the streamed chunk for each engine output (one per new token)."""

    def __init__(self, head: dict, view: ChoiceView, num_choices: int):
        self.head = head
        self.view = view
        self.offsets = [0] * num_choices
        self.started = [False] * num_choices

    def opening(self, index: int) -> list[dict]:
        return []

    def chunk(self, index: int, out: RequestOutput) -> dict:
        view = self.view
        first = not self.started[index]
        self.started[index] = True
        text = out.delta_text
        logprobs = None
        if view.want_logprobs:
            logprobs = completion_logprobs(out.delta_logprobs or [], view.texts, self.offsets[index])
        if first and view.req.echo:
            text = view.prompt_text(out) + text
            if logprobs is not None:
                logprobs = joined_logprobs(view.echoed(out), logprobs)
        if logprobs is not None:
            self.offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if logprobs["tokens"] \
                else self.offsets[index]
        extras = view.extras(out) if first else {}
        choice = {"index": index, "text": text, "logprobs": logprobs, **extras, **finish_fields(out)}
        return {**self.head, "choices": [choice]}
