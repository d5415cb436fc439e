"""OpenAI fields -> SamplingParams, and the server's limits."""

from __future__ import annotations

import pytest

from kiln.errors import InvalidRequestError
from kiln.frontends.openai.common import parse
from kiln.frontends.openai.params import check_n, resolve_max_tokens, sampling_params
from kiln.frontends.openai.protocol import CompletionRequest


def test_max_tokens_default_is_the_context_left_capped_by_the_limit():
    assert resolve_max_tokens(None, 100, 512, None) == 412
    assert resolve_max_tokens(None, 100, 512, 64) == 64
    assert resolve_max_tokens(None, 600, 512, None) == 1  # the length check then names the prompt
    assert resolve_max_tokens(10, 100, 512, 64) == 10


def test_max_tokens_over_the_limit_names_it():
    with pytest.raises(InvalidRequestError) as e:
        resolve_max_tokens(100, 1, 512, 64)
    assert e.value.param == "max_tokens" and "64" in e.value.message and "max_tokens_limit" in e.value.message


def test_n_limits():
    check_n(4, 4)
    for n in (0, 5):
        with pytest.raises(InvalidRequestError) as e:
            check_n(n, 4)
        assert e.value.param == "n"


def test_sampling_params_mapping_and_per_choice_seed():
    req = parse(
        CompletionRequest,
        {
            "prompt": "x",
            "temperature": 0.5,
            "top_k": -1,
            "stop": "END",
            "seed": 10,
            "logit_bias": {"42": -100},
            "min_tokens": 3,
            "ignore_eos": True,
            "speculate": False,
        },
    )
    p0 = sampling_params(req, max_tokens=8, logprobs=None, choice=0)
    p2 = sampling_params(req, max_tokens=8, logprobs=None, choice=2)
    assert (p0.temperature, p0.top_k, p0.stop, p0.logit_bias) == (0.5, 0, ["END"], {42: -100.0})
    assert (p0.min_tokens, p0.ignore_eos, p0.max_tokens) == (3, True, 8)
    assert (p0.seed, p2.seed) == (10, 12)
    assert p0.speculate is False


def test_defaults_when_fields_are_absent():
    p = sampling_params(parse(CompletionRequest, {"prompt": "x"}), max_tokens=4, logprobs=None, choice=0)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.seed, p.speculate) == (1.0, 1.0, 1.0, None, True)


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1.0), ("top_p", 0.0), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("min_p", 2.0)],
)
def test_out_of_range_values_are_rejected_by_sampling_params(field, value):
    req = parse(CompletionRequest, {"prompt": "x", field: value})
    with pytest.raises(InvalidRequestError) as e:
        sampling_params(req, max_tokens=4, logprobs=None, choice=0)
    assert e.value.param == field


def test_logit_bias_keys_must_be_token_ids():
    req = parse(CompletionRequest, {"prompt": "x", "logit_bias": {"hello": 1.0}})
    with pytest.raises(InvalidRequestError) as e:
        sampling_params(req, max_tokens=4, logprobs=None, choice=0)
    assert e.value.param == "logit_bias"
