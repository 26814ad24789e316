"""The training loop every app shares: schedule, steps, metrics, evaluation, checkpoints, graceful stop.

An app supplies a :class:`Task` (model, this rank's batches, loss, evaluation) and an algorithm; the
loop runs ``zero_grad → loss.backward → algo.step`` for the configured number of steps, writes metrics
(rank 0, JSON lines), evaluates the averaged model, checkpoints every rank's state to HDF5 and resumes
bit-exactly: batches are a pure function of (seed, rank, epoch, index), the learning rate a pure function
of the step, and every random generator is part of the checkpoint.

Monitoring collectives (loss averages for the log, the stop-signal agreement) go through the raw
communicator and are not booked in the Ledger: the Ledger counts what the algorithm sends. Evaluation
(which averages the models through the algorithm's communicator) runs unmetered: neither booked in the
Ledger nor charged by a modelled network (``--net``).

Time per step is split three ways from the Communicator's clock: ``compute`` (outside communication
calls), ``comm`` (modelled transfer time the rank waited for; without ``--net``, all time blocked in
communication) and ``wait`` (blocked beyond the modelled transfer: slower peers, MPI's own copies).
``train_s`` in eval events is rank 0's cumulative time inside training steps (no evaluation, logging
or checkpoints): the x-axis of time-to-accuracy. The end event adds rank 0's clock totals
(``net_blocked_s``, ``net_slept_s``, ``net_modelled_s``; see :class:`~mpicomm.net.NetClock`).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ..checkpoint.rng import capture_rng_state, restore_rng_state
from ..checkpoint.store import run_meta
from .metrics import MetricsWriter
from .schedule import LRSchedule
from .stop import StopFlag

__all__ = ["Task", "TrainConfig", "run_training"]


class Task(Protocol):
    """What an app provides. ``train_batches(epoch, start)`` must be deterministic given (seed, rank, epoch)."""

    model: torch.nn.Module
    steps_per_epoch: int

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """This rank's batches of ``epoch``, beginning at index ``start``."""

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss to differentiate and counters to log (e.g. ``{"correct": 3, "count": 16}``)."""

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out metrics of ``model`` (called with the averaged parameters loaded)."""


