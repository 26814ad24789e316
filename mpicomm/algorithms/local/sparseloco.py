"""SparseLoCo: DiLoCo's outer momentum replaced by error feedback, and the pseudo-gradient sent as 2-bit top-k.

Sarfi, Thérien, Lidin, Belilovsky. "Communication Efficient LLM Pre-training with SparseLoCo." 2025
(arXiv:2508.15706).

Step t on rank i (H = ``period``, beta = ``ef_decay``, alpha = ``outer_lr``, C the chunked top-k of
:class:`~mpicomm.codecs.chunked_topk.ChunkedTopKCodec`: ``density`` of every ``chunk`` elements kept, their
values at ``bits`` bits)::

    x_i <- InnerOpt(x_i, g_i)                       (as in DiLoCo: torch.optim.SGD or yours)
    if (t + 1) mod H == 0:
        e_i <- beta e_i + (x_g - x_i)                (the error-feedback accumulator)
        D_i = C(e_i);   e_i <- e_i - D_i
        x_g <- x_g - alpha (1/n) sum_r D_r          (payloads allgathered; plain SGD, no outer momentum)
        x_i <- x_g

Traffic: nothing between syncs; a sync is one allgather of ``codec.payload_bytes(d)`` bytes per rank.
Options and reasoning: ``docs/algorithms/diloco.md``.

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`):
the accumulator is per node and shard: rank (node a, local j) feeds e_a with its node's exact sum of shard j of
the Delta_i (reduce-scatter inside the node), sends C(e_a) to the ranks of local rank j on the other nodes
(top-k chunks start again at the shard's edge), and the node allgathers the summed shards; the 1/n keeps the
average over ranks. The N nodes are SparseLoCo's workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import residual_mean
from ...codecs.chunked_topk import ChunkedTopKCodec
from ..base import check_int, check_range
from ..shared.allgather_sum import PayloadSum
from ..shared.hierarchy import HierarchicalConfig, two_level_for
from .diloco import OuterConfig, OuterLoop

__all__ = ["SparseLoCo", "SparseLoCoConfig"]


@dataclass(frozen=True)
class SparseLoCoConfig(HierarchicalConfig, OuterConfig):
    """SparseLoCo options (outer_lr defaults to 1).

    density: fraction of each chunk sent, in (0, 1]. chunk: elements per top-k chunk, >= 1. bits: bits per
    sent value, in [1, 8] (a uniform grid over the chunk's kept values). ef_decay: beta, the decay of the
    error-feedback accumulator, in [0, 1]. hierarchical: see the module docstring.
    """

    outer_lr: float = 1.0
    density: float = 0.02
    chunk: int = 4096
    bits: int = 2
    ef_decay: float = 0.95

    def __post_init__(self):
        super().__post_init__()
        check_range("density", self.density, lo=0.0, hi=1.0, lo_open=True)
        check_int("chunk", self.chunk, 1)
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be an int in [1, 8], got {self.bits!r}")
        check_range("ef_decay", self.ef_decay, lo=0.0, hi=1.0)


class SparseLoCo(OuterLoop):
    """SparseLoCo: H inner steps, then the error-fed 2-bit chunked top-k pseudo-gradient, averaged; plain outer SGD."""

    name = "sparseloco"
    config_class = SparseLoCoConfig
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.two_level = levels = two_level_for(self.config, comm, self.flat.numel, self.flat.data)
        numel = self.flat.numel if levels is None else levels.hi - levels.lo
        self.codec = ChunkedTopKCodec(self.config.density, self.config.chunk, self.config.bits)
        self.payload_sum = PayloadSum(self.between, self.codec, numel)
        self.error = torch.zeros(numel, dtype=self.flat.data.dtype, device=self.flat.data.device)

    def _average(self, delta, round_index):
        self._summed(delta, self._compressed_sum)
        delta.div_(self.comm.size)

    def _compressed_sum(self, v: torch.Tensor) -> None:
        """``v`` <- sum over :attr:`between` of C(e_r), e <- beta e + v, e <- e - C(e)."""
        self.error.mul_(self.config.ef_decay).add_(v)  # e <- beta e + Delta
        payload = self.codec.encode(self.error)
        self.error.sub_(self.codec.decode(payload, v.numel(), out=v))  # e <- e - C(e)
        self.payload_sum(payload, out=v)

    def _extra_state(self):
        return {**super()._extra_state(), "error": self.error.clone()}

    def _resize_rules(self):
        """On a resize each rank's error-feedback residual is the saved residuals' mean (:func:`residual_mean`:
        what is still owed is kept)."""
        return {**super()._resize_rules(), "extra.error": residual_mean}

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        self.error.copy_(extra["error"])
