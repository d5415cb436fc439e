"""Structured outputs on SmolLM2: every output parses and validates
(`jsonschema`, formats checked) with greedy and sampled decoding, with and
without n-gram speculation; any JSON object, regex, EBNF and Lark grammars too."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kiln import SamplingParams
from kiln.llm.structured.spec import GrammarSpec
from tests.integration.llm.structured_schemas import PROMPTS, SCHEMAS

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


# Without speculation every schema is decoded greedy and sampled; with n-gram
# speculation each schema once, alternating greedy and sampled (test time).
@pytest.mark.parametrize(("spec_method", "modes"), [(None, "both"), ("ngram", "alternate")])
def test_every_json_output_validates(make_smollm2_engine, spec_method, modes):
    speculation = {"spec_method": spec_method, "num_speculative_tokens": 3} if spec_method else {}
    llm = make_smollm2_engine(kv_cache_memory_gib=0.25, **speculation)
    sampling = ((0.0, None), (0.9, 7))
    prompts, params, names = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        spec = GrammarSpec("json", json.dumps(schema))
        for temperature, seed in sampling if modes == "both" else sampling[i % 2 : i % 2 + 1]:
            prompts.append(chat_ids(llm, PROMPTS[name]))
            params.append(SamplingParams(max_tokens=256, temperature=temperature, seed=seed, structured=spec))
            names.append(name)
    outputs = llm.generate(prompts, params)
    for name, out in zip(names, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name], format_checker=CHECKER)
    if spec_method == "ngram":
        assert llm.engine.last_stats.spec_num_draft_tokens > 0


def test_json_object_regex_ebnf_and_lark(make_smollm2_engine):
    llm = make_smollm2_engine(kv_cache_memory_gib=0.25)
    cases = [
        (GrammarSpec("json_object"), "Reply with a JSON object with only two keys: a cat's name and age.",
         lambda t: isinstance(json.loads(t), dict)),
        (GrammarSpec("regex", r"[A-Z]{3}-[0-9]{2,4}"), "Invent a flight code.",
         lambda t: re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", t)),
        (GrammarSpec("ebnf", 'root ::= "yes" | "no" | "maybe"'), "Is the sky blue?",
         lambda t: t in ("yes", "no", "maybe")),
        (GrammarSpec("lark", 'start: NUMBER " apples"\nNUMBER: /[1-9][0-9]?/'), "How many apples?",
         lambda t: re.fullmatch(r"[1-9][0-9]? apples", t)),
    ]
    outputs = llm.generate([chat_ids(llm, q) for _, q, _ in cases],
                           [SamplingParams(max_tokens=120, temperature=0.0, structured=s) for s, _, _ in cases])
    for (_, _, valid), out in zip(cases, outputs, strict=True):
        assert out.outputs[0].finish_reason == "stop" and valid(out.outputs[0].text), out.outputs[0].text
