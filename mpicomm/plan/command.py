"""``mpicomm plan``: parse the job, predict every candidate, print the ranked table and the automatic choice.

``mpicomm plan --calibrate`` (under ``mpiexec``) measures the transport instead and caches it
(:mod:`mpicomm.comm.calibrate`); ``--net measured[:PATH]`` then prices with that calibration. Only
``--calibrate`` imports MPI.
"""

from __future__ import annotations

import argparse
import math

from ..net.calibration import BUDGET_S
from .accuracy import BASELINES, IMAGE, NOISE_POINTS, TASKS
from .shapes import MAX_PARAMS, MODELS, layers_for_model, layers_from_params

__all__ = ["MAX_RANKS", "add_arguments", "calibrate_main", "main"]

MAX_RANKS = 1024
"""The most ranks the planner predicts for."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpicomm plan``."""
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--params", type=int, help="the model's parameter count (taken as 1024 x 1024 matrices; "
                      f"at most {MAX_PARAMS:,})")
    what.add_argument("--model", choices=list(MODELS), help="a known model (its exact layer shapes)")
    parser.add_argument("--ranks", type=int, help=f"ranks in the job (1..{MAX_RANKS})")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each node (default 1)")
    parser.add_argument("--net",
                        help="the network: BANDWIDTH,LATENCY (1gbit,100us), a name (fast, gbit, slow, ib, pcie, "
                             "nvlink), intra=...,inter=... (two levels), or measured[:PATH] (a calibration: "
                             "PATH, else the cached one of --transport at --ranks)")
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--step-time", type=float, help="compute seconds per step (forward + backward)")
    when.add_argument("--measure", action="store_true", help="time a few steps of --model on this machine")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step (default 32)")
    parser.add_argument("--task", choices=TASKS, default=IMAGE,
                        help="the task family whose measured accuracy costs apply: image (classification, SGD) or "
                             "masked-lm (BERT pre-training, Adam); default image")
    parser.add_argument("--tolerance", type=float, default=NOISE_POINTS,
                        help=f"accuracy points the automatic choice may cost (default {NOISE_POINTS}: the measured "
                             "seed-to-seed noise)")
    parser.add_argument("--no-codec-work", action="store_true", help="do not count encoding and decoding time")
    parser.add_argument("--remeasure-codecs", action="store_true", help="time the codecs again (cached otherwise)")
    parser.add_argument("--calibrate", action="store_true",
                        help="under mpiexec: measure the transport (latency, allreduce, allgather and ring exchange "
                             "costs, overlap) and cache it for --net measured; takes no job options")
    parser.add_argument("--transport", default="", help="the transport's label for --calibrate and --net measured "
                                                        "(letters, digits, '.', '_', '-'; default 'default')")
    parser.add_argument("--out", default="", help="with --calibrate: the file to write (default: the cache, "
                                                  "calibration-HOST-TRANSPORT-RANKS.json)")
    parser.add_argument("--budget", type=_budget, default=None,
                        help=f"with --calibrate: seconds the measurement may take (default {BUDGET_S:g}; on a slow "
                             "link a larger budget times the larger message sizes too)")


