"""WaitPolicy / RecentPeak: when a forming batch waits, exactly."""
from kiln.serving.batching.wait_policy import MAX_SKIP, RecentPeak, WaitPolicy

S = 1_000_000_000  # ns


def test_recent_peak_covers_this_window_and_the_last_then_forgets():
    peak = RecentPeak(window_ns=S)
    peak.observe(5, 0)
    peak.observe(3, S // 2)
    assert peak.peak(S // 2) == 5
    assert peak.peak(S + 1) == 5  # the previous window still counts
    peak.observe(2, S + 2)
    assert peak.peak(2 * S + 10) == 2  # window [0, S) is forgotten, [S, 2S) remembered
    assert peak.peak(10 * S) == 0  # a long silence forgets everything


def _skipped(policy: WaitPolicy) -> int:
    n = 0
    while not policy.may_wait():
        n += 1
    return n


def test_fruitless_waits_skip_1_2_4_batches_up_to_the_cap_and_a_fruitful_one_resets():
    policy = WaitPolicy()
    assert _skipped(policy) == 0  # waiting is on from the start
    lengths = []
    for _ in range(12):
        policy.deadline_passed(joined_while_waiting=False)
        lengths.append(_skipped(policy))
    assert lengths == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024] and MAX_SKIP == 1024
    policy.deadline_passed(joined_while_waiting=True)
    assert _skipped(policy) == 0
    policy.deadline_passed(joined_while_waiting=False)
    assert _skipped(policy) == 1


def test_an_overlapping_arrival_turns_waiting_back_on():
    policy = WaitPolicy()
    policy.deadline_passed(joined_while_waiting=False)
    policy.arrived(1, 0)  # nothing else outstanding: still skipping
    assert not policy.may_wait()
    policy.deadline_passed(joined_while_waiting=False)
    policy.arrived(1, 1)  # one is outstanding already: requests overlap
    assert policy.may_wait()


def test_a_batch_with_as_many_rows_as_were_outstanding_at_the_peak_is_enough():
    policy = WaitPolicy()
    policy.arrived(1, 0)
    assert not policy.enough(1, 0)  # a peak of one says nothing: wait as configured
    for i in range(7):
        policy.arrived(1, i + 1)
    for _ in range(8):
        policy.answered(1)
    assert policy.outstanding_rows == 0
    assert not policy.enough(7, 10)
    assert policy.enough(8, 10)
