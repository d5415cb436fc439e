"""Who owns what under TP/PP: heads, KV heads, MLP columns, vocab, layers."""
import pytest

from kiln.errors import ConfigError
from kiln.llm.models.arch import LlamaArch
from kiln.llm.parallel.layout import TensorSplit, check_splittable, stage_layers
from kiln.llm.parallel.plan import split_micro_batches


def arch(heads=4, kv=2, inter=128, vocab=100, layers=2) -> LlamaArch:
    return LlamaArch(
        vocab_size=vocab, hidden_size=16 * heads, intermediate_size=inter, num_layers=layers, num_heads=heads,
        num_kv_heads=kv, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def splits(a, tp):
    return [TensorSplit(a, r, tp) for r in range(tp)]


def test_even_split_partitions_heads_and_mlp():
    s0, s1 = splits(arch(), 2)
    assert (s0.q_heads, s1.q_heads) == ((0, 2), (2, 4))
    assert (s0.kv_heads, s1.kv_heads) == ((0, 1), (1, 2))
    assert (s0.intermediate, s1.intermediate) == ((0, 64), (64, 128))


def test_uneven_smollm2_heads_follow_kv_groups():
    s0, s1 = splits(arch(heads=9, kv=3, inter=1536), 2)  # SmolLM2-135M's attention shape
    assert (s0.kv_heads, s1.kv_heads) == ((0, 1), (1, 3))
    assert (s0.q_heads, s1.q_heads) == ((0, 3), (3, 9))  # each query head stays with its KV head


def test_fewer_kv_heads_than_ranks_replicates():
    ranks = splits(arch(heads=4, kv=1), 2)
    assert [s.kv_heads for s in ranks] == [(0, 1), (0, 1)]
    assert [s.q_heads for s in ranks] == [(0, 2), (2, 4)]
    ranks = splits(arch(heads=8, kv=2), 4)
    assert [s.kv_heads for s in ranks] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in ranks] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_vocab_shards_are_equal_and_padded():
    ranks = splits(arch(vocab=101), 2)
    assert [s.vocab for s in ranks] == [(0, 51), (51, 102)]


def test_stage_layers_are_contiguous_first_stages_take_the_rest():
    assert [stage_layers(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(30, 4, r) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]


@pytest.mark.parametrize(
    "a,tp,pp",
    [(arch(heads=6, kv=3), 2 * 2, 1), (arch(heads=2, kv=1), 4, 1), (arch(layers=2), 1, 3)],
    ids=["tp-not-multiple-of-kv", "too-few-query-heads", "more-stages-than-layers"],
)
def test_unsplittable_models_are_config_errors(a, tp, pp):
    with pytest.raises(ConfigError):
        check_splittable(a, tp, pp)


def test_micro_batches_are_contiguous_balanced_and_non_empty():
    assert split_micro_batches([1] * 8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_micro_batches([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_micro_batches([5], 4) == [[0]]
    runs = split_micro_batches([1, 1, 1, 100], 3)
    assert len(runs) == 3 and all(runs) and sum(runs, []) == [0, 1, 2, 3]
