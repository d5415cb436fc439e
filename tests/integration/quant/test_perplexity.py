"""Perplexity of SmolLM2 on a fixed slice of Python's pydoc topics text:
int8 within 1% of the float32 baseline, int4 within 6% (both computed here)."""
from pydoc_data.topics import topics

import pytest

from kiln.config import EngineConfig
from kiln.llm.engine.builder import build_model
from kiln.llm.eval.perplexity import perplexity

pytestmark = pytest.mark.slow
WINDOW, WINDOWS, START = 256, 2, 20_000


@pytest.fixture(scope="module")
def ids(smollm2_tokenizer):
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    return ids[START : START + WINDOW * WINDOWS]


def model_perplexity(checkpoint, ids, **options):
    config = EngineConfig.from_flat(model=checkpoint.source, **{"dtype": "float32", **options})
    model = build_model(checkpoint, config, max_model_len=WINDOW)
    return perplexity(model, ids, window=WINDOW).value


@pytest.fixture(scope="module")
def baseline(smollm2_checkpoint, ids):
    ppl = model_perplexity(smollm2_checkpoint, ids)
    assert 2 < ppl < 100  # sane for a 135M model on this slice (~31)
    return ppl


@pytest.mark.parametrize("method,max_ratio", [("int8", 1.01), ("int4", 1.06)])
def test_quantized_perplexity_close_to_float(smollm2_checkpoint, ids, baseline, method, max_ratio):
    ppl = model_perplexity(smollm2_checkpoint, ids, quantization=method)
    assert ppl / baseline < max_ratio, f"{method}: {ppl:.4f} vs float32 {baseline:.4f}"
