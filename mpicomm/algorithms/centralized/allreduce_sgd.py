"""AllReduce-SGD: the exact average of all ranks' gradients, then a local SGD step (what DDP/Horovod do).

Update at step t on every rank (g_i the stochastic gradient of rank i at the shared iterate x)::

    g   = (1/n) * allreduce_sum(g_i)               (one allreduce of the flat fp32 gradient)
    g  <- g + weight_decay * x                     (x is the same everywhere, so decay is not sent)
    m  <- mu * m + g;  x <- x - alpha * m          (torch.optim.SGD; plain SGD when mu = 0)

With a user optimizer (``optimizer=opt``) the last line is ``opt.step()`` on the averaged gradient (its
groups' lr, weight decay and state; g is not decayed here). ``clip_grad_norm_`` clips the averaged g
(before weight decay), the same on every rank. With ``accumulate(N)`` the summed micro-batch gradients
are divided by N after the allreduce when overlapping (the hooks only launch during the last
micro-batch's backward), before it otherwise.

Every rank applies the same update to the same x, so the parameters stay identical on all ranks.
Traffic per step: one allreduce of 4d bytes (booked as 2(n-1)/n * 4d sent per rank).

``overlap=True`` starts the allreduce of gradient *buckets* while backward is still running: the
flat gradient is cut into contiguous buckets of whole parameters, in reverse layer order (the order
backward produces them), the first of at least ``first_bucket_numel`` elements and the others of at
least ``bucket_numel`` (as DDP: a 1 MiB first bucket starts communication as soon as the last layers
have their gradients, 25 MiB after it keeps the number of collectives small); a
``register_post_accumulate_grad_hook`` on each parameter counts down its bucket and, when a bucket is
complete, ``iallreduce``-s its slice (:class:`~mpicomm.algorithms.buckets.GradBuckets`).
Buckets are launched strictly in bucket order (a complete bucket
waits for the ones before it), so every rank issues the same collectives in the same order even if
its hooks fire in another order; ``step()`` launches any bucket still incomplete (parameters that got
no gradient) and waits for all. The sums are the same element-wise sums as the single allreduce,
so the result is bit-identical whenever MPI adds the n contributions of an element in the same
order for a slice as for the whole vector: always for n <= 2 (commutativity), and for MPICH, whose
allreduce adds in recursive-doubling order at every message size (see ``allgather_sum``). overlap
supports one backward pass per step outside ``accumulate``: a hook that runs before accumulation
refuses a second gradient with a RuntimeError, leaving the first intact.
With MPICH's default (no asynchronous progress thread) a pending iallreduce advances inside MPI
calls: each hook polls the newest one, and ``MPICH_ASYNC_PROGRESS=1`` lets it advance on its own.

This is the full-precision baseline of the centralized family: ``compressed_sgd`` with the identity
codec reproduces it bit for bit (see ``compressed_sgd``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Algorithm, clone_optimizer_state
from .buckets import GradBuckets, LaunchedTraffic, OverlapConfig
from .registry import register

__all__ = ["AllReduceSGD", "AllReduceSGDConfig"]


@dataclass(frozen=True)
class AllReduceSGDConfig(OverlapConfig):
    """overlap: allreduce gradient buckets during backward (bucket sizes: see OverlapConfig)."""


@register
class AllReduceSGD(LaunchedTraffic, Algorithm):
    """Exact gradient averaging by allreduce, then local (momentum) SGD; parameters identical on all ranks."""

    name = "allreduce_sgd"
    config_class = AllReduceSGDConfig
    centralized = True
    clips_average = True
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.optimizer = self._local_sgd()
        self.buckets = (GradBuckets(self, self.config.bucket_numel, self.config.first_bucket_numel,
                                    lambda lo, hi: self.comm.iallreduce(self.flat.grad[lo:hi]))
                        if self.config.overlap else None)

    def _prepare(self, grad: torch.Tensor) -> None:
        """With overlap the buckets may be in flight: scaling the accumulation waits for :meth:`_step`."""
        if self.buckets is None:
            super()._prepare(grad)

    def _step(self, grad: torch.Tensor) -> None:
        if self.buckets is None:
            self._first_launch = None
            self.comm.allreduce(grad)
        else:
            _, self._first_launch = self.buckets.finish()
            super()._prepare(grad)
        grad.div_(self.comm.size)
        self._clip(grad)
        self._decayed(grad)
        self._local_step()

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer)}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
