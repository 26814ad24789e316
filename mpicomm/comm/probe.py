"""The network probe: the real transport's latency and bandwidth, timed on a Communicator.

:func:`probe_network` times allreduces of 8 bytes (20, for the latency) and of 4 MiB (5, for the bandwidth)
on the raw MPI communicator, each after a barrier and one warm-up, all under the hang guard, and reads the
slowest rank's medians through the ring-allreduce formula ``2(n-1) alpha + 2(n-1)/n m / beta`` that the
:class:`~mpicomm.net.CostModel` prices with. The calls are not the algorithm's traffic: neither booked in the
Ledger nor charged by a ``--net`` model, and not through the Communicator's host staging (the buffers are
NumPy's), so that the Python of a collective is not counted as latency.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..net import NetSpec

__all__ = ["PROBE_LARGE_BYTES", "PROBE_SMALL_BYTES", "probe_network"]

PROBE_SMALL_BYTES, PROBE_LARGE_BYTES = 8, 4 << 20
"""Bytes of the latency and of the bandwidth probes' allreduces."""


def _median_allreduce(comm, nbytes: int, repeats: int) -> float:
    """Collective: the slowest rank's median seconds of ``repeats`` allreduces of ``nbytes`` (after a warm-up)."""
    buf = np.zeros(nbytes // 4, dtype=np.float32)
    out = np.empty_like(buf)
    times = []
    with comm.guard.waiting("the network probe"):
        comm.comm.Allreduce(buf, out)  # warm-up: connections, buffers
        for _ in range(repeats):
            comm.comm.Barrier()
            t0 = time.perf_counter()
            comm.comm.Allreduce(buf, out)
            times.append(time.perf_counter() - t0)
    return max(comm.allgather_object(statistics.median(times), "the network probe"))


def probe_network(comm) -> NetSpec | None:
    """Collective: the transport under the :class:`~mpicomm.comm.Communicator` ``comm`` as a
    :class:`~mpicomm.net.NetSpec` (bandwidth, latency), the same on every rank; None on one rank (no network)."""
    n = comm.size
    if n == 1:
        return None
    hops = 2 * (n - 1)
    small = _median_allreduce(comm, PROBE_SMALL_BYTES, 20)
    large = _median_allreduce(comm, PROBE_LARGE_BYTES, 5)
    alpha = small / hops
    seconds = max(large - hops * alpha, 1e-9)
    bytes_per_s = hops / n * PROBE_LARGE_BYTES / seconds
    return NetSpec(8 * bytes_per_s, alpha)
