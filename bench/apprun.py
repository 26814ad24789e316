"""Shared pieces of the wall-clock benchmarks: launch an app as a real MPI job, read its metrics back.

Each case is its own ``mpiexec`` job of ``apps/train_resnet.py`` or ``apps/train_bert.py`` with a
``--net`` setting, so the numbers are those a user gets from the same command line. A finished case
(its ``metrics.jsonl`` ends with an ``end`` event for the same command) is reused unless ``--fresh``
is given, so an interrupted benchmark resumes where it stopped.

Outputs (tables, JSON, PNG) go to ``docs/results/`` through :mod:`bench.common`; the raw runs to
``bench/results/runs/`` (ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from bench.common import REPO, RUNS, enter_loopback_namespace

SETTINGS = {"fast": "10gbit,1us", "gbit": "1gbit,100us", "slow": "100mbit,1ms"}

__all__ = ["SETTINGS", "AppRun", "bench_parser", "describe", "launch", "read_complete", "run_grid",
           "time_to_target"]


@dataclass
class AppRun:
    """One finished job: its command and the records of its ``metrics.jsonl``."""

    label: str
    command: list[str]
    records: list[dict] = field(default_factory=list)

    @property
    def end(self) -> dict:
        """The final summary record."""
        return self.records[-1]

    def evals(self, key: str) -> list[tuple[float, float, int]]:
        """``(train_s, value of key, step)`` at every evaluation, in order."""
        return [(r["train_s"], r[key], r["step"]) for r in self.records if r["event"] == "eval"]

    def per_step(self, first: int = 0, last: int | None = None) -> dict[str, float]:
        """Mean seconds per step of compute, comm, wait, the whole step and the modelled transfer that compute
        hid (``hidden_s``, zero in records without it) over steps ``first+1 .. last``.

        Each train record covers the steps since the previous one, so ``first``/``last`` should be
        steps with a record (all of them with ``--log-every 1``).
        """
        out = {k: 0.0 for k in ("compute_s", "comm_s", "wait_s", "step_s", "hidden_s")}
        previous, counted = 0, 0
        for r in self.records:
            if r["event"] == "train":
                if previous >= first and (last is None or r["step"] <= last):
                    for k in out:
                        out[k] += r.get(f"{k}_per_step", 0.0) * (r["step"] - previous)
                    counted += r["step"] - previous
                previous = r["step"]
        return {k: v / max(counted, 1) for k, v in out.items()}

    @property
    def start(self) -> dict:
        """The run's first record (configuration, parameter count, traffic before the first step)."""
        return self.records[0]

    def traffic_per_step(self, key: str = "bytes_sent", first: int = 0, last: int | None = None) -> float:
        """Rank 0's Ledger ``key`` per training step over steps ``first+1 .. last`` (initial broadcast excluded).

        ``first``/``last`` must be steps with a train record (``--log-every 1`` makes every step one).
        """
        at = {0: self.start.get("init_traffic", {}).get(key, 0)}
        at.update({r["step"]: r[key] for r in self.records if r["event"] == "train"})
        last = self.end["step"] if last is None else last
        at.setdefault(last, self.end[key])
        return (at[last] - at[first]) / max(last - first, 1)

    def bits_per_parameter(self) -> float:
        """Bits per parameter per step that rank 0 handed to MPI (the papers' measure)."""
        return 8 * self.traffic_per_step("bytes_contributed") / self.start["parameters"]


def _command(app: str, ranks: int, args: list[str], run_dir: str, launcher: list[str] | None) -> list[str]:
    launcher = launcher if launcher is not None else ["mpiexec", "-n", str(ranks)]
    return [*launcher, sys.executable, os.path.join("apps", app), *args, "--out-dir", run_dir, "--no-progress"]


