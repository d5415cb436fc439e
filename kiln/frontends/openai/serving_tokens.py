"""POST /tokenize and /detokenize (vLLM's shapes), GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from fastapi import Request

from kiln.dataplane.dataplane import DataPlane
from kiln.errors import InvalidRequestError, ModelNotFoundError
from kiln.frontends.limits import read_json_object
from kiln.frontends.openai.common import parse
from kiln.frontends.openai.protocol import DetokenizeRequest, TokenizeRequest
from kiln.frontends.openai.serving_chat import chat_prompt_ids


async def tokenize(dataplane: DataPlane, request: Request) -> dict:
    req = parse(TokenizeRequest, await read_json_object(request, dataplane.config.max_request_bytes))
    engine = dataplane.llm(req.model).ready_engine()
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        if req.tools:
            raise InvalidRequestError("tools go with messages (the chat prompt), not a prompt", param="tools")
        ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        ids = chat_prompt_ids(engine.tokenizer, req.messages or [], req.add_generation_prompt, req.tools)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


async def detokenize(dataplane: DataPlane, request: Request) -> dict:
    req = parse(DetokenizeRequest, await read_json_object(request, dataplane.config.max_request_bytes))
    engine = dataplane.llm(req.model).ready_engine()
    vocab = engine.info.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token ids must be in [0, {vocab}); got {bad[:3]}", param="tokens")
    # Special tokens kept, as vLLM and transformers' decode do: /detokenize undoes /tokenize.
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def list_models(dataplane: DataPlane, created: int) -> dict:
    data = []
    for name in dataplane.llm_names():
        card: dict = {"id": name, "object": "model", "created": created, "owned_by": "kiln"}
        served = dataplane.loaded_llm(name)
        if served is not None and served.engine is not None and served.engine.info is not None:
            card["root"] = served.engine.info.source
            card["max_model_len"] = served.engine.max_model_len
            if served.engine.info.dtype:
                card["dtype"] = served.engine.info.dtype
        data.append(card)
    for name in dataplane.llm_route_names():  # a route is a model name to clients
        data.append({"id": name, "object": "model", "created": created, "owned_by": "kiln", "kiln_route": True})
    return {"object": "list", "data": data}


def retrieve_model(dataplane: DataPlane, created: int, model_id: str) -> dict:
    """One card of GET /v1/models (the `openai` client's `models.retrieve`), or a 404 naming the served ones."""
    cards = list_models(dataplane, created)["data"]
    card = next((c for c in cards if c["id"] == model_id), None)
    if card is None:
        raise ModelNotFoundError(
            f"model {model_id!r} does not exist; this server serves {[c['id'] for c in cards]}", param="model")
    return card
