"""Tool calling on /v1/chat/completions.

    protocol.py  the request fields (tools, tool_choice, parallel_tool_calls)
                 and the message parts (assistant tool_calls, role tool)
    prompt.py    messages -> what the chat template renders (tools passed to a
                 template that knows them, else described in a system message)
    scanner.py   an incremental scanner of one JSON object's name/arguments
    parsers.py   model output -> content + tool calls, per model family
                 (hermes: <tool_call>{...}</tool_call>; llama3_json: {"name",
                 "parameters"}), incrementally, so streaming and whole answers
                 share one code path
    choice.py    tool_choice: none / auto (parse) / required and a named
                 function (enforced with a grammar, so arguments always parse
                 and match the function's schema)
"""
