"""The out-dir lock under contention: of processes taking it at the same instant, exactly one gets it.

A pool of worker processes is reused across trials; in each trial N of them (2-4) meet at a barrier,
wait for one common instant, and take the lock of the same fresh directory. Taking a fresh lock and
recovering a stale one (left by a process that has ended) are both raced. No MPI: plain processes.
"""

import errno
import json
import multiprocessing
import os
import random
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mpicomm.training import rundir
from mpicomm.training.rundir import LOCK_NAME

from .conftest import mount_tmpfs

WORKERS = 4
FRESH_TRIALS = 1000
STALE_TRIALS = 500


def _worker(conn, barriers) -> None:
    """Take the lock named by each task at the task's instant; answer (pid, why not: "" when taken)."""
    while True:
        task = conn.recv()
        if task is None:
            return
        lock, parties, start_at = task
        barriers[parties].wait()
        while time.monotonic() < start_at:
            pass
        try:
            why = rundir._take(Path(lock))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            why = f"raised {exc!r}"
        conn.send((os.getpid(), why))


@pytest.fixture(scope="module")
def pool():
    """Start the workers once; yield a function running one trial: its (pid, why not) per worker."""
    ctx = multiprocessing.get_context("fork")
    barriers = {n: ctx.Barrier(n) for n in range(2, WORKERS + 1)}
    pipes, procs = [], []
    for _ in range(WORKERS):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(theirs, barriers), daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)

    def trial(lock: Path, parties: int) -> list[tuple[int, str]]:
        start_at = time.monotonic() + 0.002
        for conn in pipes[:parties]:
            conn.send((str(lock), parties, start_at))
        answers = []
        for conn in pipes[:parties]:
            assert conn.poll(30), "a worker did not answer within 30 s"
            answers.append(conn.recv())
        return answers

    yield trial
    for conn in pipes:
        conn.send(None)
    for proc in procs:
        proc.join(5)


def _check_one_winner(answers, lock: Path, trial: int) -> None:
    """Exactly one worker took the lock, the others were refused naming it, and the file names the winner."""
    winners = [pid for pid, why in answers if why == ""]
    assert len(winners) == 1, f"trial {trial}: {len(winners)} of {len(answers)} processes took the lock: {answers}"
    refusal = f"is in use by another run (pid {winners[0]} on "
    assert all(why == "" or why.startswith(refusal) for _, why in answers), (trial, answers)
    assert json.loads(lock.read_text())["pid"] == winners[0], trial
    assert [p.name for p in lock.parent.iterdir()] == [LOCK_NAME], f"trial {trial}: files left behind"


def _ended_holder() -> str:
    """The content of a lock whose process has ended (on this host)."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    return json.dumps({"host": socket.gethostname(), "pid": ended.pid, "pid_start": "1", "slurm_job": "",
                       "slurm_step": "", "since": "2026-01-01T00:00:00"})


def test_of_processes_taking_a_fresh_lock_at_once_exactly_one_gets_it(pool, tmp_path):
    draw = random.Random(7)
    for trial in range(FRESH_TRIALS):
        out = tmp_path / f"fresh-{trial}"
        out.mkdir()
        _check_one_winner(pool(out / LOCK_NAME, draw.randint(2, WORKERS)), out / LOCK_NAME, trial)


def test_of_processes_recovering_a_stale_lock_at_once_exactly_one_gets_it(pool, tmp_path):
    draw = random.Random(11)
    stale = _ended_holder()
    for trial in range(STALE_TRIALS):
        out = tmp_path / f"stale-{trial}"
        out.mkdir()
        (out / LOCK_NAME).write_text(stale)
        _check_one_winner(pool(out / LOCK_NAME, draw.randint(2, WORKERS)), out / LOCK_NAME, trial)


def test_a_broken_lock_is_recovered_and_an_empty_new_one_waited_for(tmp_path):
    """An old empty lock (a process killed while writing it) is taken over; a new one may still be written."""
    lock = tmp_path / LOCK_NAME
    lock.write_text("")
    os.utime(lock, (time.time() - 60, time.time() - 60))
    assert rundir._take(lock) == ""
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert rundir._take(lock) == ""  # already this process's
    lock.unlink()
    lock.write_text("")
    holder = json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "pid_start": "", "since": "now"})
    writer = subprocess.Popen(["bash", "-c", f"sleep 0.3; printf '%s' '{holder}' > {lock}"])
    try:
        assert rundir._take(lock).startswith(f"is in use by another run (pid {os.getppid()} on ")
    finally:
        writer.wait()


def test_a_guard_left_by_a_process_that_died_while_recovering_is_recovered_too(tmp_path):
    lock = tmp_path / LOCK_NAME
    lock.write_text(_ended_holder())
    guard = tmp_path / f"{LOCK_NAME}.break-{lock.stat().st_ino}"
    guard.write_text(_ended_holder())
    assert rundir._take(lock) == ""
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]


def test_a_full_disk_refuses_the_claim_in_one_line(tmp_path):
    out = tmp_path / "disk"
    mount_tmpfs(out, "64k")
    try:
        fd = os.open(out / "other-writer", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError):
            while True:
                os.write(fd, bytes(4096))
        os.close(fd)
        lock, why = rundir._claim(out, "", False)
        assert lock.path is None and why == f"--out-dir {out} cannot be locked: No space left on device"
        assert sorted(p.name for p in out.iterdir()) == ["other-writer"]
    finally:
        subprocess.run(["umount", "-l", str(out)], check=True)


def test_without_hard_links_the_lock_is_created_then_written(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "link", no_links)
    lock = tmp_path / LOCK_NAME
    assert rundir._take(lock) == ""
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]
