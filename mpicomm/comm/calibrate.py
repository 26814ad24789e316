"""Calibrating the transport: latency, collective costs and overlap measured on the MPI in use.

:func:`calibrate` (collective) times, on a :class:`~mpicomm.comm.Communicator`:

* the one-way latency: half the median round trip of 8-byte ping-pongs between ranks 0 and 1;
* the allreduce, the allgather and the neighbour exchange on a ring of all ranks (a distributed-graph
  Communicator of :func:`~mpicomm.topology.ring`, as the gossip methods use) at each message size: after a
  warm-up, each call starts after a barrier; a rank keeps its median, and the table the slowest rank's;
* the hidden fraction: a blocking ring exchange of :data:`HIDDEN_BYTES` (less where that would not fit the time
  budget) takes ``t_block`` (the slowest rank's
  median); the same exchange posted non-blocking (``ineighbor_allgather``), then ``1.5 t_block`` of matrix
  products that never enter MPI, then ``wait()`` taking ``t_left``, hides ``1 - t_left / t_block`` (clamped to
  0..1; each rank's median over the repeats, the least of the ranks); the same for an allreduce of as many bytes
  (``iallreduce``, a gradient bucket), whose progress may differ (``MPICOMM_PROGRESS``).

The collectives are the Communicator's own calls (what an algorithm pays per call, its Python included), run
unmetered: nothing is booked in the Ledger nor charged by a ``--net`` model, and every wait is under the hang
guard. The ping-pong uses the raw communicator's ``Send``/``Recv`` on NumPy buffers (the Communicator has no
point-to-point call), inside a guarded wait. Every rank returns the same :class:`~mpicomm.net.Calibration`.
"""

from __future__ import annotations

import datetime
import socket
import statistics
import time

import numpy as np
import torch

from ..net.calibration import BUDGET_S, QUICK_BUDGET_S, Calibration, check_label, interpolate
from ..topology import ring

__all__ = ["BUDGET_S", "DEFAULT_SIZES", "HIDDEN_BYTES", "QUICK_BUDGET_S", "calibrate"]

DEFAULT_SIZES = (8, 64 << 10, 1 << 20, 8 << 20)
"""Message sizes (bytes) a calibration times by default."""
HIDDEN_BYTES = 4 << 20
"""Bytes per neighbour of the exchange whose hidden fraction is measured."""
_WHAT = "the transport calibration"


