"""A transport measured on the MPI in use, and the cost model that prices with the measurements.

A :class:`Calibration` holds what :func:`mpicomm.comm.calibrate.calibrate` timed on ``ranks`` ranks: the
one-way point-to-point latency (half a ping-pong round trip), a table of seconds per message size for the
allreduce, the allgather and the neighbour exchange on a ring (the slowest rank's median at each size), and the
share of a non-blocking ring exchange that completes while the rank computes without entering MPI. It is cached
per host, transport label and rank count (:func:`default_path`), as JSON.

:class:`MeasuredCostModel` has :class:`~mpicomm.net.CostModel`'s methods, so the planner prices with either.
Each measured operation interpolates its table **linearly in bytes** between the two nearest sizes: over each
segment a collective costs ``a + b m`` (latency plus bytes over bandwidth), which linear interpolation reproduces
exactly, while log-log interpolation would bend it (between 8 B at 20 us and 64 KiB at 40 us an affine cost is
20.2 us at 724 B, log-log says 28 us). Below the smallest size the smallest size's time holds (nothing is faster
than the shortest message measured); beyond the largest the last two points' slope continues (a negative
slope, noise, counts as zero). The table's byte argument is the CostModel method's: allreduce, the buffer;
allgather, one rank's contribution; neighbour, the bytes sent to each neighbour of the ring of ``ranks``.
``neighbor(out, in)`` looks up ``max(out, in) / degree`` (the ring's degree: the same bytes over the rank's
link), and zero bytes cost nothing, as in CostModel.

From these, with ``alpha`` the measured latency and ``s`` the link's seconds per byte (the neighbour table's
last slope over the ring's degree; ``beta = 1 / s``):

=====================  ==========================================================================
operation              derived as
=====================  ==========================================================================
message(m)             ``alpha + m s``
reduce_scatter(m, n)   ``allreduce(m, n) / 2`` (a ring allreduce is a reduce-scatter and an allgather)
allgatherv(l, n)       ``allgather(l, n)`` (each round as long as the largest part)
alltoall(m, n)         ``allgather(m / n, n)`` (CostModel's pairwise exchange costs exactly that)
alltoallv(o, i, k)     ``k alpha + max(o, i) s``
bcast(m, n)            ``ceil(log2 n) message(m)``
barrier(n)             ``ceil(log2 n) alpha``
=====================  ==========================================================================

For ``n`` ranks other than the measured ``N`` the measured time is scaled by the ratio of CostModel's formula
at ``n`` and at ``N`` with the same ``alpha`` and ``s``: allreduce ``(n-1)(alpha + m s / n) / ((N-1)(alpha +
m s / N))``, allgather ``(n-1) / (N-1)``; the neighbour exchange does not depend on ``n``. One rank costs
nothing. The scaled figure keeps the measured protocol's shape; it is an extrapolation, so calibrate at the
job's rank count where it matters (the cache is per rank count).
"""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ..topology import ring_degree

__all__ = ["BUDGET_S", "MEASURED_OPS", "QUICK_BUDGET_S", "Calibration", "MeasuredCostModel", "check_label",
           "default_path", "interpolate"]

BUDGET_S, QUICK_BUDGET_S = 10.0, 2.0
"""About the most seconds a calibration takes by default (``quick``: the one a job runs before choosing its
method; ``mpicomm plan --calibrate --budget`` sets another); on loopback it takes a fraction of a second."""

MEASURED_OPS = ("allreduce", "allgather", "neighbor")
"""The operations a calibration times; every other one is derived (see the module docstring)."""

_LABEL_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_label(transport: str) -> str:
    """``transport`` as a cache label (``default`` when empty); ``ValueError`` (one line) unless it is letters,
    digits, ``.``, ``_`` and ``-``."""
    label = transport or "default"
    if not set(label) <= _LABEL_CHARS or label.startswith("."):
        raise ValueError(f"--transport must be a label of letters, digits, '.', '_' and '-', got {transport!r}")
    return label


def default_path(transport: str, ranks: int, host: str | None = None) -> Path:
    """Where the calibration of ``transport`` (a label) at ``ranks`` ranks on ``host`` (this machine's name by
    default) is cached: ``calibration-HOST-LABEL-RANKS.json`` in the planner's cache folder (that of the codec
    costs, :func:`mpicomm.plan.codec_cost.cache_path`: ``~/.cache/mpicomm``, or beside ``MPICOMM_PLAN_CACHE``)."""
    from ..plan.codec_cost import cache_path

    host = (host or socket.gethostname()).replace(os.sep, "_")
    return cache_path().parent / f"calibration-{host}-{check_label(transport)}-{ranks}.json"


