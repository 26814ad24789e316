"""The sharded reduce-scatter: each shard's gradient sum to its owner, in fp32 or quantized blockwise with error
feedback (the stepped shards go back by :mod:`.shard_gather`).

Shards (:class:`ShardLayout`): with d elements on n ranks and c = 8 ceil(d / (8 n)), rank r owns the flat range
``[min(r c, d), min((r + 1) c, d))`` -- the chunks the 1-bit average's servers own.

fp32 (``bits=32``): rounds of one message each way, one shard-sized block per message (:mod:`.shard_rounds`), so
what lands is one block, c elements, at any n; in ``order``

* ``"fast"`` (default): the pairwise exchange, n - 1 messages per rank, s_r = g_r + g_(r-1) + ... in turn. The
  gradient is only read. Another order than the unsharded allreduce's, so from 3 ranks the sum may differ from it
  in the last bit of some elements (at 2 ranks there is one sum, a + b).
* ``"exact"``: recursive halving in MPICH's allreduce order (:func:`.allgather_sum.tree_sum`), so ``s_r`` equals bit
  for bit the slice of an MPICH allreduce of the same gradients (any MPI at 2 ranks) and sharded training equals
  the unsharded method bit for bit. n - 1 messages per rank at a power of two, at most n otherwise; the
  partial sums are kept in the gradient, which it spends.

Quantized (``bits=8`` or ``4``), ZeRO++'s qgZ in one level (Wang et al., "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training", 2023), with error feedback as in EF-SGD (Karimireddy et al., 2019)::

    v       = g_i + e_i
    p_i[k]  = Q(v[shard k])                 QSGD blockwise: bits per element, one fp32 scale per 512
    e_i    <- v - Q^-1(p_i)                 what this rank's payloads left out, sent at later steps
    s_r     = sum_k Q^-1(p_k[r])            all-to-all of the payloads; decoded and summed in fp32 (tree order)

Bytes sent per rank and step: (n - 1)/n * d * (bits + 32/512) / 8, against (n - 1)/n * 4 d in fp32 (0.127x at 4
bits, 0.252x at 8). ``e_i`` is a full-size fp32 buffer: the price of error feedback on all this rank sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...codecs import QSGDCodec
from ...comm import Communicator
from .allgather_sum import tree_sum
from .shard_rounds import ORDERS, rounds

__all__ = ["BLOCK", "ORDERS", "SHARD_BITS", "ErrorFeedback", "ShardLayout", "ShardedSum"]

SHARD_BITS = (32, 8, 4)
"""The reduce-scatter's precisions: 32 exact, 8 and 4 quantized blockwise with error feedback."""
BLOCK = 512
"""Elements per quantization block (one fp32 scale each), ZeRO++'s block size."""


