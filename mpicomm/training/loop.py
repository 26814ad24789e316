"""The training loop every app shares: schedule, steps, metrics, evaluation, checkpoints, graceful stop.

An app supplies a :class:`Task` (model, this rank's batches, loss, evaluation) and an algorithm; the
loop runs ``zero_grad → loss.backward → algo.step`` for the configured number of steps, writes metrics
(rank 0, JSON lines), evaluates the averaged model, checkpoints every rank's state to HDF5 and resumes
bit-exactly: batches are a pure function of (seed, rank, epoch, index), the learning rate a pure function
of the step, and every random generator is part of the checkpoint.

The schedule stays the loop's own pure function of the step (set into every parameter group of a
user optimizer by ``algo.set_lr``), not a ``torch.optim.lr_scheduler``: that is what keeps resume exact
without a scheduler state in the checkpoint. ``accumulate`` N: each step (update) takes N batches,
whose gradients the algorithm sums (:meth:`~mpicomm.algorithms.base.Algorithm.accumulate`); the logged
loss is the mean over the micro-batches, and checkpoints fall between steps only. ``clip_grad_norm``:
:meth:`~mpicomm.algorithms.base.Algorithm.clip_grad_norm_`.

Before the forward pass of each step (the first micro-batch's, with ``accumulate``) the loop calls
:meth:`~mpicomm.algorithms.base.Algorithm.begin_step`: a method built with ``overlap=True`` posts its
exchange of x(t) there and ``algo.step()`` completes it, so the transfer runs behind forward and backward
(not under ``--precision fp16``, whose overflow check may skip the step after backward). ``algo.step()``
has consumed it before the step ends, so no exchange is in flight when a checkpoint is written
(``state_dict`` refuses otherwise). The step's ``comm`` is what the rank waited for, so a transfer
hidden behind compute adds nothing to it.

Every quantity that decides a collective is agreed, never derived per rank: the batches per epoch
(:func:`agree_steps_per_epoch`, the smallest any rank's task offers; every rank takes exactly that many
from each epoch), hence the total, the evaluation points and the end. After each step the ranks agree,
in one small collective, whether to stop (a signal: checkpoint and exit) or whether the run cannot go
on (a non-finite loss or parameter, a metrics file that cannot be written: stop without saving); see
:mod:`.health`. With ``free_running`` (asynchronous methods only) the ranks step at their own pace and share
the run's steps; they agree only after the rounds of step counts that reach an event (:mod:`.pace`).
``lr_scaling="linear"``: after a resume at another world size the learning rate is multiplied by this size
over the size the run began at (kept in the checkpoint's position). Errors every rank shares end the run
with one message (:mod:`mpicomm.errors`). Every wait runs under the Communicator's hang guard
(``hang_timeout`` in seconds, 0: never; None: the guard's own, ``MPICOMM_HANG_TIMEOUT`` or 600 s;
:mod:`mpicomm.comm.guard`).

Monitoring collectives (loss averages for the log, that agreement) go through the Communicator's
control plane and are not booked in the Ledger: the Ledger counts what the algorithm sends. Evaluation (which averages
the models through the algorithm's communicator) runs unmetered: neither booked in the Ledger nor
charged by a modelled network (``--net``). Each step's time is split into compute, comm and wait
(:mod:`.reporting`). A checkpoint carries the run's counters, so a resumed run continues them.
``train_s`` in eval events is rank 0's cumulative time inside training steps (no evaluation, logging
or checkpoints): the x-axis of time-to-accuracy. The end event adds rank 0's clock totals
(``net_blocked_s``, ``net_slept_s``, ``net_modelled_s``; see :class:`~mpicomm.net.NetClock`).
"""

from __future__ import annotations

