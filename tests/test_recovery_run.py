"""What a run keeps across a recovery from a lost rank, tested on the run plumbing itself (one rank, no fault-tolerant
stack): the run that continues (:meth:`~mpicomm.training.run.Run.continue_after_loss`) is handed the interrupted one
as the recovery hands it, and must keep

* a stop signal received before the loss, agreed or not: it stops before training on, with a checkpoint;
* the ``--hang-timeout`` the job was given (and restore the one before the run when it ends);
* the TensorBoard mirror (rank 0's, or a new one on a new rank 0);

and evaluations and checkpoint saves are no part of a step for the hang guard's stalled-rank exit: a rank whose
save or evaluation outlasts the hang timeout under recovery has not stalled (``tests/recovery_stall_job.py``).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator
from mpicomm.training.console import Console
from mpicomm.training.loop import TrainConfig, _Training
from mpicomm.training.metrics import read_metrics
from mpicomm.training.recovery import LostRanks

from .algo_common import batch, make_model

ROOT = Path(__file__).resolve().parents[1]
HANG_TIMEOUT = 77.0
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="the tensorboard extra is not installed")


class TinyTask:
    def __init__(self):
        self.model, self.steps_per_epoch = make_model(0), 3

    def train_batches(self, epoch, start=0):
        for b in range(start, self.steps_per_epoch):
            yield batch(0, 100 * epoch + b)

    def loss(self, model, data):
        x, y = data
        return torch.nn.functional.cross_entropy(model(x), y), {"count": len(y)}

    def evaluate(self, model):
        x, y = batch(0, 10_000)
        return {"test_loss": float(torch.nn.functional.cross_entropy(model(x), y))}


class NoLoss:
    """Stands for :class:`~mpicomm.training.recovery.Recovery` in a job that loses no rank: commits are no-ops."""

    snapshot = None

    def commit(self, run, position) -> None:
        pass

    def confirm(self) -> None:
        pass

    def handles(self, exc) -> bool:
        return False


@pytest.fixture
def signal_handlers():
    """The process's stop-signal handlers, restored after the test (a run that stopped on one ignores it after)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _config(**options) -> TrainConfig:
    """Two epochs of 3 steps, capped at 6, without a progress bar; ``options``: the rest."""
    return TrainConfig(epochs=2, max_steps=6, lr=0.05, progress=False, **options)


def _built():
    task = TinyTask()
    algo = make_algorithm("allreduce_sgd", task.model, Communicator(MPI.COMM_WORLD, topology.ring(1)))
    return task, algo


def _interrupted(cfg: TrainConfig, steps: int = 2) -> tuple[_Training, dict]:
    """A run that trained ``steps`` steps and then (as the recovery finds it) lost a rank: it and its committed
    state. Trains through its own loop, stopped at ``steps`` by ``stop_at_step`` (no checkpoint: no --out-dir in
    that part of the run)."""
    task, algo = _built()
    run = _Training(task, algo, cfg, Console("test", 0), NoLoss())
    run.begin({})
    for index, data in run._batches(0, 0):
        if index == steps:
            break
        algo.zero_grad()
        loss, _ = task.loss(algo.model, data)
        loss.backward()
        algo.step()
        run.step += 1
    return run, run.state((0, steps))


def _continued(cfg: TrainConfig, previous: _Training | None, state: dict, rank0_survived: bool = True) -> _Training:
    task, algo = _built()
    lost = LostRanks(lost=[1], old_size=2, states=[state], places=[0], task=task, algo=algo,
                     rank0_survived=rank0_survived, started=time.perf_counter(), joined=[])
    run = _Training(task, algo, cfg, Console("test", 0), NoLoss())
    run.continue_after_loss(lost, previous)
    return run


