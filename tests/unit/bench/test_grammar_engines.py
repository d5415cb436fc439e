"""bench/grammar_engines.py end to end on one small grammar: the walk must
accept its own document (else its mask timings would be of a refused prefix).
llguidance is not a Kiln dependency: its test is skipped without it."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import grammar_engines  # noqa: E402


def _has_model() -> bool:
    try:
        return bool(grammar_engines.default_tokenizer())
    except SystemExit:
        return False


needs_model = pytest.mark.skipif(not _has_model(), reason="SmolLM2 not installed")


def test_help(capsys):
    with pytest.raises(SystemExit) as done:
        grammar_engines.main(["--help"])
    assert done.value.code == 0 and "--repeats" in capsys.readouterr().out


def run(engine: str, tmp_path: Path) -> dict:
    out = tmp_path / "r.json"
    grammar_engines.main(["--engines", engine, "--cases", "ebnf (arith)", "--repeats", "1", "--no-coverage",
                          "--out", str(out)])
    return json.loads(out.read_text())["results"]["ebnf (arith)"][engine]


@needs_model
def test_xgrammar_walks_a_grammar(tmp_path):
    pytest.importorskip("xgrammar")
    r = run("xgrammar", tmp_path)
    assert "error" not in r and r["tokens"] > 10 and r["mask_median_us"] > 0


@needs_model
def test_llguidance_walks_a_grammar(tmp_path):
    pytest.importorskip("llguidance", reason="llguidance is not a Kiln dependency (see bench/grammar_engines.py)")
    r = run("llguidance", tmp_path)
    assert "error" not in r and r["tokens"] > 10 and r["mask_median_us"] > 0
