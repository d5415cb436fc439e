"""POST /v1/completions."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.routed import ChosenLLM
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import InvalidRequestError
from kiln.frontends.limits import read_json_object
from kiln.frontends.openai.common import Usage, finish_fields, new_id, now_s, parse
from kiln.frontends.openai.logprobs import TokenTexts, completion_logprobs
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
from kiln.frontends.routing import report_target, route_key, with_target
from kiln.frontends.sse import SSEResponse
from kiln.llm.outputs import RequestOutput


def split_prompts(prompt: str | list) -> list[str | list[int]]:
    """One prompt or a batch: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


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
        engine = served.ready_engine()
        check_n(req.n, settings.max_n)
        texts = split_prompts(req.prompt)
        check_work(len(texts), req.n, settings.max_prompts_per_request)  # before any tokenizing
        prompts = [engine.inputs.tokenize(p)[1] for p in texts]
        params = [
            [
                sampling_params(
                    req,
                    max_tokens=resolve_max_tokens(
                        req.max_tokens, len(ids), engine.max_model_len, settings.max_tokens_limit
                    ),
                    logprobs=req.logprobs,
                    choice=i,
                    defaults=engine.generation_defaults,
                )
                for i in range(req.n)
            ]
            for ids in prompts
        ]
        served.admit(engine, len(prompts) * req.n)
        group_id = new_id("cmpl")
        streams = submit_group(engine, group_id, prompts, params, req.priority)
        return Submitted(group_id, streams, Usage(prompt_tokens=sum(len(ids) for ids in prompts)), engine)

    async def _create(self, request: Request, req: CompletionRequest, chosen: ChosenLLM) -> Response:
        group_id, raw_streams, usage, engine = self._submit(req, chosen.served)
        streams = chosen.track(raw_streams)
        chosen.shadow(lambda served: run_to_end(self._submit(req, served)))
        model = chosen.model_name(report_target(request.headers))
        head = {"id": group_id, "object": "text_completion", "created": now_s(), "model": model}
        texts = TokenTexts(engine.tokenizer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = CompletionChunks(head, req.logprobs is not None, texts, len(streams))
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
        choices = [self._choice(i, out, req.logprobs is not None, texts) for i, out in enumerate(finals)]
        return JSONResponse({**head, "choices": choices, "usage": usage.body()})

    @staticmethod
    def _choice(index: int, out: RequestOutput, want_logprobs: bool, texts: TokenTexts) -> dict:
        completion = out.outputs[0]
        logprobs = completion_logprobs(completion.logprobs or [], texts) if want_logprobs else None
        return {"index": index, "text": completion.text, "logprobs": logprobs, **finish_fields(out)}


class CompletionChunks:
    """Builds the streamed chunk for each engine output (one per new token)."""

    def __init__(self, head: dict, want_logprobs: bool, texts: TokenTexts, num_choices: int):
        self.head = head
        self.want_logprobs = want_logprobs
        self.texts = texts
        self.offsets = [0] * num_choices

    def opening(self, index: int) -> list[dict]:
        return []

    def chunk(self, index: int, out: RequestOutput) -> dict:
        logprobs = None
        if self.want_logprobs:
            logprobs = completion_logprobs(out.delta_logprobs or [], self.texts, self.offsets[index])
            self.offsets[index] += sum(len(t) for t in logprobs["tokens"])
        choice = {"index": index, "text": out.delta_text, "logprobs": logprobs, **finish_fields(out)}
        return {**self.head, "choices": [choice]}
