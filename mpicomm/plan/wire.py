"""Bytes on the wire per step and rank: the closed forms the Ledger is checked against.

Each method's step is a few collective calls (:class:`Op`); the Ledger books for each call the bytes this
rank handed to MPI (``contributed``) and the bytes it sent (``sent``):

=================  ====================  ===================================================
call               contributed           sent (n ranks, out-degree k)
=================  ====================  ===================================================
allreduce of m     m                     ``2 (n - 1) m // n`` (the bandwidth-optimal volume)
allgather of P     P                     ``(n - 1) P``
alltoall of n P    n P                   ``(n - 1) P``
neighbour of M     M                     ``k M``
=================  ====================  ===================================================

The payload sizes below are the closed forms the MPI tests assert against the Ledger (their tests import
them from here), with ``d`` the parameter count, ``T`` the number of tensors, ``n`` the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Op", "allreduce_sent", "apmsqueeze_chunk_payload", "ef_signsgd_payload", "hsq_payload",
           "moniqua_agreed_floats", "moniqua_message_bytes", "qsgd_payload", "signsgd_payload", "terngrad_payload"]

KINDS = ("allreduce", "allgather", "alltoall", "neighbor")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def allreduce_sent(nbytes: int, n: int) -> int:
    """Bytes the Ledger books as sent for one allreduce of ``nbytes`` over ``n`` ranks: ``2 (n-1) m // n``."""
    return 2 * (n - 1) * nbytes // n


@dataclass(frozen=True)
class Op:
    """One collective call of a step: ``kind`` (one of allreduce, allgather, alltoall, neighbor) of ``nbytes``
    (the buffer handed to MPI; for alltoall the whole send buffer), to ``degree`` neighbours (neighbor only)."""

    kind: str
    nbytes: int
    degree: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    def contributed(self) -> int:
        """Bytes this rank hands to MPI in this call."""
        return self.nbytes

    def sent(self, n: int) -> int:
        """Bytes the Ledger books as sent by this rank in this call, with ``n`` ranks."""
        if self.kind == "allreduce":
            return allreduce_sent(self.nbytes, n)
        if self.kind == "allgather":
            return (n - 1) * self.nbytes
        if self.kind == "alltoall":
            return (n - 1) * (self.nbytes // n)
        return self.degree * self.nbytes

    def seconds(self, model, n: int) -> float:
        """Modelled seconds of this call on ``model`` (a :class:`~mpicomm.net.CostModel`), as the Communicator
        charges it."""
        if self.kind == "allreduce":
            return model.allreduce(self.nbytes, n)
        if self.kind == "allgather":
            return model.allgather(self.nbytes, n)
        if self.kind == "alltoall":
            return model.alltoall(self.nbytes, n)
        out = self.degree * self.nbytes
        return model.neighbor(out, out)


def moniqua_message_bytes(sizes, bits: int, parts: int) -> int:
    """Moniqua's message: ``4 T`` header bytes + one slot of ``ceil(ceil(n_l / P) b / 8)`` bytes per tensor,
    rounded up to a multiple of 4."""
    raw = 4 * len(sizes) + sum(math.ceil(math.ceil(n / parts) * bits / 8) for n in sizes)
    return 4 * math.ceil(raw / 4)


def moniqua_agreed_floats(tensors: int, theta) -> int:
    """float32 values Moniqua allreduces per step: 2 per tensor, 3 under ``theta="observed"`` (the distances)."""
    return 3 * tensors if theta == "observed" else 2 * tensors


def hsq_payload(sizes, d: int, k: int, n_bit: int, min_compress: int) -> int:
    """HSQ: per layer raw ``4 D`` (at most ``min_compress`` elements) or ``8 + ceil(N n_bit / 8) +
    ceil(N ceil(log2 K) / 8)`` with N = ceil(D / d) chunks."""
    b = math.ceil(math.log2(k))
    total = 0
    for size in sizes:
        if size <= min_compress:
            total += 4 * size
        else:
            chunks = _ceil(size, d)
            total += 8 + _ceil(chunks * n_bit, 8) + _ceil(chunks * b, 8)
    return total


def qsgd_payload(d: int, bits: int, bucket_size: int) -> int:
    """QSGD: one float32 scale per bucket + ``bits`` bits per element."""
    return 4 * _ceil(d, bucket_size) + _ceil(bits * d, 8)


def terngrad_payload(d: int) -> int:
    """TernGrad: one float32 scale + 2 bits per element."""
    return 4 + _ceil(2 * d, 8)


def signsgd_payload(d: int) -> int:
    """SignSGD (majority vote): 1 bit per element, no scale."""
    return _ceil(d, 8)


def ef_signsgd_payload(d: int) -> int:
    """EF-SignSGD: one float32 scale + 1 bit per element."""
    return 4 + _ceil(d, 8)


def apmsqueeze_chunk_payload(d: int, n: int) -> tuple[int, int]:
    """APMSqueeze's chunk: ``L = 8 ceil(d / 8n)`` elements, ``P = 4 + L / 8`` bytes (scale + signs); (L, P)."""
    chunk = 8 * _ceil(d, 8 * n)
    return chunk, 4 + chunk // 8
