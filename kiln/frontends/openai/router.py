"""Routes of the OpenAI-compatible API; the work is in the serving_* modules.
Each POST route declares its request model for /openapi.json (openapi.py)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kiln.dataplane.dataplane import DataPlane
from kiln.frontends.openai import serving_tokens
from kiln.frontends.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kiln.frontends.openai.serving_chat import ChatServing
from kiln.frontends.openai.serving_completions import CompletionServing
from kiln.frontends.openai.serving_embeddings import EmbeddingRequest, EmbeddingServing
from kiln.frontends.openapi import request_body


def openai_router(dataplane: DataPlane) -> APIRouter:
    router = APIRouter()
    completions = CompletionServing(dataplane)
    chat = ChatServing(dataplane)
    embeddings = EmbeddingServing(dataplane)
    started = int(time.time())

    @router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def create_completion(request: Request) -> Response:
        return await completions.create(request)

    @router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(request)

    @router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
    async def create_embeddings(request: Request) -> Response:
        return await embeddings.create(request)

    @router.get("/v1/models")
    async def models() -> dict:
        return serving_tokens.list_models(dataplane, started)

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        return serving_tokens.retrieve_model(dataplane, started, model_id)

    @router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        return await serving_tokens.tokenize(dataplane, request)

    @router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        return await serving_tokens.detokenize(dataplane, request)

    return router
