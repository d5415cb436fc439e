"""/v1/models: a loaded LLM's card names its source, context length and the
dtype its engine chose (`--dtype auto` resolved); one still loading has none."""
from types import SimpleNamespace

from kiln.frontends.openai.serving_tokens import list_models
from kiln.llm.engine.messages import Ready


def plane(info: Ready | None):
    engine = SimpleNamespace(info=info, max_model_len=info.max_model_len if info else 0)
    served = SimpleNamespace(engine=engine if info else None)
    return SimpleNamespace(llm_names=lambda: ["m"], loaded_llm=lambda name: served, llm_route_names=lambda: [])


def test_a_loaded_models_card_shows_the_chosen_dtype():
    info = Ready(max_model_len=2048, vocab_size=10, tokenizer_path="t", source="/models/smol", num_blocks=4,
                 block_size=16, pid=1, dtype="bfloat16")
    (card,) = list_models(plane(info), created=7)["data"]
    assert card == {"id": "m", "object": "model", "created": 7, "owned_by": "kiln", "root": "/models/smol",
                    "max_model_len": 2048, "dtype": "bfloat16"}


def test_a_model_still_loading_has_no_engine_fields():
    (card,) = list_models(plane(None), created=7)["data"]
    assert "dtype" not in card and "max_model_len" not in card
