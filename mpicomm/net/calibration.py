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
at ``n`` and at ``N`` with the same ``alpha`` and ``s``: allreduce :func:`~mpicomm.net.model.allreduce_seconds`
(``ceil(log2 n) (alpha + m s)`` up to 2 KiB, ``2 ceil(log2 n) alpha + 2 (n-1)/n m s`` above) at ``n`` over the same
at ``N``, allgather ``(n-1) / (N-1)``; the neighbour exchange does not depend on ``n``. One rank costs
nothing. The scaled figure keeps the measured protocol's shape; it is an extrapolation, so calibrate at the
job's rank count where it matters (the cache is per rank count).

**The layout and the node.** The tables are timed on the calibration's ranks as they were placed:
``ranks_per_node`` records how many shared a node (None: not recorded; a job's own calibration runs on its
ranks). A flat collective over several nodes timed so already contains the node's ranks sharing its network
card. :meth:`MeasuredCostModel.on` gives ``inter``, the measured tables, and ``intra``, the link between ranks of
one node: the calibration's in-node measurement ``node`` (the same tables timed among the ranks of one node)
where it has one, else the modelled link ``intra_net`` (a ``--net`` setting, :data:`DEFAULT_INTRA_NET` unless
set: a measurement across nodes says nothing about the node's own link). :attr:`Calibration.intra_source` says
which, and the summary line shows it.
"""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ..topology import ring_degree
from .model import CostModel, allreduce_seconds
from .spec import NetSpec, parse_net

__all__ = ["BUDGET_S", "DEFAULT_INTRA_NET", "MEASURED_OPS", "QUICK_BUDGET_S", "Calibration", "MeasuredCostModel",
           "check_label", "default_path", "interpolate"]

BUDGET_S, QUICK_BUDGET_S = 10.0, 2.0
"""About the most seconds a calibration takes by default (``quick``: the one a job runs before choosing its
method; ``mpicomm plan --calibrate --budget`` sets another); on loopback it takes a fraction of a second."""

MEASURED_OPS = ("allreduce", "allgather", "neighbor")
"""The operations a calibration times; every other one is derived (see the module docstring)."""

DEFAULT_INTRA_NET = "pcie"
"""The modelled link between ranks of one node where a calibration has no in-node measurement (``pcie``:
200 Gbit/s, 5 us; about the bandwidth of a shared-memory copy, and below NVLink's)."""

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
    not measured (the ring exchange's then stands for it); ``created``: when (ISO 8601, UTC); ``ranks_per_node``:
    the ranks that shared a node while it was timed (None: not recorded); ``intra_net``: the modelled link (a
    ``--net`` setting of one link) in-node calls are priced on without ``node``; ``node``: the same measurements
    timed among the ranks of one node (a Calibration), or None. ``ValueError`` (one line) for anything else.
    """

    ranks: int
    transport: str
    host: str
    latency_s: float
    tables: dict[str, list[tuple[int, float]]]
    hidden_fraction: float | None = None
    created: str = ""
    bucket_hidden_fraction: float | None = None
    ranks_per_node: int | None = None
    intra_net: str = DEFAULT_INTRA_NET
    node: Calibration | None = None

    def __post_init__(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"a calibration needs at least 2 ranks, got {self.ranks!r}")
        per_node = self.ranks_per_node
        if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int)
                                     or not 1 <= per_node <= self.ranks):
            raise ValueError(f"a calibration's ranks per node must be an integer in 1..{self.ranks} or None, "
                             f"got {per_node!r}")
        try:
            spec = parse_net(self.intra_net) if isinstance(self.intra_net, str) else None
        except ValueError:
            spec = None
        if not isinstance(spec, NetSpec):
            raise ValueError(f"a calibration's in-node link must be a --net setting of one link (e.g. pcie, "
                             f"nvlink, 200gbit,5us), got {self.intra_net!r}")
        if self.node is not None and (not isinstance(self.node, Calibration) or self.node.node is not None):
            raise ValueError("a calibration's in-node measurement must be a calibration without one of its own")
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
        return json.dumps(self._data(), indent=1)

    def _data(self) -> dict:
        return {"ranks": self.ranks, "transport": self.transport, "host": self.host,
                "latency_s": self.latency_s, "hidden_fraction": self.hidden_fraction,
                "bucket_hidden_fraction": self.bucket_hidden_fraction, "created": self.created,
                "ranks_per_node": self.ranks_per_node, "intra_net": self.intra_net,
                "intra_source": self.intra_source, "node": None if self.node is None else self.node._data(),
                "tables": {op: [list(row) for row in rows] for op, rows in self.tables.items()}}

    @classmethod
    def _from_data(cls, data: dict) -> Calibration:
        node = data.get("node")
        return cls(ranks=data["ranks"], transport=data["transport"], host=data["host"],
                   latency_s=data["latency_s"], hidden_fraction=data.get("hidden_fraction"),
                   bucket_hidden_fraction=data.get("bucket_hidden_fraction"), created=data.get("created", ""),
                   ranks_per_node=data.get("ranks_per_node"), intra_net=data.get("intra_net", DEFAULT_INTRA_NET),
                   node=None if node is None else cls._from_data(node),
                   tables={op: [tuple(row) for row in rows] for op, rows in data["tables"].items()})

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """The calibration in the JSON ``text``; ``ValueError`` (one line) when it is not one."""
        try:
            return cls._from_data(json.loads(text))
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

    def cost_model(self, intra: NetSpec | None = None) -> MeasuredCostModel:
        """The :class:`MeasuredCostModel` that prices with these measurements (``intra``: the modelled in-node link
        instead of :attr:`intra_net`, where there is no in-node measurement)."""
        return MeasuredCostModel(self, intra)

    @property
    def intra_source(self) -> str:
        """What in-node calls are priced on: ``measured on L ranks of one node`` or ``modelled: SETTING``."""
        if self.node is not None:
            return f"measured on {self.node.ranks} ranks of one node"
        spec = parse_net(self.intra_net)
        return f"modelled: {self.intra_net}" + ("" if str(spec) == self.intra_net else f" ({spec})")

    def summary(self) -> str:
        """One line: ``measured: latency X us, allreduce 8 B Y us / 1 MiB Z ms, ..., hidden H``."""
        ops = "; ".join(f"{op} " + " / ".join(f"{_size(b)} {_seconds(t)}" for b, t in self.tables[op])
                        for op in MEASURED_OPS)
        hidden = "not measured" if self.hidden_fraction is None else f"{self.hidden_fraction:.2f}"
        if self.bucket_hidden_fraction is not None:
            hidden += f" (allreduce {self.bucket_hidden_fraction:.2f})"
        layout = "" if self.ranks_per_node is None else f" ({self.ranks_per_node} per node)"
        return (f"measured: {self.transport} on {self.host}, {self.ranks} ranks{layout}: latency "
                f"{_seconds(self.latency_s)}; {ops}; hidden fraction {hidden}; in-node {self.intra_source}")


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

    def __init__(self, calibration: Calibration, intra: NetSpec | None = None):
        self.calibration = calibration
        self.ranks = calibration.ranks
        self.degree = ring_degree(calibration.ranks)
        self.alpha = calibration.latency_s
        self.seconds_per_byte = _slope(calibration.tables["neighbor"]) / self.degree
        self.beta = 1 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf
        self._tables = calibration.tables
        if calibration.node is not None:
            self.intra = MeasuredCostModel(calibration.node)
        else:
            self.intra = CostModel(intra if intra is not None else parse_net(calibration.intra_net))

    def on(self, link: str) -> MeasuredCostModel | CostModel:
        """``inter``: itself, the tables as measured; ``intra``: the in-node measurement's model where the
        calibration has one, else the modelled in-node link (``intra_net``, or the ``intra`` given)."""
        if link == "inter":
            return self
        if link == "intra":
            return self.intra
        raise ValueError(f"link class must be one of intra, inter, got {link!r}")

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
        measured = allreduce_seconds(alpha, s, nbytes, big)
        if measured <= 0:  # no latency and no cost per byte: scale by the steps
            return seconds * (n - 1).bit_length() / (big - 1).bit_length()
        return seconds * allreduce_seconds(alpha, s, nbytes, n) / measured

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
