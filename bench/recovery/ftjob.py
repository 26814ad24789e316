"""Shared by the recovery benchmarks: launch a job under the fault-tolerant stack, watch its metrics, kill a rank.

Each job runs in its own network namespace with only loopback up (``unshare -n``), under ``nice``, launched by
``scripts/ft_run.sh`` (Open MPI 5 with ULFM). Its ``metrics.jsonl`` is read incrementally every ``POLL_S``, and
each event is stamped with the ``time.monotonic()`` at which this process first saw it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
POLL_S = 0.001
HANG_S = 900  # a hang bound only


class Job:
    """One ``ft_run.sh -n RANKS python SCRIPT ARGS --out-dir OUT`` job, its output in ``OUT.log``."""

    def __init__(self, ranks: int, script: str, args: list[str], out: Path, nice: int = 10, log: str = ""):
        """Start the job. ``log``: the output's file (default ``OUT.log``); events already in ``OUT/metrics.jsonl``
        (a run this job resumes) are not read."""
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        inner = " ".join(shlex.quote(a) for a in ["scripts/ft_run.sh", "-n", str(ranks), "python", script, *args,
                                                     "--out-dir", str(out), "--no-progress"])
        command = ["nice", "-n", str(nice), "unshare", "-n", "bash", "-c", f"ip link set lo up && exec {inner}"]
        self.log_path = Path(log or f"{out}.log")
        self.log = open(self.log_path, "w+")
        metrics = out / "metrics.jsonl"
        self._offset, self._partial = (metrics.stat().st_size if metrics.exists() else 0), b""
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        """Events written since the last call, each with ``seen`` (monotonic seconds) added."""
        try:
            with open(self.out / "metrics.jsonl", "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        now = time.monotonic()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            if line.strip():
                event = json.loads(line)
                event["seen"] = now
                new.append(event)
        self.events += new
        return new

    def wait_for(self, condition, what: str, timeout: float = HANG_S) -> dict:
        """Poll until an event satisfies ``condition``; return it (raise if the job ends or hangs first)."""
        end = time.monotonic() + timeout
        for event in self.events:
            if condition(event):
                return event
        while True:
            for event in self.poll():
                if condition(event):
                    return event
            if self.proc.poll() is not None:
                self.poll()
                for event in self.events:
                    if condition(event):
                        return event
                raise RuntimeError(f"{self.out.name}: the job ended (exit {self.proc.returncode}) before {what}; "
                                   f"log tail: {self.tail()}")
            if time.monotonic() > end:
                raise RuntimeError(f"{self.out.name}: no {what} within {timeout} s")
            time.sleep(POLL_S)

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the job's rank processes (their command line names the out dir, their environment a rank)."""
        pids = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if str(self.out).encode() not in (entry / "cmdline").read_bytes():
                    continue
                items = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            environ = dict(item.split(b"=", 1) for item in items if b"=" in item)
            if b"OMPI_COMM_WORLD_RANK" in environ:
                pids[int(environ[b"OMPI_COMM_WORLD_RANK"])] = int(entry.name)
        return pids

    def kill(self, *ranks: int) -> float:
        """SIGKILL the processes of ``ranks`` (one after the other); the monotonic time taken just before the first."""
        pids = self.rank_pids()
        missing = [r for r in ranks if r not in pids]
        if missing:
            raise RuntimeError(f"{self.out.name}: rank(s) {missing} not found among {pids}")
        t = time.monotonic()
        for rank in ranks:
            os.kill(pids[rank], signal.SIGKILL)
        return t

    def finish(self, timeout: float = HANG_S) -> int:
        """Wait for the job (kill its process group past ``timeout``), read the rest of its events; its exit code."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.poll()
        self.log.close()
        return self.proc.returncode

    def tail(self, chars: int = 600) -> str:
        """The end of the job's output."""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def of(self, kind: str) -> list[dict]:
        """The events of one kind, in file order."""
        return [e for e in self.events if e.get("event") == kind]


def median(values: list[float]) -> float:
    """The median (nan for none)."""
    values = sorted(values)
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def step_times(events: list[dict], after: int = 1) -> list[float]:
    """Wall seconds between consecutive ``train`` events one step apart (``--log-every 1``), past step ``after``:
    the whole step, its commit and log line included."""
    train = [e for e in events if e.get("event") == "train"]
    return [b["wall_s"] - a["wall_s"] for a, b in zip(train, train[1:])
            if b["step"] == a["step"] + 1 and a["step"] > after]


def save_json(name: str, payload: dict) -> Path:
    """Write ``payload`` to ``bench/results/NAME`` (gitignored)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=1))
    return path


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return list(os.getloadavg())
