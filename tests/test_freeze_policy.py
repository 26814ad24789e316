"""The 1-bit family's freeze policy on hand-built sequences of the typical denominator s: the earliest and latest
steps of a run, the settling test over its window, a step given, a run too short to compress, and a resume that
decides as the straight run does."""

import pytest

from mpicomm.algorithms.onebit.freeze import FreezePolicy


def _run(policy, scales, start=1):
    """Feed s at steps start, start + 1, ... (only where the policy asks for it); the step it froze at."""
    for step, s in enumerate(scales, start):
        if policy.after_step(step, s if policy.needs_scale(step) else None):
            return step
    return None


def test_bounds_and_window_of_a_run_of_100_steps():
    policy = FreezePolicy("apmsqueeze", None, 100)
    assert (policy.earliest, policy.latest, policy.window) == (20, 50, 5)
    assert [policy.needs_scale(t) for t in (14, 15, 50)] == [False, True, True]


def test_freezes_at_the_first_step_past_the_earliest_where_s_settled():
    """s doubles every step until step 24, then stays at 2^24: |s_t - s_(t-5)| / s_t < 0.05 first at t = 29."""
    scales = [2.0 ** min(t, 24) for t in range(1, 101)]
    policy = FreezePolicy("apmsqueeze", None, 100)
    assert _run(policy, scales) == 29
    assert policy.metrics() == {"variance_frozen_at": 29, "variance_frozen_because": "settled", "variance_change": 0.0}


def test_settled_before_the_earliest_step_still_waits_for_it():
    policy = FreezePolicy("onebit_lamb", None, 100)
    assert _run(policy, [1.0] * 100) == 20


def test_a_variance_still_moving_freezes_at_the_latest_step():
    """s grows 3 % a step: 14 % over the window of 5, never below the tolerance of 10 %."""
    policy = FreezePolicy("zeroone_adam", None, 100)
    assert _run(policy, [1.03**t for t in range(1, 101)]) == 50
    assert policy.reason == "latest" and policy.change == pytest.approx(1 - 1.03**-5)


def test_a_change_just_under_the_tolerance_has_settled():
    """s grows 2 % a step: 9.4 % over the window, under the tolerance of 10 %: settled at the earliest step."""
    policy = FreezePolicy("zeroone_adam", None, 100)
    assert _run(policy, [1.02**t for t in range(1, 101)]) == 20 and policy.reason == "settled"


def test_a_step_given_is_kept():
    policy = FreezePolicy("apmsqueeze", 7, 100)
    assert not policy.adaptive and _run(policy, [None] * 100) == 7 and policy.reason == "given"


def test_a_run_too_short_to_compress_is_refused_in_one_line():
    with pytest.raises(ValueError) as caught:
        FreezePolicy("apmsqueeze", None, 1)
    assert "too short to compress" in str(caught.value) and "\n" not in str(caught.value)


def test_resumed_mid_window_it_decides_as_the_straight_run():
    scales = [2.0 ** min(t, 24) for t in range(1, 101)]
    first = FreezePolicy("apmsqueeze", None, 100)
    assert _run(first, scales[:26]) is None
    second = FreezePolicy("apmsqueeze", None, 100)
    second.load_state_dict(first.state_dict(), 26, False)
    assert _run(second, scales[26:], start=27) == 29
