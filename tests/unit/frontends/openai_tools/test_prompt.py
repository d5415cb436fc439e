"""Tools described to a template that does not render them: in a system message,
or, where the template has no system role (Gemma 2), at the top of the first user turn."""
from __future__ import annotations

import pytest

from kiln.errors import InvalidRequestError
from kiln.frontends.openai.protocol import ChatMessage
from kiln.frontends.openai.serving_chat import chat_prompt_ids
from kiln.frontends.openai.tools.protocol import Tool

NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<turn>{{ m['role'] }}\n{{ m['content'] }}</turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<turn>model\n{% endif %}"
)
TOOL = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}})


@pytest.fixture(scope="module")
def no_system_tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer.with_chat_template(NO_SYSTEM)


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn(no_system_tokenizer):
    # It was a 400 "System role not supported" for a client that sent no system message.
    ids = chat_prompt_ids(no_system_tokenizer, [ChatMessage(role="user", content="Weather in Oslo?")], True, [TOOL])
    text = no_system_tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<turn>user\n") and "get_weather" in text and text.index("get_weather") < text.index("Oslo")
    with pytest.raises(InvalidRequestError, match="System role not supported"):  # the client's own system turn
        chat_prompt_ids(no_system_tokenizer, [ChatMessage(role="system", content="Be brief."),
                                              ChatMessage(role="user", content="Hi")], True, [TOOL])


def test_a_template_with_a_system_role_keeps_the_system_message(smollm2_tokenizer):
    ids = chat_prompt_ids(smollm2_tokenizer, [ChatMessage(role="user", content="Weather in Oslo?")], True, [TOOL])
    text = smollm2_tokenizer.decode(ids, skip_special_tokens=False)
    assert "system" in text[: text.index("get_weather")] and text.index("get_weather") < text.index("Oslo")
