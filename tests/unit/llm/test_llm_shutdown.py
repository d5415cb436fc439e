import pytest

from kiln.errors import EngineDeadError
from kiln.llm.llm import LLM
from kiln.llm.sampling_params import SamplingParams


def test_an_llm_after_its_with_block_refuses_requests_by_name(tiny_llama_dir):
    # A tensor/pipeline-parallel LLM used after `with` failed with "a collective failed".
    with LLM(str(tiny_llama_dir), num_blocks=16, dtype="float32") as llm:
        assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    for call in (lambda: llm.generate("Hi"), lambda: llm.embed("Hi")):
        with pytest.raises(EngineDeadError, match=r"this LLM was shut down .*create a new LLM"):
            call()
    llm.shutdown()  # twice is harmless