def finished(label: str, app: str, ranks: int, args: list[str], run_dir: str, *,
             launcher: list[str] | None = None) -> AppRun | None:
    """The finished run of exactly this command in ``run_dir``, or None (never started, other command, cut short,
    or stopped by a signal: such a run writes its ``end`` record too)."""
    command = _command(app, ranks, args, run_dir, launcher)
    metrics, stamp = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "command.json")
    if not (os.path.exists(stamp) and os.path.exists(metrics)):
        return None
    with open(stamp) as f:
        same = json.load(f) == command
    records = _read(metrics)
    ended = same and records and records[-1].get("event") == "end" and not records[-1].get("stopped_by_signal")
    return AppRun(label, command, records) if ended else None


def launch(label: str, app: str, ranks: int, args: list[str], run_dir: str, *, fresh: bool = False,
           timeout: float = 1800, launcher: list[str] | None = None, env: dict[str, str] | None = None) -> AppRun:
    """Run ``mpiexec -n ranks python apps/<app> args --out-dir run_dir`` (or reuse a finished identical run).

    ``launcher`` replaces ``mpiexec -n ranks`` (e.g. ``scripts/netshape.sh mpirun --ranks 4 --net ... --``).
    ``env`` adds variables to the job's environment (e.g. ``{"MPICOMM_RANKS_PER_NODE": "2"}``); they are not
    part of the command a finished run is matched on, so a caller that varies them gives each its own ``run_dir``.
    """
    command = _command(app, ranks, args, run_dir, launcher)
    done = None if fresh else finished(label, app, ranks, args, run_dir, launcher=launcher)
    if done is not None:
        print(f"  reuse  {label:<28} {run_dir}", flush=True)
        return done
    metrics, stamp = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "command.json")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    t0 = time.perf_counter()
    job_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(command, cwd=REPO, env=job_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: {' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(stamp, "w") as f:
        json.dump(command, f)
    print(f"  ran    {label:<28} {time.perf_counter() - t0:6.1f} s", flush=True)
    return AppRun(label, command, _read(metrics))


def bench_parser(description: str, default_settings: str = ",".join(SETTINGS)) -> argparse.ArgumentParser:
    """A parser with the options every wall-clock benchmark shares: ``--settings`` and ``--fresh``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--settings", default=default_settings, help="comma list of " + ",".join(SETTINGS))
    parser.add_argument("--fresh", action="store_true", help="rerun cases that already finished")
    return parser


def run_grid(name: str, app: str, ranks: int, base: list[str], cases: list[tuple[str, list[str]]],
             settings: str, *, fresh: bool) -> dict[tuple[str, str], AppRun]:
    """Launch every (setting, case) in order; ``cases`` are ``(label, extra arguments)``.

    Runs land in ``bench/results/runs/<name>/<setting>/<label>``; returns ``{(setting, label): AppRun}``.
    """
    chosen = settings.split(",")
    unknown = [s for s in chosen if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")
    enter_loopback_namespace()
    results = {}
    for setting in chosen:
        print(f"{name}: setting {setting} ({SETTINGS[setting]})", flush=True)
        for label, extra in cases:
            run_dir = os.path.join(RUNS, name, setting, label.replace(" ", "_"))
            results[(setting, label)] = launch(label, app, ranks, [*base, *extra, "--net", SETTINGS[setting]],
                                               run_dir, fresh=fresh)
    return results


def describe(settings: str) -> str:
    """``fast = 10gbit,1us, ...`` for the chosen settings."""
    return ", ".join(f"{s} = {SETTINGS[s]}" for s in settings.split(","))


def read_complete(path: str) -> list[dict]:
    """The complete JSON lines of a metrics file (a line cut off by a killed or stopped job is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def time_to_target(points: list[tuple[float, float, int]], target: float, *, lower_is_better: bool = False):
    """The first ``train_s`` at which the evaluated value reaches ``target`` (None if never)."""
    for seconds, value, _ in points:
        if (value <= target) if lower_is_better else (value >= target):
            return seconds
    return None