@dataclass(frozen=True)
class TrainConfig:
    """Options of the loop itself (the algorithm's live in its own config)."""

    epochs: int = 1
    max_steps: int = 0
    lr: float = 0.1
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    milestones: tuple[float, ...] = (0.5, 0.75)
    lr_gamma: float = 0.1
    log_every: int = 10
    eval_every: int = 0
    out_dir: str = ""
    save_every: int = 0
    keep_last: int = 2
    resume: str = ""
    progress: bool = True
    handle_signals: bool = True
    stop_at_step: int = 0

    def __post_init__(self):
        for name in ("epochs", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "eval_every", "save_every", "warmup_steps", "stop_at_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.keep_last < 1:
            raise ValueError(f"--keep-last must be >= 1, got {self.keep_last}")
        if (self.save_every or self.resume) and not self.out_dir:
            raise ValueError("--save-every/--resume need --out-dir (where checkpoints live)")

    def total_steps(self, steps_per_epoch: int) -> int:
        """Steps of the whole run: ``epochs * steps_per_epoch``, capped by ``max_steps`` when set."""
        total = self.epochs * steps_per_epoch
        return min(total, self.max_steps) if self.max_steps else total


def _with_params(algo, flat: torch.Tensor, fn: Callable[[], dict]) -> dict:
    """Run ``fn`` with ``flat`` temporarily loaded into the model's flat buffer."""
    saved = algo.flat.data.clone()
    algo.flat.data.copy_(flat)
    try:
        was_training = algo.model.training
        algo.model.eval()
        with torch.no_grad():
            return fn()
    finally:
        algo.model.train(was_training)
        algo.flat.data.copy_(saved)


def _evaluate(task: Task, algo, mpi_comm) -> dict[str, float]:
    """Collective: metrics of the averaged model, plus min/max of each metric over the ranks' own models."""
    average = algo.consensus_model()
    out = _with_params(algo, average, lambda: task.evaluate(algo.model))
    own = _with_params(algo, algo.flat.data, lambda: task.evaluate(algo.model))
    everyone = mpi_comm.allgather(own)
    for key in own:
        values = [o[key] for o in everyone]
        out[f"{key}_rank_min"], out[f"{key}_rank_max"] = min(values), max(values)
    out["consensus_distance"] = algo.consensus_distance()
    return out


class _Progress:
    """tqdm on rank 0 when enabled and installed; silent otherwise."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stdout, dynamic_ncols=True)

    def update(self, n: int, **postfix) -> None:
        """Advance by ``n`` steps and show ``postfix``."""
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


def run_training(task: Task, algo, cfg: TrainConfig, *, run_info: dict | None = None) -> dict:
    """Train ``task`` with ``algo`` as ``cfg`` says; return the final summary (same on every rank).

    Exit status for the caller: ``summary["stopped_by_signal"]`` is the signal number when the run was
    interrupted (after a checkpoint was committed), else 0.
    """
    mpi_comm = algo.comm.comm
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    total = cfg.total_steps(task.steps_per_epoch)
    schedule = LRSchedule(cfg.lr, total, cfg.lr_schedule, cfg.warmup_steps, cfg.milestones, cfg.lr_gamma)
    meta = run_meta(algo.comm, algo)
    expect = {"topology": meta["topology"], "algorithm": {"name": algo.name},
              "model_signature": meta["model_signature"]}
    step, epoch, start = 0, 0, 0
    resumed_from = ""
    if cfg.resume:
        path = latest_checkpoint(cfg.out_dir) if cfg.resume == "latest" else cfg.resume
        if path is not None:
            state, _ = load_checkpoint(path, algo.comm, expect=expect)
            algo.load_state_dict(state["algorithm"])
            _load_buffers(algo.model, state["buffers"])
            restore_rng_state(state["rng"])
            step, epoch, start = (int(state["position"][k]) for k in ("step", "epoch", "batch"))
            resumed_from = str(path)
    metrics_path = f"{cfg.out_dir}/metrics.jsonl" if cfg.out_dir else ""
    metrics = MetricsWriter(metrics_path or None, enabled=rank == 0, append=bool(resumed_from))
    if rank == 0:
        metrics.write({"event": "start", "step": step, "resumed_from": resumed_from, "total_steps": total,
                       "ranks": size, "algorithm": algo.name,
                       "net": str(algo.comm.net) if algo.comm.net else "", "parameters": algo.flat.numel,
                       "init_traffic": algo.comm.ledger.totals(), "config": dataclasses.asdict(algo.config),
                       "train_config": dataclasses.asdict(cfg), **(run_info or {})})
    stop = StopFlag(install=cfg.handle_signals)
    progress = _Progress(cfg.progress and rank == 0, total, step)
    window = {"loss": 0.0, "compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "step_s": 0.0, "n": 0}
    clock = algo.comm.clock
    train_s = 0.0
    counters: dict[str, float] = {}
    stopped_by = 0
    last_eval: dict[str, float] = {}
    t_run = time.perf_counter()

    def save(position_epoch: int, position_batch: int) -> None:
        if not cfg.out_dir:
            return
        state = {"algorithm": algo.state_dict(), "rng": capture_rng_state(),
                 "buffers": {name: b.detach().clone() for name, b in algo.model.named_buffers()},
                 "position": {"step": step, "epoch": position_epoch, "batch": position_batch}}
        path = save_checkpoint(cfg.out_dir, algo.comm, state, step=step, meta=meta, keep_last=cfg.keep_last)
        metrics.write({"event": "checkpoint", "step": step, "path": str(path)})

    while step < total and not stopped_by:
        for index, batch in enumerate(task.train_batches(epoch, start), start=start):
            algo.set_lr(schedule(step))
            blocked, slept = clock.blocked_s, clock.slept_s
            t0 = time.perf_counter()
            algo.zero_grad()
            loss, counts = task.loss(algo.model, batch)
            loss.backward()
            algo.step()
            elapsed = time.perf_counter() - t0
            step += 1
            train_s += elapsed
            _account(window, elapsed, clock.blocked_s - blocked, clock.slept_s - slept, clock.model is not None)
            window["loss"] += float(loss.detach())
            for k, v in counts.items():
                counters[k] = counters.get(k, 0.0) + float(v)
            finished_epoch = index + 1 == task.steps_per_epoch
            position = (epoch + 1, 0) if finished_epoch else (epoch, index + 1)
            if step % cfg.log_every == 0 or step == total:
                _log(metrics, progress, mpi_comm, algo, step, epoch, window, counters, time.perf_counter() - t_run)
            if (cfg.eval_every and step % cfg.eval_every == 0) or (finished_epoch and not cfg.eval_every) \
                    or step == total:
                with algo.comm.unmetered():
                    last_eval = _evaluate(task, algo, mpi_comm)
                metrics.write({"event": "eval", "step": step, "epoch": epoch + (index + 1) / task.steps_per_epoch,
                               "wall_s": time.perf_counter() - t_run, "train_s": train_s, **last_eval,
                               **algo.comm.ledger.totals()})
            if cfg.save_every and step % cfg.save_every == 0:
                save(*position)
            stopped_by = stop.agreed(mpi_comm) if cfg.handle_signals else 0
            if step == cfg.stop_at_step and step < total:
                stopped_by = stopped_by or int(signal.SIGUSR1)
            if stopped_by:
                if not (cfg.save_every and step % cfg.save_every == 0):
                    save(*position)
                metrics.write({"event": "stopped", "step": step, "signal": stopped_by})
                break
            if step == total:
                break
        epoch, start = (epoch + 1, 0) if not stopped_by else (epoch, start)
    if step == total and not stopped_by and cfg.save_every and step % cfg.save_every:
        save(epoch, 0)
    progress.close()
    stop.uninstall()
    algo.close()
    summary = {"event": "end", "step": step, "total_steps": total, "stopped_by_signal": stopped_by,
               "wall_s": time.perf_counter() - t_run, "train_s": train_s, **last_eval,
               **algo.comm.ledger.totals(), **{f"net_{k}": v for k, v in clock.totals().items()},
               **algo.metrics()}
    metrics.write(summary)
    metrics.close()
    return summary


def _load_buffers(model: torch.nn.Module, saved: dict) -> None:
    """Copy checkpointed buffers (BatchNorm running statistics) into ``model``."""
    buffers = dict(model.named_buffers())
    if set(buffers) != set(saved):
        raise ValueError(f"checkpoint buffers {sorted(saved)} do not match the model's {sorted(buffers)}")
    for name, value in saved.items():
        buffers[name].copy_(value)


def _account(window: dict, elapsed: float, blocked: float, slept: float, modelled: bool) -> None:
    """Split one step's ``elapsed`` seconds into compute, comm and wait (see the module docstring)."""
    comm = slept if modelled else blocked
    window["step_s"] += elapsed
    window["compute_s"] += elapsed - blocked
    window["comm_s"] += comm
    window["wait_s"] += blocked - comm
    window["n"] += 1


def _log(metrics, progress, mpi_comm, algo, step, epoch, window, counters, wall) -> None:
    """Collective: average the window over ranks, write a metrics line, advance the bar, reset the window."""
    n = max(window["n"], 1)
    timings = ("compute_s", "comm_s", "wait_s", "step_s")
    local = [window["loss"] / n] + [window[k] / n for k in timings]
    summed = [sum(vals) for vals in zip(*mpi_comm.allgather(local + [counters.get(k, 0.0) for k in sorted(counters)]))]
    size = mpi_comm.Get_size()
    record = {"event": "train", "step": step, "epoch": epoch, "lr": algo.lr, "wall_s": wall,
              "loss": summed[0] / size, **{f"{k}_per_step": v / size for k, v in zip(timings, summed[1:])},
              **algo.comm.ledger.totals(), **algo.metrics()}
    for key, value in zip(sorted(counters), summed[1 + len(timings):]):
        record[f"sum_{key}"] = value
    if "correct" in counters and "count" in counters:
        record["train_accuracy"] = record["sum_correct"] / max(record["sum_count"], 1)
    metrics.write(record)
    progress.update(window["n"], loss=f"{record['loss']:.3f}", MB_sent=f"{record['bytes_sent'] / 1e6:.1f}")
    window.update(loss=0.0, compute_s=0.0, comm_s=0.0, wait_s=0.0, step_s=0.0, n=0)
    counters.clear()
