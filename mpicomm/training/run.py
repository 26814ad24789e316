"""One training run's state and everything around its step loop: claiming ``--out-dir``, resuming, the start
record, checkpoints, evaluation, giving up, and the clean-up (the step loop itself is :mod:`.loop`'s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import signal
import time

from ..checkpoint import save_checkpoint
from ..checkpoint.rng import capture_rng_state
from ..checkpoint.store import run_meta, set_aside_after
from ..comm import raise_together
from ..errors import TrainingStopped, agreed_of, mark_agreed
from .config import Task, TrainConfig
from .console import Console
from .health import agree
from .metrics import MetricsWriter
from .pace import SharedSteps
from .precision import Precision
from .recovery import state_digest
from .reporting import Progress, drifted, eval_line, evaluate
from .resume import Resumed, resolve_resume, restore_run, restore_states
from .rundir import RunLock, claim_out_dir
from .schedule import LRSchedule
from .stop import StopFlag
from .tensorboard import ScalarMirror

__all__ = ["Run"]


class Run:
    """One call of :func:`~.loop.run_training`: position, counters, metrics, progress bar, signal handlers."""

    def __init__(self, task: Task, algo, cfg: TrainConfig, console: Console, recovery=None):
        self.task, self.algo, self.cfg, self.console = task, algo, cfg, console
        self.recovery = recovery  # --on-rank-loss continue: the steps' commits and the survivors' rebuild
        self.lost = False  # a lost rank interrupted this run: its communicators are revoked
        self.continued = False  # this run continues one that a lost rank interrupted (continue_after_loss)
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
        self._continue_from(resumed)
        self._set_aside_later_checkpoints()
        self.last_saved, self.saved_step = str(resumed.path), resumed.step
        resized = f" (saved at {resumed.resized_from} ranks, continued at {self.size})" if resumed.resized_from else ""
        if self.lr_factor != 1.0:
            resized += f"; learning rate x {self.lr_factor:g} (--lr-scaling linear: {self.size} ranks, " \
                       f"the run began at {self.started_ranks})"
        elif resumed.resized_from and cfg.lr_scaling == "none":
            resized += (f"; the global batch is now {self.size}/{resumed.resized_from} of the saved run's at the same "
                        "learning rate (--lr-scaling linear scales the rate with the ranks)")
        self.console.info(f"resumed from {resumed.path} at step {self.step} of {self.total}{resized}")
        return resumed

    def _continue_from(self, resumed: Resumed) -> None:
        """Take the position, the run's first size (and ``--lr-scaling``'s factor) and the counters of ``resumed``."""
        self.step, self.epoch, self.start = resumed.step, resumed.epoch, resumed.batch
        self.started_ranks = resumed.started_ranks or self.size
        if self.cfg.lr_scaling == "linear":
            self.lr_factor = self.size / self.started_ranks
        counters = resumed.counters
        if counters:  # checkpoints of mpicomm 0.1.0 have none: their counters start again at 0
            self.train_s, self.wall_offset = float(counters["train_s"]), float(counters["wall_s"])
            self.algo.comm.ledger.load_state_dict(counters["ledger"])
            self.algo.comm.clock.load_totals(counters["clock"])

    def continue_after_loss(self, lost, previous: Run | None) -> None:
        """Collective over the survivors (and the replacements that joined them): continue ``previous`` (the run a
        lost rank interrupted; None in a replacement) from its last committed step at this size (:mod:`.recovery`);
        its lock, last checkpoint and evaluation carry over."""
        self.continued = True
        resumed = restore_states(lost.states, lost.places, self.algo, self.precision, self.task.steps_per_epoch)
        self._continue_from(resumed)
        self.console.rank = self.rank  # the new rank 0 speaks for the job
        digests = self.comm.allgather_object(state_digest(self.algo.flat.data), "the digests of the models")
        stop, mirror = None, None
        if previous is not None:
            self.wall_offset = previous.wall()  # the time lost to the failure and the recovery counts
            self.last_saved, self.saved_step = previous.last_saved, previous.saved_step
            self.evaluated = previous.evaluated
            self.lock, previous.lock = previous.lock, RunLock(None)
            # what outlives the rebuild: the hang timeout the job was given (and the one to restore at the end),
            # the signal handlers with any stop signal already received, the TensorBoard mirror
            self.previous_timeout = previous.previous_timeout
            self.signalled = previous.signalled
            stop, previous.stop = previous.stop, StopFlag(install=False)
            mirror, previous.metrics.mirror = previous.metrics.mirror, None
            previous.close()
            if self.cfg.hang_timeout is not None:
                self.guard.timeout_s = self.cfg.hang_timeout
        if self.cfg.out_dir and not lost.rank0_survived:  # rank 0's process held the lock and the metrics file
            self.lock = claim_out_dir(self.comm, self.cfg.out_dir, resume="latest", overwrite=False)
        if mirror is None and self.cfg.tensorboard and self.rank == 0:  # a new rank 0: its own event file
            mirror = ScalarMirror(self.cfg.tensorboard, purge_step=self.step + 1)
        path = f"{self.cfg.out_dir}/metrics.jsonl" if self.cfg.out_dir else None
        self.metrics = MetricsWriter(path, enabled=self.rank == 0, append=True, mirror=mirror)
        seconds = time.perf_counter() - lost.started
        survivors = self.size - len(lost.joined)
        self.metrics.write({"event": "rank_lost", "step": self.step, "lost": lost.lost, "old_size": lost.old_size,
                            "new_size": survivors, "recover_s": seconds, "rule": self.algo.resize_family,
                            "epoch": self.epoch, "batch": self.start, "wall_s": self.wall_offset})
        joined = ""
        if lost.joined:
            donors = set(digests[:survivors])
            self.metrics.write({"event": "rank_joined", "step": self.step, "joined": lost.joined, "size": self.size,
                                "model_equals_donors": all(digests[r] in donors for r in lost.joined),
                                "donors_agree": len(donors) == 1})
            joined = f", {len(lost.joined)} replacement(s) joined"
        self.console.warning(f"rank(s) {', '.join(map(str, lost.lost))} lost: continuing at step {self.step} on "
                             f"{self.size} of {lost.old_size} ranks{joined} ({self.algo.resize_family} rule), "
                             f"recovered in {seconds:.2f} s")
        self.stop = stop if stop is not None else StopFlag(install=self.cfg.handle_signals, guard=self.guard)
        self.progress = Progress(self.cfg.progress and self.rank == 0, self.total, self.step)
        self.t_run = time.perf_counter() - self.wall_offset

    def stop_carried_over(self, position: tuple[int, int]) -> int:
        """Collective, in a run that continues after a lost rank, before its first step: if any rank received a
        stop signal before the loss (the ranks may have agreed to stop and the loss hit the stop's checkpoint), or
        the run continues from ``stop_at_step``, stop here as the interrupted run would have: checkpoint, record,
        and return the signal (else 0)."""
        if not self.continued:
            return 0
        stopped_by = 0
        if self.cfg.handle_signals:
            verdict = agree(self.comm, self.stop.signum, "")
            if verdict.signal:
                self.guard.signal_handled()
                self.signalled = True
                stopped_by = verdict.signal
        if not stopped_by and 0 < self.cfg.stop_at_step == self.step:
            stopped_by = int(signal.SIGUSR1)
        if not stopped_by:
            return 0
        self.save(position, stopping=True)
        self.metrics.write({"event": "stopped", "step": self.step, "signal": stopped_by})
        where = f", checkpoint at {self.last_saved}" if self.cfg.out_dir else " (no --out-dir: nothing saved)"
        self.console.info(f"stopped by {signal.Signals(stopped_by).name} at step {self.step}{where} (the stop "
                          "came before the lost rank)")
        return stopped_by

    @contextlib.contextmanager
    def _between_steps(self, activity: str):
        """The body (an evaluation, a checkpoint's save) is no part of a step for the hang guard: under recovery a
        rank that spends the hang timeout in it outside MPI has not stalled and does not leave the job (its waits
        still end the job after the timeout). ``activity`` names it, with the step, in a hang message."""
        step, self.guard.step = self.guard.step, None
        try:
            with self.guard.doing(activity):
                yield
        finally:
            self.guard.step = step

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

    def state(self, position: tuple[int, int]) -> dict:
        """This rank's whole state between steps, as a checkpoint holds it: the algorithm, generators, buffers, the
        data ``position`` (epoch, batch) and the counters (the loss scale under mixed precision)."""
        algo = self.algo
        assert not algo.exchange_in_flight, "the state is taken between steps, with no exchange in flight"
        counters = {"wall_s": self.wall(), "train_s": self.train_s, "ledger": algo.comm.ledger.state_dict(),
                    "clock": algo.comm.clock.totals()}
        state = {"algorithm": algo.state_dict(), "rng": capture_rng_state(self.device),
                 "buffers": {name: b.detach().clone() for name, b in algo.model.named_buffers()},
                 "position": {"step": self.step, "epoch": position[0], "batch": position[1],
                              "steps_per_epoch": self.task.steps_per_epoch, "started_ranks": self.started_ranks},
                 "counters": counters}
        if self.cfg.precision != "fp32":
            state["precision"] = self.precision.state_dict()
        return state

    def save(self, position: tuple[int, int], stopping: bool = False) -> None:
        """Collective: commit a checkpoint of every rank at this step (a failure stops the run, agreed).

        Rank 0 adds the model the last evaluation scored when it is this step's, or, for the checkpoint of a
        stopped run (``stopping``), whatever its step: the model the final line's score belongs to."""
        if not self.cfg.out_dir:
            return
        algo = self.algo
        state = self.state(position)
        if self.rank == 0 and self.evaluated and (stopping or self.evaluated["step"] == self.step):
            state["evaluated"] = self.evaluated  # what the run scored: mpicomm export's default
        try:
            with self._between_steps(f"saving the checkpoint of step {self.step}"):
                path = save_checkpoint(self.cfg.out_dir, algo.comm, state, step=self.step, meta=self.meta,
                                       keep_last=self.cfg.keep_last,
                                       confirm=self.recovery.confirm if self.recovery else None)
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

    def _evaluate(self, epoch: float | None = None) -> dict[str, float]:
        """Collective, unmetered: evaluate the averaged model, write the eval record and its console line."""
        with self.algo.comm.unmetered(), self._between_steps(f"evaluation at step {self.step}"):
            result, model = evaluate(self.task, self.algo, self.cfg.eval_bn_batches)
        self.evaluated = {"step": self.step, **model}
        record = {"event": "eval", "step": self.step, "wall_s": self.wall(), "train_s": self.train_s, **result,
                  **self.algo.comm.ledger.totals()}
        if epoch is not None:
            record["epoch"] = epoch
        if self.pace is not None:
            record["steps_by_rank"] = self.pace.by_rank  # free running: each rank's own steps so far
        reason = drifted(result)
        if reason:
            record["drifted"] = True
        if self.recovery is not None:
            self.recovery.confirm()  # no rank was lost during it: the averages are every rank's
        self.metrics.write(record)
        self.console.info(eval_line(self.step, self.total, result))
        if reason:
            self.console.warning(f"step {self.step}: {reason}")
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
