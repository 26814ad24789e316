"""``--overlap`` of the compressed methods in the apps (MPI jobs): the same run as without, or one clear refusal."""

from mpicomm.training.metrics import read_metrics

from .app_runs import RESNET, launch


def test_qsgd_overlap_trains_exactly_as_without(tmp_path):
    """``--overlap`` reaches the algorithm (the configuration its start event records has overlap on, with the
    bucket sizes given; off with ``--no-overlap``), and the run's losses equal those without it, bit for bit."""
    losses, sent = {}, {}
    for flag in ("--overlap", "--no-overlap"):
        out = tmp_path / flag.strip("-")
        proc = launch(2, "train_resnet.py", [*RESNET, "--algorithm", "qsgd", "--bits", "4", "--momentum", "0.9",
                                            "--accumulate", "2", flag, "--first-bucket-numel", "1000",
                                            "--bucket-numel", "50000", "--out-dir", str(out)])
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


def test_terngrad_overlap_fails_with_one_clear_message():
    proc = launch(2, "train_resnet.py", ["--max-steps", "1", "--no-progress", "--algorithm", "terngrad", "--overlap"],
                  timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("terngrad cannot overlap: its one max-norm scale") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
