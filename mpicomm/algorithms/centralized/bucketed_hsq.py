"""HSQ's encode and allgather bucket by bucket during backward (``hsq`` with ``overlap=True``).

HSQ encodes each layer on its own: the layer's chunks against the shared codebook, its norms with their own
[lo, hi] range, its section of the payload starting on a byte boundary. The flat gradient is cut into the
buckets of :class:`~mpicomm.algorithms.shared.buckets.GradBuckets` (whole tensors, the last layers first), and
each bucket gets a codec over its own layers (:class:`~mpicomm.codecs.hsq.HSQCodec`, the same options and
codebook), whose payload is exactly that bucket's section of the whole-gradient payload. On rank i::

    first launch of the step:  S_t = participants(step);  if i in S_t: draws = codec.draw()   (every layer's)
    bucket [lo, hi), once backward has produced it:
        g[lo:hi] <- g[lo:hi] / N                              (N micro-batches of an accumulation)
        payload = bucket codec.encode(g[lo:hi], draws of its chunks)   (all zero if i is not in S_t)
        iallgather(payload)
    after backward (finish):   g[lo:hi] = (1/|S_t|) sum_{r in S_t, rank order} decode(payload_r)  per bucket
                               ("server" aggregation: on rank 0, then one bcast of g, as the blocking step)

The random draws of the step (norm rounding, index sampling) are taken at the first launch in the calls one
whole encode makes (:meth:`~mpicomm.codecs.hsq.HSQCodec.draw`), so each bucket rounds and samples with the
values the whole encode would give its layers; decode and sum are per layer and elementwise. The result is
bit for bit ``overlap=False``'s, generator states included (tests/test_hsq_overlap_mpi.py). Memory beyond the
blocking step: the step's draws (2 bytes per compressed chunk, 4 more in unbiased mode) and one receive buffer
per bucket (n payloads each, together as many bytes as the whole gradient's).
"""

from __future__ import annotations

import torch

from ...codecs.hsq import HSQCodec
from ..shared.buckets import GradBuckets

__all__ = ["BucketedHSQ"]


class BucketedHSQ:
    """Encode and ``iallgather`` each bucket of HSQ's gradient as backward completes it; :meth:`finish` the step.

    ``algo``: the :class:`~mpicomm.algorithms.centralized.hsq.HSQ` (flat gradient, codec, config, participants).
    """

    def __init__(self, algo, bucket_numel: int, first_bucket_numel: int):
        self.algo = algo
        self.buckets = GradBuckets(algo, bucket_numel, first_bucket_numel, self._launch)
        codec, cfg, n = algo.codec, algo.config, algo.comm.size
        starts = [layer.offset for layer in algo.flat.layers]
        device = algo.flat.grad.device
        self.parts = []  # per bucket: (its codec, first and last compressed chunk, receive buffer)
        for lo, hi in self.buckets.ranges:
            first, last = starts.index(lo), starts.index(hi) if hi < algo.flat.numel else len(starts)
            part = HSQCodec(codec.sizes[first:last], d=cfg.d, K=cfg.K, codebook=cfg.codebook, mode=cfg.mode,
                            n_bit=cfg.n_bit, min_compress=cfg.min_compress, codebook_seed=cfg.seed)
            received = torch.empty(n, part.payload_bytes(hi - lo), dtype=torch.uint8, device=device)
            self.parts.append((part, codec.chunks_before(first), codec.chunks_before(last), received))
        self._draws = None
        self._chosen: list[int] = []
        self._launched = 0

    def _launch(self, lo: int, hi: int):
        """Bucket [lo, hi) is complete: encode it with its share of the step's draws and start its allgather."""
        algo, b = self.algo, self._launched
        self._launched += 1
        if b == 0:
            self._chosen = algo.choose_participants()
            self._draws = algo.codec.draw(algo.flat.grad.device) if algo.comm.rank in self._chosen else None
        part, first, last, received = self.parts[b]
        grad = algo.flat.grad[lo:hi]
        if algo.accumulation > 1:
            grad.div_(algo.accumulation)
        if self._draws is None:  # not participating: zeros, as the blocking step sends
            payload = algo.zero_payload[:received.shape[1]]
        else:
            payload = part.encode(grad, draws=self._draws.chunks(first, last))
        return algo.comm.iallgather(payload, out=received)

    def finish(self, grad: torch.Tensor) -> dict | None:
        """Collective: launch what is left, wait, and leave the decoded average in ``grad``. Returns the ledger
        totals before this step's first launch."""
        algo = self.algo
        handles, first_launch = self.buckets.finish()
        aggregate = algo.config.aggregation == "allgather" or algo.comm.rank == 0
        for (lo, hi), (part, _, _, _), handle in zip(self.buckets.ranges, self.parts, handles):
            rows = handle.wait()
            if aggregate:
                vec = grad[lo:hi].zero_()
                for r in self._chosen:
                    vec.add_(part.decode(rows[r], hi - lo, out=algo.decoded[lo:hi]))
                vec.div_(len(self._chosen))
        if algo.config.aggregation == "server":
            algo.comm.bcast(grad, root=0)
        self._draws, self._launched = None, 0
        return first_launch
