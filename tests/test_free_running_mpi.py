"""Free running (``--free-running``): an asynchronous method's ranks step at their own pace and share the run.

Run in-process by the apps' ``main`` on the 2-rank tier, rank 1 made 4x slower (``--slow-ranks 1:4``). What
the pace guarantees whatever the OS grants each rank: no rank waits for a round before the run's last two
(a pace that waited every round would), together the ranks take at least ``size x`` the steps the run owes,
every rank-wide event (evaluation, checkpoint, stop, end) lands at the same run step on both, and a stopped
run resumes to the end. How many of the steps each rank takes is the scheduler's, not asserted (the pace's
own rule, deterministically: tests/test_pace_mpi.py). A synchronous method is refused in one line.
"""

import json
import os
import signal

import pytest

from .app_runs import app_module
from .conftest import assert_all

pytestmark = pytest.mark.mpi

BASE = ["--model", "resnet8", "--batch-size", "16", "--eval-limit", "32", "--eval-bn-batches", "1", "--epochs",
        "100", "--max-steps", "24", "--log-every", "4", "--eval-every", "8", "--no-progress", "--free-running",
        "--slow-ranks", "1:4"]


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def main():
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() != 2:
        pytest.skip("runs once, in the 2-rank tier")
    return app_module("train_resnet").main


def test_no_rank_waits_before_the_end_and_events_agree(comm, main, tmp_path_factory, capsys):
    out = comm.bcast(str(tmp_path_factory.mktemp("free")) if comm.Get_rank() == 0 else None)
    args = [*BASE, "--algorithm", "adpsgd", "--out-dir", out, "--save-every", "8"]
    first = main([*args, "--stop-at-step", "12"])
    second = main([*args, "--resume", "latest"])
    capsys.readouterr()
    problems = []
    if comm.Get_rank() == 0:
        records = _records(os.path.join(out, "metrics.jsonl"))
        stopped = [r for r in records if r["event"] == "stopped"]
        resumed = [r for r in records if r["event"] == "resume"]
        end = records[-1]
        evals = [r["step"] for r in records if r["event"] == "eval"]
        saves = [r["step"] for r in records if r["event"] == "checkpoint"]
        if not (stopped and 12 <= stopped[0]["step"] < 24 and resumed and resumed[0]["step"] == stopped[0]["step"]):
            problems.append(f"stop/resume records: {stopped} {resumed}")
        if end["event"] != "end" or end["step"] != 24:
            problems.append(f"the run did not end at step 24: {end}")
        counts, rounds = end.get("steps_by_rank", [0, 0]), end.get("rounds", 0)
        owed = 2 * (24 - resumed[0]["step"]) if resumed else 0
        early = [(rank, r) for rank, rs in enumerate(end.get("waited_rounds_by_rank", [])) for r in rs
                 if r < rounds - 1]
        if early or len(end.get("waited_rounds_by_rank", [])) != 2:
            problems.append(f"(rank, round) waits before the last two of {rounds} rounds: {early}; end record {end}")
        if not sum(counts) >= owed:
            problems.append(f"the ranks took {counts} steps of the {owed} the resumed run owed")
        if evals != sorted(evals) or evals[-1] != 24 or any(s // 8 == t // 8 for s, t in zip(evals, evals[1:])):
            problems.append(f"evaluations at steps {evals}: one after each multiple of 8, and at the end")
        if not saves or saves[-1] != 24:
            problems.append(f"checkpoints at {saves}: the last at the end")
    stopped_status = 128 + int(signal.SIGUSR1)  # the apps' exit after a stop: checkpointed, resumable
    assert_all(comm, first == stopped_status and second == 0 and not problems, f"exit {first}, {second}; {problems}")


def test_a_synchronous_method_is_refused_in_one_line(comm, main, capsys):
    capsys.readouterr()
    code = main([*BASE, "--algorithm", "dpsgd"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    ok = code == 2 and (comm.Get_rank() != 0 or (
        len(lines) == 1 and lines[0].startswith("train_resnet: error: --free-running needs an asynchronous method")))
    assert_all(comm, ok, f"exit {code}; stderr {lines}")