def _budget(text: str) -> float:
    """``--budget``: seconds in (0, 3600] (``argparse.ArgumentTypeError`` with one line otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], got {text!r}")
    return value


_JOB_OPTIONS = ("params", "model", "ranks", "net", "step_time", "measure")


def _check_options(args) -> None:
    """``ValueError`` (one line) for options missing, or given where they do not apply."""
    from ..net.calibration import check_label

    check_label(args.transport)
    if args.calibrate:
        given = [f"--{name.replace('_', '-')}" for name in _JOB_OPTIONS if getattr(args, name) not in (None, False)]
        if given:
            raise ValueError(f"--calibrate measures the transport and takes no job options; leave out "
                             f"{', '.join(given)}")
        return
    if args.out:
        raise ValueError("--out is for --calibrate (the file to write the calibration to)")
    if args.budget is not None:
        raise ValueError("--budget is for --calibrate (the seconds the measurement may take)")
    for names, present in ((("--params", "--model"), args.params is not None or args.model),
                           (("--ranks",), args.ranks is not None), (("--net",), args.net is not None),
                           (("--step-time", "--measure"), args.step_time is not None or args.measure)):
        if not present:
            raise ValueError(f"{' or '.join(names)} is required (or --calibrate, under mpiexec, to measure the "
                             "transport)")


def _calibration(args):
    """The calibration ``--net measured[:PATH]`` names (``ValueError`` with one line when there is none), or
    None for a modelled ``--net``."""
    net = args.net.strip()
    if net != "measured" and not net.startswith("measured:"):
        return None
    from ..net.calibration import Calibration, default_path

    if args.ranks == 1 and net == "measured":
        raise ValueError("--net measured: one rank sends nothing and has no calibration; any --net (e.g. fast) "
                         "gives the same plan")
    path = net.partition(":")[2] or default_path(args.transport, args.ranks)
    transport = f" --transport {args.transport}" if args.transport else ""
    try:
        return Calibration.load(path)
    except FileNotFoundError:
        out = f" --out {path}" if net != "measured" else ""
        raise ValueError(f"--net measured: no calibration at {path}; run mpiexec -n {args.ranks} python -m mpicomm "
                         f"plan --calibrate{transport}{out} first") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--net measured: {str(exc).splitlines()[0]}") from None


def calibrate_main(args) -> int:
    """``--calibrate``, collective over the MPI world: measure the transport, write it (rank 0) and print its
    one-line summary with the path (rank 0). A refusal is one line on rank 0 and exit status 2 on every rank;
    an unexpected error on any rank aborts the job. Returns the exit status."""
    import sys

    from ..comm import Communicator, abort_on_exception, world
    from ..comm.calibrate import calibrate
    from ..net.calibration import default_path
    from ..topology import ring

    with abort_on_exception(world()):
        comm = Communicator(world(), ring(world().size), net=None)
        line, refusal = "", ""
        try:
            _check_options(args)
            calibration = calibrate(comm, args.transport, budget=args.budget)
        except ValueError as exc:  # the same on every rank
            refusal = str(exc)
        if not refusal and comm.rank == 0:
            try:
                path = calibration.save(args.out or default_path(args.transport, calibration.ranks))
                line = f"{calibration.summary()}; written to {path}"
            except OSError as exc:
                refusal = f"--out: cannot write the calibration: {exc}"
        refusal = comm.bcast_object(refusal, 0, "the calibration's outcome") or refusal
    if comm.rank == 0:
        print(f"mpicomm plan: error: {refusal}" if refusal else line, file=sys.stderr if refusal else sys.stdout)
    return 2 if refusal else 0


def main(args) -> str:
    """The text to print for the parsed ``args`` (``ValueError`` with one line for a refused input)."""
    from .codec_cost import codec_costs
    from .model import Job, auto_choice, check_step_time, check_tolerance, rank_candidates
    from .table import format_plan

    _check_options(args)
    if not 1 <= args.ranks <= MAX_RANKS:
        raise ValueError(f"--ranks must be in 1..{MAX_RANKS}, got {args.ranks}")
    if args.ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    check_tolerance(args.tolerance)
    if args.step_time is not None:
        check_step_time(args.step_time)  # before the layers and the codec costs are worked out
    calibration = _calibration(args)
    layers = layers_for_model(args.model) if args.model else layers_from_params(args.params)
    if args.measure:
        if not args.model:
            raise ValueError("--measure needs --model (the model to time)")
        from .measure import measure_step_time

        step_time = measure_step_time(args.model, args.batch_size)
    else:
        step_time = args.step_time
    costs = {} if args.no_codec_work else codec_costs(refresh=args.remeasure_codecs)
    net = args.net if calibration is None else calibration.summary()
    job = Job(layers, args.ranks, net, step_time, args.ranks_per_node, args.batch_size, costs, calibration)
    preds = rank_candidates(job, task=args.task)
    try:
        choice, reason = auto_choice(preds, args.tolerance, BASELINES[args.task])
    except ValueError as exc:  # no measured candidate within the (valid) tolerance: the table says so
        return format_plan(job, preds, refusal=str(exc))
    return format_plan(job, preds, choice, reason)