import dataclasses
import itertools
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..checkpoint import save_checkpoint
from ..checkpoint.rng import capture_rng_state
from ..checkpoint.store import run_meta, set_aside_after
from ..comm import raise_together
from ..errors import TrainingStopped, agreed_of, mark_agreed
from .console import Console
from .device import to_device
from .health import agree, local_problem
from .metrics import MetricsWriter
from .pace import SharedSteps
from .precision import PRECISIONS, Precision
from .reporting import Progress, account, eval_line, evaluate, log_window
from .resume import Resumed, resolve_resume, restore_run
from .rundir import RunLock, claim_out_dir
from .schedule import LRSchedule
from .stop import StopFlag
from .tensorboard import ScalarMirror

__all__ = ["LR_SCALINGS", "Task", "TrainConfig", "agree_steps_per_epoch", "run_training"]

LR_SCALINGS = ("none", "linear")
"""``--lr-scaling``: after a resume at another world size, keep the learning rate, or scale it with the ranks."""


class Task(Protocol):
    """What an app provides. ``train_batches(epoch, start)`` must be deterministic given (seed, rank, epoch).

    ``steps_per_epoch``: the batches one epoch offers on this rank; :func:`agree_steps_per_epoch` sets it to
    the number every rank takes (the smallest any rank offers), and ``train_batches`` must yield at least that.
    """

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
    eval_bn_batches: int = 8
    out_dir: str = ""
    save_every: int = 0
    keep_last: int = 2
    resume: str = ""
    overwrite: bool = False
    progress: bool = True
    handle_signals: bool = True
    stop_at_step: int = 0
    precision: str = "fp32"
    tensorboard: str = ""
    accumulate: int = 1
    clip_grad_norm: float = 0.0
    hang_timeout: float | None = None
    slow_ranks: tuple[tuple[int, float], ...] = ()
    free_running: bool = False
    lr_scaling: str = "none"

    def __post_init__(self):
        for name in ("epochs", "log_every", "accumulate"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "eval_every", "eval_bn_batches", "save_every", "warmup_steps", "stop_at_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.keep_last < 1:
            raise ValueError(f"--keep-last must be >= 1, got {self.keep_last}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not self.clip_grad_norm >= 0:
            raise ValueError(f"--clip-grad-norm must be >= 0 (0: no clipping), got {self.clip_grad_norm}")
        if self.hang_timeout is not None and not self.hang_timeout >= 0:
            raise ValueError(f"--hang-timeout must be a number of seconds >= 0 (0: never), got {self.hang_timeout}")
        if self.accumulate > 1 and self.precision == "fp16":
            raise ValueError("--accumulate cannot be combined with --precision fp16 (the loss scale's overflow "
                             "check is per backward pass); use bf16")
        if (self.save_every or self.resume or self.overwrite) and not self.out_dir:
            raise ValueError("--save-every/--resume/--overwrite need --out-dir (where checkpoints live)")
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"--lr-scaling: expected one of {', '.join(LR_SCALINGS)}, got {self.lr_scaling!r}")
        if self.free_running and self.precision == "fp16":
            raise ValueError("--free-running cannot be combined with --precision fp16 (its loss scale is agreed "
                             "by every rank at every step); use bf16")
        if self.overwrite and self.resume:
            raise ValueError("--overwrite deletes the run in --out-dir and --resume continues it: give one of them")

    def total_steps(self, steps_per_epoch: int) -> int:
        """Steps (updates) of the whole run: ``epochs * steps_per_epoch // accumulate``, capped by ``max_steps``.

        ``steps_per_epoch`` counts batches; with ``accumulate`` N each update takes N of them (an update
        may straddle the end of an epoch; a remainder of fewer than N batches at the end is not used).
        """
        total = self.epochs * steps_per_epoch // self.accumulate
        return min(total, self.max_steps) if self.max_steps else total

    def check_total(self, steps_per_epoch: int) -> None:
        """Raise ``ValueError`` naming the options when the run would have no update at all."""
        if self.total_steps(steps_per_epoch) < 1:
            raise ValueError(f"--accumulate {self.accumulate} needs more batches than the run has: --epochs "
                             f"{self.epochs} x {steps_per_epoch} batches per epoch make "
                             f"{self.epochs * steps_per_epoch}; lower --accumulate or raise --epochs")


def crossed(before: int, after: int, every: int) -> bool:
    """Whether the steps ``before`` < s <= ``after`` hold a multiple of ``every`` (0: never)."""
    return bool(every) and after // every > before // every


def agree_steps_per_epoch(task: Task, comm, console: Console | None = None) -> int:
    """Collective: set ``task.steps_per_epoch`` to the batches per epoch every rank takes, and return it.

    That is the smallest count any rank's task offers (a rank whose shard holds more leaves the rest of
    it for later epochs, whose order differs); a task that offers none is refused on every rank alike.
    """
    counts = comm.allgather_object(int(task.steps_per_epoch), "the agreement on batches per epoch")
    steps = min(counts)
    if steps < 1:
        raise_together(comm, ValueError(f"rank {counts.index(steps)}'s data give no batch per epoch "
                                        f"(steps_per_epoch {steps}); lower --batch-size or give more data"))
    if console is not None and max(counts) != steps:
        console.warning(f"the ranks' data give {steps} to {max(counts)} batches per epoch; every rank takes {steps}")
    task.steps_per_epoch = steps
    return steps


def run_training(task: Task, algo, cfg: TrainConfig, *, run_info: dict | None = None,
                 console: Console | None = None) -> dict:
    """Train ``task`` with ``algo`` as ``cfg`` says; return the final summary (same on every rank).

    Exit status for the caller: ``summary["stopped_by_signal"]`` is the signal number when the run was
    interrupted (after a checkpoint was committed), else 0. A run that cannot go on raises an error
    every rank shares (:func:`mpicomm.errors.agreed_of`): an unusable ``--resume`` checkpoint
    (``CheckpointError``), a divergence or a checkpoint that could not be written (``TrainingStopped``).
    """
    console = console or Console("train", algo.comm.rank)
    agree_steps_per_epoch(task, algo.comm, console)
    run = _Run(task, algo, cfg, console)
    try:
        run.begin(run_info or {})
        return run.train()
    except BaseException as exc:
        mark = agreed_of(exc)
        if mark is None:
            raise  # a rank's own crash: the caller aborts the job (no collective clean-up could finish)
        run.metrics.write({"event": "error", "step": run.step, "message": mark.describe()})
        algo.close()
        raise
    finally:
        run.close()


class _Run:
    """One call of :func:`run_training`: position, counters, metrics, progress bar, signal handlers."""

    def __init__(self, task: Task, algo, cfg: TrainConfig, console: Console):
        self.task, self.algo, self.cfg, self.console = task, algo, cfg, console
        self.comm, self.guard = algo.comm, algo.comm.guard
        self.rank, self.size = self.comm.rank, self.comm.size
        self.previous_timeout = self.guard.timeout_s
        if cfg.hang_timeout is not None:
            self.guard.timeout_s = cfg.hang_timeout
        self.total = cfg.total_steps(task.steps_per_epoch)
        algo.accumulate(cfg.accumulate)
        algo.clip_grad_norm_(cfg.clip_grad_norm or None)
        self.schedule = LRSchedule(cfg.lr, self.total, cfg.lr_schedule, cfg.warmup_steps, cfg.milestones,
                                   cfg.lr_gamma)
        self.meta = run_meta(algo.comm, algo)
        self.device = algo.flat.data.device
        self.precision = Precision(cfg.precision, self.device, algo.comm)
        # fp16 may skip a step after backward (an overflow anywhere), leaving a begun exchange pending over a
        # checkpoint: under fp16 the exchange is not begun early (the step exchanges blocking)
        self.begins_steps = cfg.precision != "fp16"
        self.step, self.epoch, self.start = 0, 0, 0
        self.started_ranks, self.lr_factor = self.size, 1.0  # the run's first world size; --lr-scaling's factor
        self.train_s, self.wall_offset = 0.0, 0.0
        self.last_saved, self.saved_step = "", -1
        self.evaluated: dict = {}
        self.metrics = MetricsWriter(None, enabled=False)
        self.progress = Progress(False, 0, 0)
        self.stop = StopFlag(install=False)
        self.lock = RunLock(None)
        self.signalled = False
        self.pace: SharedSteps | None = None
        self.t_run = time.perf_counter()

    def begin(self, run_info: dict) -> None:
        """Collective: claim ``--out-dir``, resume if asked, open the metrics file, install the signal handlers."""
        if self.cfg.out_dir:
            self.lock = claim_out_dir(self.comm, self.cfg.out_dir, resume=self.cfg.resume,
                                      overwrite=self.cfg.overwrite)
        resumed = self._resume()
        path = f"{self.cfg.out_dir}/metrics.jsonl" if self.cfg.out_dir else None
        mirror = None
        if self.cfg.tensorboard and self.rank == 0:  # past resumed logs are purged as continued() drops them
            mirror = ScalarMirror(self.cfg.tensorboard, purge_step=resumed.step + 1 if resumed else None)
        # A run continuing this directory appends (a restart from step 0 included: its start record
        # supersedes the earlier attempt's lines, see metrics.continued); a fresh run found it empty.
        self.metrics = MetricsWriter(path, enabled=self.rank == 0, append=bool(self.cfg.resume), mirror=mirror)
        self._write_start(resumed, run_info)
        self.stop = StopFlag(install=self.cfg.handle_signals, guard=self.guard)
        self.progress = Progress(self.cfg.progress and self.rank == 0, self.total, self.step)
        self.t_run = time.perf_counter() - self.wall_offset

    def _resume(self) -> Resumed | None:
        cfg = self.cfg
        if not cfg.resume:
            return None
        path = resolve_resume(cfg.resume, cfg.out_dir)
        if path is None:
            self.console.info(f"--resume latest: no checkpoint in {cfg.out_dir} yet, starting from step 0")
            return None
        expect = {"topology": self.meta["topology"], "algorithm": {"name": self.algo.name}}
        with self.guard.doing("resuming"):
            resumed = restore_run(path, self.algo, expect, self.meta, self.precision, self.task.steps_per_epoch)
        if resumed.step > self.total:
            raise_together(self.comm, ValueError(
                f"the checkpoint {resumed.path} is at step {resumed.step}, beyond this run's {self.total} steps: "
                "raise --epochs or --max-steps to train on from it"))
        self.step, self.epoch, self.start = resumed.step, resumed.epoch, resumed.batch
        self.started_ranks = resumed.started_ranks or self.size
        if cfg.lr_scaling == "linear":
            self.lr_factor = self.size / self.started_ranks
        self._set_aside_later_checkpoints()
        counters = resumed.counters
        if counters:  # checkpoints of mpicomm 0.1.0 have none: their counters start again at 0
            self.train_s, self.wall_offset = float(counters["train_s"]), float(counters["wall_s"])
            self.algo.comm.ledger.load_state_dict(counters["ledger"])
            self.algo.comm.clock.load_totals(counters["clock"])
        self.last_saved, self.saved_step = str(resumed.path), resumed.step
        resized = f" (saved at {resumed.resized_from} ranks, continued at {self.size})" if resumed.resized_from else ""
        if self.lr_factor != 1.0:
            resized += f"; learning rate x {self.lr_factor:g} (--lr-scaling linear: {self.size} ranks, " \
                       f"the run began at {self.started_ranks})"
        self.console.info(f"resumed from {resumed.path} at step {self.step} of {self.total}{resized}")
        return resumed

    def _set_aside_later_checkpoints(self) -> None:
        """Collective: a run resumed from an earlier checkpoint keeps its later ones as ``superseded-step-…``."""
        moved, error = [], None
        if self.rank == 0:
            try:
                moved = set_aside_after(self.cfg.out_dir, self.step)
            except OSError as exc:
                error = exc
        raise_together(self.comm, error)
        if moved:
            self.console.info(f"resuming step {self.step} of a run that went on further: its later checkpoints are "
                              f"kept as {', '.join(p.name for p in moved)}")

    def _write_start(self, resumed: Resumed | None, run_info: dict) -> None:
        algo = self.algo
        if resumed:
            self.metrics.write({"event": "resume", "step": self.step, "path": str(resumed.path),
                                "wall_s": self.wall_offset, "train_s": self.train_s, **algo.comm.ledger.totals()})
            if resumed.resized_from:
                self.metrics.write({"event": "resize", "step": self.step, "old_size": resumed.resized_from,
                                    "new_size": self.size, "rule": algo.resize_family, "lr_factor": self.lr_factor,
                                    "epoch": self.epoch, "batch": self.start})
        self.metrics.write({"event": "start", "step": self.step, "resumed_from": str(resumed.path) if resumed else "",
                            "total_steps": self.total, "steps_per_epoch": self.task.steps_per_epoch,
                            "ranks": self.size, "algorithm": algo.name,
                            "net": str(algo.comm.net) if algo.comm.net else "", "parameters": algo.flat.numel,
                            "init_traffic": algo.comm.ledger.totals(), "config": dataclasses.asdict(algo.config),
                            "optimizer": algo.optimizer_description(),
                            "train_config": dataclasses.asdict(self.cfg), **run_info})

    def wall(self) -> float:
        """Seconds since the run began, earlier runs it resumed from included (not the time between them)."""
        return time.perf_counter() - self.t_run

    def save(self, position: tuple[int, int], stopping: bool = False) -> None:
        """Collective: commit a checkpoint of every rank at this step (a failure stops the run, agreed).

        Rank 0 adds the model the last evaluation scored when it is this step's, or, for the checkpoint of a
        stopped run (``stopping``), whatever its step: the model the final line's score belongs to."""
        if not self.cfg.out_dir:
            return
        algo = self.algo
        assert not algo.exchange_in_flight, "checkpoints are written between steps, with no exchange in flight"
        counters = {"wall_s": self.wall(), "train_s": self.train_s, "ledger": algo.comm.ledger.state_dict(),
                    "clock": algo.comm.clock.totals()}
        state = {"algorithm": algo.state_dict(), "rng": capture_rng_state(self.device),
                 "buffers": {name: b.detach().clone() for name, b in algo.model.named_buffers()},
                 "position": {"step": self.step, "epoch": position[0], "batch": position[1],
                              "steps_per_epoch": self.task.steps_per_epoch, "started_ranks": self.started_ranks},
                 "counters": counters}
        if self.cfg.precision != "fp32":
            state["precision"] = self.precision.state_dict()
        if self.rank == 0 and self.evaluated and (stopping or self.evaluated["step"] == self.step):
            state["evaluated"] = self.evaluated  # what the run scored: mpicomm export's default
        try:
            with self.guard.doing("saving a checkpoint"):
                path = save_checkpoint(self.cfg.out_dir, algo.comm, state, step=self.step, meta=self.meta,
                                       keep_last=self.cfg.keep_last)
        except Exception as exc:
            mark = agreed_of(exc)
            if mark is None:
                raise
            raise self._stopped(f"could not write the checkpoint of step {self.step} in {self.cfg.out_dir}: "
                                f"{mark.describe()}") from exc
        self.last_saved, self.saved_step = str(path), self.step
        self.metrics.write({"event": "checkpoint", "step": self.step, "path": str(path)})
        self.console.info(f"checkpoint of step {self.step} saved: {path}")

    def _stopped(self, why: str) -> TrainingStopped:
        """The agreed error that ends a run which cannot go on, naming the last good checkpoint."""
        last = (f"the last checkpoint is {self.last_saved} (--resume {self.last_saved})" if self.last_saved
                else "no checkpoint was written")
        exc = TrainingStopped(f"{why}; {last}")
        return mark_agreed(exc, str(exc), range(self.size), self.size)

    def _batches(self, epoch: int, start: int):
        """``(index, batch)`` for batches ``start`` … ``steps_per_epoch - 1`` of ``epoch``: exactly the agreed count."""
        count = self.task.steps_per_epoch
        index = start - 1
        for index, batch in enumerate(itertools.islice(self.task.train_batches(epoch, start), count - start),
                                      start=start):
            yield index, batch
        if index + 1 < count:  # a task that offers fewer batches than it declared: a bug in the task
            raise RuntimeError(f"the task's train_batches(epoch={epoch}, start={start}) ended after batch {index} "
                               f"on rank {self.rank}; it declared {count} batches per epoch")

    def train(self) -> dict:
        """The loop itself; returns the end summary."""
        algo, cfg, task, total = self.algo, self.cfg, self.task, self.total
        window = {"loss": 0.0, "compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "step_s": 0.0, "hidden_s": 0.0, "n": 0}
        clock = algo.comm.clock
        counters: dict[str, float] = {}
        stopped_by = 0
        last_eval: dict[str, float] = {}
        epoch, start = self.epoch, self.start
        blocked = slept = elapsed = 0.0
        step_loss, crossed_epoch = None, False
        slowdown = dict(cfg.slow_ranks).get(self.rank, 1.0)
        pace = SharedSteps(self.comm, self.step, total) if cfg.free_running and self.step < total else None
        self.pace = pace
        if self.step == total:  # resumed from the end of the run: report where it ended
            self.console.info(f"the run had already finished at step {total}; nothing to train")
            last_eval = self._evaluate()
        while self.step < total and not stopped_by:
            for index, batch in self._batches(epoch, start):
                if not algo.pending_micro_batches:  # the first micro-batch of a step
                    algo.set_lr(self.lr_factor * self.schedule(self.step))
                    blocked, slept, modelled = clock.blocked_s, clock.slept_s, clock.modelled_s
                    elapsed, step_loss = 0.0, None
                    self.guard.step = self.step + 1
                t0 = time.perf_counter()
                if self.begins_steps and not algo.pending_micro_batches:
                    algo.begin_step()  # an overlapping method posts its exchange of x(t) now, before forward
                algo.zero_grad()
                with self.precision.autocast():
                    loss, counts = task.loss(algo.model, to_device(batch, self.device))
                self.precision.backward(loss)
                if slowdown > 1:  # a straggler: this rank's compute takes slowdown times as long
                    time.sleep((slowdown - 1) * (time.perf_counter() - t0))
                if self.precision.ready(algo.flat):
                    algo.step()
                elapsed += time.perf_counter() - t0
                loss = loss.detach().double()  # on the device: read at checks and log lines only
                step_loss = loss if step_loss is None else step_loss + loss
                for k, v in counts.items():
                    counters[k] = counters.get(k, 0) + (v.detach() if torch.is_tensor(v) else float(v))
                crossed_epoch = crossed_epoch or index + 1 == task.steps_per_epoch
                if algo.pending_micro_batches:  # accumulating: no update, so no step to account for yet
                    continue
                self.train_s += elapsed
                account(window, elapsed, clock.blocked_s - blocked, clock.slept_s - slept,
                        None if clock.model is None else clock.modelled_s - modelled)
                window["loss"] += step_loss / cfg.accumulate if cfg.accumulate > 1 else step_loss
                finished_epoch = index + 1 == task.steps_per_epoch
                position = (epoch + 1, 0) if finished_epoch else (epoch, index + 1)
                signum = self.stop.signum if cfg.handle_signals else None
                previous = self.step
                if pace is None:
                    self.step += 1
                else:  # free running: the run's step moves when a round completes (see .pace)
                    pace.took_step()
                    reached = pace.poll()
                    if reached is None:
                        continue
                    self.step = min(reached.step, total)
                    crossed_epoch = crossed(previous, self.step, max(1, task.steps_per_epoch // cfg.accumulate))
                step = self.step
                logging = crossed(previous, step, cfg.log_every) or step == total
                saving = crossed(previous, step, cfg.save_every)
                stopping_here = previous < cfg.stop_at_step <= step
                evaluating = crossed(previous, step, cfg.eval_every) or (crossed_epoch and not cfg.eval_every) \
                    or step == total
                if pace is not None and not (logging or saving or stopping_here or evaluating or reached.signal):
                    pace.post(signum)  # nothing for every rank to do after this round
                    continue
                checking = logging or saving or signum or stopping_here
                problem = local_problem(float(window["loss"]), algo.flat.data) if checking else ""
                verdict = agree(self.comm, signum, problem or self.metrics.problem)
                if verdict.signal:
                    self.guard.signal_handled()  # every rank stops after this step: agreed, checkpoint, exit
                    self.signalled = True
                if verdict.problem:
                    self._give_up(verdict, step)
                if logging:
                    log_window(self.metrics, self.progress, algo, step, epoch, window, counters, self.wall())
                if evaluating:
                    last_eval = self._evaluate(epoch + (index + 1) / task.steps_per_epoch)
                crossed_epoch = False
                stopped_by = verdict.signal
                if stopping_here and step < total:
                    stopped_by = stopped_by or int(signal.SIGUSR1)
                if saving or stopped_by:
                    self.save(position, stopping=bool(stopped_by))
                if stopped_by:
                    self.metrics.write({"event": "stopped", "step": step, "signal": stopped_by})
                    where = f", checkpoint at {self.last_saved}" if cfg.out_dir else " (no --out-dir: nothing saved)"
                    self.console.info(f"stopped by {signal.Signals(stopped_by).name} at step {step}{where}")
                    break
                if step == total:
                    break
                if pace is not None:
                    pace.post(signum)
            epoch, start = (epoch + 1, 0) if not stopped_by else (epoch, start)
        self.guard.step = None
        if self.step == total and not stopped_by and self.saved_step != total:
            self.save((epoch, 0))  # the end of every run with --out-dir: the model to export
        if pace is not None:
            pace.close()
        algo.close()
        summary = {"event": "end", "step": self.step, "total_steps": total, "stopped_by_signal": stopped_by,
                   **({"loss_scale": self.precision.scale, "skipped_steps": self.precision.skipped}
                      if cfg.precision == "fp16" else {}),
                   "wall_s": self.wall(), "train_s": self.train_s, **last_eval,
                   **({"evaluated_step": self.evaluated["step"]} if last_eval else {}), **algo.comm.ledger.totals(),
                   **{f"net_{k}": v for k, v in clock.totals().items()}, **algo.metrics(),
                   **({"steps_by_rank": pace.by_rank} if pace is not None else {})}
        self.metrics.write(summary)
        if self.metrics.problem:
            self.console.warning(f"{self.metrics.problem}; the run itself finished")
        return summary

    def _evaluate(self, epoch: float | None = None) -> dict[str, float]:
        """Collective, unmetered: evaluate the averaged model, write the eval record and its console line."""
        with self.algo.comm.unmetered(), self.guard.doing("evaluation"):
            result, model = evaluate(self.task, self.algo, self.cfg.eval_bn_batches)
        self.evaluated = {"step": self.step, **model}
        record = {"event": "eval", "step": self.step, "wall_s": self.wall(), "train_s": self.train_s, **result,
                  **self.algo.comm.ledger.totals()}
        if epoch is not None:
            record["epoch"] = epoch
        if self.pace is not None:
            record["steps_by_rank"] = self.pace.by_rank  # free running: each rank's own steps so far
        self.metrics.write(record)
        self.console.info(eval_line(self.step, self.total, result))
        return result

    def _give_up(self, verdict, step: int) -> None:
        """Raise the agreed error of a run that cannot go on (divergence, unwritable metrics)."""
        if verdict.problem.startswith(MetricsWriter.PROBLEM):
            raise self._stopped(f"rank {verdict.rank}: {verdict.problem} at step {step}")
        self.metrics.write({"event": "diverged", "step": step, "rank": verdict.rank, "problem": verdict.problem})
        raise self._stopped(f"training diverged by step {step}: on rank {verdict.rank} the "
                            f"{verdict.problem} (lr {self.algo.lr:g}); nothing was saved after it")

    def close(self) -> None:
        """Local clean-up, whatever happened: the bar, the signal handlers, the metrics file, the lock."""
        self.guard.timeout_s = self.previous_timeout
        self.progress.close()
        self.stop.uninstall(keep_ignoring=self.signalled or self.stop.signum is not None)
        self.metrics.close()
        self.lock.release()
