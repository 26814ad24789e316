"""An output directory belongs to one run: a lock for the run's life, and no fresh run over an earlier one.

``claim_out_dir`` (collective; rank 0 touches the file system, every rank raises the same one-line error):

* the directory must be creatable and writable (a file, a read-only file system: refused up front);
* ``<out-dir>/.mpicomm.lock`` names its holder (host, pid and the pid's start time, the SLURM job and
  step). It is created whole, at once: the holder is written to a file of this process's own and
  hard-linked to the lock's name, which fails if the name exists, so of processes taking it at the same
  instant exactly one gets it, and none ever reads a lock still being written. A lock whose holder is
  gone is taken over: same host and the pid no longer runs (or is another process now), or under SLURM
  the same job and step (a requeued job), or a job ``squeue`` no longer lists as running; the stale file
  is removed under a second lock of its own (:func:`_remove_stale`), so of processes recovering it at
  once exactly one gets the lock too. A lock held by a live run, or by one it cannot check (another host
  without SLURM), is a refusal naming the holder;
* a fresh run (no ``--resume``) into a directory that holds another run's metrics or checkpoints is
  refused, naming ``--resume latest`` to continue it and ``--overwrite`` to delete it and start over.
  Nothing of the earlier run is truncated, pruned or replaced unless ``--overwrite`` says so.

The lock is released when the run ends (whatever way it ends that leaves the process alive); a killed
job leaves it behind, and the next run's stale-lock check recovers it.
"""

from __future__ import annotations

import datetime
import errno
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

from ..errors import mark_agreed

__all__ = ["LOCK_NAME", "RunLock", "claim_out_dir", "previous_run"]

LOCK_NAME = ".mpicomm.lock"
_ATTEMPTS = 100  # attempts at a recovery's guard that keeps changing before looking at the lock again
_BEING_WRITTEN_S = 5.0  # an empty lock file younger than this may be being written (no hard links)
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}
_MAX_DEPTH = 3  # guards of guards: each level is only needed after a process died while recovering a lock
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


def _link_new(content: Path, lock: Path) -> bool:
    """Give ``lock`` the content of the file ``content`` if ``lock`` does not exist: True when it did not.

    ``os.link`` creates the name with its content already complete, and fails if the name exists: two
    processes can never both create ``lock``, and no process reads a lock that is being written. On a file
    system without hard links, ``lock`` is created exclusively and then written (see :func:`_acquire`).
    """
    try:
        os.link(content, lock)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        return _create_written(lock, content.read_text())
    return True


def _create_written(path: Path, text: str) -> bool:
    """Create ``path`` exclusively holding ``text`` (written and fsynced): False if it exists.

    A write that fails (a full disk) removes the file again and raises.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        path.unlink(missing_ok=True)
        raise
    return True


def _write_unique(lock: Path, text: str) -> Path:
    """A new file beside ``lock``, named for this process alone, holding ``text``."""
    path = lock.with_name(f"{lock.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}")
    _create_written(path, text)
    return path


def _read_holder(lock: Path) -> tuple[os.stat_result, dict] | None:
    """(stat, holder) of ``lock`` read through one open file (a content that is no holder: ``{}``); None if gone."""
    try:
        with open(lock) as f:
            stat, text = os.fstat(f.fileno()), f.read()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    return stat, holder if isinstance(holder, dict) else {}


def _broken(stat: os.stat_result, holder: dict) -> bool | None:
    """Whether a lock file is broken (no holder in it): True; None while it may still be being written."""
    if holder:
        return False
    return True if time.time() - stat.st_mtime > _BEING_WRITTEN_S else None


def _stale(stat: os.stat_result, holder: dict) -> bool:
    """Whether a lock file is broken or its holder gone."""
    broken = _broken(stat, holder)
    return broken or (broken is False and _holder_alive(holder) is False)


def _mine(holder: dict) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def _acquire(lock: Path, mine: Path, depth: int = 0) -> str | None:
    """One attempt to make ``lock`` this process's (``mine``: its content): "" when taken, why not when held
    by a live run or one this host cannot check, None when the caller should look again.

    A lock whose holder is gone, or whose content is no holder (a broken file, unless it is new: created
    without a hard link and not written yet), is removed by :func:`_remove_stale`; then the caller looks
    again, as after a lock that vanished meanwhile.
    """
    if _link_new(mine, lock):
        return ""
    found = _read_holder(lock)
    if found is None:
        return None
    stat, holder = found
    if _mine(holder):
        return ""  # already ours (the app claimed it before training)
    broken = _broken(stat, holder)
    if broken is None:
        return None
    alive = False if broken else _holder_alive(holder)
    if alive is None:
        return (f"is locked by a run this host cannot check ({_describe(holder)}); if that run is gone, "
                f"delete {lock}")
    if alive:
        return f"is in use by another run ({_describe(holder)}); wait for it to end or use another --out-dir"
    if depth < _MAX_DEPTH:
        _remove_stale(lock, stat.st_ino, mine, depth)
    return None


def _remove_stale(lock: Path, inode: int, mine: Path, depth: int) -> None:
    """Remove ``lock`` if it still is file ``inode`` and its holder is still gone, as the one process doing so.

    Deleting a name is unconditional, so two processes that both found the same stale lock could
    otherwise both delete it: the second deleting the new lock the first had just taken. Here removing
    file ``inode`` takes a second lock, ``<lock>.break-<inode>``, the same way (one whose holder died is
    recovered alike); only its holder removes, after checking again, under it, that the name still is
    that file and its holder still gone. No other process removes a lock whose holder is gone, so the
    name cannot change between that check and the removal.
    """
    guard = lock.with_name(f"{lock.name}.break-{inode}")
    for _ in range(_ATTEMPTS):
        why = _acquire(guard, mine, depth + 1)
        if why:
            return  # another process is removing it: the caller looks again
        if why == "":
            break
    else:
        return
    try:
        found = _read_holder(lock)
        if found is not None and found[0].st_ino == inode and _stale(*found):
            lock.unlink()
    finally:
        guard.unlink(missing_ok=True)


def _take(lock: Path) -> str:
    """Make ``lock`` this process's; "" on success, else why not (a live or unknown holder).

    Taking it is atomic (:func:`_link_new`), and so is recovering a stale one (:func:`_remove_stale`):
    of any number of processes taking the same lock at once, exactly one gets it.
    """
    mine = _write_unique(lock, json.dumps(_me()))
    deadline = time.monotonic() + 2 * _BEING_WRITTEN_S
    try:
        for attempt in itertools.count():
            why = _acquire(lock, mine)
            if why is not None:
                return why
            if time.monotonic() > deadline:
                break
            time.sleep(0.001 * min(attempt, 20))
    finally:
        mine.unlink(missing_ok=True)
    return f"could not be locked ({lock} keeps changing)"


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
    try:
        why = _take(lock)
    except OSError as exc:  # a full disk: the lock's content cannot be written
        return RunLock(None), f"--out-dir {out_dir} cannot be locked: {exc.strerror or exc}"
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
