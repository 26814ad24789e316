"""PowerSGD's two allreduces bucket by bucket during backward, as torch's ``powerSGD_hook`` chains them per bucket.

The flat gradient is cut into the buckets of :class:`~mpicomm.algorithms.shared.buckets.GradBuckets` (whole
tensors, the last layers first). A bucket's compressed matrices are consecutive in the P and Q buffers and its
uncompressed slices consecutive in the packed plain buffer, so each bucket exchanges contiguous pieces of the
buffers the whole-gradient step exchanges. On rank i, as soon as backward has produced all of bucket k::

    g[k] <- g[k] / N                                      (N micro-batches of an accumulation)
    warm-up:  iallreduce(g[k])                            (AllReduce-SGD's, divided by n after backward)
    else:     finish bucket k - 1 (below), then
              M_i <- g_i + e_i;  P_i = M_i orthogonalize(Q) for k's matrices;  u_i = k's plain slices
              iallreduce(P[k]);  iallreduce(u[k])                                   (allreduce #1)

    finish bucket k:  wait #1 of k;  P̂ = orthogonalize(P);  Q_i = M_i^T P̂;  e_i <- M_i - P̂ Q_i^T
                      iallreduce(Q[k])                                               (allreduce #2)

so bucket k's second allreduce runs while backward produces bucket k + 1 (the last bucket's after backward).
After backward every #2 and plain allreduce is waited for, Q <- Q / n, Delta = P̂ Q^T per matrix and u / n,
and the columns of Q that came out zero are redrawn, over the whole buffer as the blocking step does.
Every operation is the whole-gradient step's on a slice (the same orthogonalization per matrix, the same
error per element, Q redrawn at the first launch from the same generator), and MPICH sums each element of an
allreduce in an order that does not depend on how the vector is cut, so the result is bit-identical to
``overlap=False`` (tests/test_powersgd_overlap_mpi.py). Collectives are issued in one fixed order on every
rank: #1 of bucket 0, then for each next bucket #2 of the previous one and #1 of its own, then the last #2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..shared.buckets import GradBuckets
from .layout import Matrix, gather_slices, scatter_slices

__all__ = ["BucketedPowerSGD"]


@dataclass
class _Bucket:
    """The compressed matrices of one gradient bucket and where its pieces lie in the P, Q and plain buffers."""

    matrices: list[Matrix]
    p: slice
    q: slice
    plain: list[tuple[int, int]]
    u: slice


def _buckets(layout, ranges) -> list[_Bucket]:
    out = []
    plain_at = [0]
    for _, numel in layout.plain:
        plain_at.append(plain_at[-1] + numel)
    for lo, hi in ranges:
        mats = [m for m in layout.matrices if lo <= m.offset < hi]
        which = [j for j, (offset, _) in enumerate(layout.plain) if lo <= offset < hi]
        p = slice(mats[0].p_offset, mats[-1].p_offset + mats[-1].rows * mats[-1].rank) if mats else slice(0, 0)
        q = slice(mats[0].q_offset, mats[-1].q_offset + mats[-1].cols * mats[-1].rank) if mats else slice(0, 0)
        u = slice(plain_at[which[0]], plain_at[which[-1] + 1]) if which else slice(0, 0)
        out.append(_Bucket(mats, p, q, [layout.plain[j] for j in which], u))
    return out


class BucketedPowerSGD:
    """Launch PowerSGD's allreduces bucket by bucket as backward completes each bucket; :meth:`finish` the rest.

    ``algo``: the :class:`~mpicomm.algorithms.lowrank.powersgd.PowerSGD` (flat, its layout and buffers).
    """

    def __init__(self, algo, bucket_numel: int, first_bucket_numel: int):
        self.algo = algo
        self.buckets = GradBuckets(algo, bucket_numel, first_bucket_numel, self._launch)
        self.parts = _buckets(algo.layout, self.buckets.ranges)
        lay = algo.layout
        self.p = algo.p_and_plain[:lay.p_numel]
        self.u = algo.p_and_plain[lay.p_numel:]
        self._plain_handles: list = []  # this step's, launch order (None: a bucket without plain slices)
        self._q_handles: list = []
        self._launched = 0

    def _launch(self, lo: int, hi: int):
        """Bucket [lo, hi) is complete: start its exchange (and finish the previous bucket's first half)."""
        algo, k = self.algo, self._launched
        self._launched += 1
        grad = algo.flat.grad
        if algo.accumulation > 1:
            grad[lo:hi].div_(algo.accumulation)
        if algo.phase == "warmup":
            return algo.comm.iallreduce(grad[lo:hi])
        cfg, part = algo.config, self.parts[k]
        if k == 0 and not cfg.warm_start and algo.step_count > cfg.warmup_steps:
            algo.layout.draw_q(algo.q, algo.generator)
        if k > 0:
            self._second_half(k - 1, self.buckets.handles[k - 1])
        if algo.error is not None:
            grad[lo:hi].add_(algo.error[lo:hi])  # M_i = g_i + e_i
        algo.project(part.matrices, grad, self.p)
        gather_slices(part.plain, grad, self.u[part.u])
        p_handle = algo.comm.iallreduce(self.p[part.p]) if part.matrices else None
        u_handle = algo.comm.iallreduce(self.u[part.u]) if part.plain else None
        self._plain_handles.append(u_handle)
        return p_handle or u_handle

    def _second_half(self, k: int, p_handle) -> None:
        """Wait for bucket k's P (``p_handle``), then Q_i = M_i^T P̂ and the error of its matrices; start Q's
        allreduce."""
        algo, part = self.algo, self.parts[k]
        if not part.matrices:
            self._q_handles.append(None)
            return
        p_handle.wait()
        algo.back_project(part.matrices, algo.flat.grad, self.p)
        self._q_handles.append(algo.comm.iallreduce(algo.q[part.q]))

    def finish(self, grad: torch.Tensor) -> dict | None:
        """Collective: launch what is left, complete every exchange and leave Delta (or the warm-up mean) in
        ``grad``. Returns the ledger totals before this step's first launch."""
        algo, n = self.algo, self.algo.comm.size
        warmup = algo.phase == "warmup"
        handles, first = self.buckets.finish()
        if warmup:
            grad.div_(n)
        else:
            self._second_half(len(self.parts) - 1, handles[-1])
            for part, q_handle, u_handle in zip(self.parts, self._q_handles, self._plain_handles):
                if u_handle is not None:
                    u_handle.wait()
                    scatter_slices(part.plain, self.u[part.u].div_(n), grad)
                if q_handle is not None:
                    q_handle.wait()
                    algo.q[part.q].div_(n)
                    for mat in part.matrices:
                        torch.matmul(mat.p(self.p), mat.q(algo.q).t(), out=mat.view(grad))  # Delta = P̂ Q^T
            algo.redraw_lost()
        self._plain_handles, self._q_handles, self._launched = [], [], 0
        return first
