"""What every app's ``main`` does: parse, set up on every rank, train, report, exit with a clear status.

Exit status (the same on every rank):

* 0: trained to the end, or stopped by SIGUSR1/SIGTERM inside a requeueing SLURM job (below);
* 2: the input was refused before training: a bad argument or option value, unusable data, a
  ``--resume`` checkpoint that is missing, damaged or from another world size/algorithm/model;
* 3: training stopped because it cannot go on: the loss or parameters became non-finite, or a
  checkpoint or the metrics could not be written (disk full), or fewer than ``--min-ranks`` survived a lost
  rank (``--on-rank-loss continue``/``replace``, :mod:`.recovery`); the last good checkpoint is named;
* 1: an unexpected exception on some rank: the whole job is aborted, with that rank's traceback;
* 4: a rank waited longer than ``--hang-timeout`` in a collective (one line names it and the step);
* 5: trained to the end, but the last evaluation's averaged model (the score the run reports) scored far
  below every rank's own model: the ranks drifted apart and the score is not a trained model's
  (:func:`~.reporting.drifted`); the checkpoint keeps every rank's own model;
* 128 + N: stopped by signal N outside a requeueing job, after committing a checkpoint (or, when the
  signal found a rank blocked in a collective it could not leave, at once and without one).

A resume compares the app's settings (``settings(args)``, the app's own flags, plus the shared ones of
:func:`~.arguments.run_settings`) with those the checkpoint's run recorded in its ``start`` record, where
``run_info["settings"]`` keeps them (:mod:`.resume`).

Cases 2 and 3 are agreed by every rank, so rank 0 alone prints the one-line reason and no rank aborts.
A run stopped by SIGUSR1/SIGTERM commits a checkpoint first; then, inside a SLURM job that asked for
requeueing (``MPICOMM_REQUEUE=1``, set by the templates), rank 0 writes the marker file
``<out-dir>/requeue`` and every rank exits 0. The job script, once the launcher has returned, sees the
marker and runs ``scontrol requeue``; the requeued job resumes from ``--resume latest``. The requeue is
asked only after every rank has exited: asked while the MPI step still ran, Slurm killed the step
during the ranks' clean exit, and under load the job then ended FAILED instead of going back to the queue.
"""

from __future__ import annotations

import os
import sys

from ..comm import abort_on_exception, world
from ..comm.faults import join, leave
from ..errors import TrainingStopped, agreed_of
from .arguments import (
    OptionRefused,
    derived_options,
    parse_app_args,
    rebuilder,
    recovery_for,
    run_settings,
    setup_run,
    train_config,
)
from .console import Console
from .loop import run_training
from .recovery import Recovery
from .reporting import drifted
from .resume import AppSettings, comparing_app_settings

__all__ = ["EXIT_REFUSED", "EXIT_STOPPED", "REQUEUE_MARKER", "run_app"]

EXIT_REFUSED = 2
EXIT_STOPPED = 3


REQUEUE_MARKER = "requeue"


def _mark_for_requeue(console: Console, out_dir: str, step: int) -> bool:
    """Inside a requeueing SLURM job, leave ``<out_dir>/requeue`` for the job script; False elsewhere."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("MPICOMM_REQUEUE") != "1" or not out_dir:
        return False
    if console.rank == 0:
        with open(os.path.join(out_dir, REQUEUE_MARKER), "w") as marker:
            marker.write(f"job {job} stopped at step {step}\n")
        console.info(f"job {job} will be requeued by its script once every rank has exited")
    return True


def _refused(console: Console, exc: BaseException) -> int | None:
    """Print an error every rank shares once and return its exit status; None for a rank's own error."""
    mark = agreed_of(exc)
    if mark is None:
        return None
    console.error(mark.describe())
    return EXIT_STOPPED if isinstance(exc, TrainingStopped) else EXIT_REFUSED


