"""Command-line arguments every training app shares, and the set-up they drive.

``app_parser`` adds the loop's options (epochs, schedule, checkpoints, …), ``--algorithm`` and
``--topology``, ``--accumulate``, ``--clip-grad-norm`` and ``--no-decay-bias-norm``; ``parse_app_args``
parses in two passes so the chosen algorithm's own options
(generated from its config dataclass) are accepted and shown in ``--help``; ``setup_run`` builds the
communicator and the algorithm, turning any configuration error into the same message on every rank.
``run_settings`` lists the shared options a run's trajectory depends on, which a resume compares
(:mod:`.resume`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys

import numpy as np
import torch

from .. import topology
from ..algorithms import ALGORITHMS, make_algorithm
from ..comm import Communicator, raise_together
from ..comm.guard import DEFAULT_HANG_TIMEOUT_S
from ..net import NAMED, parse_net
from .auto import AUTO, add_auto_options, choose_algorithm
from .device import place, place_task
from .loop import LR_SCALINGS, TrainConfig, agree_steps_per_epoch
from .options import add_algorithm_options, config_kwargs, foreign_option, settle_app_defaults
from .pace import ASYNC_ONLY
from .param_groups import app_optimizer
from .precision import PRECISIONS
from .recovery import ON_RANK_LOSS, Recovery, check_on_rank_loss
from .rundir import RunLock, claim_out_dir
from .tensorboard import require_tensorboard

__all__ = ["MAX_SLOWDOWN", "OptionRefused", "accept_args", "app_parser", "derived_options", "fractions",
           "parse_app_args", "run_settings", "seed_everything", "setup_run", "train_config"]


class OptionRefused(ValueError):
    """An option the command line cannot take, refused before anything starts (the app prints one line)."""


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after an option's help only where X says something: not for an empty or unset default
    (the help says what that means), a flag's False, or a help that names its default already."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, "", False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def app_parser(description: str, default_algorithm: str, epochs: int) -> argparse.ArgumentParser:
    """A parser with the options shared by every app (the app adds its own data/model options)."""
    p = argparse.ArgumentParser(description=description, formatter_class=DefaultsHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--algorithm", default=default_algorithm,
                   help=f"one of {', '.join(sorted(ALGORITHMS))}, or auto: the fastest for this job's model, "
                        "ranks and network (mpicomm plan), within --auto-tolerance accuracy points")
    p.add_argument("--topology", default="ring", help=f"one of {', '.join(sorted(topology.TOPOLOGIES))}")
    p.add_argument("--net", default="", help="model this network on top of the real transfers: BANDWIDTH,LATENCY "
                   f"such as 1gbit,100us, or one of {', '.join(NAMED)}, or intra=SETTING,inter=SETTING for the "
                   "links inside and between nodes, e.g. intra=nvlink,inter=10gbit,5us (empty: no model)")
    p.add_argument("--epochs", type=int, default=epochs, help="passes over the training set (see --max-steps)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: run all epochs)")
    p.add_argument("--lr-schedule", default="cosine", choices=["constant", "step", "cosine"],
                   help="the learning rate over the run: constant, step (times --lr-gamma at --milestones) or cosine "
                        "(to 0 at the end)")
    p.add_argument("--lr-warmup-steps", type=int, default=0, help="linear learning-rate warm-up (steps)")
    p.add_argument("--milestones", type=fractions, default=(0.5, 0.75),
                   help="step schedule: fractions of the run where lr is multiplied by --lr-gamma")
    p.add_argument("--lr-gamma", type=float, default=0.1, help="step schedule: the factor at each milestone")
    p.add_argument("--log-every", type=int, default=10, help="steps between metrics lines")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: each epoch)")
    p.add_argument("--eval-bn-batches", type=int, default=8, metavar="N",
                   help="BatchNorm statistics of the averaged model are recomputed from N training batches per "
                        "rank before it is evaluated (0: use rank 0's running statistics)")
    p.add_argument("--out-dir", default="", help="metrics.jsonl and checkpoints go here")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="also write the metrics as TensorBoard scalars into DIR (needs the tensorboard extra)")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: none)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    p.add_argument("--resume", default="", help="'latest' (in --out-dir) or a checkpoint path")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the metrics and checkpoints of an earlier run in --out-dir and start over "
                        "(without it, a fresh run into a directory holding a run is refused)")
    p.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                   help="end the job with one line when a rank waits this long in a collective (0: never; "
                        f"default: MPICOMM_HANG_TIMEOUT, else {DEFAULT_HANG_TIMEOUT_S:g})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--slow-ranks", type=slowdowns, default=(), metavar="RANK:FACTOR,...",
                   help="make these ranks' compute FACTOR times slower (each step sleeps (FACTOR - 1) x its "
                        "forward and backward time): a straggler, for measuring what a slow rank costs")
    p.add_argument("--free-running", action="store_true",
                   help="asynchronous methods (adpsgd, moniqua_adpsgd): each rank steps at its own pace and the "
                        "ranks share the run's steps (a fast rank takes more of them), instead of lockstep")
    p.add_argument("--lr-scaling", default="none", choices=LR_SCALINGS,
                   help="on a resume at another world size: none keeps the learning rate; linear multiplies it by "
                        "ranks now / ranks the run began with (the global batch changed by that factor)")
    p.add_argument("--on-rank-loss", default="stop", choices=ON_RANK_LOSS,
                   help="stop: a lost rank ends the job (resume from the last checkpoint); continue: the survivors "
                        "go on from the last step (needs the fault-tolerant stack: scripts/ft_run.sh)")
    p.add_argument("--min-ranks", type=int, default=1, metavar="N",
                   help="with --on-rank-loss continue: end the job when fewer than N ranks are left")
    p.add_argument("--stop-at-step", type=int, default=0,
                   help="behave as if SIGUSR1 arrived after this step: checkpoint and stop (0: never)")
    p.add_argument("--device", default="auto", help="auto (cuda:{local rank %% GPUs} if CUDA is available, "
                   "else cpu), cpu, cuda or cuda:N")
    p.add_argument("--accumulate", type=int, default=1, metavar="N",
                   help="sum the gradients of N batches per update (one update = N batches of --batch-size)")
    p.add_argument("--clip-grad-norm", type=float, default=0.0, metavar="C",
                   help="clip the gradient to 2-norm C (centralized algorithms: the averaged one; 0: off)")
    p.add_argument("--no-decay-bias-norm", action="store_true",
                   help="no weight decay on biases and norm weights (a torch optimizer with two parameter groups)")
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)} (bf16/fp16: autocast; "
                   "fp16 with a loss scale agreed across ranks)")
    return p


def fractions(text: str) -> tuple[float, ...]:
    """``"0.5,0.75"`` -> ``(0.5, 0.75)``: argparse's type for ``--milestones``."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions of the run such as 0.5,0.75, "
                                         f"got {text!r}") from None


