"""A one-rank ShardedLlamaModel is LlamaModel: same weights, same outputs;
and sharded linears keep exactly their slices (owned copies, not views)."""
import torch

from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.checkpoint import expected_weight_shapes
from kiln.llm.models.llama import LlamaModel
from kiln.llm.parallel.layers import ColumnParallelLinear, RowParallelLinear
from kiln.llm.parallel.model import ShardedLlamaModel, resident_weight_bytes
from kiln.llm.parallel.plan import PlanChunk
from kiln.llm.parallel.state import ParallelState
from kiln.llm.parallel.weights import DictReader
from kiln.llm.runner.inputs import build_inputs

ARCH = LlamaArch(
    vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
)


def random_weights():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(*s, generator=g) * 0.2 for n, s in expected_weight_shapes(ARCH).items()}


def test_one_rank_sharded_model_equals_llama_model():
    weights = random_weights()
    ref = LlamaModel(ARCH, 64).eval()
    ref.load_weights(weights)
    sharded = ShardedLlamaModel(ARCH, 64, ParallelState()).eval()
    sharded.load_weights(DictReader(weights))
    chunk = PlanChunk(0, [3, 4, 5, 6, 7], 0, 5, [0], True)
    inputs = build_inputs([chunk], 16, torch.device("cpu"))
    kv = lambda: [torch.zeros(2, 16, 2, 8) for _ in range(2)]  # noqa: E731
    with torch.inference_mode():
        a = ref.compute_logits(ref(inputs.input_ids, inputs.positions, kv(), inputs.meta))
        b = sharded.compute_logits(sharded(inputs.input_ids, inputs.positions, kv(), inputs.meta))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert resident_weight_bytes(sharded) == resident_weight_bytes(ref)


def test_parallel_linears_own_their_slices():
    w = {"a": torch.arange(24.0).view(6, 4), "b": torch.arange(24.0, 48.0).view(6, 4)}
    col = ColumnParallelLinear(4, [(2, 4), (0, 1)])
    col.load(DictReader(w), ["a", "b"])
    assert torch.equal(col.weight, torch.cat([w["a"][2:4], w["b"][0:1]]))
    row = RowParallelLinear((1, 3), 6)
    row.load(DictReader(w), "a")
    assert torch.equal(row.weight, w["a"][:, 1:3])
    assert row.weight.untyped_storage().nbytes() == 6 * 2 * 4  # a copy, not a view of the whole
