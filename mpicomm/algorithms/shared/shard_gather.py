"""The sharded parameter allgather: every owner's stepped shard back to every rank, exact or as a quantized update.

Exact (``gather_bits=32``): one allgather of the owners' fp32 shards in equal padded parts (the flat buffer keeps
8 n spare elements for the padding), 4 c (n - 1) ~ 4 d (n - 1) / n bytes sent per rank.

Quantized (``gather_bits=8`` or ``4``), ZeRO++'s qwZ (Wang et al., 2023) sent as an update with error feedback, on
the owner r of shard s (x the parameters before the step, identical on every rank; x' the owner's stepped shard)::

    delta  = x'[s] - x[s] + e_r                 e_r: what earlier updates of this shard left out
    p_r    = Q(delta)                           QSGD blockwise: bits per element, one fp32 scale per 512
    e_r   <- delta - Q^-1(p_r)
    x[s]  <- x[s] + Q^-1(p_r)                   on every rank, the owner included: the ranks stay identical

so the parameters every rank computes with trail the owner's exact step by ``e_r``, which later steps send.
Bytes sent per rank: (n - 1) * the payload of one shard, about d (n - 1) / n * (bits + 32 / 512) / 8. The
optimizer keeps stepping the shared x, so its state sees the parameters the model computes with.
"""

from __future__ import annotations

import torch

from ...codecs import QSGDCodec
from ...comm import Communicator
from .shard_exchange import BLOCK, ErrorFeedback, ShardLayout

__all__ = ["GATHER_SEED", "ShardedGather"]

GATHER_SEED = 1 << 20
"""Added to a rank's seed for the update codec's rounding, apart from the reduce-scatter codec's."""


class ShardedGather(ErrorFeedback):
    """Every owner's stepped shard of the flat parameters back to every rank (exact, or an 8/4-bit update)."""

    def __init__(self, comm: Communicator, layout: ShardLayout, bits: int, seed: int, like: torch.Tensor):
        self.comm, self.layout = comm, layout
        self.lo, self.hi = layout.bounds(comm.rank)
        self.codec = QSGDCodec(bits, BLOCK, seed=seed + GATHER_SEED) if bits != 32 else None
        self.error = None
        if self.codec is not None:
            mine = self.hi - self.lo
            self.before = torch.empty(mine, dtype=like.dtype, device=like.device)
            self.error = torch.zeros(mine, dtype=like.dtype, device=like.device)
            self._row = self.payload_row(layout)
            self._send = torch.zeros(self._row, dtype=torch.uint8, device=like.device)
            self._decoded = torch.empty(layout.chunk, dtype=like.dtype, device=like.device)

    def exact(self, data: torch.Tensor) -> None:
        """Collective: every owner's shard of ``data`` (d elements, this rank's own in place) to every rank, fp32.

        Where the memory after ``data`` holds the padding of the equal chunks (the flat buffer's spare elements, the
        1-bit average's padded input; in two levels, the next node shard, which the node's gather then rewrites),
        one ``MPI_Allgather`` of equal parts moves them: MPICH's ``MPI_Allgatherv`` stalled for seconds on large
        vectors when ranks outnumbered free cores. Elsewhere, ``MPI_Allgatherv`` of the exact shards."""
        padded = self.layout.chunk * self.comm.size
        room = data.untyped_storage().nbytes() // data.element_size() - data.storage_offset()
        if data.is_contiguous() and room >= padded:
            self.comm.allgather_(data.as_strided((padded,), (1,)))
        else:
            self.comm.allgatherv_(data, self.layout.counts)

    def remember(self, data: torch.Tensor) -> None:
        """Before the owner's step: keep its shard of ``data`` (the update is measured from it; quantized only)."""
        if self.codec is not None:
            self.before.copy_(data[self.lo:self.hi])

    def gather(self, data: torch.Tensor) -> None:
        """Collective, after the owner stepped its shard of ``data`` (the flat parameters): every rank gets every
        stepped shard, exactly or as the quantized update from what :meth:`remember` kept."""
        if self.codec is None:
            self.exact(data)
            return
        mine = self.hi - self.lo
        delta = data[self.lo:self.hi].sub_(self.before).add_(self.error)
        payload = self._send[:self.codec.payload_bytes(mine)] if mine else self._send[:0]
        if mine:
            payload.copy_(self.codec.encode(delta))
            sent = self.codec.decode(payload, mine, out=self._decoded[:mine])
            torch.sub(delta, sent, out=self.error)
            torch.add(self.before, sent, out=data[self.lo:self.hi])   # what every other rank computes for it
        got = self.comm.allgather(self._send).view(self.comm.size, self._row)
        for k in range(self.comm.size):
            lo, hi = self.layout.bounds(k)
            if hi > lo and k != self.comm.rank:
                data[lo:hi].add_(self.codec.decode(got[k, :self.codec.payload_bytes(hi - lo)], hi - lo,
                                                   out=self._decoded[:hi - lo]))
