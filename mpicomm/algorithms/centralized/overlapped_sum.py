"""The compressed-gradient allgather of ``compressed_sgd`` and its family, bucket by bucket during backward.

Same maths as :class:`~mpicomm.algorithms.shared.allgather_sum.PayloadSum` on the whole gradient, cut into the
buckets of :class:`~mpicomm.algorithms.buckets.GradBuckets` (boundaries on multiples of the codec's
``split_alignment``, so a QSGD scale block never straddles two buckets). For each bucket [lo, hi), as
soon as backward has produced all of it, on rank i::

    g[lo:hi] <- g[lo:hi] / N                                  (N micro-batches of an accumulation)
    p        =  g[lo:hi]            or, with error feedback,  alpha g[lo:hi] + e[lo:hi]
    payload  =  encode(p);  e[lo:hi] <- p - decode(payload)   (the latter with error feedback)
    iallgather(payload)                                       (non-blocking, one per bucket, in order)

and after backward, ``finish`` waits for every bucket and writes ``sum_r decode(payload_r)`` into
g[lo:hi] in recursive-doubling order. Every operation is elementwise given the bucket's scales, so the
result is bit-identical to one encode + allgather + decode-sum of the whole gradient (Karimireddy et
al.'s error feedback included). Stochastic codecs (QSGD) draw the step's uniforms for the whole gradient
at the first launch, exactly as one whole encode would (``QSGDCodec.draw_uniforms``), and each bucket
rounds with its slice: the random stream is the one of the non-overlapped run. The learning rate of
error feedback is read when a bucket launches, i.e. during backward (``set_lr`` before backward).

Memory beyond the non-overlapped exchange: d floats of pre-drawn uniforms (stochastic codecs only); the
receive buffers are one per bucket (n payloads each, as many bytes as the whole gradient's), and the
decode scratch is O(log n) vectors per distinct bucket length.
"""

from __future__ import annotations

import torch

from ..shared.allgather_sum import tree_sum
from ..shared.buckets import GradBuckets

__all__ = ["OverlappedPayloadSum"]


class OverlappedPayloadSum:
    """Encode and ``iallgather`` each gradient bucket as backward completes it; decode and sum in :meth:`finish`.

    ``algo``: the centralized algorithm (its flat gradient, communicator, lr and accumulation);
    ``codec``: its codec, whose ``split_alignment()`` must not be None; ``error``: the error-feedback
    buffer (d floats) or None.
    """

    def __init__(self, algo, codec, error: torch.Tensor | None, bucket_numel: int, first_bucket_numel: int):
        self.algo, self.codec, self.error = algo, codec, error
        self.buckets = GradBuckets(algo, bucket_numel, first_bucket_numel, self._launch, codec.split_alignment())
        grad, n = algo.flat.grad, algo.comm.size
        self.uniforms = torch.empty_like(grad) if hasattr(codec, "draw_uniforms") else None
        self.received = [torch.empty(n, codec.payload_bytes(hi - lo), dtype=torch.uint8, device=grad.device)
                         for lo, hi in self.buckets.ranges]
        self._sent: list[torch.Tensor] = []  # this step's payloads, alive until their allgather completes
        self._scratch: dict[int, list[torch.Tensor]] = {}

    def _launch(self, lo: int, hi: int):
        """Encode bucket [lo, hi) of the gradient (with error feedback if any) and start its allgather."""
        algo, codec, error = self.algo, self.codec, self.error
        if not self._sent and self.uniforms is not None:
            codec.draw_uniforms(self.uniforms.numel(), self.uniforms.device, out=self.uniforms)
        g = algo.flat.grad[lo:hi]
        if algo.accumulation > 1:
            g.div_(algo.accumulation)
        if error is not None:
            g.mul_(algo.lr).add_(error[lo:hi])  # p = alpha*g + e, in the gradient buffer
        payload = codec.encode(g) if self.uniforms is None else codec.encode(g, uniforms=self.uniforms[lo:hi])
        if error is not None:
            codec.decode(payload, hi - lo, out=error[lo:hi])  # Delta = C(p)
            torch.sub(g, error[lo:hi], out=error[lo:hi])  # e <- p - Delta
        self._sent.append(payload)
        return algo.comm.iallgather(payload, out=self.received[len(self._sent) - 1])

    def finish(self, grad: torch.Tensor) -> dict | None:
        """Collective: launch what is left, wait, ``grad <- sum_r decode(payload_r)`` bucket by bucket.

        Returns the ledger totals before this step's first launch (for the step's traffic).
        """
        handles, first = self.buckets.finish()
        n = self.algo.comm.size
        for (lo, hi), handle in zip(self.buckets.ranges, handles):
            rows, m = handle.wait(), hi - lo
            tree_sum(n, lambda r, buf, rows=rows, m=m: self.codec.decode(rows[r], m, out=buf), grad[lo:hi],
                     self._scratch.setdefault(m, []))
        self._sent = []
        return first
