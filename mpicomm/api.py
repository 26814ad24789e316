"""The library in a few lines: what a Horovod or DDP user expects, on top of the algorithms.

    import mpicomm
    job = mpicomm.init()                                    # MPI, this rank's device, one-line errors
    model = Net().to(job.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algo = mpicomm.wrap(model, optimizer, "moniqua", topology="ring", bits=1)
    for x, y in loader:                                     # loader with mpicomm.sampler(dataset)
        algo.zero_grad()
        loss_fn(model(x), y).backward()
        algo.step()                                         # communicates, then steps your optimizer
    with algo.averaged_model() as averaged:                 # every rank: the average of all ranks' models
        evaluate(averaged)
    mpicomm.save("runs/a", algo, step=100, scheduler=scheduler.state_dict())   # every rank's state, HDF5
    step, extra = mpicomm.restore("runs/a", algo)           # a later job: on from the latest checkpoint

:func:`init` also installs how errors end a job: an error every rank raised alike (a bad option, a
checkpoint that cannot be used) is printed once, by rank 0, in one line, and every rank exits with
status 2. A mistake in the loop that a rank finds on its own (:class:`~mpicomm.errors.ScriptError`: a
parameter re-homed after ``wrap``, ``optimizer.step()`` outside ``algo.step()``) is one line as well, and
exit 2: from rank 0 when every rank made it, else from each rank that did. Any other uncaught exception
prints that rank's traceback and aborts the whole job, so no rank is left waiting in a collective.

What ``wrap`` keeps in step, as DDP does: every parameter (trainable or frozen) and every buffer starts
equal to rank 0's; the trainable ones are averaged or mixed by the algorithm, the frozen ones and the
buffers are saved and restored, and ``averaged_model()`` averages the floating-point buffers too. The
parameters must be float32 (or float64): half precision is for the compute, under ``torch.autocast``
(``model.half()`` after ``wrap`` is one line at the next step, as is a parameter group added to the optimizer
then). A parameter that got no gradient in a step is not stepped by your optimizer, as with DDP's
``find_unused_parameters=True``: centralized methods agree on it over the ranks (one used on some ranks only
is stepped with the average, the others counting zero), the others decide on each rank
(:meth:`~mpicomm.algorithms.base.Algorithm.use_optimizer`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # importing mpicomm.comm starts MPI: init() does it, not ``import mpicomm``
    from .comm import World

__all__ = ["Job", "init", "restore", "sampler", "save", "wrap"]


@dataclass(frozen=True)
class Job:
    """This process's place in the job: ``rank`` of ``size``, ``local_rank`` on its node, its ``device``."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    world: World  # every rank: rank, size, allgather_object; its ``comm`` is mpi4py's, for those who want it


_JOB: Job | None = None