MAX_SLOWDOWN = 1000.0
"""The largest ``--slow-ranks`` factor: a rank 1000 times slower is already a stalled one (and an infinite
factor cannot be slept)."""


def slowdowns(text: str) -> tuple[tuple[int, float], ...]:
    """``"3:2,5:4"`` -> ``((3, 2.0), (5, 4.0))``: argparse's type for ``--slow-ranks`` (rank:factor pairs)."""
    try:
        pairs = tuple((int(rank), float(factor)) for rank, factor in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:FACTOR pairs such as 3:2 or 3:2,5:4, got {text!r}") from None
    if any(rank < 0 or not 1 <= factor <= MAX_SLOWDOWN for rank, factor in pairs):
        raise argparse.ArgumentTypeError(f"ranks must be >= 0 and factors >= 1 (at most {MAX_SLOWDOWN:g}), "
                                         f"got {text!r}")
    return pairs


def parse_app_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse twice: first to learn ``--algorithm``, then with that algorithm's options added.

    An option of other algorithms that the chosen one lacks (``--overlap`` with ``dcd``) raises
    :class:`OptionRefused` naming it, instead of argparse's usage block.
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--algorithm", default=parser.get_default("algorithm"))
    known, _ = pre.parse_known_args(argv)
    if known.algorithm == AUTO:
        add_auto_options(parser)
    else:
        add_algorithm_options(parser, known.algorithm)
    typed = sys.argv[1:] if argv is None else list(argv)
    problem = foreign_option(parser, known.algorithm, typed)
    if problem:
        raise OptionRefused(problem)
    args = parser.parse_args(argv)
    if known.algorithm != AUTO:
        settle_app_defaults(args, known.algorithm, typed)
    else:  # settled once the method is chosen (choose_algorithm)
        args.typed_options = [token.split("=", 1)[0] for token in typed if token.startswith("--")]
    return args


def run_settings(args: argparse.Namespace) -> dict:
    """The shared options a run's trajectory depends on, by flag (the app adds its own; see :mod:`.resume`).

    The algorithm's options are compared apart, from its config. ``--milestones`` and ``--lr-gamma``
    count only for the step schedule, which alone reads them.
    """
    out = {"--epochs": args.epochs, "--max-steps": args.max_steps, "--lr-schedule": args.lr_schedule,
           "--lr-warmup-steps": args.lr_warmup_steps, "--accumulate": args.accumulate,
           "--clip-grad-norm": args.clip_grad_norm, "--precision": args.precision}
    if args.lr_schedule == "step":
        out.update({"--milestones": list(args.milestones), "--lr-gamma": args.lr_gamma})
    return out


def derived_options(args: argparse.Namespace) -> frozenset:
    """The algorithm's options the app fills in from the run's length because the user gave none
    (APMSqueeze's ``total_steps``, the base of its warm-up fraction)."""
    fields = {f.name for f in dataclasses.fields(ALGORITHMS[args.algorithm].config_class)}
    return frozenset(name for name in ("total_steps",) if name in fields and getattr(args, name, None) is None)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The loop's config from parsed arguments (the base lr is the algorithm's ``--lr``)."""
    return TrainConfig(
        epochs=args.epochs, max_steps=args.max_steps, lr=args.lr, lr_schedule=args.lr_schedule,
        warmup_steps=args.lr_warmup_steps, milestones=args.milestones, lr_gamma=args.lr_gamma,
        log_every=args.log_every, eval_every=args.eval_every, eval_bn_batches=args.eval_bn_batches,
        out_dir=args.out_dir, save_every=args.save_every,
        keep_last=args.keep_last, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
        stop_at_step=args.stop_at_step, precision=args.precision, tensorboard=args.tensorboard,
        accumulate=args.accumulate, clip_grad_norm=args.clip_grad_norm, hang_timeout=args.hang_timeout,
        slow_ranks=args.slow_ranks, free_running=args.free_running, lr_scaling=args.lr_scaling,
        on_rank_loss=args.on_rank_loss, min_ranks=args.min_ranks,
    )


def seed_everything(seed: int) -> None:
    """Seed torch, numpy's and python's global generators (a resumed run restores them from the checkpoint)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def accept_args(args: argparse.Namespace, size: int, check=None) -> tuple:
    """What a launch of ``size`` ranks refuses in the parsed ``args`` before anything is built: the loop's
    config, the app's own option values (``check(args)``, which raises), a missing TensorBoard, the topology on
    ``size`` ranks, the network and the options that cannot go together. Returns ``(cfg, topology, net)``; raises
    the ``ValueError`` (or ``TypeError``, ``OSError``) whose message the app prints. :func:`setup_run` and
    ``mpicomm slurm check`` both call it, so a checked job is refused with the launch's own line."""
    cfg = train_config(args)
    if check is not None:
        check(args)
    if cfg.tensorboard:
        require_tensorboard()  # on every rank, so that a missing package is one agreed refusal
    check_on_rank_loss(cfg.on_rank_loss, cfg.min_ranks, size)
    topo = topology.build(args.topology, size)
    net = parse_net(args.net)
    if cfg.precision == "fp16" and getattr(args, "overlap", False):
        raise ValueError("--precision fp16 cannot be combined with --overlap: the overlapped exchange "
                         "sends gradients before the loss scale's overflow check; use bf16 or no --overlap")
    return cfg, topo, net


