"""The apps when things go wrong: divergence, unusable checkpoints, a full disk, and resumed runs' counters.

Real MPI jobs (serial tier). Every failure must end every rank with the same exit status (2: input
refused, 3: training stopped), rank 0 printing the reason once in one line, no traceback, nothing
already written lost. A resumed run's counters go on from its checkpoint.

The 2-rank runs whose tests read only their exit status, output and files run one after another in one
MPI job (``run_apps``: Python and torch start once per rank): the saved run and the resume refused on
its model, the divergence, the full disk (a 7 MiB tmpfs), the straight run and the run stopped at step 3;
then, once a copy of the saved run has been damaged, a second job with the refused and the intact
resume of that copy. Launched alone: the resume at 3 ranks (another world size), the resume of the
stopped run (its test reads the order of the process's start-up line and the resume line, and the
start-up line is printed as the app is imported, once per process), and the run in a requeueing job
(its SLURM environment would reach every run of a batch).
"""

import contextlib
import shutil

import h5py
import numpy as np
import pytest

from mpicomm.training.metrics import continued

from .app_runs import RESNET, launch, run_apps, strict_records
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
def batch(tmp_path_factory):
    """``(root, results, disk)``: the 2-rank runs of one job, in this order, each into ``root / name``:
    ``saved`` (4 steps, checkpoints at steps 2 and 4), ``other-model`` (``saved`` resumed with ResNet-32),
    ``diverged`` (lr 1e8, a checkpoint every step), ``straight`` (6 steps), ``stopped`` (6 steps, stopped at
    step 3) and ``full-disk`` (6 steps, a checkpoint every 2, into the 7 MiB tmpfs ``disk``; left out, and
    ``disk`` None, where no tmpfs can be mounted)."""
    root = tmp_path_factory.mktemp("failures")
    with contextlib.ExitStack() as stack:
        try:
            disk = stack.enter_context(tmpfs(root / "disk", "7m"))
        except pytest.skip.Exception:
            disk = None
        runs = {"saved": _args(4, root / "saved", "--save-every", "2"),
                "other-model": _args(6, root / "saved", "--resume", "latest", "--model", "resnet32"),
                "diverged": _args(8, root / "diverged", "--lr", "1e8", "--save-every", "1"),
                "straight": _args(6, root / "straight"),
                "stopped": _args(6, root / "stopped", "--stop-at-step", "3")}
        if disk is not None:
            runs["full-disk"] = _args(6, disk, "--save-every", "2")
        results = run_apps(2, {name: ("train_resnet.py", args) for name, args in runs.items()}, root / "batch")
        yield root, results, disk


@pytest.fixture(scope="module")
def saved_run(batch):
    """A 2-rank run of 4 steps with checkpoints at steps 2 and 4."""
    root, results, _ = batch
    assert results["saved"].returncode == 0, results["saved"].stderr[-3000:]
    return root / "saved"


@pytest.fixture(scope="module")
def damaged_resumes(saved_run, tmp_path_factory):
    """``(run, damaged, results)``: ``run``, a copy of the saved run whose rank-1 file of step 4 is cut short
    (``damaged``), resumed from ``latest`` (``refused``), then from step 2 (``intact``), in one job."""
    root = tmp_path_factory.mktemp("damaged")
    run = root / "run"
    shutil.copytree(saved_run, run)
    damaged = run / "step-000000004" / "rank-00001.h5"
    damaged.write_bytes(damaged.read_bytes()[:100_000])
    results = run_apps(2, {"refused": ("train_resnet.py", _args(6, run, "--resume", "latest")),
                           "intact": ("train_resnet.py", _args(4, run, "--resume", "step-000000002"))},
                       root / "batch")
    return run, damaged, results


def test_divergence_stops_every_rank_once_and_saves_nothing_after_it(batch):
    root, results, _ = batch
    proc, tmp_path = results["diverged"], root / "diverged"
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
    assert "the global batch is now 3/2 of the saved run's at the same learning rate (--lr-scaling linear" \
        in proc.stdout, proc.stdout[-2000:]
    resize = [r for r in strict_records(run / "metrics.jsonl") if r["event"] == "resize"]
    assert [(r["old_size"], r["new_size"], r["step"]) for r in resize] == [(2, 3, 2)]


def test_resuming_another_model_names_the_first_differing_parameter(batch, saved_run):
    proc = batch[1]["other-model"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_error(proc).endswith(
        "its model differs at parameter 21: the checkpoint has layers.3.conv1.weight of shape (32, 16, 3, 3), "
        "this job's model has layers.3.conv1.weight of shape (16, 16, 3, 3)")


def test_a_damaged_checkpoint_names_the_file_and_the_intact_earlier_one(damaged_resumes):
    run, damaged, results = damaged_resumes
    proc = results["refused"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error(proc)
    assert f"{damaged} is unreadable or corrupted" in line
    assert line.endswith(f"the earlier checkpoint step-000000002 is intact: --resume {run / 'step-000000002'}")
    again = results["intact"]  # ... and it is
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_resumed_run_continues_its_counters_and_says_what_it_does(batch):
    """Stop at step 3 of 6 (as SIGUSR1 would), resume: bytes, time and steps go on; one curve; same total."""
    root, results, _ = batch
    straight = root / "straight"
    assert results["straight"].returncode == 0
    run = root / "stopped"
    first = results["stopped"]
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


def test_a_full_disk_stops_with_one_line_and_keeps_the_last_checkpoint(batch):
    """A checkpoint of this run (2 ranks, ResNet-20 with momentum) takes ~4.4 MB: one fits in 7 MiB, two do not."""
    _, results, small_disk = batch
    if small_disk is None:
        pytest.skip("needs root to mount a small tmpfs")
    proc = results["full-disk"]
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = _one_error(proc)
    assert f"could not write the checkpoint of step 4 in {small_disk}: " in line
    assert "[Errno 28] No space left on device" in line
    assert line.endswith(f"the last checkpoint is {small_disk / 'step-000000002'} "
                         f"(--resume {small_disk / 'step-000000002'})")
    assert sorted(p.name for p in small_disk.iterdir()) == ["latest", "metrics.jsonl", "step-000000002"]
    assert _params_finite(small_disk / "step-000000002")