def _excepthook(kind, value, tb) -> None:
    """Agreed errors and script errors: one line, exit 2; anything else: this rank's traceback, then abort."""
    from .comm import world
    from .comm.failfast import abort_with_line, settle_local_error
    from .errors import ScriptError, agreed_of, one_line

    job = world()
    if isinstance(value, ScriptError):
        line, everyone = settle_local_error(one_line(str(value)))
        if line:
            sys.stderr.write(f"mpicomm: error: {line}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        if not everyone:  # the others may wait in a collective: end them, with this exit status
            abort_with_line(2)
        os._exit(2)
    mark = agreed_of(value)
    if mark is not None:
        if job.rank == 0:
            sys.stderr.write(f"mpicomm: error: {mark.describe()}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    sys.stderr.write(f"[rank {job.rank}] uncaught exception; aborting the job\n")
    traceback.print_exception(kind, value, tb)
    sys.stderr.flush()
    if job.size > 1:
        job.abort(1)
    os._exit(1)


def init(device: str = "auto", errors: bool = True) -> Job:
    """Start (or join) the MPI job: this rank's :class:`Job`; idempotent.

    ``device``: ``auto`` (``cuda:{local_rank % GPUs}`` when CUDA is available, else the CPU), ``cpu``,
    ``cuda`` or ``cuda:N``; a CUDA device is made current. ``errors``: install the job-wide error handling
    described in the module docstring (``sys.excepthook``), first, so that a bad ``device`` or a bad
    ``MPICOMM_*`` environment variable is already one line.
    """
    global _JOB
    if errors:
        sys.excepthook = _excepthook
    if _JOB is None:
        from .comm import node_layout, raise_together, world
        from .comm.failfast import prepare_local_errors
        from .training.device import select_device

        comm = world()
        local, _ = node_layout(comm)
        chosen, error = None, None
        try:
            _check_environment()
            chosen = select_device(device, local, named="mpicomm.init(device='{}')")
        except ValueError as exc:
            error = exc
        raise_together(comm, error)
        prepare_local_errors(comm)
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        _JOB = Job(comm.rank, comm.size, local, chosen, comm)
    return _JOB


def _check_environment() -> None:
    """Raise ``ValueError`` naming the first ``MPICOMM_*`` environment variable with a value mpicomm cannot use."""
    from .comm import query_cuda_aware
    from .comm.guard import hang_timeout_from_env, signal_grace_from_env
    from .comm.nodes import ranks_per_node_setting
    from .comm.progress import progress_mode

    hang_timeout_from_env()
    signal_grace_from_env()
    ranks_per_node_setting()
    progress_mode()
    if os.environ.get("MPICOMM_CUDA_AWARE") is not None:
        query_cuda_aware()


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, algorithm: str = "allreduce_sgd",
         *, topology: str = "ring", net: str | None = None, **options):
    """Collective: ``algorithm`` (a name of :data:`mpicomm.algorithms.ALGORITHMS`) around ``model`` on every rank.

    ``optimizer``: your ``torch.optim`` optimizer over ``model``'s parameters, used as the local step (None:
    the algorithm's built-in one from ``lr``, ``momentum``, ``weight_decay``). ``topology``: the graph the
    decentralized methods gossip on (``ring``, ``torus``, ``exponential``, …). ``net``: a network to model
    on top of the real transfers (``"1gbit,100us"``). ``options``: the algorithm's own (``bits=1``, …).
    Every rank must call it with the same arguments; a bad one is the same one-line error on every rank.

    ``algorithm="auto"`` lets the planner choose (``mpicomm plan``; :mod:`mpicomm.plan.choose`): give
    ``step_time=`` (seconds of one forward and backward pass of your step) and optionally ``tolerance=``
    (accuracy points, default 0.3), ``task=`` (``"image"``, the default, or ``"masked-lm"``: whose measured
    accuracy costs apply, and without your optimizer whether SGD-type or Adam-type methods qualify) and the
    options every method shares (``lr``, ``momentum``, …). The network is ``net`` if given, else a probe of the
    transport. With your optimizer only methods that take it qualify.
    The returned algorithm's ``auto_choice`` holds the choice, why and what was measured.
    """
    from . import topology as topologies
    from .algorithms import make_algorithm
    from .comm import Communicator, raise_together

    job = _JOB or init()
    graph, spec, error = None, None, None
    try:
        graph = topologies.build(topology, job.size)
        spec = _net_setting(net)
        if algorithm == "auto":
            auto, options = _auto_request(options)
    except (ValueError, TypeError) as exc:
        error = exc
    raise_together(job.world, error)
    comm = Communicator(job.world, graph, net=spec)
    if algorithm != "auto":
        return make_algorithm(algorithm, model, comm, optimizer=optimizer, **options)
    from .plan.choose import plan_choice
    from .training.options import accepted_options

    record = plan_choice(model, comm, auto["step_time"], net or "", auto["tolerance"],
                         user_optimizer=optimizer is not None, net_source="net=" if net else "", task=auto["task"])
    chosen = accepted_options(record["algorithm"], record["options"], options)
    algo = make_algorithm(record["algorithm"], model, comm, optimizer=optimizer, **chosen)
    algo.auto_choice = record
    if job.rank == 0:
        logging.getLogger("mpicomm").info("algorithm='auto': %s (%s); %s", record["algorithm"], record["label"],
                                          record["reason"])
    return algo


def _net_setting(net):
    """``wrap``'s ``net`` parsed (None: no model), or ``ValueError`` naming ``net`` and what it expects."""
    from .net import NetLinks, NetSpec, parse_net

    if net is None or isinstance(net, (NetSpec, NetLinks)):
        return net
    if not isinstance(net, str):
        raise ValueError(f"net must be a string such as '1gbit,100us' (or None), got {type(net).__name__} {net!r}")
    try:
        return parse_net(net)
    except ValueError as exc:
        raise ValueError(f"net={net!r}: {str(exc).removeprefix('--net: ')}") from None


def _auto_request(options: dict) -> tuple[dict, dict]:
    """``wrap(..., "auto", step_time=S, tolerance=T, **shared)``: (the request, the shared options), or
    ``ValueError`` naming what is missing or not taken."""
    from .algorithms.base import AlgorithmConfig
    from .plan.accuracy import IMAGE, NOISE_POINTS, TASKS

    options = dict(options)
    request = {"step_time": options.pop("step_time", None), "tolerance": options.pop("tolerance", NOISE_POINTS),
               "task": options.pop("task", IMAGE)}
    shared = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    extra = sorted(set(options) - shared)
    if extra:
        raise ValueError(f"algorithm='auto' takes step_time, tolerance, task and the options every method shares "
                         f"({', '.join(sorted(shared))}); got {', '.join(extra)}")
    if request["task"] not in TASKS:
        raise ValueError(f"algorithm='auto': task must be one of {', '.join(map(repr, TASKS))}, "
                         f"got {request['task']!r}")
    step_time = request["step_time"]
    if isinstance(step_time, bool) or not isinstance(step_time, (int, float)) or not 0 < step_time < float("inf"):
        raise ValueError("algorithm='auto' needs step_time=SECONDS > 0 and finite: the compute of one forward and "
                         f"backward pass of your training step (time a few steps of your loop); got {step_time!r}")
    return request, options




def sampler(dataset, *, shuffle: bool = True, seed: int = 0):
    """A ``torch.utils.data.DistributedSampler`` for this rank: its share of ``dataset``, as many samples on every
    rank (``drop_last``: the ranks take equal numbers of steps, which synchronous methods need). Call its
    ``set_epoch(epoch)`` at every epoch for a fresh order."""
    from torch.utils.data import DistributedSampler

    job = _JOB or init()
    return DistributedSampler(dataset, num_replicas=job.size, rank=job.rank, shuffle=shuffle, seed=seed,
                              drop_last=True)


def save(directory, algo, step: int, keep_last: int | None = 2, **extra) -> str:
    """Collective: commit a checkpoint of every rank as ``directory/step-<step>`` (atomic; HDF5, one file per rank).

    It holds the algorithm's whole state (parameters, frozen ones too, optimizer, error buffers, replicas,
    …), the model's buffers, every global random generator and ``extra`` (tensors, numbers, strings, nested
    dicts: e.g. a scheduler's ``state_dict()``), so that :func:`restore` continues bit for bit. Older
    checkpoints beyond ``keep_last`` are removed. Returns the checkpoint's path. Refused (one line, every
    rank) between the micro-batches of an accumulated step (``algo.pending_micro_batches``): their summed
    gradient is not part of the state.
    """
    from .checkpoint import capture_rng_state, run_meta, save_checkpoint
    from .comm import raise_together

    pending = algo.pending_micro_batches
    raise_together(algo.comm, None if not pending else ValueError(
        f"save: {pending} micro-batch(es) of an accumulated step are pending (algo.accumulate); their summed "
        "gradient is not checkpointed, so save right after the step that updates (pending_micro_batches == 0)"))
    algo.check_model("state_dict()")
    state = {"algorithm": algo.state_dict(), "rng": capture_rng_state(algo.flat.data.device),
             "buffers": {name: b.detach().clone() for name, b in algo.model.named_buffers()}, "extra": extra}
    return str(save_checkpoint(directory, algo.comm, state, step=step, meta=run_meta(algo.comm, algo),
                               keep_last=keep_last))


def restore(path, algo) -> tuple[int, dict]:
    """Collective: load :func:`save`'s checkpoint into ``algo`` (a run directory: its latest); ``(step, extra)``.

    The checkpoint must come from the same algorithm and model (parameter names and shapes, frozen ones and
    buffers), and ``algo`` must have the checkpoint's topology, options (``lr`` and the algorithm's own, as
    given to ``wrap``) and optimizer (type and parameter groups' options but the lr): anything else is the
    same one-line error on every rank, listing each difference. The current lr (a scheduler's) comes from
    the checkpoint. Tensors land on the device of ``algo``'s parameters.

    A checkpoint of another world size N continues at this job's size M: every rank reads the N saved
    states and builds its own by the algorithm's family rule (:meth:`~mpicomm.algorithms.base.Algorithm.
    reshard_state`; docs/checkpoints.md, Another world size); ``extra`` is old rank r's for r < N, rank 0's
    for the ranks past N. A method that cannot continue at another size is one line naming it.
    """
    from pathlib import Path

    from .checkpoint import latest_checkpoint, load_checkpoint, map_location, restore_rng_state
    from .checkpoint.compatibility import settings_differences, signature_mismatch
    from .comm import raise_together

    where = Path(path)
    if where.is_dir() and not (where / "checkpoint.h5").exists():
        where = latest_checkpoint(where) or where
    state, meta = load_checkpoint(where, algo.comm, expect={"algorithm": {"name": algo.name}}, any_size=True)
    resized = isinstance(state, list)
    problem = signature_mismatch(str(meta.get("model_signature", "")), repr(algo.flat.signature()))
    differ = settings_differences(meta, algo)
    saved_buffers, buffers = (state[0] if resized else state)["buffers"], dict(algo.model.named_buffers())
    if not problem and differ:
        problem = ("this job's settings differ from those it was saved with: " +
                   ", ".join(f"{key}={now!r} (the checkpoint's: {then!r})" for key, now, then in differ) +
                   "; wrap with the checkpoint's settings to continue it")
    if not problem and set(saved_buffers) != set(buffers):
        problem = f"its buffers {sorted(saved_buffers)} are not the model's {sorted(buffers)}"
    raise_together(algo.comm, ValueError(f"cannot restore {where}: {problem}") if problem else None)
    if resized:
        return int(meta["step"]), _restore_resized(where, state, algo, int(meta["step"]))
    device = algo.flat.data.device
    state = map_location(state, device)
    algo.load_state_dict(state["algorithm"])
    with torch.no_grad():
        for name, value in state["buffers"].items():
            buffers[name].copy_(value)
    restore_rng_state(state["rng"], device)
    return int(meta["step"]), state.get("extra", {})


def _restore_resized(where, states: list, algo, step: int) -> dict:
    """Collective: load the N saved ``states`` into ``algo`` at this job's size; this rank's ``extra``."""
    from .checkpoint.resize import load_resized
    from .comm import raise_together

    error, mine = None, None
    try:
        mine = load_resized(states, algo, step)
    except ValueError as exc:
        error = ValueError(f"cannot restore {where} at {algo.comm.size} ranks (saved at {len(states)}): {exc}")
    raise_together(algo.comm, error)
    return mine.get("extra", {})