def setup_run(args: argparse.Namespace, world, build, console=None, check=None):
    """Collective over ``world`` (:func:`mpicomm.comm.world`): the topology and communicator, ``--out-dir`` claimed,
    ``build()`` -> task, then the algorithm.

    Any ``ValueError``/``TypeError`` raised on any rank (bad data dir, batch size, option value, an output
    directory in use) becomes the same ``ValueError`` on every rank, so the app can print it once and
    exit non-zero, no hang. ``check(args)``: the app's own option values, refused first (:func:`accept_args`).
    Returns ``(task, algo, cfg, lock)``: ``lock`` holds ``--out-dir`` until released.
    """
    error, cfg, topo, net = None, None, None, None
    device = place(args.device, world)  # before anything is built: a device error trains nothing
    seed_everything(1_000_003 * args.seed + world.rank)  # dropout, augmentation: reproducible per rank
    try:
        cfg, topo, net = accept_args(args, world.size, check)
    except (ValueError, TypeError, OSError) as exc:
        error = exc
    raise_together(world, error)
    comm = Communicator(world, topo, net=net)
    lock = claim_out_dir(comm, cfg.out_dir, resume=cfg.resume, overwrite=cfg.overwrite) if cfg.out_dir \
        else RunLock(None)
    try:
        return (*_build(args, comm, cfg, device, build, console), lock)
    except BaseException:
        lock.release()
        raise


