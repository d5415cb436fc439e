"""The `llm` backend's KServe parameters (text_input, max_tokens, temperature)
obey the same limits as the OpenAI routes: prompts per request, the server's
max_tokens_limit, integer token counts (issue 17)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.dataplane.llm_model import DEFAULT_MAX_TOKENS, _rows
from kiln.errors import InvalidRequestError
from kiln.serving.types import InferRequest


def request(prompts: int = 1, **columns) -> InferRequest:
    inputs = {"text_input": np.array([b"hi"] * prompts, dtype=object)}
    inputs.update({name: np.asarray(values) for name, values in columns.items()})
    return InferRequest("tiny", inputs)


def test_rows_carry_each_prompts_parameters():
    rows = _rows(request(2, max_tokens=np.array([3, 5], np.int32), temperature=np.array([0.0, 0.5], np.float32)))
    assert [(p, s.max_tokens, s.temperature) for p, s in rows] == [("hi", 3, 0.0), ("hi", 5, 0.5)]


def test_the_default_max_tokens_respects_the_servers_limit():
    assert _rows(request())[0][1].max_tokens == DEFAULT_MAX_TOKENS
    assert _rows(request(), max_tokens_limit=4)[0][1].max_tokens == min(4, DEFAULT_MAX_TOKENS)


@pytest.mark.parametrize(("req", "param", "words"), [
    (request(9), "text_input", "at most 8 per request"),
    (request(max_tokens=np.array([9], np.int64)), "max_tokens", "limit of 8"),
    (request(max_tokens=np.array([2**64 - 1], np.uint64)), "max_tokens", "limit of 8"),
    (request(max_tokens=np.array([np.nan], np.float32)), "max_tokens", "integer tensor"),
    (request(max_tokens=np.array([3.5], np.float64)), "max_tokens", "integer tensor"),
    (request(2, max_tokens=np.array([3], np.int32)), "max_tokens", "1 values for 2 prompts"),
    (request(temperature=np.array([np.nan], np.float32)), "temperature", "temperature"),
], ids=["prompts", "max_tokens", "uint64", "nan", "float", "count", "temperature"])
def test_bad_parameters_are_invalid_requests_naming_the_field(req, param, words):
    with pytest.raises(InvalidRequestError, match=words) as caught:
        _rows(req, max_rows=8, max_tokens_limit=8)
    assert caught.value.param == param or param in str(caught.value)


def test_a_cache_salt_parameter_reaches_every_row_and_is_checked():
    salted = InferRequest("tiny", request(2).inputs, parameters={"cache_salt": "tenant-a"})
    assert [s.cache_salt for _, s in _rows(salted)] == ["tenant-a", "tenant-a"]
    assert _rows(request())[0][1].cache_salt is None
    for bad in (7, ""):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            _rows(InferRequest("tiny", request().inputs, parameters={"cache_salt": bad}))


@pytest.mark.parametrize(("parameters", "named"), [
    ({"max_tokens": 5}, "'max_tokens' is not read by an llm model"),  # was a 200 with the default 64 tokens
    ({"temperature": "hot"}, "'temperature'"),
    ({"stop": "."}, "'stop'"),
    ({"guided_choice": "a"}, "'guided_choice'"),  # vLLM's name; the output was silently unconstrained
    ({"timeout": -1}, "parameter 'timeout' must be a non-negative number"),
    ({"timeout": "abc"}, "parameter 'timeout'"),
])
def test_parameters_it_would_not_read_are_refused_by_name(parameters, named):
    with pytest.raises(InvalidRequestError, match=named):
        _rows(InferRequest("tiny", request().inputs, parameters=parameters))


def test_a_failing_row_cancels_its_siblings():
    import asyncio

    from kiln.dataplane.llm_model import _all_or_none

    async def main():
        started = asyncio.Event()

        async def endless() -> str:
            started.set()
            await asyncio.sleep(3600)
            return "never"

        async def fails() -> str:
            await started.wait()
            raise InvalidRequestError("prompt too long")

        sibling = endless()
        with pytest.raises(InvalidRequestError):
            await _all_or_none([sibling, fails()])
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []  # the endless row was cancelled, not left generating
