"""Rendered templates on a real SLURM: a job completes; a signalled job checkpoints, requeues, resumes exactly;
a requeued job resized while it waits continues its checkpoint at the new size; a job with ``ON_RANK_LOSS=continue``
completes when one of its ranks is killed, and one without ends naming how to enable that.

Runs only inside ``scripts/slurm_local.sh`` (which brings up munge + slurmctld + slurmd on loopback and
exports ``SLURM_CONF``); ``scripts/test.sh`` does that as root. Elsewhere these tests skip with the reason.
"""

import math
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import pytest

from mpicomm.slurm import render
from mpicomm.slurm.commands import repo_slurm_dir
from mpicomm.training.metrics import read_metrics

REPO = os.path.dirname(repo_slurm_dir())
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not os.environ.get("SLURM_CONF"), reason="no SLURM cluster (run via scripts/slurm_local.sh)"),
]
STEPS = 12


def _job_text(out_dir: str, save_every: int, extra: str = "", tasks: int = 2, params: dict | None = None) -> str:
    with open(os.path.join(repo_slurm_dir(), "generic.sbatch")) as f:
        generic = f.read()
    return render(generic, {
        "job-name": "ci", "ntasks-per-node": str(tasks), "cpus-per-task": "1", "time": "10",
        "output": f"{out_dir}/job-%j.out", "error": f"{out_dir}/job-%j.out",
        "APP": "apps/train_resnet.py", "ALGORITHM": "moniqua", "EPOCHS": "1", "OUT_DIR": out_dir,
        "SAVE_EVERY": str(save_every),
        "EXTRA_ARGS": f"--max-steps {STEPS} --batch-size 8 --eval-limit 64 --log-every 1 --bits 2 {extra}".strip(),
        **(params or {}),
    })


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _submit(tmp_path, name: str, save_every: int, wait: bool, extra: str = "", tasks: int = 2,
            params: dict | None = None) -> tuple[int, str]:
    """Submit the job (``tasks`` ranks on the one node, template parameters ``params`` set); with ``wait``, return
    once it has completed (polled twice a second: ``sbatch --wait`` polls at 2, 10 and 42 s, so a 12-second job
    would hold the test for 42)."""
    out_dir = str(tmp_path / name)
    os.makedirs(out_dir)
    job = tmp_path / f"{name}.sbatch"
    job.write_text(_job_text(out_dir, save_every, extra, tasks, params))
    proc = subprocess.run(["sbatch", "--parsable", str(job)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = int(proc.stdout.strip().split(";")[0])
    if wait:
        if not _poll(lambda: _job_field(job_id, "JobState") in FINISHED, 240):
            pytest.fail(f"job {job_id} did not finish in 240 s; queue:\n{_queue()}\n" + _diagnose(out_dir))
        state = _job_field(job_id, "JobState")
        assert state == "COMPLETED", f"job {job_id} {state}: " + _diagnose(out_dir, job_id=job_id)
    return job_id, out_dir


def _poll(condition, seconds: float, every: float = 0.5) -> bool:
    """Whether ``condition()`` came true, asked every ``every`` s for at most ``seconds`` (a hang bound only)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def _queue() -> str:
    return subprocess.run(["squeue", "-o", "%i %T %r"], capture_output=True, text=True).stdout


def _job_field(job_id: int, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "-o", "job", str(job_id)], capture_output=True, text=True).stdout
    match = re.search(rf"\b{field}=(\S+)", out)
    return match.group(1) if match else ""


def _daemon_log_lines(job_id: int) -> str:
    """The lines of slurmctld's and slurmd's logs (paths from SLURM_CONF) that mention job ``job_id``."""
    with open(os.environ["SLURM_CONF"]) as f:
        paths = re.findall(r"^Slurm(?:ctld|d)LogFile=(\S+)", f.read(), re.MULTILINE)
    mention = re.compile(rf"(JobId|job_id|StepId|job)[= ]?{job_id}\b")
    lines = []
    for path in paths:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                lines += [f"{os.path.basename(path)}: {line.rstrip()}" for line in f if mention.search(line)]
    return "\n".join(lines[-60:])


def _diagnose(out_dir: str, extra: str = "", job_id: int | None = None) -> str:
    logs = [open(os.path.join(out_dir, f)).read()[-3000:] for f in os.listdir(out_dir) if f.startswith("job-")]
    if job_id is not None:
        shown = subprocess.run(["scontrol", "show", "-o", "job", str(job_id)], capture_output=True, text=True)
        logs += [f"scontrol show job {job_id}: {shown.stdout.strip()}", _daemon_log_lines(job_id)]
    return extra + "\n".join(logs)


def _final_params(out_dir: str) -> list:
    with h5py.File(os.path.join(out_dir, open(os.path.join(out_dir, "latest")).read().strip(), "checkpoint.h5")) as f:
        assert int(f["meta/step"][()]) == STEPS
        return [f[f"ranks/{r:05d}/algorithm/params"][()] for r in range(int(f["meta/world_size"][()]))]


def _job_log(out_dir: str) -> str:
    """The job's output (every start of it appends to the same file)."""
    return "".join(open(os.path.join(out_dir, f)).read() for f in os.listdir(out_dir) if f.startswith("job-"))


def _signal_mid_run(job_id: int, out_dir: str) -> None:
    """Send the job SIGUSR1 once training is under way (step 3 logged: the stop handlers are installed)."""
    metrics = os.path.join(out_dir, "metrics.jsonl")

    def under_way():
        return os.path.exists(metrics) and any(r.get("event") == "train" and r["step"] >= 3
                                               for r in read_metrics(metrics))

    if not _poll(under_way, 240):
        pytest.fail(f"the job never reached step 3; queue:\n{_queue()}\n" + _diagnose(out_dir))
    subprocess.run(["scancel", "--signal=USR1", str(job_id)], check=True)


def _wait_completed(job_id: int, out_dir: str) -> None:
    """Wait (at most 300 s) until the job is COMPLETED and its metrics end at the last step."""
    metrics = os.path.join(out_dir, "metrics.jsonl")

    def finished():
        return _job_field(job_id, "JobState") == "COMPLETED" and any(
            r.get("event") == "end" and r["step"] == STEPS for r in read_metrics(metrics))

    if not _poll(finished, 300, every=1):
        pytest.fail(f"job state {_job_field(job_id, 'JobState')}: " + _diagnose(out_dir, job_id=job_id))


@pytest.fixture(scope="module")
def plain_job(tmp_path_factory):
    """One uninterrupted job of the template, run once: checked on its own, and the reference the preempted
    job's parameters must equal."""
    return _submit(tmp_path_factory.mktemp("slurm"), "plain", save_every=6, wait=True)


def test_template_job_completes_with_metrics_and_checkpoint(plain_job):
    job_id, out_dir = plain_job
    assert _job_field(job_id, "JobState") == "COMPLETED"
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    end = [r for r in records if r["event"] == "end"]
    assert end and end[-1]["step"] == STEPS, _diagnose(out_dir)
    assert 0.0 <= end[-1]["test_accuracy"] <= 1.0 and end[-1]["bytes_sent"] > 0
    params = _final_params(out_dir)
    assert len(params) == 2 and params[0].shape == params[1].shape
    # an independent process opens the whole checkpoint through its one index file
    check = ("import h5py,sys; f=h5py.File(sys.argv[1]); print(sorted(f['ranks']), f['meta/world_size'][()])")
    latest = os.path.join(out_dir, open(os.path.join(out_dir, "latest")).read().strip(), "checkpoint.h5")
    shown = subprocess.run([sys.executable, "-c", check, latest], capture_output=True, text=True).stdout
    assert shown.strip() == "['00000', '00001'] 2"


@pytest.mark.timeout(600)
def test_signalled_job_checkpoints_requeues_and_resumes_exactly(tmp_path, plain_job):
    reference_id, reference_dir = plain_job
    # A modelled 500 ms latency makes every step last about a second (the maths is unchanged: --net only
    # sleeps), so the signal reliably arrives mid-run however fast this machine is.
    job_id, out_dir = _submit(tmp_path, "preempted", save_every=6, wait=False, extra="--net 1gbit,500ms")
    metrics = os.path.join(out_dir, "metrics.jsonl")
    _signal_mid_run(job_id, out_dir)
    # Slurm holds a requeued job for its credential lifetime (Reason=BeginTime; AuthInfo cred_expire, 120 s by
    # default, 30 s in scripts/slurm_local.sh). Releasing it sooner by hand (StartTime=now) raced the revoked
    # credential of its first run: "Killing non-startable batch job: Job credential revoked", job FAILED.
    _wait_completed(job_id, out_dir)
    records = read_metrics(metrics)
    stopped = [r for r in records if r.get("event") == "stopped"]
    assert stopped and 3 <= stopped[0]["step"] < STEPS, _diagnose(out_dir, job_id=job_id)
    assert "mpicomm: requeueing job" in _job_log(out_dir), _diagnose(out_dir, job_id=job_id)
    assert int(_job_field(job_id, "Restarts") or 0) >= 1
    assert not os.path.exists(os.path.join(out_dir, "requeue")), "the job script left its requeue marker"
    assert [r["resumed_from"] for r in records if r.get("event") == "start"][-1], "second run did not resume"
    for mine, reference in zip(_final_params(out_dir), _final_params(reference_dir)):
        assert (mine == reference).all(), "resumed run differs from the uninterrupted one"
    assert reference_id != job_id


@pytest.mark.timeout(600)
@pytest.mark.parametrize("new_size", [2, 3])
def test_requeued_job_resized_while_pending_continues_at_the_new_size(tmp_path, new_size):
    """4 ranks, signalled mid-run; while the requeued job waits its size is changed (as an admin or the user
    would when fewer nodes are free) and its next start continues the 4-rank checkpoint at ``new_size``."""
    job_id, out_dir = _submit(tmp_path, f"resized{new_size}", save_every=6, wait=False,
                              extra="--net 1gbit,500ms", tasks=4)
    _signal_mid_run(job_id, out_dir)

    def requeued():  # pending again after its first run (held for the credential lifetime, see above)
        return _job_field(job_id, "JobState") == "PENDING" and int(_job_field(job_id, "Restarts") or 0) >= 1

    if not _poll(requeued, 240):
        pytest.fail(f"job not requeued; state {_job_field(job_id, 'JobState')}: " + _diagnose(out_dir, job_id=job_id))
    # Slurm 22.05 takes a pending job's size as these fields; MinCPUsNode (sbatch set it to 4 tasks x 1 CPU)
    # must shrink too, else the job keeps 4 CPUs for its fewer tasks.
    size = str(new_size)
    update = ["scontrol", "update", f"JobId={job_id}", "NumNodes=1", f"NumTasks={size}", f"TasksPerNode={size}",
              f"MinCPUsNode={size}"]
    proc = subprocess.run(update, capture_output=True, text=True)
    assert proc.returncode == 0 and _job_field(job_id, "NumTasks") == size, proc.stderr + _queue()
    _wait_completed(job_id, out_dir)

    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    resize = [r for r in records if r.get("event") == "resize"]
    assert len(resize) == 1, _diagnose(out_dir, job_id=job_id)
    assert (resize[0]["old_size"], resize[0]["new_size"], resize[0]["rule"]) == (4, new_size, "decentralized")
    assert [r["ranks"] for r in records if r.get("event") == "start"] == [4, new_size]
    assert f"(saved at 4 ranks, continued at {new_size})" in _job_log(out_dir), _diagnose(out_dir, job_id=job_id)
    after = [r for r in records if r.get("event") == "train" and r["step"] > resize[0]["step"]]
    assert [r["step"] for r in after] == list(range(resize[0]["step"] + 1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in after), [r["loss"] for r in after]
    assert len(_final_params(out_dir)) == new_size  # the last checkpoint: step STEPS, written by new_size ranks


def test_rendered_job_submitted_from_another_folder_completes(tmp_path):
    """A job written by ``mpicomm slurm render`` and submitted from a folder that is not the checkout finds the
    project, its venv and the app from the path the renderer wrote into it, and its relative OUT_DIR lands in
    the submission folder."""
    elsewhere = tmp_path / "elsewhere"
    out_dir = elsewhere / "run"
    out_dir.mkdir(parents=True)
    job = elsewhere / "job.sbatch"
    sets = {"job-name": "ci-elsewhere", "ntasks-per-node": "2", "cpus-per-task": "1", "time": "10",
            "output": f"{out_dir}/job-%j.out", "error": f"{out_dir}/job-%j.out", "APP": "apps/train_resnet.py",
            "ALGORITHM": "dpsgd", "EPOCHS": "1", "OUT_DIR": "run", "SAVE_EVERY": "100",
            "EXTRA_ARGS": "--max-steps 4 --batch-size 8 --eval-limit 32 --log-every 1"}
    rendered = subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", "generic", "-o", str(job),
                               *[f"--set={k}={v}" for k, v in sets.items()]], cwd=elsewhere, capture_output=True,
                              text=True)
    assert rendered.returncode == 0, rendered.stderr
    proc = subprocess.run(["sbatch", "--parsable", str(job)], cwd=elsewhere, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = int(proc.stdout.strip().split(";")[0])
    if not _poll(lambda: _job_field(job_id, "JobState") in FINISHED, 240):
        pytest.fail(f"job {job_id} did not finish in 240 s; queue:\n{_queue()}\n" + _diagnose(str(out_dir)))
    state = _job_field(job_id, "JobState")
    assert state == "COMPLETED", f"job {job_id} {state}: " + _diagnose(str(out_dir), job_id=job_id)
    end = [r for r in read_metrics(os.path.join(out_dir, "metrics.jsonl")) if r["event"] == "end"]
    assert end and end[-1]["step"] == 4, _diagnose(str(out_dir))


def _rank_pids(out_dir: str) -> dict[int, int]:
    """{rank: pid} of the job's rank processes: their command line names ``out_dir`` and their environment holds
    the rank their launcher gave them (Open MPI's ``OMPI_COMM_WORLD_RANK``, MPICH's ``PMI_RANK``)."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if out_dir.encode() not in argv or not any(arg.endswith(b"train_resnet.py") for arg in argv):
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        rank = environ.get(b"OMPI_COMM_WORLD_RANK", environ.get(b"PMI_RANK"))
        if rank is not None:
            pids[int(rank)] = int(entry)
    return pids


def _kill_rank_mid_run(job_id: int, out_dir: str, rank: int) -> None:
    """SIGKILL rank ``rank``'s process once the job has logged step 3."""
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if not _poll(lambda: os.path.exists(metrics) and any(r.get("event") == "train" and r["step"] >= 3
                                                         for r in read_metrics(metrics)), 240):
        pytest.fail(f"the job never reached step 3; queue:\n{_queue()}\n" + _diagnose(out_dir, job_id=job_id))
    pids = _rank_pids(out_dir)
    assert rank in pids, f"rank {rank}'s process not found among {pids}"
    os.kill(pids[rank], signal.SIGKILL)


HINT = "mpicomm: a rank of the job was lost (launcher exit"


@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.exists(os.path.join(REPO, ".venv-ft", "bin", "mpirun")),
                    reason="the fault-tolerant stack is not set up (scripts/setup_env.sh --ft)")
def test_job_with_recovery_completes_when_a_task_is_killed(tmp_path):
    """ON_RANK_LOSS=continue at 4 tasks, one rank SIGKILLed mid-run: the job ends COMPLETED (exit 0) at the
    run's last step with one ``rank_lost`` record (4 -> 3), and no line about enabling recovery. Before it is
    queued, ``mpicomm slurm check`` accepts it, and refuses with the launch's line the same job with an option
    recovery cannot go with (so the check passes ``--on-rank-loss continue`` to the stack's own Python)."""
    jobs = []
    for name, extra in (("ok", ""), ("free", "--free-running")):
        jobs.append(tmp_path / f"check-{name}.sbatch")
        jobs[-1].write_text(_job_text(str(tmp_path / name), 100, extra, 4, {"ON_RANK_LOSS": "continue"}))
    checked = subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "check", *map(str, jobs)], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 2 and checked.stdout.splitlines() == [
        f"{jobs[0]}: OK: apps/train_resnet.py with moniqua on 4 rank(s) from {REPO}",
        f"{jobs[1]}: options: --on-rank-loss continue cannot be combined with --free-running (recovery continues "
        "from the last step every rank committed, and free-running ranks commit none)"], checked.stdout + checked.stderr
    # a modelled 100 ms latency: about a second a step at 4 ranks, so the kill lands mid-run
    job_id, out_dir = _submit(tmp_path, "recover", save_every=100, wait=False, extra="--net 1gbit,100ms",
                              tasks=4, params={"ON_RANK_LOSS": "continue"})
    _kill_rank_mid_run(job_id, out_dir, rank=1)
    _wait_completed(job_id, out_dir)
    assert _job_field(job_id, "ExitCode") == "0:0", _diagnose(out_dir, job_id=job_id)
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    lost = [r for r in records if r.get("event") == "rank_lost"]
    assert len(lost) == 1, _diagnose(out_dir, job_id=job_id)
    assert (lost[0]["lost"], lost[0]["old_size"], lost[0]["new_size"]) == ([1], 4, 3), lost
    assert [r["step"] for r in records if r.get("event") == "end"] == [STEPS]
    assert HINT not in _job_log(out_dir)


@pytest.mark.timeout(600)
def test_job_without_recovery_ends_naming_how_to_enable_it(tmp_path):
    """The default (ON_RANK_LOSS=stop, MPICH): a rank SIGKILLed mid-run ends the job FAILED before its last step,
    and the job log has exactly one line saying how to keep training on the survivors."""
    job_id, out_dir = _submit(tmp_path, "lost", save_every=100, wait=False, extra="--net 1gbit,500ms")
    _kill_rank_mid_run(job_id, out_dir, rank=1)
    if not _poll(lambda: _job_field(job_id, "JobState") in FINISHED, 240):
        pytest.fail(f"job {job_id} did not finish in 240 s; queue:\n{_queue()}\n" + _diagnose(out_dir))
    assert _job_field(job_id, "JobState") == "FAILED", _diagnose(out_dir, job_id=job_id)
    hints = [line for line in _job_log(out_dir).splitlines() if line.startswith(HINT)]
    assert len(hints) == 1 and "ON_RANK_LOSS=continue" in hints[0], _diagnose(out_dir, job_id=job_id)
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    assert not [r for r in records if r.get("event") == "end"], "the job went on after its rank was lost"