def run_app(name: str, parser, build_task, argv=None, headline: tuple[str, str] = ("", ""),
            preparing: str = "loading the data and building the model", settings=None, check=None) -> int:
    """Run one training app; ``build_task(args, rank, size)`` returns its Task (model included).

    ``preparing`` says what the set-up does, printed before it starts (it can take a while).
    ``settings(args)``: the app's own options its runs' trajectory depends on, by flag (``{"--batch-size":
    32, …}``), which a resume compares with the checkpoint's run (a path such as ``--data`` is best left out:
    the data may move). ``check(args)``: the app's own option values that need no data, refused (``ValueError``)
    before anything is built; ``mpicomm slurm check`` calls the app module's ``check_args`` the same way.
    """
    console = Console(name)
    try:
        with console.quiet_unless_rank0():
            args = parse_app_args(parser, argv)
    except OptionRefused as exc:
        console.error(str(exc))
        return EXIT_REFUSED
    console.route_warnings()
    replace = [sys.executable, os.path.abspath(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)]
    membership = join()  # a replacement for a lost rank, started by the survivors: it joins their run
    if membership is not None:
        return _join(name, console, args, build_task, membership, replace, argv, headline)
    job = world()
    rank, size = job.rank, job.size
    console.rank = rank
    console.info(f"{size} rank(s): {preparing} …")
    with abort_on_exception(job):
        try:
            task, algo, cfg, lock = setup_run(args, job, lambda: build_task(args, rank, size), console, check)
        except (ValueError, TypeError) as exc:
            code = _refused(console, exc)
            if code is None:
                raise
            return code
        try:
            app = AppSettings({**run_settings(args), **(settings(args) if settings else {})},
                              cfg.total_steps(task.steps_per_epoch), cfg.lr_schedule, derived_options(args))
            recovery = recovery_for(args, cfg, job, build_task, console, replace)
            with comparing_app_settings(app):
                code = _train(name, console, task, algo, cfg, argv, headline,
                              {"settings": app.flags, "auto": getattr(args, "auto_choice", None)}, recovery)
        finally:
            lock.release()
    leave(recovery.membership if recovery else None, code)
    return code


def _join(name: str, console: Console, args, build_task, membership, replace: list[str], argv, headline) -> int:
    """A replacement process: receive the survivors' state (no checkpoint is read), then train with them."""
    console.rank = membership.world.rank
    with abort_on_exception(membership.world):
        cfg = train_config(args)
        recovery, joined = Recovery.join(membership, rebuilder(args, build_task, console), cfg.min_ranks, replace)
        code = _train(name, console, joined.task, joined.algo, cfg, argv, headline, {}, recovery, joined)
    leave(membership, code)
    return code


def _train(name: str, console: Console, task, algo, cfg, argv, headline: tuple[str, str], recorded: dict,
           recovery=None, joined=None) -> int:
    """Train, print the final line, and return the exit status (see the module docstring).

    The final line's score is the last evaluation's. A run stopped after it (a signal, ``--stop-at-step``)
    says which step's model that score belongs to: the stop's checkpoint keeps that model, which ``mpicomm
    export`` writes by default.

    ``recorded`` goes into the run's ``start`` record: ``settings`` (what a later resume compares with) and
    ``auto`` (``--algorithm auto``'s choice, or None).
    """
    size = algo.comm.size
    graph = "" if algo.centralized else f"{algo.comm.schedule.name} topology, "  # centralized methods use none
    console.info(f"training {cfg.total_steps(task.steps_per_epoch)} steps of {algo.name} on {size} rank(s), "
                 f"{graph}{algo.flat.numel:,} parameters")
    try:
        summary = run_training(task, algo, cfg, console=console, recovery=recovery, joined=joined, run_info={
            "app": name, "argv": sys.argv[1:] if argv is None else list(argv),
            **{k: v for k, v in recorded.items() if v is not None}})
    except Exception as exc:
        code = _refused(console, exc)
        if code is None:
            raise
        return code
    key, label = headline
    if key and key in summary:
        evaluated = summary.get("evaluated_step", summary["step"])
        if evaluated != summary["step"]:  # stopped after its last evaluation: the score is that step's model's
            export = f"; mpicomm export {cfg.out_dir} writes that model" if cfg.out_dir else ""
            label = f"{label.removeprefix('final ')} of step {evaluated} (its last evaluation{export})"
        console.info(f"{label}: {100 * summary[key]:.2f} %  |  steps {summary['step']}/{summary['total_steps']}"
                     f"  |  bytes sent by rank 0: {summary['bytes_sent'] / 1e6:.2f} MB"
                     f"  |  wall {summary['wall_s']:.1f} s")
    if summary["stopped_by_signal"]:
        requeued = _mark_for_requeue(console, cfg.out_dir, summary["step"])
        return 0 if requeued else 128 + summary["stopped_by_signal"]
    reason = drifted(summary)
    if reason:
        console.error(f"{reason}; the reported score is not a trained model's (lower --lr, a better-connected "
                      "--topology, or more bits would keep the ranks together)")
        return 5
    return 0
