"""Structured outputs: a grammar constrains which tokens a request may sample.

    spec.py      GrammarSpec: what a request asks for (JSON schema, any JSON
                 object, regex, EBNF or Lark grammar); travels in SamplingParams
    validate.py  API side: a spec is checked (and JSON schemas meta-validated)
                 before it is submitted, so a bad one is a 400 naming the problem
    backend.py   engine side: the tokenizer's xgrammar vocabulary, compiled
                 grammars cached by spec hash, compiled off the step loop
    matchers.py  engine side: one matcher per request; the masks of a step are
                 filled on a worker thread while the forward pass runs; tokens
                 are accepted after the step, drafts are checked and rolled back
    masks.py     a step's bitmask, applied to the logits before sampling

The grammar engine is xgrammar (bench/grammar_engines.py compares it with
llguidance; docs/benchmarks.md has the figures and the reasons).
"""
