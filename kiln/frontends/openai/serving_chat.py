"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.routed import ChosenLLM
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import InvalidRequestError
from kiln.frontends.limits import read_json_object
from kiln.frontends.openai.chat_tools import DeltaReader, answer_message, finish_reason, tool_parser
from kiln.frontends.openai.common import Usage, finish_fields, new_id, now_s, parse
from kiln.frontends.openai.logprobs import TokenTexts, chat_logprobs
from kiln.frontends.openai.params import check_n, check_work, resolve_max_tokens, sampling_params
from kiln.frontends.openai.protocol import ChatCompletionRequest, ChatMessage, MediaPart
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
from kiln.frontends.openai.tools.choice import ToolPlan, check_against_structured, plan_tools
from kiln.frontends.openai.tools.prompt import (
    message_dict,
    template_knows_tools,
    tool_dicts,
    tools_in_first_turn,
    with_tools_described,
)
from kiln.frontends.openai.tools.protocol import Tool
from kiln.frontends.routing import report_target, route_key, with_target
from kiln.frontends.sse import SSEResponse
from kiln.llm.outputs import RequestOutput
from kiln.llm.sampling_params import MAX_LOGPROBS
from kiln.llm.tokenizer import Tokenizer


def chat_prompt_ids(
    tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, tools: list[Tool] | None = None
) -> list[int]:
    """The prompt the model's chat template makes of the messages (and tools: tools/prompt.py)."""
    knows_tools = template_knows_tools(tokenizer.chat_template)
    plain = [message_dict(m, knows_tools) for m in messages]
    if tools and not knows_tools:
        try:
            return tokenizer.apply_chat_template(with_tools_described(plain, tools), add_generation_prompt)
        except InvalidRequestError:
            if plain and plain[0]["role"] == "system":
                raise  # the client's own system message: the template's refusal is theirs to see
            # A template with no system role (Gemma 2 raises on one): the description
            # opens the first user turn instead of a system message of Kiln's own.
            return tokenizer.apply_chat_template(tools_in_first_turn(plain, tools), add_generation_prompt)
    rendered_tools = tool_dicts(tools) if tools and knows_tools else None
    return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tools=rendered_tools)


def check_messages(messages: list[ChatMessage], model: str) -> None:
    """Image/audio/video parts name the model's lack of support; tool results name their call."""
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if isinstance(part, MediaPart):
                    raise InvalidRequestError(
                        f"model {model!r} does not support {part.type} content (it has no vision or audio "
                        "encoder); send text only",
                        param=f"messages.{i}.content.{j}",
                    )
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidRequestError("a tool message needs tool_call_id", param=f"messages.{i}.tool_call_id")
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError("only assistant messages carry tool_calls", param=f"messages.{i}.tool_calls")


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

    def plan(self, req: ChatCompletionRequest, served: ServedLLM) -> ToolPlan:
        """Validate what the engine does not see (messages, tools, grammar fields)."""
        check_messages(req.messages, served.name)
        parser = tool_parser(served.ready_engine().tokenizer, self.dataplane.config.tool_call_parser)
        return plan_tools(req, parser)

    def _submit(self, req: ChatCompletionRequest, served: ServedLLM, plan: ToolPlan) -> Submitted:
        """Apply the model's chat template, validate, admit and submit every choice."""
        settings = self.dataplane.config
        engine = served.generation_engine()
        check_n(req.n, settings.max_n)
        check_work(1, req.n, settings.max_prompts_per_request)
        structured = grammar_spec(req)
        check_against_structured(plan, structured[0] if structured else None)
        spec = plan.spec or (structured[1] if structured else None)
        ids = chat_prompt_ids(engine.tokenizer, req.messages, req.add_generation_prompt, plan.tools)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = resolve_max_tokens(wanted, len(ids), engine.max_model_len, settings.max_tokens_limit)
        logprobs = chat_logprobs_count(req)
        params = [[sampling_params(
            req, max_tokens=max_tokens, logprobs=logprobs, choice=i, defaults=engine.generation_defaults,
            structured=spec,
        ) for i in range(req.n)]]
        served.admit(engine, req.n)
        group_id = new_id("chatcmpl")
        streams = submit_group(engine, group_id, [ids], params, req.priority)
        return Submitted(group_id, streams, Usage(prompt_tokens=len(ids)), engine)

    async def _create(self, request: Request, req: ChatCompletionRequest, chosen: ChosenLLM) -> Response:
        plan = self.plan(req, chosen.served)
        group_id, raw_streams, usage, engine = self._submit(req, chosen.served, plan)
        streams = chosen.track(raw_streams)
        chosen.shadow(lambda served: run_to_end(self._submit(req, served, plan)))
        model = chosen.model_name(report_target(request.headers))
        texts = TokenTexts(engine.tokenizer)
        want_logprobs = req.logprobs
        if req.stream:
            head = {"id": group_id, "object": "chat.completion.chunk", "created": now_s(), "model": model}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = ChatChunks(head, want_logprobs, texts, plan, len(streams))
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
        head = {"id": group_id, "object": "chat.completion", "created": now_s(), "model": model}
        choices = [self._choice(i, out, want_logprobs, texts, plan) for i, out in enumerate(finals)]
        return JSONResponse({**head, "choices": choices, "usage": usage.body()})

    @staticmethod
    def _choice(index: int, out: RequestOutput, want_logprobs: bool, texts: TokenTexts, plan: ToolPlan) -> dict:
        completion = out.outputs[0]
        message = answer_message(completion.text, plan)
        fields = finish_fields(out)
        fields["finish_reason"] = finish_reason(fields["finish_reason"], "tool_calls" in message)
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(completion.logprobs or [], texts) if want_logprobs else None,
            **fields,
        }


class ChatChunks:
    """Streamed chat chunks: the role first, then content and tool-call deltas."""

    def __init__(self, head: dict, want_logprobs: bool, texts: TokenTexts, plan: ToolPlan, num_choices: int):
        self.head = head
        self.want_logprobs = want_logprobs
        self.texts = texts
        self.readers = [DeltaReader(plan) for _ in range(num_choices)]

    def opening(self, index: int) -> list[dict]:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [{**self.head, "choices": [choice]}]

    def chunk(self, index: int, out: RequestOutput) -> dict:
        reader = self.readers[index]
        delta = reader.delta(out.delta_text, out.finished)
        logprobs = chat_logprobs(out.delta_logprobs or [], self.texts) if self.want_logprobs else None
        fields = finish_fields(out)
        fields["finish_reason"] = finish_reason(fields["finish_reason"], reader.has_calls)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, **fields}
        return {**self.head, "choices": [choice]}
