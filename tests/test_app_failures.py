"""The apps when things go wrong: divergence, unusable checkpoints, a full disk, and resumed runs' counters.

Each case launches real MPI jobs (serial tier). Every failure must end every rank with the same exit
status (2: input refused, 3: training stopped), rank 0 printing the reason once in one line, no
traceback, nothing already written lost. A resumed run's counters go on from its checkpoint.
"""

import shutil

import h5py
import numpy as np
import pytest

from mpicomm.training.metrics import continued

from .app_runs import RESNET, launch, strict_records
from .conftest import tmpfs

DPSGD = [*RESNET, "--algorithm", "dpsgd", "--momentum", "0.9"]


def _args(steps: int, out_dir, *extra) -> list[str]:
    args = list(DPSGD)
    args[args.index("--max-steps") + 1] = str(steps)
    return [*args, "--out-dir", str(out_dir), *extra]


def _one_error(proc) -> str:
    """The single ``error:`` line rank 0 printed (and that nothing else reached stderr)."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train_resnet: error: "), proc.stderr[-3000:]
    return lines[0]


def _params_finite(checkpoint) -> bool:
    with h5py.File(checkpoint / "checkpoint.h5", "r") as f:
        return all(np.isfinite(f[f"ranks/{r}/algorithm/params"][()]).all() for r in f["ranks"])


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-rank run of 4 steps with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("saved")
    proc = launch(2, "train_resnet.py", _args(4, out, "--save-every", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_divergence_stops_every_rank_once_and_saves_nothing_after_it(tmp_path):
    proc = launch(2, "train_resnet.py", _args(8, tmp_path, "--lr", "1e8", "--save-every", "1"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = _one_error(proc)
    records = strict_records(tmp_path / "metrics.jsonl")  # valid JSON: no bare NaN
    diverged = next(r for r in records if r["event"] == "diverged")
    step = diverged["step"]
    assert f"training diverged by step {step}: on rank {diverged['rank']} the " in line
    saved = sorted(p.name for p in tmp_path.glob("step-*"))
    assert saved and int(saved[-1][5:]) < step
    assert f"the last checkpoint is {tmp_path / saved[-1]} (--resume {tmp_path / saved[-1]})" in line
    assert all(_params_finite(tmp_path / name) for name in saved)
    assert not any(r["event"] == "checkpoint" and r["step"] >= step for r in records)


def test_resuming_with_another_world_size_continues_at_that_size(saved_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    proc = launch(3, "train_resnet.py", _args(4, run, "--resume", "step-2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run / 'step-000000002'} at step 2 of 4 (saved at 2 ranks, continued at 3)" in proc.stdout
    resize = [r for r in strict_records(run / "metrics.jsonl") if r["event"] == "resize"]
    assert [(r["old_size"], r["new_size"], r["step"]) for r in resize] == [(2, 3, 2)]


def test_resuming_another_model_names_the_first_differing_parameter(saved_run):
    proc = launch(2, "train_resnet.py", _args(6, saved_run, "--resume", "latest", "--model", "resnet32"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_error(proc).endswith(
        "its model differs at parameter 21: the checkpoint has layers.3.conv1.weight of shape (32, 16, 3, 3), "
        "this job's model has layers.3.conv1.weight of shape (16, 16, 3, 3)")


def test_a_damaged_checkpoint_names_the_file_and_the_intact_earlier_one(saved_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    damaged = run / "step-000000004" / "rank-00001.h5"
    damaged.write_bytes(damaged.read_bytes()[:100_000])
    proc = launch(2, "train_resnet.py", _args(6, run, "--resume", "latest"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error(proc)
    assert f"{damaged} is unreadable or corrupted" in line
    assert line.endswith(f"the earlier checkpoint step-000000002 is intact: --resume {run / 'step-000000002'}")
    again = launch(2, "train_resnet.py", _args(4, run, "--resume", "step-000000002"))  # ... and it is
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_resumed_run_continues_its_counters_and_says_what_it_does(tmp_path):
    """Stop at step 3 of 6 (as SIGUSR1 would), resume: bytes, time and steps go on; one curve; same total."""
    straight = tmp_path / "straight"
    assert launch(2, "train_resnet.py", _args(6, straight)).returncode == 0
    run = tmp_path / "run"
    first = launch(2, "train_resnet.py", _args(6, run, "--stop-at-step", "3"))
    assert first.returncode == 128 + 10, first.stderr[-3000:]  # SIGUSR1 outside a requeueing job
    assert f"train_resnet: stopped by SIGUSR1 at step 3, checkpoint at {run / 'step-000000003'}" in first.stdout
    second = launch(2, "train_resnet.py", _args(6, run, "--resume", "latest"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"train_resnet: resumed from {run / 'step-000000003'} at step 3 of 6" in second.stdout
    assert second.stdout.index("starting:") < second.stdout.index("resumed from")

    records = strict_records(run / "metrics.jsonl")
    resume = next(r for r in records if r["event"] == "resume")
    before = [r for r in records[:records.index(resume)] if r["event"] == "train"]
    after = [r for r in records[records.index(resume):] if r["event"] == "train"]
    assert resume["step"] == 3 and resume["bytes_sent"] == before[-1]["bytes_sent"]
    assert after[0]["bytes_sent"] > resume["bytes_sent"] and after[0]["wall_s"] > resume["wall_s"]
    end = records[-1]
    assert end["event"] == "end" and end["train_s"] > resume["train_s"] > 0
    assert end["bytes_sent"] == strict_records(straight / "metrics.jsonl")[-1]["bytes_sent"]
    steps = [r["step"] for r in continued(records) if r["event"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_signal_inside_a_requeueing_job_leaves_the_marker_its_script_requeues_on(tmp_path):
    """The app never calls scontrol itself (Slurm would kill the step mid-exit): it exits 0 and leaves a marker."""
    run = tmp_path / "run"
    proc = launch(2, "train_resnet.py", _args(4, run, "--stop-at-step", "2"),
                  env={"SLURM_JOB_ID": "4242", "MPICOMM_REQUEUE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "requeue").read_text() == "job 4242 stopped at step 2\n"
    assert "job 4242 will be requeued by its script once every rank has exited" in proc.stdout
    assert (run / "step-000000002" / "checkpoint.h5").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 7 MiB tmpfs."""
    with tmpfs(tmp_path / "disk", "7m") as disk:
        yield disk


def test_a_full_disk_stops_with_one_line_and_keeps_the_last_checkpoint(small_disk):
    """A checkpoint of this run (2 ranks, ResNet-20 with momentum) takes ~4.4 MB: one fits in 7 MiB, two do not."""
    proc = launch(2, "train_resnet.py", _args(6, small_disk, "--save-every", "2"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = _one_error(proc)
    assert f"could not write the checkpoint of step 4 in {small_disk}: " in line
    assert "[Errno 28] No space left on device" in line
    assert line.endswith(f"the last checkpoint is {small_disk / 'step-000000002'} "
                         f"(--resume {small_disk / 'step-000000002'})")
    assert sorted(p.name for p in small_disk.iterdir()) == ["latest", "metrics.jsonl", "step-000000002"]
    assert _params_finite(small_disk / "step-000000002")
