"""Network settings as one string: ``--net 1gbit,100us`` (bandwidth per rank's link, one-way latency).

Bandwidth units follow ``tc``: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (powers of 1000, bits
per second). Latency units: ``ns``, ``us``, ``ms``, ``s``. ``""`` or ``"none"`` means no network
setting (MPI's own transport, unmodelled). A few named settings cover the usual classes:

* ``fast``: ``10gbit,1us`` (a data-centre NIC with RDMA-class latency)
* ``gbit``: ``1gbit,100us`` (commodity Ethernet)
* ``slow``: ``100mbit,1ms`` (a shared or wide-area link)
* ``ib``: ``200gbit,2us`` (an InfiniBand HDR port)
* ``pcie``: ``200gbit,5us`` (PCIe 4.0 x16 between GPUs of one node, ~25 GB/s)
* ``nvlink``: ``2400gbit,2us`` (NVLink between GPUs of one node, ~300 GB/s)

Two link classes: ``intra=SETTING,inter=SETTING`` (each a name or ``BANDWIDTH,LATENCY``, e.g.
``intra=nvlink,inter=10gbit,5us``) sets the link between ranks of one node apart from the link between
nodes, a :class:`NetLinks`. A single setting is both (a :class:`NetSpec`; what a flat run is charged).
A link is at least ``1kbit`` with a latency of at most ``10s`` (:data:`MIN_BITS_PER_S`, :data:`MAX_LATENCY_S`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["LINKS", "MAX_LATENCY_S", "MIN_BITS_PER_S", "NAMED", "NetLinks", "NetSpec", "parse_net"]

_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
NAMED = {"fast": "10gbit,1us", "gbit": "1gbit,100us", "slow": "100mbit,1ms", "ib": "200gbit,2us",
         "pcie": "200gbit,5us", "nvlink": "2400gbit,2us"}
MIN_BITS_PER_S = 1e3
MAX_LATENCY_S = 10.0
"""The range of a modelled link: at least 1 kbit/s and at most 10 s one-way. Every message sleeps its modelled
time, so a slower link models no network anyone trains over, only a run that never ends (and a latency such
as 1e300s cannot even be slept)."""
LINKS = ("intra", "inter")
"""The link classes: between ranks of one node (``intra``) and between nodes (``inter``)."""
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"


@dataclass(frozen=True)
class NetSpec:
    """A link of ``bits_per_s`` bandwidth and ``latency_s`` one-way latency, in each direction."""

    bits_per_s: float
    latency_s: float

    def __post_init__(self):
        if not self.bits_per_s > 0:
            raise ValueError(f"--net: bandwidth must be > 0 bit/s, got {self.bits_per_s}")
        if not MIN_BITS_PER_S <= self.bits_per_s < math.inf:
            raise ValueError(f"--net: bandwidth must be a finite rate of at least 1kbit, got {self.bits_per_s:g} bit/s")
        if not 0 <= self.latency_s <= MAX_LATENCY_S:
            raise ValueError(f"--net: latency must be in [0s, {MAX_LATENCY_S:g}s], got {self.latency_s:g} s")

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth in bytes per second."""
        return self.bits_per_s / 8

    def link(self, name: str) -> NetSpec:
        """The setting of link class ``name`` (one setting: itself for both)."""
        _check_link(name)
        return self

    def __str__(self) -> str:
        return f"{_format(self.bits_per_s, _RATE)},{_format(self.latency_s, _TIME)}"


@dataclass(frozen=True)
class NetLinks:
    """Two link classes: ``intra`` between ranks of one node, ``inter`` between nodes."""

    intra: NetSpec
    inter: NetSpec

    def link(self, name: str) -> NetSpec:
        """The setting of link class ``name`` (``"intra"`` or ``"inter"``)."""
        _check_link(name)
        return getattr(self, name)

    def __str__(self) -> str:
        return f"intra={self.intra},inter={self.inter}"


def _check_link(name: str) -> None:
    if name not in LINKS:
        raise ValueError(f"link class must be one of {', '.join(LINKS)}, got {name!r}")


def _format(value: float, units: dict[str, float]) -> str:
    """The largest unit that keeps ``value`` >= 1 (``1gbit``, ``100us``); ``0s`` for zero."""
    if value == 0:
        return "0" + min(units, key=units.get)
    unit = max((u for u, scale in units.items() if value >= scale), key=units.get, default=min(units, key=units.get))
    return f"{value / units[unit]:g}{unit}"


def _quantity(text: str, units: dict[str, float], what: str, example: str) -> float:
    match = re.fullmatch(rf"({_NUMBER})\s*([a-z]+)", text.strip().lower())
    if not match or match.group(3) not in units:
        raise ValueError(f"--net: {what} {text.strip()!r} is not a number with a unit in "
                         f"{', '.join(units)} (e.g. {example})")
    return float(match.group(1)) * units[match.group(3)]


def parse_net(text: str | None) -> NetSpec | NetLinks | None:
    """``"1gbit,100us"`` (or a name in :data:`NAMED`) -> :class:`NetSpec`; ``"intra=A,inter=B"`` ->
    :class:`NetLinks`; ``""``/``"none"``/None -> None."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    if "=" in text:
        return _parse_links(text)
    return _parse_one(text)


def _parse_links(text: str) -> NetLinks:
    """``intra=A,inter=B``: each key opens a group; the comma-separated parts after it, up to the next key,
    are its setting (a name or ``BANDWIDTH,LATENCY``)."""
    form = "intra=SETTING,inter=SETTING such as intra=nvlink,inter=10gbit,5us"
    groups: dict[str, list[str]] = {}
    current = None
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if sep:
            current = key.strip().lower()
            if current not in LINKS or current in groups:
                raise ValueError(f"--net: expected {form}; {key.strip()!r} is "
                                 f"{'given twice' if current in groups else 'not intra or inter'} in {text!r}")
            groups[current] = [value]
        elif current is None:
            raise ValueError(f"--net: expected {form}, got {text!r}")
        else:
            groups[current].append(part)
    missing = [name for name in LINKS if name not in groups]
    if missing:
        raise ValueError(f"--net: expected {form}; {' and '.join(missing)} is missing in {text!r}")
    return NetLinks(**{name: _parse_one(",".join(groups[name]), name) for name in LINKS})


def _parse_one(text: str, link: str = "") -> NetSpec:
    where = f" (for {link})" if link else ""
    if text.strip().lower() in ("", "none"):
        raise ValueError(f"--net: a link class needs a setting{where}, got {text!r}")
    text = NAMED.get(text.strip().lower(), text)
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"--net: expected BANDWIDTH,LATENCY such as 1gbit,100us (or one of "
                         f"{', '.join(NAMED)}, or none, or intra=...,inter=...){where}, got {text!r}")
    return NetSpec(_quantity(parts[0], _RATE, "bandwidth", "1gbit"), _quantity(parts[1], _TIME, "latency", "100us"))
