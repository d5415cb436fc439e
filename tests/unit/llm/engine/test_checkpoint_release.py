"""An engine that reads its checkpoint releases it once the model holds the
weights: no Checkpoint tensor outlives build_engine_core. One the caller
passes in stays the caller's (LLM(checkpoint=...) shares one read)."""
import gc
import weakref

from kiln.config import EngineConfig
from kiln.llm.engine import builder
from kiln.llm.models.loader import load_checkpoint


def test_a_checkpoint_read_by_the_engine_dies_after_build(tiny_llama_dir, monkeypatch):
    refs = []

    def load_and_watch(path):
        checkpoint = load_checkpoint(path)
        refs.extend([weakref.ref(checkpoint), weakref.ref(checkpoint.weights["model.embed_tokens.weight"])])
        return checkpoint

    monkeypatch.setattr(builder, "load_checkpoint", load_and_watch)
    config = EngineConfig.from_flat(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory_gib=0.01)
    core, described = builder.build_engine_core(config)
    gc.collect()
    assert refs and all(ref() is None for ref in refs)
    assert described.weights == {} and described.quantized == {} and described.source == str(tiny_llama_dir)
    assert core.runner.model.embed_tokens.numel() > 0


def test_a_checkpoint_passed_in_is_left_whole(tiny_llama_dir):
    checkpoint = load_checkpoint(tiny_llama_dir)
    names = set(checkpoint.weights)
    config = EngineConfig.from_flat(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory_gib=0.01)
    _, described = builder.build_engine_core(config, checkpoint)
    assert set(checkpoint.weights) == names and described.weights == {}