@pytest.mark.parametrize("agreed", [True, False])
def test_a_stop_signal_received_before_the_loss_stops_the_continued_run(tmp_path, signal_handlers, agreed):
    """SIGTERM before the loss (agreed by the ranks, as when the loss hit the stop's checkpoint, or only received):
    the continued run stops at once at the committed step, with a checkpoint and exit status of the signal."""
    cfg = _config(out_dir=str(tmp_path / "out"), handle_signals=True)
    previous, state = _interrupted(cfg)
    previous.stop.signum = int(signal.SIGTERM)
    previous.signalled = agreed
    continued = _continued(cfg, previous, state)
    try:
        assert continued.stop.signum == signal.SIGTERM
        summary = continued.train()
    finally:
        continued.close()
    assert summary["stopped_by_signal"] == signal.SIGTERM and summary["step"] == 2, summary
    records = read_metrics(str(tmp_path / "out" / "metrics.jsonl"))
    assert [(r["event"], r["step"]) for r in records if r["event"] in ("checkpoint", "stopped")] == \
        [("checkpoint", 2), ("stopped", 2)], records
    assert (tmp_path / "out" / "step-000000002" / "checkpoint.h5").exists()


def test_the_continued_run_stops_at_stop_at_step_when_the_loss_hit_that_stop(tmp_path, signal_handlers):
    cfg = _config(out_dir=str(tmp_path / "out"), handle_signals=False, stop_at_step=2)
    previous, state = _interrupted(cfg)
    continued = _continued(cfg, previous, state)
    try:
        summary = continued.train()
    finally:
        continued.close()
    assert summary["stopped_by_signal"] == signal.SIGUSR1 and summary["step"] == 2, summary


def test_the_continued_run_trains_on_without_a_signal(tmp_path, signal_handlers):
    cfg = _config(out_dir=str(tmp_path / "out"), handle_signals=True)
    previous, state = _interrupted(cfg)
    continued = _continued(cfg, previous, state)
    try:
        summary = continued.train()
    finally:
        continued.close()
    assert summary["stopped_by_signal"] == 0 and summary["step"] == 6, summary


def test_the_hang_timeout_given_outlives_the_rebuild(tmp_path, signal_handlers):
    """--hang-timeout 77: 77 s in the continued run as before the loss, and the guard's own again after it."""
    before = Communicator(MPI.COMM_WORLD, topology.ring(1)).guard.timeout_s
    assert before != HANG_TIMEOUT
    cfg = _config(handle_signals=False, hang_timeout=HANG_TIMEOUT)
    previous, state = _interrupted(cfg)
    assert previous.guard.timeout_s == HANG_TIMEOUT
    continued = _continued(cfg, previous, state)
    try:
        assert continued.guard.timeout_s == HANG_TIMEOUT
        again = _continued(cfg, continued, continued.state((0, 2)))  # a second loss
        assert again.guard.timeout_s == HANG_TIMEOUT
    finally:
        again.close()
    assert again.guard.timeout_s == before


def _scalars(logdir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@needs_tensorboard
@pytest.mark.parametrize("rank0_survived", [True, False])
def test_the_tensorboard_mirror_goes_on_after_a_recovery(tmp_path, signal_handlers, rank0_survived):
    """The records after the loss (the loss itself, the steps, the end) reach TensorBoard too: through rank 0's
    mirror when its process survived, through a new one on the new rank 0 otherwise."""
    out = None if not rank0_survived else str(tmp_path / "out")  # a new rank 0 would claim --out-dir again
    cfg = _config(log_every=1, out_dir=out, handle_signals=False, tensorboard=str(tmp_path / "tb"))
    previous, state = _interrupted(cfg)
    continued = _continued(cfg, previous, state, rank0_survived)
    try:
        assert continued.metrics.mirror is not None
        continued.train()
    finally:
        continued.close()
    got = _scalars(tmp_path / "tb")
    assert got.get("rank_lost/new_size") == {2: 1.0}, sorted(got)
    assert sorted(got.get("train/loss", {})) == [3, 4, 5, 6], got.get("train/loss")
    assert got.get("end/total_steps") == {6: 6.0}, sorted(got)


def test_slow_evaluations_and_saves_are_not_a_stalled_step(tmp_path):
    """Under recovery a rank that spends the hang timeout inside a step outside MPI leaves the job; an evaluation and
    a checkpoint's save of 5 s each under a 2 s timeout are not such a stall: the run finishes."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "recovery_stall_job.py"), str(tmp_path / "out"),
                           "2", "5"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "without reaching MPI" not in proc.stderr, proc.stderr[-3000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert done == {"step": 4, "total_steps": 4}, done
