"""``--algorithm auto``: the apps pick the method and its settings for this job, with the planner.

At start-up, after the model and data are built, every rank:

1. times the compute of a training step: one warm-up and three timed forward-and-backward passes of the
   app's own loss on its first batches, the slowest rank's median kept (the step waits for it);
2. takes the network from ``--auto-net``, else ``--net``, else probes the real MPI transport
   (:mod:`mpicomm.plan.choose`);
3. rank 0 ranks every candidate of ``mpicomm plan`` on this model's layer shapes, ranks, ranks per node,
   batch size, network and codec costs (:mod:`mpicomm.plan.model`) and takes the fastest one whose measured
   accuracy cost for the app's task family (``image`` or ``masked-lm``) is not significantly above
   ``--auto-tolerance`` points; every rank gets its choice. The image app's options describe an SGD run
   (``--lr``, ``--momentum``), so it weighs the SGD-type candidates; the BERT app's describe an Adam run, so
   it weighs the Adam-type ones (AllReduce-Adam, APMSqueeze, 1-bit LAMB, 0/1 Adam). The record lists the
   others as left out.

The choice, why, what was measured and the five fastest predictions go into the run's ``start`` record
(``"auto"``) of ``metrics.jsonl``, and one console line says it. A run resumed with ``--algorithm auto``
takes the choice its ``start`` record holds instead of choosing again (measurements vary; the checkpoint
belongs to one method). No candidate within the tolerance, or a negative tolerance, is refused in one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import random

import numpy as np
import torch

from ..algorithms import ALGORITHMS
from ..algorithms.base import AlgorithmConfig
from ..comm import raise_together
from ..net import parse_net
from ..plan.accuracy import IMAGE
from ..plan.choose import plan_choice
from ..plan.measure import median_pass_seconds
from .device import to_device
from .metrics import read_metrics
from .options import accepted_options, add_config_options, settle_app_defaults

__all__ = ["AUTO", "add_auto_options", "choose_algorithm"]

AUTO = "auto"
"""The ``--algorithm`` value that asks the apps to choose."""

def add_auto_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``--algorithm auto``: the base options every method shares, the tolerance, the network."""
    from ..plan.accuracy import NOISE_POINTS

    group = parser.add_argument_group("auto options", "pick the fastest method for this job (mpicomm plan)")
    add_config_options(group, AlgorithmConfig)
    group.add_argument("--auto-tolerance", type=float, default=NOISE_POINTS, metavar="POINTS",
                       help=f"accuracy points the chosen method may cost against the baseline, as measured in "
                            f"docs/results (default {NOISE_POINTS}: the seed-to-seed noise)")
    group.add_argument("--auto-net", default="", metavar="SETTING",
                       help="plan for this network (BANDWIDTH,LATENCY, a name, or intra=...,inter=...) instead of "
                            "--net or a probe of the real transport")


def choose_algorithm(args: argparse.Namespace, comm, task, console, total_steps: int = 0) -> dict:
    """Collective: choose the method, set ``args.algorithm`` and its options on ``args``; return the record.

    ``comm``: the run's :class:`~mpicomm.comm.Communicator`; ``task``: the built app task (model, batches);
    ``total_steps``: the run's length, which the apps give the methods that derive a schedule from it (the
    1-bit family's warm-up), so that their options are judged as they will be built.
    """
    error = None
    try:
        parse_net(args.auto_net)
    except ValueError as exc:
        error = ValueError(f"--auto-net: {str(exc).removeprefix('--net: ')}")
    raise_together(comm, error)
    recorded = _recorded_choice(args, comm)
    if recorded:
        record = dict(recorded, resumed=True)
    else:
        net, source = (args.auto_net, "--auto-net") if args.auto_net else (args.net, "--net") if args.net \
            else ("", "")
        record = plan_choice(task.model, comm, _step_time(task, comm), net, args.auto_tolerance,
                             batch_size=args.batch_size, overlap=args.precision != "fp16", net_source=source,
                             who="--algorithm auto", flag="--auto-tolerance", task=getattr(task, "family", IMAGE))
    args.algorithm = record["algorithm"]
    config_class = ALGORITHMS[args.algorithm].config_class
    derived = {"total_steps": total_steps} if total_steps and "total_steps" in {
        f.name for f in dataclasses.fields(config_class)} else {}
    options = accepted_options(args.algorithm, {**record["options"], **derived},
                               {f.name: getattr(args, f.name) for f in dataclasses.fields(AlgorithmConfig)})
    for key in derived:
        options.pop(key, None)  # the apps give it when they build the method
    defaults = {f.name: f.default for f in dataclasses.fields(config_class)}
    for field in dataclasses.fields(AlgorithmConfig):  # a shared option the choice refuses takes its default
        setattr(args, field.name, options.pop(field.name, defaults[field.name]))
    for key, value in options.items():
        setattr(args, key, value)
    settle_app_defaults(args, args.algorithm, getattr(args, "typed_options", []))  # e.g. the method's own --lr
    how = "the run's earlier choice" if record.get("resumed") else record["reason"]
    if console is not None:
        console.info(f"--algorithm auto: {record['algorithm']} ({record['label']}); {how}; network {record['net']} "
                     f"({record['net_source']}), compute {1e3 * record['step_time_s']:.1f} ms per step")
        if record.get("accuracy_note"):
            console.info(f"--algorithm auto: {record['accuracy_note']}")
    return record


def _recorded_choice(args: argparse.Namespace, comm) -> dict | None:
    """The choice in the ``start`` record of the run ``--resume`` continues (rank 0 reads it), or None."""
    found = None
    if comm.rank == 0 and args.resume and args.out_dir:
        path = os.path.join(args.out_dir, "metrics.jsonl")
        if os.path.isfile(path):
            starts = [r for r in read_metrics(path) if r.get("event") == "start" and r.get("auto")]
            found = starts[-1]["auto"] if starts else None
    return comm.bcast_object(found, 0, "the earlier automatic choice")


def _step_time(task, comm) -> float:
    """Collective: the slowest rank's median seconds of a forward and backward pass of the task's loss."""
    model = task.model
    device = next(model.parameters()).device
    # timing leaves no trace: the generators (dropout, masking, augmentation) and the buffers are put back
    states = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    buffers = [b.detach().clone() for b in model.buffers()]
    batches = list(itertools.islice(task.train_batches(0, 0), 4))

    def one(batch) -> None:
        loss, _ = task.loss(model, to_device(batch, device))
        loss.backward()

    mine = median_pass_seconds([functools.partial(one, batch) for batch in batches], device)
    torch.random.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])
    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), buffers):
            buffer.copy_(saved)
    model.zero_grad(set_to_none=True)
    return max(comm.allgather_object(mine, "the step-time measurement"))
