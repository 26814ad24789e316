"""AllReduce-SGD: the exact average of all ranks' gradients, then a local SGD step (what DDP/Horovod do).

Update at step t on every rank (g_i the stochastic gradient of rank i at the shared iterate x)::

    g   = (1/n) * allreduce_sum(g_i)               (one allreduce of the flat fp32 gradient)
    g  <- g + weight_decay * x                     (x is the same everywhere, so decay is not sent)
    m  <- mu * m + g;  x <- x - alpha * m          (torch.optim.SGD; plain SGD when mu = 0)

With a user optimizer the last line is ``opt.step()`` on the averaged gradient; ``clip_grad_norm_`` clips
the averaged g. Traffic per step: one allreduce of 4d bytes. ``overlap=True`` allreduces gradient buckets
while backward runs (:class:`~mpicomm.algorithms.shared.buckets.GradBuckets`), bit-identical to the single
allreduce under MPICH. The full-precision baseline of the centralized family: ``compressed_sgd`` with the
identity codec reproduces it bit for bit. Buckets, accumulation and progress: ``docs/algorithms/centralized.md``.

``shard=True`` (ZeRO-1, :mod:`~mpicomm.algorithms.shared.sharding`): reduce-scatter the gradient, step this rank's
1/n shard (the optimizer state of the shard only), allgather the parameters; bit for bit the unsharded step with
``shard_bits=32``, or a 4/8-bit reduce-scatter with error feedback.

``hierarchical`` (auto: on over several nodes of several ranks) sums in two levels: reduce-scatter inside the
node, allreduce of each local rank's shard between nodes, allgather inside the node
(:mod:`~mpicomm.algorithms.shared.hierarchy`). Every sum is exact, so the step is the flat one up to the
order of float32 additions; only a fraction 1/L (L ranks per node) of the gradient leaves each rank for the
slow network, and every rank's NIC carries its own share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Algorithm, clone_optimizer_state
from ..shared.buckets import GradBuckets, LaunchedTraffic
from ..shared.hierarchy import TwoLevelConfig, two_level_for
from ..shared.sharding import ShardConfig, Sharding

__all__ = ["AllReduceSGD", "AllReduceSGDConfig"]


@dataclass(frozen=True)
class AllReduceSGDConfig(TwoLevelConfig, ShardConfig):
    """overlap: allreduce gradient buckets during backward (bucket sizes: see OverlapConfig). hierarchical:
    see TwoLevelConfig. shard, shard_bits: see ShardConfig."""


class AllReduceSGD(LaunchedTraffic, Algorithm):
    """Exact gradient averaging by allreduce, then local (momentum) SGD; parameters identical on all ranks."""

    name = "allreduce_sgd"
    config_class = AllReduceSGDConfig
    centralized = True
    clips_average = True
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        sharded = self.config.shard
        self.sharding = Sharding(self, 4 if self.config.momentum else 0) if sharded else None
        self.optimizer = self._local_sgd()
        self.buckets = (GradBuckets(self, self.config.bucket_numel, self.config.first_bucket_numel,
                                    lambda lo, hi: self.comm.iallreduce(self.flat.grad[lo:hi]))
                        if self.config.overlap else None)
        self.two_level = None if sharded else two_level_for(self.config, self.comm, self.flat.numel, self.flat.grad)

    def _prepare(self, grad: torch.Tensor) -> None:
        """With overlap the buckets may be in flight: scaling the accumulation waits for :meth:`_step`."""
        if self.buckets is None:
            super()._prepare(grad)

    def _step(self, grad: torch.Tensor) -> None:
        if self.sharding is not None:
            self._first_launch = None
            self.sharding.step(grad, self._shard_update)
            return
        if self.two_level is not None:
            self._first_launch = None
            self.two_level.allreduce(grad)
        elif self.buckets is None:
            self._first_launch = None
            self.comm.allreduce(grad)
        else:
            _, self._first_launch = self.buckets.finish()
            super()._prepare(grad)
        grad.div_(self.comm.size)
        self._clip(grad)
        self._decayed(grad)
        self._local_step()

    def _shard_update(self, grad: torch.Tensor) -> None:
        """The local step on this rank's shard (``grad``: the shard's averaged gradient), weight decay folded in."""
        if self.config.weight_decay and not self.user_optimizer:
            grad.add_(self.sharding.parameter.detach(), alpha=self.config.weight_decay)
        self._local_step()

    def _extra_state(self):
        if self.sharding is not None:
            return {"shard": self.sharding.state_dict(self.optimizer)}
        return {"optimizer": clone_optimizer_state(self.optimizer)}

    def _load_extra_state(self, extra):
        if self.sharding is not None:
            self.sharding.load_state_dict(self.optimizer, extra["shard"])
        else:
            self.optimizer.load_state_dict(extra["optimizer"])

    def _resize_rules(self):
        """Sharded: the shard's optimizer state is re-cut by the new ownership."""
        rules = super()._resize_rules()
        return {**rules, **Sharding.resize_rules("extra.shard")} if self.sharding is not None else rules