@dataclass(frozen=True)
class ShardLayout:
    """Which flat range each of ``size`` ranks owns of ``numel`` elements (chunks of ``8 ceil(numel / (8 size))``,
    the 1-bit average's server chunks)."""

    numel: int
    size: int

    @property
    def chunk(self) -> int:
        """c = 8 ceil(numel / (8 size)): every shard's length but the last ones'."""
        return 8 * -(-self.numel // (8 * self.size))

    def bounds(self, rank: int) -> tuple[int, int]:
        """``(lo, hi)``: the flat range rank ``rank`` owns."""
        c = self.chunk
        return min(rank * c, self.numel), min((rank + 1) * c, self.numel)

    @property
    def counts(self) -> list[int]:
        """Every rank's shard length, in rank order."""
        return [hi - lo for lo, hi in map(self.bounds, range(self.size))]


class ErrorFeedback:
    """What a quantized sharded exchange keeps between steps: its codec (``None`` when exact), whose generator
    rounds, and its error-feedback residual ``error``; and the payload row it sends, the longest shard's."""

    codec: QSGDCodec | None
    error: torch.Tensor | None

    def payload_row(self, layout: ShardLayout) -> int:
        """Bytes of one payload row: the codec's payload of the longest shard (every row has that length)."""
        return max(self.codec.payload_bytes(max(k, 1)) for k in layout.counts)

    def state_dict(self) -> dict:
        """The error-feedback residual and the codec's generator (empty when exact)."""
        if self.codec is None:
            return {}
        return {"error": self.error.clone(), "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        if self.codec is not None:
            self.error.copy_(state["error"])
            self.codec.load_state_dict(state["codec"])


class ShardedSum(ErrorFeedback):
    """The gradient's sum on this rank's shard, in fp32 (``order``: see the module docstring) or quantized."""

    def __init__(self, comm: Communicator, numel: int, bits: int, seed: int, like: torch.Tensor,
                 order: str = "fast"):
        self.comm = comm
        self.layout = ShardLayout(numel, comm.size)
        self.lo, self.hi = self.layout.bounds(comm.rank)
        self.order = order
        n, c = comm.size, self.layout.chunk
        self.codec = QSGDCodec(bits, BLOCK, seed=seed) if bits != 32 else None
        # fp32: rounds of one block each way, so what lands is one block; one rank alone exchanges nothing
        self.rounds = rounds(order, n, comm.rank, self.layout.counts) if self.codec is None else []
        self.received = torch.empty(max(self.layout.counts) if self.rounds else 0, dtype=like.dtype,
                                    device=like.device)
        self._scratch: list[torch.Tensor] = []  # the quantized sum's temporaries
        self.error = torch.zeros(numel, dtype=like.dtype, device=like.device) if self.codec else None
        if self.codec is not None:
            self._row = self.payload_row(self.layout)
            self._send = torch.zeros(n * self._row, dtype=torch.uint8, device=like.device)
            self._sent = torch.empty(c, dtype=like.dtype, device=like.device)
            self._scratch.append(self._sent[:self.hi - self.lo])  # free once the payloads are encoded

    @staticmethod
    def planned_bytes(layout: ShardLayout, bits: int, element_size: int) -> int:
        """Bytes a ShardedSum over ``layout`` will hold (for the memory check, before it is built): in fp32 the
        landing buffer, one block (none at one rank); quantized the residual (d), the payloads sent and received
        (n rows each), the decode buffer and the tree sum's scratch (about log2 n + 2 shards)."""
        n, c = layout.size, layout.chunk
        if bits == 32:
            return max(layout.counts) * element_size if n > 1 else 0
        row = max(-(-k // BLOCK) * 4 + -(-k * bits // 8) for k in layout.counts)
        return layout.numel * element_size + 2 * n * row + (n.bit_length() + 2) * c * element_size

    def reduce_scatter(self, grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Collective: ``out <- sum over ranks of grad[lo:hi]`` (this rank's shard), the same sum on every rank's
        account; ``grad`` is this rank's flat gradient: read by the fast order, spent by the exact one (its
        partial sums), the residual added when quantized."""
        if self.codec is not None:
            return self._quantized(grad, out)
        if not self.rounds:
            return out.copy_(grad[self.lo:self.hi])
        if self.order == "fast":
            return self._pairwise(grad, out)
        return self._halving(grad, out)

    def _round(self, data: torch.Tensor, step) -> torch.Tensor:
        """One round: ``data``'s block ``step.send_block`` to ``step.send_to``, the block from ``step.recv_from``
        into the landing buffer (returned; empty when nothing comes), one all-to-all with one part each way."""
        n, counts = self.comm.size, self.layout.counts
        send_counts, recv_counts = [0] * n, [0] * n
        send = data[:0]
        if step.send_to >= 0:
            lo, hi = self.layout.bounds(step.send_block)
            send, send_counts[step.send_to] = data[lo:hi], hi - lo
        got = self.received[:counts[step.recv_block] if step.recv_from >= 0 else 0]
        if step.recv_from >= 0:
            recv_counts[step.recv_from] = got.numel()
        return self.comm.ialltoallv(send, send_counts, [0] * n, got, recv_counts).wait()

    def _pairwise(self, grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.copy_(grad[self.lo:self.hi])
        for step in self.rounds:
            got = self._round(grad, step)
            if got.numel():
                out.add_(got)
        return out

    def _halving(self, grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for step in self.rounds:
            got = self._round(grad, step)
            if got.numel():
                lo, hi = self.layout.bounds(step.recv_block)
                if step.keep:
                    grad[lo:hi].copy_(got)
                else:
                    grad[lo:hi].add_(got)
        return out.copy_(grad[self.lo:self.hi])

    def _quantized(self, grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        n, mine = self.comm.size, self.hi - self.lo
        v = grad.add_(self.error)
        self.error.copy_(v)
        for k in range(n):
            lo, hi = self.layout.bounds(k)
            if hi == lo:
                continue
            row = self._send[k * self._row:k * self._row + self.codec.payload_bytes(hi - lo)]
            row.copy_(self.codec.encode(v[lo:hi]))
            self.error[lo:hi].sub_(self.codec.decode(row, hi - lo, out=self._sent[:hi - lo]))
        got = self.comm.alltoall(self._send)
        if mine == 0:
            return out
        size = self.codec.payload_bytes(mine)
        return tree_sum(n, lambda k, buf: self.codec.decode(got[k * self._row:k * self._row + size], mine, out=buf),
                        out, self._scratch)
