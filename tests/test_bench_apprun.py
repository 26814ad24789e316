"""The wall-clock benchmarks' arithmetic on metrics records: per-step splits, traffic per phase, time to target."""

import pytest

from bench.apprun import AppRun, time_to_target


def _run() -> AppRun:
    # 4 steps logged every 2: steps 1-2 cost 1.0 s each (0.6 compute + 0.4 comm), steps 3-4 cost 0.5 s each.
    records = [
        {"event": "start", "parameters": 1000, "init_traffic": {"bytes_sent": 500, "bytes_contributed": 100}},
        {"event": "train", "step": 2, "compute_s_per_step": 0.6, "comm_s_per_step": 0.4, "wait_s_per_step": 0.0,
         "step_s_per_step": 1.0, "bytes_sent": 2500, "bytes_contributed": 1100},
        {"event": "eval", "step": 2, "train_s": 2.0, "test_accuracy": 0.5},
        {"event": "train", "step": 4, "compute_s_per_step": 0.3, "comm_s_per_step": 0.1, "wait_s_per_step": 0.1,
         "step_s_per_step": 0.5, "hidden_s_per_step": 0.2, "bytes_sent": 2900, "bytes_contributed": 1300},
        {"event": "eval", "step": 4, "train_s": 3.0, "test_accuracy": 0.8},
        {"event": "end", "step": 4, "train_s": 3.0, "bytes_sent": 2900, "bytes_contributed": 1300},
    ]
    return AppRun("case", ["cmd"], records)


def test_per_step_weights_each_record_by_its_steps():
    run = _run()
    assert run.per_step() == pytest.approx({"compute_s": 0.45, "comm_s": 0.25, "wait_s": 0.05, "step_s": 0.75,
                                            "hidden_s": 0.1})  # the first record has none: zero there
    assert run.per_step(2, None)["step_s"] == pytest.approx(0.5)
    assert run.per_step(0, 2)["comm_s"] == pytest.approx(0.4)


def test_traffic_excludes_the_initial_broadcast_and_splits_by_phase():
    run = _run()
    assert run.traffic_per_step() == pytest.approx((2900 - 500) / 4)
    assert run.traffic_per_step("bytes_sent", 0, 2) == pytest.approx(1000)
    assert run.traffic_per_step("bytes_sent", 2) == pytest.approx(200)
    assert run.bits_per_parameter() == pytest.approx(8 * (1300 - 100) / 4 / 1000)


def test_time_to_target():
    curve = _run().evals("test_accuracy")
    assert curve == [(2.0, 0.5, 2), (3.0, 0.8, 4)]
    assert time_to_target(curve, 0.7) == 3.0
    assert time_to_target(curve, 0.5) == 2.0
    assert time_to_target(curve, 0.9) is None
    assert time_to_target([(1.0, 3.0, 1), (2.0, 2.0, 2)], 2.5, lower_is_better=True) == 2.0
