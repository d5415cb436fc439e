"""Engine-side grammar compilation against the model's vocabulary (xgrammar).

The tokenizer's vocabulary is read once, on the first structured request
(a GGUF tokenizer takes seconds to build), on the compile thread, never on
the step loop. Compiled grammars are cached by spec hash (LRU), so a schema
used by many requests compiles once.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kiln.errors import InvalidRequestError
from kiln.llm.structured.spec import GrammarSpec
from kiln.llm.structured.validate import _problem

if TYPE_CHECKING:
    import xgrammar

CACHE_SIZE = 256
# Longest whitespace run a JSON grammar allows between tokens: room for an indented
# document, while a weak model cannot fill max_tokens with spaces.
MAX_WHITESPACE = 24


class GrammarBackend:
    def __init__(self, tokenizer_path: str, vocab_size: int, cache_size: int = CACHE_SIZE, threads: int = 1):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's (logits width), may exceed the tokenizer's
        self.cache_size = cache_size
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kiln-grammar")

    def compile_async(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (InvalidRequestError if it does not compile)."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                done: Future = Future()
                done.set_result(hit)
                return done
        return self._pool.submit(self.compile, spec)

    def compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            hit = self._cache.get(spec.key)
        if hit is not None:
            return hit
        compiler = self.compiler()
        try:
            compiled = _compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"structured output grammar: {_problem(e)}", param="response_format") from None
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            # Imported on the first constrained request: xgrammar and the tokenizer's
            # vocabulary cost seconds that an engine serving none should not pay.
            import xgrammar

            from kiln.llm.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer_path)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer.hf, vocab_size=self.vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compile(compiler: xgrammar.GrammarCompiler, spec: GrammarSpec) -> Any:
    if spec.kind == "json":
        return compiler.compile_json_schema(
            spec.value, strict_mode=True, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE
        )
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=True,
                                            max_whitespace_cnt=MAX_WHITESPACE)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.value)
    if spec.kind == "lark":
        return compiler.compile_lark(spec.value)
    raise InvalidRequestError(f"unknown grammar kind {spec.kind!r}", param="response_format")
