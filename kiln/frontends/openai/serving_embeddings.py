"""POST /v1/embeddings: pooled final hidden states of any served LLM.

Every input is its own prefill-only engine request, all submitted at once,
so the engine batches them like any prompts (chunked prefill included) and
frees their KV blocks as soon as each prompt is done. The vector is the
model's (pooling per model: kiln/serving/repository/embedding.py), cut to
`dimensions` (matryoshka models only), then L2-normalised unless the
request sets `normalize: false` (a Kiln extension); `encoding_format:
base64` sends little-endian float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kiln.dataplane.dataplane import DataPlane
from kiln.dataplane.served_llm import ServedLLM
from kiln.errors import InvalidRequestError
from kiln.frontends.limits import read_json_object
from kiln.frontends.openai.common import new_id, parse
from kiln.frontends.openai.limits import CacheSalt, Int32, PositiveInt32, Prompt
from kiln.frontends.openai.serving_completions import split_prompts
from kiln.frontends.openai.streams import ClientGone, close_all, collect_finals, unless_disconnected
from kiln.frontends.openai.strict import Strict
from kiln.frontends.routing import report_target, route_key, with_target
from kiln.llm.engine.input_processor import InputProcessor
from kiln.llm.sampling_params import SamplingParams


class EmbeddingRequest(Strict):
    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt32 | None = None
    user: str | None = None
    # Kiln extensions
    normalize: bool = True
    pooling: Literal["last", "mean"] | None = None  # default: the model's
    priority: Int32 = 0
    cache_salt: CacheSalt | None = None  # as on completions: prefix-cache sharing only within one salt


def finish_vector(vector: list[float], dimensions: int | None, normalize: bool) -> np.ndarray:
    out = np.asarray(vector, dtype=np.float32)
    if dimensions is not None:
        out = out[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(out))
        out = out / norm if norm > 0 else out
    return out


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()



def tokenized_inputs(inputs: InputProcessor, given: str | list) -> list[list[int]]:
    """Each input's token ids. The engine's checks name a `prompt`; here the field
    is `input`, so a problem is a 400 naming it (and which one, in a list of them)."""
    texts = split_prompts(given, "input")
    single = isinstance(given, str) or isinstance(given[0], int)
    out = []
    for i, text in enumerate(texts):
        name = "input" if single else f"input[{i}]"
        if len(text) == 0:
            raise InvalidRequestError(f"{name} must not be empty", param="input")
        try:
            out.append(inputs.tokenize(text)[1])
        except InvalidRequestError as e:
            if e.param != "prompt":
                raise
            raise InvalidRequestError(e.message.replace("prompt", name, 1), param="input") from None
    return out

class EmbeddingServing:
    def __init__(self, dataplane: DataPlane):
        self.dataplane = dataplane

    async def create(self, request: Request) -> Response:
        settings = self.dataplane.config
        req = parse(EmbeddingRequest, await read_json_object(request, settings.max_request_bytes))
        chosen = self.dataplane.choose_llm(req.model, route_key(request.headers, req.user))
        try:
            response = await self._create(request, req, chosen.served)
        except BaseException as exc:
            chosen.fail(exc)
            raise
        model = chosen.model_name(report_target(request.headers))
        if isinstance(response, dict):
            return with_target(JSONResponse({**response, "model": model}), chosen.target)
        return with_target(response, chosen.target)

    async def _create(self, request: Request, req: EmbeddingRequest, served: ServedLLM) -> dict | Response:
        engine = served.ready_engine()
        settings = served.embedding
        if req.dimensions is not None and not settings.matryoshka:
            raise InvalidRequestError(
                f"model {served.name!r} does not support dimensions (it is not a matryoshka embedding model)",
                param="dimensions",
            )
        prompts = tokenized_inputs(engine.inputs, req.input)
        served.admit(engine, len(prompts))
        group = new_id("embd")
        pooling = req.pooling or settings.pooling
        streams = []
        try:
            for i, ids in enumerate(prompts):
                params = SamplingParams(max_tokens=1, cache_salt=req.cache_salt)
                streams.append(engine.add_request(f"{group}-{i}", ids, params, req.priority, pooling=pooling))
            finals = await unless_disconnected(request, collect_finals(streams))
        except ClientGone:
            return Response(status_code=499)
        finally:
            close_all(streams)
        data = []
        for i, out in enumerate(finals):
            if out.embedding is None:
                raise InvalidRequestError(f"input {i} produced no embedding", param="input")
            if req.dimensions is not None and req.dimensions > len(out.embedding):
                raise InvalidRequestError(
                    f"dimensions ({req.dimensions}) exceeds the model's {len(out.embedding)}", param="dimensions"
                )
            vector = finish_vector(out.embedding, req.dimensions, req.normalize)
            data.append({"object": "embedding", "index": i, "embedding": encode(vector, req.encoding_format)})
        tokens = sum(len(ids) for ids in prompts)
        return {"object": "list", "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
