"""The check that makes a drifted averaged model loud: its accuracy against every rank's own model's."""

from mpicomm.training.reporting import DRIFT_GAP, drifted


def test_an_average_far_below_every_rank_is_called_drifted():
    # the MNIST-1D case: the average at chance, the worst rank's own model at 81 %
    result = {"test_loss": 2.3, "test_accuracy": 0.1018, "test_accuracy_rank_min": 0.81,
              "test_accuracy_rank_max": 0.92, "consensus_distance": 18.7}
    reason = drifted(result)
    assert "10.18 % test accuracy" in reason and "at least 81.00 %" in reason
    assert "consensus distance 18.7" in reason


def test_an_average_within_the_gap_or_above_is_not():
    assert DRIFT_GAP == 0.10
    assert drifted({"test_accuracy": 0.72, "test_accuracy_rank_min": 0.81}) == ""  # 9 points below
    assert drifted({"test_accuracy": 0.95, "test_accuracy_rank_min": 0.81}) == ""  # above: averaging helped
    assert drifted({"val_mlm_accuracy": 0.30, "val_mlm_accuracy_rank_min": 0.41}) != ""  # 11 below, any app's key


def test_losses_and_single_figures_are_not_compared():
    # a loss is not an accuracy (lower is better); without the ranks' figures there is nothing to compare
    assert drifted({"test_loss": 9.0, "test_loss_rank_min": 0.1}) == ""
    assert drifted({"test_accuracy": 0.1}) == ""
