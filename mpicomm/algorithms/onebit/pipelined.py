"""The 1-bit average of APMSqueeze pipelined over its chunks during backward (``overlap=True``).

:class:`~mpicomm.algorithms.onebit.average.OneBitAverage` cuts the padded vector into n chunks of L elements,
chunk k served by rank k, each with its own scale. The flat gradient is cut into the buckets of
:class:`~mpicomm.algorithms.shared.buckets.GradBuckets` with every boundary on a multiple of L, so bucket b
holds whole chunks K_b = [k0, k1) (the top bucket also the chunks of pure padding). On rank i, as soon as
backward has produced all of bucket b::

    g[b] <- g[b] / N                                    (N micro-batches of an accumulation)
    warm-up:  iallreduce(g[b])                          (AllReduce-Adam's sum, divided by n after backward)
    else:     phase 2 of bucket b - 1 (below), then
              u_i[b] = fill(b)  (APMSqueeze: b1 m + (1 - b1) g_i);  encode chunks K_b, e_i updated
              phase 1: ialltoallv, chunk k of C(u_i) to rank k for k in K_b

    phase 2 of bucket b:  wait its phase 1;  the server of a chunk in K_b forms s_k = mean + e'_k, C(s_k)
                          and e'_k;  ialltoallv, C(s_k) from each server in K_b to every rank

and after backward the last bucket's phase 2, then every C(s_k) decoded into the result. Each chunk goes
through exactly the operations of the whole-vector average (its own scale, the same sum over j in rank
order, the same error buffers), so the result is bit-identical to ``overlap=False``
(tests/test_apmsqueeze_overlap_mpi.py). Collectives are issued in one order on every rank: phase 1 of bucket
0, then for each next bucket phase 2 of the previous one and phase 1 of its own, then the last phase 2.

Traffic: the same bytes as the whole average (n payloads of P bytes out, n in, per phase and rank), in more
messages: a bucket's phase 1 is an incast to its servers and its phase 2 their broadcast, so a rank's link
carries (n - 1) P in each of the two phases of the bucket holding its own chunk and P per chunk of the
others, one after the other: about twice the link time of the blocking all-to-all + allgather, which run
both ways at once (:meth:`~mpicomm.net.CostModel.alltoallv`). What it buys is that the time runs during
backward. Memory: L floats of decode scratch beyond the blocking average.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..shared.buckets import GradBuckets
from .average import OneBitAverage

__all__ = ["PipelinedOneBitAverage"]


class PipelinedOneBitAverage:
    """Run ``onebit``'s two phases per gradient bucket during backward; :meth:`finish` completes the step.

    ``algo``: the algorithm (flat gradient, communicator, accumulation, ``phase``); ``fill(lo, hi)`` writes
    u_i[lo:hi] into ``onebit.input`` from the gradient slice, once that slice is complete.
    """

    def __init__(self, algo, onebit: OneBitAverage, fill: Callable[[int, int], None], bucket_numel: int,
                 first_bucket_numel: int):
        self.algo, self.onebit, self.fill = algo, onebit, fill
        self.buckets = GradBuckets(algo, bucket_numel, first_bucket_numel, self._launch, onebit.chunk)
        L, n, top = onebit.chunk, algo.comm.size, algo.flat.numel
        self.chunks = [(lo // L, n if hi == top else hi // L) for lo, hi in self.buckets.ranges]
        self._scratch = torch.empty(L, dtype=torch.float32, device=onebit.input.device)
        self._nothing = torch.empty(0, dtype=torch.uint8, device=onebit.input.device)
        self._phase2: list = []
        self._launched = 0
        self.sent_before: dict[str, int] = {}  # algo.bytes_sent_by_op() before this step's first launch

    def _counts(self, first: int, last: int) -> list[int]:
        """P bytes for each rank in [first, last), nothing for the others."""
        payload = self.onebit.chunk_payload
        return [payload if first <= k < last else 0 for k in range(self.algo.comm.size)]

    def _launch(self, lo: int, hi: int):
        """Bucket [lo, hi) is complete: phase 2 of the previous bucket, then phase 1 of this one."""
        algo, b = self.algo, self._launched
        self._launched += 1
        if b == 0:
            self.sent_before = algo.bytes_sent_by_op()
        grad = algo.flat.grad
        if algo.accumulation > 1:
            grad[lo:hi].div_(algo.accumulation)
        if algo.phase == "warmup":
            return algo.comm.iallreduce(grad[lo:hi])
        if b > 0:
            self._second_phase(b - 1, self.buckets.handles[b - 1])
        first, last = self.chunks[b]
        self.fill(lo, hi)
        onebit, n, rank, payload = self.onebit, algo.comm.size, algo.comm.rank, self.onebit.chunk_payload
        onebit.encode_chunks(first, last)
        rows = onebit.send[first:last].view(-1)
        displs = [(k - first) * payload if first <= k < last else 0 for k in range(n)]
        serving = first <= rank < last
        out = onebit.received.view(-1) if serving else self._nothing
        return algo.comm.ialltoallv(rows, self._counts(first, last), displs, out,
                                    [payload if serving else 0] * n)

    def _second_phase(self, b: int, first_phase) -> None:
        """Wait for bucket ``b``'s phase 1; serve my chunk if it is in the bucket; start the servers' broadcast."""
        algo, onebit, payload = self.algo, self.onebit, self.onebit.chunk_payload
        first, last = self.chunks[b]
        n, rank = algo.comm.size, algo.comm.rank
        first_phase.wait()
        serving = first <= rank < last
        send = onebit.serve(onebit.received, self._scratch) if serving else self._nothing
        self._phase2.append(algo.comm.ialltoallv(send, [payload if serving else 0] * n, [0] * n,
                                                 onebit.gathered.view(-1)[first * payload:last * payload],
                                                 self._counts(first, last)))

    def finish(self, grad: torch.Tensor) -> dict | None:
        """Collective: launch what is left and complete every exchange. Warm-up: ``grad`` becomes the mean;
        otherwise the average is left in ``onebit.input``. Returns the ledger totals before the first launch."""
        algo, onebit = self.algo, self.onebit
        handles, first_launch = self.buckets.finish()
        if algo.phase == "warmup":
            grad.div_(algo.comm.size)
        else:
            self._second_phase(len(self.chunks) - 1, handles[-1])
            for (first, last), handle in zip(self.chunks, self._phase2):
                handle.wait()
                onebit.decode_chunks(onebit.gathered, first, last)
        self._phase2, self._launched = [], 0
        return first_launch
