"""An output directory belongs to one run: a lock for the run's life, and no fresh run over an earlier one.

``claim_out_dir`` (collective; rank 0 touches the file system, every rank raises the same one-line error):

* the directory must be creatable and writable (a file, a read-only file system: refused up front);
* ``<out-dir>/.mpicomm.lock`` is created exclusively and names its holder (host, pid and the pid's start
  time, the SLURM job and step). A lock whose holder is gone is taken over: same host and the pid no
  longer runs (or is another process now), or under SLURM the same job and step (a requeued job), or a
  job ``squeue`` no longer lists as running. A lock held by a live run, or by one it cannot check
  (another host without SLURM), is a refusal naming the holder;
* a fresh run (no ``--resume``) into a directory that holds another run's metrics or checkpoints is
  refused, naming ``--resume latest`` to continue it and ``--overwrite`` to delete it and start over.
  Nothing of the earlier run is truncated, pruned or replaced unless ``--overwrite`` says so.

The lock is released when the run ends (whatever way it ends that leaves the process alive); a killed
job leaves it behind, and the next run's stale-lock check recovers it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

from ..errors import mark_agreed

__all__ = ["LOCK_NAME", "RunLock", "claim_out_dir", "previous_run"]

LOCK_NAME = ".mpicomm.lock"
_RUN_FILES = re.compile(r"metrics\.jsonl|latest|requeue|step-\d{9,}|\.tmp-step-\d{9,}|\.trash-step-\d{9,}")
_LIVE_SLURM_STATES = {"RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                      "STOPPED", "SIGNALING", "STAGE_OUT"}


def _start_time(pid: int) -> str:
    """The kernel's start time of process ``pid`` ("" where /proc cannot tell): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""), "slurm_step": os.environ.get("SLURM_STEP_ID", ""),
            "since": datetime.datetime.now().isoformat(timespec="seconds")}


def _pid_runs(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not start or _start_time(pid) == start


def _slurm_job_runs(job: str) -> bool | None:
    """Whether SLURM job ``job`` is still live per ``squeue`` (None: cannot ask)."""
    if not shutil.which("squeue"):
        return None
    try:
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        return None
    return bool(set(done.stdout.split()) & _LIVE_SLURM_STATES)


def _holder_alive(holder: dict) -> bool | None:
    """Whether the run that wrote ``holder`` still runs: True, False, or None when this host cannot tell."""
    job = str(holder.get("slurm_job", ""))
    if job and job == os.environ.get("SLURM_JOB_ID") and str(holder.get("slurm_step", "")) == \
            os.environ.get("SLURM_STEP_ID", ""):
        return False  # this very job step, started again (a requeued job): the lock is its earlier life's
    if holder.get("host") == socket.gethostname():
        return _pid_runs(int(holder.get("pid", 0)), str(holder.get("pid_start", "")))
    return _slurm_job_runs(job) if job else None


def _describe(holder: dict) -> str:
    job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('since', '?')}"


class RunLock:
    """The lock file of one run's output directory, held by rank 0 (a no-op on other ranks)."""

    def __init__(self, path: Path | None):
        self.path = path

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        if self.path is None:
            return
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink()
        except (OSError, ValueError):
            pass
        self.path = None


def _take(lock: Path) -> str:
    """Create ``lock`` for this process; "" on success, else why not (a live or unknown holder)."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                return ""  # already ours (the app claimed it before training)
            alive = _holder_alive(holder) if holder else False
            if alive is False:
                lock.unlink(missing_ok=True)  # a killed run's lock: recovered
                continue
            if alive is None:
                return (f"is locked by a run this host cannot check ({_describe(holder)}); if that run is gone, "
                        f"delete {lock}")
            return f"is in use by another run ({_describe(holder)}); wait for it to end or use another --out-dir"
        with os.fdopen(fd, "w") as f:
            json.dump(_me(), f)
            f.flush()
            os.fsync(f.fileno())
        return ""
    return f"could not be locked ({lock} keeps reappearing)"


def previous_run(out_dir: Path) -> str:
    """What of an earlier run ``out_dir`` holds ("metrics.jsonl, checkpoints up to step-…"), or ""."""
    if not out_dir.is_dir():
        return ""
    names = sorted(p.name for p in out_dir.iterdir() if _RUN_FILES.fullmatch(p.name))
    steps = [n for n in names if n.startswith("step-")]
    parts = []
    if "metrics.jsonl" in names and (out_dir / "metrics.jsonl").stat().st_size:
        parts.append("metrics.jsonl")
    if steps:
        parts.append(f"{len(steps)} checkpoint(s) up to {steps[-1]}")
    elif "latest" in names:
        parts.append("a 'latest' pointer")
    return ", ".join(parts)


def _inside(out_dir: Path, resume: str) -> bool:
    """Whether the checkpoint ``--resume`` names lies in ``out_dir`` (a bare name is taken relative to it)."""
    path = Path(resume)
    if not path.exists():
        path = out_dir / resume
    return out_dir.resolve() in path.resolve().parents or path.resolve() == out_dir.resolve()


def _delete_run(out_dir: Path) -> None:
    for p in out_dir.iterdir():
        if _RUN_FILES.fullmatch(p.name):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _claim(out_dir: Path, resume: str, overwrite: bool) -> tuple[RunLock, str]:
    """Rank 0's part of :func:`claim_out_dir`: (the lock, "") or (no lock, the reason for refusing)."""
    if out_dir.exists() and not out_dir.is_dir():
        return RunLock(None), f"--out-dir {out_dir} is a file, not a directory"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return RunLock(None), f"--out-dir {out_dir} cannot be written: {exc.strerror or exc}"
    lock = out_dir / LOCK_NAME
    why = _take(lock)
    if why:
        return RunLock(None), f"--out-dir {out_dir} {why}"
    held = RunLock(lock)
    earlier = previous_run(out_dir)
    if earlier and resume and resume != "latest" and not _inside(out_dir, resume):
        held.release()
        return RunLock(None), (f"--out-dir {out_dir} holds another run ({earlier}); resuming {resume} there would "
                               "mix the two runs: use an empty --out-dir, or --resume a checkpoint of this one")
    if earlier and not resume:
        if not overwrite:
            held.release()
            return RunLock(None), (f"--out-dir {out_dir} already holds a run ({earlier}): continue it with "
                                   "--resume latest, or pass --overwrite to delete it and start over")
        _delete_run(out_dir)
    return held, ""


def claim_out_dir(comm, out_dir: str, *, resume: str = "", overwrite: bool = False) -> RunLock:
    """Collective: lock ``out_dir`` for this run (rank 0) or raise the same one-line ``ValueError`` everywhere.

    ``comm``: a :class:`~mpicomm.comm.Communicator`. ``resume``: the run continues the one in the
    directory (``--resume``); ``overwrite``: delete an earlier run's files there first.
    """
    lock, why = RunLock(None), ""
    if comm.rank == 0:
        lock, why = _claim(Path(out_dir), resume, overwrite)
    why = comm.bcast_object(why, what="the output directory's claim")
    if why:
        raise mark_agreed(ValueError(why), why, range(comm.size), comm.size)
    return lock
