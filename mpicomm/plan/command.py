"""``mpicomm plan``: parse the job, predict every candidate, print the ranked table and the automatic choice."""

from __future__ import annotations

import argparse

from .accuracy import NOISE_POINTS
from .shapes import MAX_PARAMS, MODELS, layers_for_model, layers_from_params

__all__ = ["MAX_RANKS", "add_arguments", "main"]

MAX_RANKS = 1024
"""The most ranks the planner predicts for."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpicomm plan``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=int, help="the model's parameter count (taken as 1024 x 1024 matrices; "
                      f"at most {MAX_PARAMS:,})")
    what.add_argument("--model", choices=list(MODELS), help="a known model (its exact layer shapes)")
    parser.add_argument("--ranks", type=int, required=True, help=f"ranks in the job (1..{MAX_RANKS})")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each node (default 1)")
    parser.add_argument("--net", required=True,
                        help="the network: BANDWIDTH,LATENCY (1gbit,100us), a name (fast, gbit, slow, ib, pcie, "
                             "nvlink) or intra=...,inter=... (two levels)")
    when = parser.add_mutually_exclusive_group(required=True)
    when.add_argument("--step-time", type=float, help="compute seconds per step (forward + backward)")
    when.add_argument("--measure", action="store_true", help="time a few steps of --model on this machine")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step (default 32)")
    parser.add_argument("--tolerance", type=float, default=NOISE_POINTS,
                        help=f"accuracy points the automatic choice may cost (default {NOISE_POINTS}: the measured "
                             "seed-to-seed noise)")
    parser.add_argument("--no-codec-work", action="store_true", help="do not count encoding and decoding time")
    parser.add_argument("--remeasure-codecs", action="store_true", help="time the codecs again (cached otherwise)")


def main(args) -> str:
    """The text to print for the parsed ``args`` (``ValueError`` with one line for a refused input)."""
    from .codec_cost import codec_costs
    from .model import Job, auto_choice, check_step_time, check_tolerance, rank_candidates
    from .table import format_plan

    if not 1 <= args.ranks <= MAX_RANKS:
        raise ValueError(f"--ranks must be in 1..{MAX_RANKS}, got {args.ranks}")
    if args.ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    check_tolerance(args.tolerance)
    if args.step_time is not None:
        check_step_time(args.step_time)  # before the layers and the codec costs are worked out
    layers = layers_for_model(args.model) if args.model else layers_from_params(args.params)
    if args.measure:
        if not args.model:
            raise ValueError("--measure needs --model (the model to time)")
        from .measure import measure_step_time

        step_time = measure_step_time(args.model, args.batch_size)
    else:
        step_time = args.step_time
    costs = {} if args.no_codec_work else codec_costs(refresh=args.remeasure_codecs)
    job = Job(layers, args.ranks, args.net, step_time, args.ranks_per_node, args.batch_size, costs)
    preds = rank_candidates(job)
    try:
        choice, reason = auto_choice(preds, args.tolerance)
    except ValueError as exc:  # no measured candidate within the (valid) tolerance: the table says so
        return format_plan(job, preds, refusal=str(exc))
    return format_plan(job, preds, choice, reason)
