"""``--overlap`` of the compressed methods in the apps (MPI jobs): the same run as without, or one clear refusal.

The three app runs (QSGD with and without ``--overlap``, TernGrad's refusal) read only their exit status,
output and files, so they run one after another in one 2-rank MPI job (``run_apps``: Python and torch start
once).
"""

import pytest

from mpicomm.training.metrics import read_metrics

from .app_runs import RESNET, run_apps

FLAGS = ("--overlap", "--no-overlap")


@pytest.fixture(scope="module")
def app_runs(tmp_path_factory):
    """``(folder, results)``: the QSGD run with each of :data:`FLAGS` (named by the flag without its dashes, writing
    into ``folder / name``) and TernGrad with ``--overlap`` (``terngrad``), run in one batch."""
    root = tmp_path_factory.mktemp("overlap")
    runs = {flag.strip("-"): ("train_resnet.py", [*RESNET, "--algorithm", "qsgd", "--bits", "4", "--momentum", "0.9",
                                                  "--accumulate", "2", flag, "--first-bucket-numel", "1000",
                                                  "--bucket-numel", "50000", "--out-dir", str(root / flag.strip("-"))])
            for flag in FLAGS}
    runs["terngrad"] = ("train_resnet.py", ["--max-steps", "1", "--no-progress", "--algorithm", "terngrad",
                                            "--overlap"])
    return root, run_apps(2, runs, root / "batch")


def test_qsgd_overlap_trains_exactly_as_without(app_runs):
    """``--overlap`` reaches the algorithm (the configuration its start event records has overlap on, with the
    bucket sizes given; off with ``--no-overlap``), and the run's losses equal those without it, bit for bit."""
    root, results = app_runs
    losses, sent = {}, {}
    for flag in FLAGS:
        out = root / flag.strip("-")
        proc = results[flag.strip("-")]
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = read_metrics(str(out / "metrics.jsonl"))
        config = next(r for r in records if r["event"] == "start")["config"]
        assert config["overlap"] is (flag == "--overlap"), (flag, config)
        assert (config["first_bucket_numel"], config["bucket_numel"]) == (1000, 50000), config
        train = [r for r in records if r["event"] == "train"]
        losses[flag] = [r["loss"] for r in train]
        sent[flag] = train[-1]["bytes_sent"]
    assert len(losses["--overlap"]) == 4 and losses["--overlap"] == losses["--no-overlap"]
    assert 0 <= sent["--overlap"] - sent["--no-overlap"] <= 4 * 100  # at most a byte of padding per bucket


def test_terngrad_overlap_fails_with_one_clear_message(app_runs):
    proc = app_runs[1]["terngrad"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("terngrad cannot overlap: its one max-norm scale") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