def recovery_for(args: argparse.Namespace, cfg: TrainConfig, world, build_task, console=None,
                 replace: list[str] | None = None) -> Recovery | None:
    """Collective: the :class:`~.recovery.Recovery` of a run with ``--on-rank-loss continue`` or ``replace`` (None
    with ``stop``); ``replace``: the command a replacement process runs (the app's own)."""
    if cfg.on_rank_loss == "stop":
        return None
    return Recovery(world, rebuilder(args, build_task, console), cfg.min_ranks,
                    replace if cfg.on_rank_loss == "replace" else None)


def rebuilder(args: argparse.Namespace, build_task, console=None):
    """``rebuild(world)`` for :class:`~.recovery.Recovery`: the run rebuilt on the world of the survivors (and any
    replacements) exactly as :func:`setup_run` built it: the topology and communicator at its size,
    ``build_task(args, rank, size)`` (this rank's data shard), the algorithm (``--algorithm auto``: the one chosen
    at the start, which set ``args.algorithm``). Collective over that world."""

    def rebuild(survivors):
        again = argparse.Namespace(**vars(args))
        device = place(again.device, survivors)
        new_cfg, topo, net = accept_args(again, survivors.size)
        comm = Communicator(survivors, topo, net=net)
        task, algo, _ = _build(again, comm, new_cfg, device,
                               lambda: build_task(again, survivors.rank, survivors.size), console)
        return task, algo

    return rebuild


def _build(args, comm, cfg, device, build, console):
    """The rest of :func:`setup_run`, once the run owns its output directory: (task, algo, cfg)."""
    error, task = None, None
    try:
        if cfg.tensorboard and comm.rank == 0:
            _check_writable(cfg.tensorboard, "--tensorboard")
        task = build()
        place_task(task, device)
    except (ValueError, TypeError, OSError) as exc:
        error = exc
    raise_together(comm, error)
    steps_per_epoch = agree_steps_per_epoch(task, comm, console)
    raise_together(comm, _error_of(cfg.check_total, steps_per_epoch))
    if args.algorithm == AUTO:
        args.auto_choice = choose_algorithm(args, comm, task, console, cfg.total_steps(steps_per_epoch))
        cfg = dataclasses.replace(cfg, lr=args.lr)  # the chosen method's --lr (its family's) drives the schedule
    options = config_kwargs(args, args.algorithm)
    if "total_steps" in derived_options(args):
        options["total_steps"] = cfg.total_steps(steps_per_epoch)  # e.g. APMSqueeze's warm-up fraction
    optimizer = None
    if getattr(args, "no_decay_bias_norm", False):
        try:
            optimizer = app_optimizer(args.algorithm, task.model, options)
        except (ValueError, TypeError) as exc:
            error = exc
        raise_together(comm, error)
    algo = make_algorithm(args.algorithm, task.model, comm, optimizer=optimizer, **options)
    try:
        algo.accumulate(cfg.accumulate)
        algo.clip_grad_norm_(cfg.clip_grad_norm or None)
        if cfg.free_running and not algo.asynchronous:
            raise ValueError(ASYNC_ONLY.format(name=algo.name))
    except ValueError as exc:
        error = exc
    raise_together(comm, error)
    return task, algo, cfg


def _error_of(check, *args) -> Exception | None:
    """The ``ValueError`` ``check(*args)`` raises, or None."""
    try:
        check(*args)
    except ValueError as exc:
        return exc
    return None


def _check_writable(directory: str, option: str) -> None:
    """Raise ``ValueError`` naming ``option`` unless ``directory`` is (or can be made) a writable directory."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{option} {directory} is a file, not a directory")
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{option} {directory} cannot be written: {exc.strerror or exc}") from None