def _repeats(nbytes: int, quick: bool) -> int:
    """Timed calls per size: many for latency-bound sizes, few for large ones (halved when quick)."""
    count = 30 if nbytes <= 4096 else 15 if nbytes <= 256 << 10 else 7 if nbytes <= 2 << 20 else 4
    return max(2, count // 2) if quick else count


def _ping_pong(comm, round_trips: int) -> float:
    """Collective: this rank's half median round trip of 8 bytes between ranks 0 and 1 (0.0 on other ranks)."""
    if comm.rank > 1:
        return 0.0
    raw, peer = comm.comm, 1 - comm.rank
    buf = np.zeros(1, dtype=np.float64)
    trips = []
    with comm.guard.waiting(_WHAT):
        for i in range(round_trips + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            if comm.rank == 0:
                raw.Send(buf, dest=peer, tag=7)
                raw.Recv(buf, source=peer, tag=7)
            else:
                raw.Recv(buf, source=peer, tag=7)
                raw.Send(buf, dest=peer, tag=7)
            if i:
                trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2


def _median_call(comm, call, repeats: int) -> float:
    """Collective: this rank's median seconds of ``repeats`` calls of ``call`` (after a warm-up), each after a
    barrier."""
    call()
    times = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compute_for(seconds: float) -> None:
    """Matrix products for ``seconds`` without entering MPI (what a rank does while an exchange is pending)."""
    a = torch.ones(128, 128) / 128
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = a @ a


def _hidden(comm, blocking, posting, nbytes: int, repeats: int) -> float:
    """Collective: the least of the ranks' median hidden fractions of the call ``blocking`` of ``nbytes``, posted
    non-blocking by ``posting`` (both take the tensor)."""
    x = torch.zeros(nbytes // 4)
    t_block = max(comm.allgather_object(_median_call(comm, lambda: blocking(x), repeats), _WHAT))
    shares = []
    for _ in range(repeats):
        comm.barrier()
        handle = posting(x)
        _compute_for(1.5 * t_block)
        t0 = time.perf_counter()
        handle.wait()
        shares.append(min(1.0, max(0.0, 1 - (time.perf_counter() - t0) / t_block)))
    return min(comm.allgather_object(statistics.median(shares), _WHAT))


def _hidden_bytes(neighbor: list[tuple[int, float]], seconds: float) -> int:
    """The largest exchange of at most :data:`HIDDEN_BYTES` (halving, down to 64 KiB) whose measured or
    extrapolated time is at most ``seconds``."""
    nbytes = HIDDEN_BYTES
    while nbytes > 64 << 10 and interpolate(neighbor, nbytes) > seconds:
        nbytes //= 2
    return nbytes


def calibrate(comm, transport: str = "", sizes=DEFAULT_SIZES, *, quick: bool = False,
              budget: float | None = None) -> Calibration:
    """Collective: the transport under the Communicator ``comm`` measured (see the module docstring), the same
    :class:`~mpicomm.net.Calibration` on every rank.

    ``transport``: its label (``default`` when empty; letters, digits, ``.``, ``_``, ``-``); ``sizes``: message
    bytes (multiples of 4) timed per operation, ascending; ``quick``: fewer repeats and a smaller time budget;
    ``budget``: the seconds instead of :data:`BUDGET_S` (or :data:`QUICK_BUDGET_S`).
    The time is bounded on a slow network: after the first two sizes, a size whose calls (estimated from the
    table so far, its last slope continued) would take the sizes past half of :data:`BUDGET_S`
    (:data:`QUICK_BUDGET_S` when quick) is left out with every larger one, and the hidden fraction's exchange
    shrinks from :data:`HIDDEN_BYTES` until it fits the other half. ``ValueError`` (one line, every rank) on one
    rank or for a bad label or sizes.
    """
    label = check_label(transport)
    sizes = tuple(sizes)
    if len(sizes) < 2 or list(sizes) != sorted(set(sizes)) \
            or not all(isinstance(s, int) and s > 0 and s % 4 == 0 for s in sizes):
        raise ValueError(f"calibration sizes must be at least 2 ascending byte counts > 0 that are multiples of 4, "
                         f"got {sizes!r}")
    if comm.size < 2:
        raise ValueError(f"calibrating a transport needs at least 2 ranks, got {comm.size}")
    budget = budget or (QUICK_BUDGET_S if quick else BUDGET_S)
    start = time.perf_counter()
    graph = comm.on_graph(ring(comm.size))
    tables: dict[str, list[tuple[int, float]]] = {"allreduce": [], "allgather": [], "neighbor": []}
    with comm.unmetered():
        latency = max(comm.allgather_object(_ping_pong(comm, 20 if quick else 50), _WHAT))
        for i, nbytes in enumerate(sizes):
            x, reps = torch.zeros(nbytes // 4), _repeats(nbytes, quick)
            mine = [_median_call(comm, lambda call=call, x=x: call(x), reps)
                    for call in (comm.allreduce, comm.allgather, graph.neighbor_allgather)]
            slowest = [max(column) for column in zip(*comm.allgather_object(mine, _WHAT))]
            for op, seconds in zip(tables, slowest):
                tables[op].append((nbytes, seconds))
            if i + 1 < len(sizes):
                spent = max(comm.allgather_object(time.perf_counter() - start, _WHAT))
                nxt = sizes[i + 1]
                estimate = sum(interpolate(rows, nxt) for rows in tables.values()) * (_repeats(nxt, quick) + 1)
                if i >= 1 and spent + estimate > budget / 2:  # half the budget for the sizes, half for overlap
                    break
        repeats = 3 if quick else 5
        nbytes = _hidden_bytes(tables["neighbor"], budget / 4 / (1 + 3.5 * repeats))
        hidden = _hidden(comm, graph.neighbor_allgather, graph.ineighbor_allgather, nbytes, repeats)
        bucket = _hidden(comm, comm.allreduce, comm.iallreduce, nbytes, repeats)
    calibration = None
    if comm.rank == 0:
        calibration = Calibration(ranks=comm.size, transport=label, host=socket.gethostname(), latency_s=latency,
                                  tables=tables, hidden_fraction=hidden, bucket_hidden_fraction=bucket,
                                  created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return comm.bcast_object(calibration, 0, _WHAT)
