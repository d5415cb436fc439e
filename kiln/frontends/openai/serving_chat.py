"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.routed import ChosenLLM
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import InvalidRequestError
from kiln.frontends.limits import read_json_object
from kiln.frontends.openai.common import Usage, finish_fields, new_id, now_s, parse
from kiln.frontends.openai.logprobs import TokenTexts, chat_logprobs
from kiln.frontends.openai.params import check_n, check_work, resolve_max_tokens, sampling_params
from kiln.frontends.openai.protocol import ChatCompletionRequest, ChatMessage
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
from kiln.llm.sampling_params import MAX_LOGPROBS
from kiln.llm.tokenizer import Tokenizer


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    plain = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)


def chat_logprobs_count(req: ChatCompletionRequest) -> int | None:
    """Chat asks with `logprobs: true` plus `top_logprobs: k`; the engine wants k (or None)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", param="top_logprobs"
        )
    return (req.top_logprobs or 0) if req.logprobs else None


class ChatServing:
    def __init__(self, dataplane: DataPlane):
        self.dataplane = dataplane

    async def create(self, request: Request) -> Response:
        settings = self.dataplane.config
        req = parse(ChatCompletionRequest, await read_json_object(request, settings.max_request_bytes))
        chosen = self.dataplane.choose_llm(req.model, route_key(request.headers, req.user))
        try:
            response = await self._create(request, req, chosen)
        except BaseException as exc:
            chosen.fail(exc)
            raise
        return with_target(response, chosen.target)

    def _submit(self, req: ChatCompletionRequest, served: ServedLLM) -> Submitted:
        """Apply the model's chat template, validate, admit and submit every choice."""
        settings = self.dataplane.config
        engine = served.ready_engine()
        check_n(req.n, settings.max_n)
        check_work(1, req.n, settings.max_prompts_per_request)
        ids = chat_prompt_ids(engine.tokenizer, req.messages, req.add_generation_prompt)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = resolve_max_tokens(wanted, len(ids), engine.max_model_len, settings.max_tokens_limit)
        logprobs = chat_logprobs_count(req)
        params = [[sampling_params(
            req, max_tokens=max_tokens, logprobs=logprobs, choice=i, defaults=engine.generation_defaults,
        ) for i in range(req.n)]]
        served.admit(engine, req.n)
        group_id = new_id("chatcmpl")
        streams = submit_group(engine, group_id, [ids], params, req.priority)
        return Submitted(group_id, streams, Usage(prompt_tokens=len(ids)), engine)

    async def _create(self, request: Request, req: ChatCompletionRequest, chosen: ChosenLLM) -> Response:
        group_id, raw_streams, usage, engine = self._submit(req, chosen.served)
        streams = chosen.track(raw_streams)
        chosen.shadow(lambda served: run_to_end(self._submit(req, served)))
        model = chosen.model_name(report_target(request.headers))
        texts = TokenTexts(engine.tokenizer)
        want_logprobs = req.logprobs
        if req.stream:
            head = {"id": group_id, "object": "chat.completion.chunk", "created": now_s(), "model": model}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = stream_events(streams, ChatChunks(head, want_logprobs, texts), usage, head, include_usage)
            return SSEResponse(events, on_close=lambda: close_all(streams))
        try:
            finals = await unless_disconnected(request, collect_finals(streams))
        except ClientGone:
            return Response(status_code=499)
        finally:
            close_all(streams)
        for out in finals:
            usage.add_final(out)
        head = {"id": group_id, "object": "chat.completion", "created": now_s(), "model": model}
        choices = [self._choice(i, out, want_logprobs, texts) for i, out in enumerate(finals)]
        return JSONResponse({**head, "choices": choices, "usage": usage.body()})

    @staticmethod
    def _choice(index: int, out: RequestOutput, want_logprobs: bool, texts: TokenTexts) -> dict:
        completion = out.outputs[0]
        return {
            "index": index,
            "message": {"role": "assistant", "content": completion.text},
            "logprobs": chat_logprobs(completion.logprobs or [], texts) if want_logprobs else None,
            **finish_fields(out),
        }


class ChatChunks:
    """Streamed chat chunks: the role first, then content deltas."""

    def __init__(self, head: dict, want_logprobs: bool, texts: TokenTexts):
        self.head = head
        self.want_logprobs = want_logprobs
        self.texts = texts

    def opening(self, index: int) -> list[dict]:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [{**self.head, "choices": [choice]}]

    def chunk(self, index: int, out: RequestOutput) -> dict:
        delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
        logprobs = chat_logprobs(out.delta_logprobs or [], self.texts) if self.want_logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": logprobs, **finish_fields(out)}
        return {**self.head, "choices": [choice]}
