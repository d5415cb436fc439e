"""Rejection sampling keeps the target distribution; greedy is exact."""
import pytest
import torch
from scipy.stats import chisquare

from kiln.llm.spec_decode.rejection import greedy_accept, rejection_sample

P = torch.tensor([0.05, 0.35, 0.1, 0.3, 0.2])
Q = torch.tensor([0.3, 0.1, 0.3, 0.2, 0.1])
TRIALS = 8000


def first_token_counts(draft_probs_of, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    target = torch.stack([P, P])
    counts = torch.zeros(len(P))
    for _ in range(TRIALS):
        q, draft = draft_probs_of(gen)
        counts[rejection_sample(target, [draft], q, gen)[0]] += 1
    return counts


def test_output_follows_target_for_a_model_draft():
    def draft(gen):
        return Q.unsqueeze(0), int(torch.multinomial(Q, 1, generator=gen))

    counts = first_token_counts(draft)
    assert chisquare(counts.numpy(), (P * TRIALS).numpy()).pvalue > 0.001


def test_output_follows_target_for_a_point_mass_draft():
    # An n-gram proposer always proposing token 2 (q = one-hot).
    counts = first_token_counts(lambda gen: (None, 2))
    assert chisquare(counts.numpy(), (P * TRIALS).numpy()).pvalue > 0.001


def test_a_wrong_sampler_would_fail_the_test():
    # Guard against a vacuous test: always accepting the draft yields Q.
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(Q, TRIALS, replacement=True, generator=gen), minlength=5)
    assert chisquare(counts.numpy(), (P * TRIALS).numpy()).pvalue < 0.001


def test_all_accepted_gives_a_bonus_token_and_zero_p_is_always_rejected():
    gen = torch.Generator().manual_seed(0)
    onehot = torch.eye(5)
    assert rejection_sample(onehot[[1, 3, 4]], [1, 3], None, gen) == [1, 3, 4]
    assert rejection_sample(onehot[[1, 3, 4]], [1, 2], None, gen) == [1, 3]
    assert rejection_sample(onehot[[0]], [], None, gen) == [0]


@pytest.mark.parametrize(
    "argmax, drafts, expected",
    [
        ([5, 6, 7, 8], [5, 6, 7], [5, 6, 7, 8]),  # all accepted + bonus
        ([5, 6, 7, 8], [5, 9, 7], [5, 6]),  # first mismatch at 1: correction
        ([5, 6, 7, 8], [4, 6, 7], [5]),  # nothing accepted
        ([3], [], [3]),
    ],
)
def test_greedy_acceptance_is_exact(argmax, drafts, expected):
    assert greedy_accept(argmax, drafts) == expected
