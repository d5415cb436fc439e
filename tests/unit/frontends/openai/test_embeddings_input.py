"""/v1/embeddings names its own field, `input`, in every problem with it."""
from __future__ import annotations

import pytest

from kiln.errors import InvalidRequestError
from kiln.frontends.openai.serving_embeddings import tokenized_inputs
from kiln.llm.engine.input_processor import InputProcessor


@pytest.fixture(scope="module")
def inputs(smollm2_tokenizer):
    return InputProcessor(smollm2_tokenizer, 2048, smollm2_tokenizer.vocab_size)


@pytest.mark.parametrize(("given", "named"), [
    ("", "input must not be empty"),
    ([""], "input[0] must not be empty"),
    (["a", ""], "input[1] must not be empty"),
    ([], "input must not be empty"),
    ([[1], []], "input[1] must not be empty"),
    ([10**9], "input token ids must be in"),
])
def test_a_bad_input_is_named_input(inputs, given, named):
    with pytest.raises(InvalidRequestError) as caught:
        tokenized_inputs(inputs, given)
    assert caught.value.param == "input" and named in caught.value.message and "prompt" not in caught.value.message


def test_good_inputs_are_tokenized_as_the_engine_does(inputs, smollm2_tokenizer):
    assert tokenized_inputs(inputs, ["hi", "there"]) == [inputs.tokenize("hi")[1], inputs.tokenize("there")[1]]
    assert tokenized_inputs(inputs, [5, 6]) == [[5, 6]]
