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

This module holds :func:`run_training` and the step loop; the options and the :class:`Task` protocol are
:mod:`.config`'s (importable from here too), the run's state around the loop (resume, the start record,
checkpoints, evaluation) :mod:`.run`'s, the free-running rounds :mod:`.pace`'s.
"""

from __future__ import annotations

import signal
import time

import torch

from ..errors import agreed_of
from .config import LR_SCALINGS, Task, TrainConfig, agree_steps_per_epoch, crossed
from .console import Console
from .device import to_device
from .health import agree, local_problem
from .pace import SharedSteps
from .recovery import LostRanks, Recovery
from .reporting import account, log_window
from .run import Run

__all__ = ["LR_SCALINGS", "Task", "TrainConfig", "agree_steps_per_epoch", "run_training"]


def run_training(task: Task, algo, cfg: TrainConfig, *, run_info: dict | None = None,
                 console: Console | None = None, recovery: Recovery | None = None, joined: LostRanks | None = None
                 ) -> dict:
    """Train ``task`` with ``algo`` as ``cfg`` says; return the final summary (same on every rank).

    ``recovery`` (``--on-rank-loss continue`` or ``replace``): a lost rank does not end the run (:mod:`.recovery`).
    ``joined``: in a replacement process, what it received from the survivors; the run continues from there.

    Exit status for the caller: ``summary["stopped_by_signal"]`` is the signal number when the run was
    interrupted (after a checkpoint was committed), else 0. A run that cannot go on raises an error
    every rank shares (:func:`mpicomm.errors.agreed_of`): an unusable ``--resume`` checkpoint
    (``CheckpointError``), a divergence or a checkpoint that could not be written (``TrainingStopped``).
    """
    console = console or Console("train", algo.comm.rank)
    if joined is None:  # a replacement's task was agreed on when the survivors rebuilt the run with it
        agree_steps_per_epoch(task, algo.comm, console)
    run = _Training(task, algo, cfg, console, recovery)
    try:
        if joined is None:
            run.begin(run_info or {})
        else:
            run.continue_after_loss(joined, None)
        while True:
            try:
                return run.train()
            except Exception as exc:
                if recovery is None or not recovery.handles(exc):
                    raise
            run.lost = True
            run = _continued(run, recovery, cfg, console)
    except BaseException as exc:
        mark = agreed_of(exc)
        if mark is None:
            raise  # a rank's own crash: the caller aborts the job (no collective clean-up could finish)
        run.metrics.write({"event": "error", "step": run.step, "message": mark.describe()})
        if not run.lost:  # after a lost rank, the old communicators are revoked: nothing left to close
            run.algo.close()
        raise
    finally:
        run.close()


def _continued(run: _Training, recovery: Recovery, cfg: TrainConfig, console: Console) -> _Training:
    """Collective over the survivors of a lost rank: the run that continues ``run`` on them (:mod:`.recovery`); a
    further loss while recovering starts the recovery again."""
    while True:
        try:
            lost = recovery.recover()
            continued = _Training(lost.task, lost.algo, cfg, console, recovery)
            continued.continue_after_loss(lost, run)
            return continued
        except Exception as exc:
            if not recovery.handles(exc):
                raise


class _Training(Run):
    """A run with its step loop."""

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
        if self.recovery is not None:
            self.recovery.commit(self, (epoch, start))  # where a lost rank before the first step continues from
            if self.step < total:  # a stop signal received before the loss: the continued run stops here
                stopped_by = self.stop_carried_over((epoch, start))
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
                    if self.recovery is not None:  # every rank has finished this step, or none keeps it
                        self.recovery.commit(self, position)
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
                   **({"steps_by_rank": pace.by_rank, "rounds": pace.rounds,
                       "waited_rounds_by_rank": pace.waited_by_rank} if pace is not None else {})}
        self.metrics.write(summary)
        if self.metrics.problem:
            self.console.warning(f"{self.metrics.problem}; the run itself finished")
        return summary
