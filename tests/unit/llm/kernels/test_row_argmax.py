"""kiln::row_argmax (greedy decoding's token choice) against torch.argmax(dim=-1):
the same index for every row, ties (common in bf16), NaNs, infinities, rows
shorter than a vector and strided views included."""
import pytest
import torch

from kiln.llm.kernels import ops
from kiln.llm.kernels.build import cpu_supported
from kiln.llm.sampling.sampler import row_argmax

pytestmark = pytest.mark.skipif(not cpu_supported(), reason="CPU without AVX2/FMA: kernels are not built")


def assert_matches_argmax(logits: torch.Tensor) -> None:
    got = ops.row_argmax(logits)
    assert got is not None and got.dtype == torch.long
    assert torch.equal(got, logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 300, 49152])
def test_random_rows_match_argmax(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    assert_matches_argmax((torch.randn(13, vocab, generator=g) * 4).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_first_index(dtype):
    logits = torch.zeros(4, 40, dtype=dtype)
    logits[0, [3, 17, 39]] = 2.0
    logits[1, [38, 39]] = 1.0  # in the scalar tail past the last full vector
    logits[2] = -1.0  # all equal
    logits[3, 5] = -0.0  # -0.0 == 0.0: index 0 is the first maximum
    assert_matches_argmax(logits)
    assert ops.row_argmax(logits).tolist() == [3, 38, 0, 0]
    # bf16 logits of a real vocabulary tie often: rounded to 3 significant digits
    g = torch.Generator().manual_seed(0)
    coarse = torch.randint(-20, 21, (16, 49152), generator=g).to(dtype) / 4
    assert_matches_argmax(coarse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_infinities(dtype):
    logits = torch.randn(5, 50).to(dtype)
    logits[0, 20] = float("nan")  # a NaN counts as the largest
    logits[1, [30, 12]] = float("nan")  # the first NaN wins
    logits[1, 5] = float("inf")
    logits[2, 44] = float("inf")
    logits[3] = float("-inf")  # a fully masked row: index 0
    logits[4, 49] = float("nan")  # in the tail
    assert_matches_argmax(logits)
    assert ops.row_argmax(logits).tolist() == [20, 12, 44, 0, 49]


def test_strided_views_and_empty_batches():
    base = torch.randn(6, 2 * 300)
    assert_matches_argmax(base[:, ::2])  # inner stride 2: copied first
    assert_matches_argmax(base[::2, :300])  # row stride 600
    assert_matches_argmax(torch.randn(0, 300))


def test_what_it_does_not_take_falls_back_to_torch():
    assert ops.row_argmax(torch.randn(3, 10, dtype=torch.float64)) is None
    assert ops.row_argmax(torch.randn(3, 0)) is None
    half = torch.randn(3, 10).half()
    assert torch.equal(row_argmax(half), half.argmax(dim=-1))  # the sampler's path for every dtype