def interpolate(table: list[tuple[int, float]], nbytes: float) -> float:
    """Seconds at ``nbytes`` from ``table`` (``(bytes, seconds)`` sorted by bytes): linear between sizes, flat
    below the smallest, the last slope (at least zero) beyond the largest."""
    if nbytes <= table[0][0] or len(table) == 1:
        return table[0][1]
    for (b0, t0), (b1, t1) in zip(table, table[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    return table[-1][1] + _slope(table) * (nbytes - table[-1][0])


def _slope(table: list[tuple[int, float]]) -> float:
    """Seconds per byte of ``table``'s last two points (zero for one point or a falling pair)."""
    if len(table) < 2:
        return 0.0
    (b0, t0), (b1, t1) = table[-2], table[-1]
    return max((t1 - t0) / (b1 - b0), 0.0)


@dataclass
class Calibration:
    """A transport measured on ``ranks`` ranks (see the module docstring).

    ``transport``: its label; ``host``: the machine's name; ``latency_s``: one-way point-to-point latency;
    ``tables``: operation -> ``[(bytes, seconds)]`` for at least :data:`MEASURED_OPS`; ``hidden_fraction``: the
    share (0..1) of a non-blocking ring exchange that completes while the rank computes outside MPI, None when
    not measured; ``bucket_hidden_fraction``: the same for a non-blocking allreduce (a gradient bucket), None when
    not measured (the ring exchange's then stands for it); ``created``: when (ISO 8601, UTC). ``ValueError`` (one
    line) for anything else.
    """

    ranks: int
    transport: str
    host: str
    latency_s: float
    tables: dict[str, list[tuple[int, float]]]
    hidden_fraction: float | None = None
    created: str = ""
    bucket_hidden_fraction: float | None = None

    def __post_init__(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"a calibration needs at least 2 ranks, got {self.ranks!r}")
        if not (isinstance(self.latency_s, (int, float)) and math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"a calibration's latency must be a finite number of seconds >= 0, got {self.latency_s!r}")
        for name in ("hidden_fraction", "bucket_hidden_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"a calibration's {name.replace('_', ' ')} must be in [0, 1] or None, got {value!r}")
        missing = [op for op in MEASURED_OPS if op not in self.tables]
        if missing:
            raise ValueError(f"a calibration needs tables for {', '.join(MEASURED_OPS)}; {', '.join(missing)} missing")
        tables = {}
        for op, rows in self.tables.items():
            try:
                table = sorted((int(b), float(t)) for b, t in rows)
            except (TypeError, ValueError):
                raise ValueError(f"a calibration's {op} table must be (bytes, seconds) pairs, got {rows!r}") from None
            sizes = [b for b, _ in table]
            if not table or len(set(sizes)) != len(sizes) or sizes[0] < 0 \
                    or not all(math.isfinite(t) and t >= 0 for _, t in table):
                raise ValueError(f"a calibration's {op} table must be (bytes, seconds) pairs with distinct sizes >= 0 "
                                 f"and finite seconds >= 0, got {rows!r}")
            tables[op] = table
        self.tables = tables

    def to_json(self) -> str:
        """The calibration as a JSON text (:meth:`from_json` reads it back)."""
        return json.dumps({"ranks": self.ranks, "transport": self.transport, "host": self.host,
                           "latency_s": self.latency_s, "hidden_fraction": self.hidden_fraction,
                           "bucket_hidden_fraction": self.bucket_hidden_fraction, "created": self.created,
                           "tables": {op: [list(row) for row in rows] for op, rows in self.tables.items()}}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """The calibration in the JSON ``text``; ``ValueError`` (one line) when it is not one."""
        try:
            data = json.loads(text)
            return cls(ranks=data["ranks"], transport=data["transport"], host=data["host"],
                       latency_s=data["latency_s"], hidden_fraction=data.get("hidden_fraction"),
                       bucket_hidden_fraction=data.get("bucket_hidden_fraction"), created=data.get("created", ""),
                       tables={op: [tuple(row) for row in rows] for op, rows in data["tables"].items()})
        except ValueError as exc:
            raise ValueError(f"not a calibration: {str(exc).splitlines()[0]}") from None
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a calibration: {type(exc).__name__} {exc}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the calibration to ``path`` atomically (a temporary file, then a rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """The calibration saved at ``path`` (``FileNotFoundError`` when there is none; ``ValueError`` with one
        line naming the file when it is not a calibration)."""
        text = Path(path).read_text()
        try:
            return cls.from_json(text)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def cost_model(self) -> MeasuredCostModel:
        """The :class:`MeasuredCostModel` that prices with these measurements."""
        return MeasuredCostModel(self)

    def summary(self) -> str:
        """One line: ``measured: latency X us, allreduce 8 B Y us / 1 MiB Z ms, ..., hidden H``."""
        ops = "; ".join(f"{op} " + " / ".join(f"{_size(b)} {_seconds(t)}" for b, t in self.tables[op])
                        for op in MEASURED_OPS)
        hidden = "not measured" if self.hidden_fraction is None else f"{self.hidden_fraction:.2f}"
        if self.bucket_hidden_fraction is not None:
            hidden += f" (allreduce {self.bucket_hidden_fraction:.2f})"
        return (f"measured: {self.transport} on {self.host}, {self.ranks} ranks: latency {_seconds(self.latency_s)}; "
                f"{ops}; hidden fraction {hidden}")


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _seconds(s: float) -> str:
    return f"{1e6 * s:.1f} us" if s < 1e-3 else f"{1e3 * s:.2f} ms"


class MeasuredCostModel:
    """Seconds each operation takes on a measured transport: :class:`~mpicomm.net.CostModel`'s methods priced
    from a :class:`Calibration` (see the module docstring for the interpolation, the derived operations and the
    scaling to other rank counts). ``alpha``: the measured latency; ``beta``: the link's bytes per second from the
    neighbour table (infinite when it shows no cost per byte)."""

    def __init__(self, calibration: Calibration):
        self.calibration = calibration
        self.ranks = calibration.ranks
        self.degree = ring_degree(calibration.ranks)
        self.alpha = calibration.latency_s
        self.seconds_per_byte = _slope(calibration.tables["neighbor"]) / self.degree
        self.beta = 1 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf
        self._tables = calibration.tables

    def on(self, link: str) -> MeasuredCostModel:
        """Itself: a calibration measures the one transport its ranks used."""
        return self

    def message(self, nbytes: int) -> float:
        """One point-to-point message: ``alpha + m s``."""
        return self.alpha + nbytes * self.seconds_per_byte

    def neighbor(self, out_bytes: int, in_bytes: int) -> float:
        """A neighbour collective that sends ``out_bytes`` and receives ``in_bytes`` in total: the ring exchange
        of ``max(out_bytes, in_bytes) / degree`` bytes per neighbour."""
        if out_bytes == 0 and in_bytes == 0:
            return 0.0
        return interpolate(self._tables["neighbor"], max(out_bytes, in_bytes) / self.degree)

    def allreduce(self, nbytes: int, n: int) -> float:
        """Allreduce of an ``nbytes`` buffer over ``n`` ranks."""
        if n <= 1:
            return 0.0
        seconds = interpolate(self._tables["allreduce"], nbytes)
        if n == self.ranks:
            return seconds
        alpha, s, big = self.alpha, self.seconds_per_byte, self.ranks
        measured = (big - 1) * (alpha + nbytes * s / big)
        if measured <= 0:
            return seconds * (n - 1) / (big - 1)
        return seconds * (n - 1) * (alpha + nbytes * s / n) / measured

    def reduce_scatter(self, nbytes: int, n: int) -> float:
        """Reduce-scatter of an ``nbytes`` input: half an allreduce."""
        return self.allreduce(nbytes, n) / 2

    def allgatherv(self, largest: int, n: int) -> float:
        """Allgather of unequal parts, each round as long as the ``largest`` part."""
        return self.allgather(largest, n)

    def allgather(self, nbytes: int, n: int) -> float:
        """Allgather where every rank contributes ``nbytes``."""
        if n <= 1:
            return 0.0
        return interpolate(self._tables["allgather"], nbytes) * (n - 1) / (self.ranks - 1)

    def alltoall(self, nbytes: int, n: int) -> float:
        """All-to-all of an ``nbytes`` send buffer: an allgather of ``nbytes / n`` per rank."""
        if n <= 1:
            return 0.0
        return self.allgather(nbytes / n, n)

    def alltoallv(self, out_bytes: int, in_bytes: int, peers: int) -> float:
        """An all-to-all of unequal parts with at most ``peers`` peers either way: ``peers alpha + max s``."""
        if peers == 0:
            return 0.0
        return peers * self.alpha + max(out_bytes, in_bytes) * self.seconds_per_byte

    def bcast(self, nbytes: int, n: int) -> float:
        """Binomial-tree broadcast of ``nbytes``: ``ceil(log2 n)`` messages."""
        if n <= 1:
            return 0.0
        return math.ceil(math.log2(n)) * self.message(nbytes)

    def barrier(self, n: int) -> float:
        """Dissemination barrier: ``ceil(log2 n)`` latencies."""
        if n <= 1:
            return 0.0
        return math.ceil(math.log2(n)) * self.alpha
