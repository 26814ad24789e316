"""The loop's options and what it asks of an app: :class:`TrainConfig`, the :class:`Task` protocol, the agreed epoch.

:class:`TrainConfig` checks its options at construction (one line naming the option); :func:`agree_steps_per_epoch`
makes every rank take the same batches per epoch, so the run's total and its events are the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..comm import raise_together
from .console import Console
from .precision import PRECISIONS

__all__ = ["LR_SCALINGS", "Task", "TrainConfig", "agree_steps_per_epoch", "crossed"]

LR_SCALINGS = ("none", "linear")
"""``--lr-scaling``: after a resume at another world size, keep the learning rate, or scale it with the ranks."""


class Task(Protocol):
    """What an app provides. ``train_batches(epoch, start)`` must be deterministic given (seed, rank, epoch).

    ``steps_per_epoch``: the batches one epoch offers on this rank; :func:`agree_steps_per_epoch` sets it to
    the number every rank takes (the smallest any rank offers), and ``train_batches`` must yield at least that.
    An optional ``family`` names the task family for ``--algorithm auto`` (``"image"`` without one, or
    ``"masked-lm"``; :data:`mpicomm.plan.accuracy.TASKS`).
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
    on_rank_loss: str = "stop"
    min_ranks: int = 1

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
        if self.on_rank_loss != "stop" and self.free_running:
            raise ValueError(f"--on-rank-loss {self.on_rank_loss} cannot be combined with --free-running (recovery "
                             "continues from the last step every rank committed, and free-running ranks commit none)")
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
        """Raise ``ValueError`` naming the options when the run would have no update at all, or a learning-rate
        warm-up as long as the run."""
        total = self.total_steps(steps_per_epoch)
        if total < 1:
            raise ValueError(f"--accumulate {self.accumulate} needs more batches than the run has: --epochs "
                             f"{self.epochs} x {steps_per_epoch} batches per epoch make "
                             f"{self.epochs * steps_per_epoch}; lower --accumulate or raise --epochs")
        if self.warmup_steps >= total:
            raise ValueError(f"--lr-warmup-steps {self.warmup_steps} must be below the run's {total} steps (the "
                             "learning rate would never leave its warm-up); lower it or train longer")


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
