"""Hypothesis strategies for request bodies: every field drawn within its
range, at its edges, past them, of the wrong type, or as any JSON at all;
sometimes with a field nobody knows. Strings may hold lone surrogates (sent as
JSON escapes), numbers may be NaN, infinite or far past 64 bits."""

from __future__ import annotations

from hypothesis import strategies as st

VOCAB = 49152  # the tiny test Llama's (the SmolLM2 tokenizer's)

EDGE_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1,
                             2**64 - 1, 2**64, 2**70, 10**30, VOCAB - 1, VOCAB])
INTS = st.one_of(st.integers(-3, 300), EDGE_INTS, st.integers())
FLOATS = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, -0.0, 1.0, 1e308, -1e308, 5e-324]),
                   st.floats(allow_nan=True, allow_infinity=True))
LONE_SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\ud83d", "\udc00b", "\ud83d\ude00\ud800"])
TEXT = st.one_of(st.text(max_size=24), LONE_SURROGATES, st.text(alphabet="ab \n<|>", max_size=8))
ANY_JSON = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=8,
)


def either(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value, else anything at all."""
    return st.one_of(valid, valid, ANY_JSON)


def body(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    fields = st.fixed_dictionaries({k: either(v) for k, v in required.items()},
                                   optional={k: either(v) for k, v in optional.items()})
    unknown = st.dictionaries(st.sampled_from(["suffix", "functions", "audio", "\ud800"]), ANY_JSON,
                              max_size=1)
    return st.one_of(fields, fields, fields, st.builds(lambda a, b: {**a, **b}, fields, unknown))


TOKEN_ID = st.one_of(st.integers(0, VOCAB - 1), EDGE_INTS)
SAMPLING = {
    "model": st.sampled_from(["tiny", "nope", "double"]) | st.none(),
    "n": st.integers(1, 4),
    "temperature": st.floats(0, 2) | st.none(),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 64) | EDGE_INTS,
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1) | EDGE_INTS,
    "stop": TEXT | st.lists(TEXT, max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str) | TEXT, st.floats(-100, 100), max_size=3),
    "user": TEXT,
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(TOKEN_ID, max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "priority": st.integers(-5, 5) | EDGE_INTS,
    "speculate": st.booleans(),
    "prompt_logprobs": st.integers(0, 5) | EDGE_INTS,
}
# Structured outputs: small schemas, regexes and grammars, valid or not (any of them may be set).
SCHEMA = st.one_of(
    st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "integer"},
                     {"enum": ["a", "b"]}, {"type": "nonsense"}, {"type": "array", "items": {"type": "boolean"}}]),
    st.dictionaries(st.sampled_from(["type", "properties", "required", "items", "enum"]), ANY_JSON, max_size=3),
)
STRUCTURED = {
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"),
                               "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": SCHEMA})}),
    ),
    "guided_json": SCHEMA | TEXT,
    "guided_regex": st.sampled_from(["a+", "[0-9]{1,3}", "(unclosed", "x*?", ""]) | TEXT,
    "guided_choice": st.lists(TEXT, max_size=3),
    "guided_grammar": st.sampled_from(['root ::= "yes" | "no"', "root ::=", 'start: "a"']) | TEXT,
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]),
                                          ANY_JSON, max_size=2),
}
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["weather", "get.time", "bad name!"]) | TEXT},
    optional={"description": TEXT, "parameters": SCHEMA})})
TOOLS = {
    "tools": st.lists(TOOL, max_size=3),
    "tool_choice": st.sampled_from(["none", "auto", "required", "bogus"])
    | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["weather", "nope"])})}),
    "parallel_tool_calls": st.booleans(),
}
PROMPT = st.one_of(
    TEXT,
    st.lists(TEXT, min_size=1, max_size=3),
    st.lists(TOKEN_ID, min_size=1, max_size=12),
    st.lists(st.lists(TOKEN_ID, min_size=1, max_size=6), min_size=1, max_size=3),
)
COMPLETION = body({"prompt": PROMPT}, {**SAMPLING, **STRUCTURED, "max_tokens": st.integers(0, 8),
                                      "logprobs": st.integers(0, 5) | EDGE_INTS, "echo": st.booleans(),
                                      "best_of": st.integers(1, 4) | EDGE_INTS})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])},
    optional={"content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3),
              "name": TEXT},
)
CHAT = body({"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
            {**SAMPLING, **STRUCTURED, **TOOLS, "max_tokens": st.integers(1, 8),
             "max_completion_tokens": st.integers(1, 8),
             "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "add_generation_prompt": st.booleans()})
TOKENIZE = body({}, {"model": SAMPLING["model"], "prompt": TEXT,
                     "messages": st.lists(MESSAGE, min_size=1, max_size=2),
                     "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans()})
EMBEDDING = body({"input": PROMPT}, {
    "model": SAMPLING["model"], "encoding_format": st.sampled_from(["float", "base64", "hex"]),
    "dimensions": st.integers(1, 80) | EDGE_INTS, "user": TEXT, "normalize": st.booleans(),
    "pooling": st.sampled_from(["last", "mean", "cls"]), "priority": SAMPLING["priority"]})
DETOKENIZE = body({"tokens": st.lists(TOKEN_ID, max_size=8)}, {"model": SAMPLING["model"]})

# ---- KServe v2 -------------------------------------------------------------------

DATATYPES = ["BOOL", "UINT8", "INT32", "INT64", "UINT64", "FP16", "FP32", "FP64", "BF16", "BYTES", "BAD"]
SHAPE = st.lists(st.integers(0, 4) | EDGE_INTS | st.integers(-3, -1), max_size=3)
DATA = st.one_of(
    st.lists(st.floats(-10, 10) | st.integers(-10, 10), max_size=6),
    st.lists(TEXT, max_size=4),
    st.lists(st.lists(st.floats(-10, 10), max_size=3), max_size=3),
    ANY_JSON,
)
PARAMS = st.dictionaries(st.sampled_from(["binary_data_size", "binary_data", "stream", "x"]),
                         st.booleans() | INTS | TEXT, max_size=2)
TENSOR = st.fixed_dictionaries(
    {"name": st.sampled_from(["text_input", "max_tokens", "temperature", "IN", "T", "nope"]),
     "datatype": st.sampled_from(DATATYPES), "shape": SHAPE},
    optional={"data": DATA, "parameters": PARAMS},
)
GOOD_TENSORS = st.sampled_from([
    {"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]},
    {"name": "T", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]},
    {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]},
    {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [3]},
])
INFER = body({"inputs": st.lists(TENSOR | GOOD_TENSORS, max_size=3)},
             {"id": TEXT, "parameters": PARAMS, "outputs": st.lists(st.fixed_dictionaries(
                 {"name": st.sampled_from(["text_output", "OUT", "T", "x"])}, optional={"parameters": PARAMS}),
                 max_size=2)})
KSERVE_MODELS = st.sampled_from(["tiny", "double", "echo", "nope"])
