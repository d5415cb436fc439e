"""Prompt-lookup proposals: longest n-gram first, most recent occurrence."""
from kiln.llm.spec_decode.ngram import propose_ngram


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 3, 7, 1, 2, 3]
    # suffix [1,2,3] occurred at 0 (followed by 4 5 3); [3] alone more recently at 5 (-> 7).
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 3]
    assert propose_ngram(tokens, 3, 1, 1) == [7, 1, 2]


def test_most_recent_occurrence_and_k_limit():
    tokens = [9, 8, 1, 2, 9, 8, 3, 4, 5, 9, 8]
    assert propose_ngram(tokens, 2, 1, 2) == [3, 4]
    assert propose_ngram(tokens, 5, 2, 2) == [3, 4, 5, 9, 8]


def test_proposal_stops_at_the_end_of_the_sequence():
    assert propose_ngram([5, 6, 7, 5], 3, 1, 4) == [6, 7, 5]
    assert propose_ngram([4, 4, 4], 3, 1, 2) == [4]  # overlapping match at 0: [4 4] then one token


def test_no_match_or_too_short():
    assert propose_ngram([1, 2, 3], 3, 1, 4) == []
    assert propose_ngram([1, 2, 1], 3, 2, 4) == []  # min_n = 2: the 1-gram match does not count
    assert propose_ngram([1], 3, 1, 4) == []
    assert propose_ngram([1, 1], 0, 1, 4) == []
