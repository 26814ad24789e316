"""Network settings as one string: ``--net 1gbit,100us`` (bandwidth per rank's link, one-way latency).

Bandwidth units follow ``tc``: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (powers of 1000, bits
per second). Latency units: ``ns``, ``us``, ``ms``, ``s``. ``""`` or ``"none"`` means no network
setting (MPI's own transport, unmodelled). A few named settings cover the usual classes:

* ``fast``: ``10gbit,1us`` (a data-centre NIC with RDMA-class latency)
* ``gbit``: ``1gbit,100us`` (commodity Ethernet)
* ``slow``: ``100mbit,1ms`` (a shared or wide-area link)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["NAMED", "NetSpec", "parse_net"]

_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
NAMED = {"fast": "10gbit,1us", "gbit": "1gbit,100us", "slow": "100mbit,1ms"}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"


@dataclass(frozen=True)
class NetSpec:
    """A link of ``bits_per_s`` bandwidth and ``latency_s`` one-way latency, in each direction."""

    bits_per_s: float
    latency_s: float

    def __post_init__(self):
        if not self.bits_per_s > 0:
            raise ValueError(f"--net: bandwidth must be > 0 bit/s, got {self.bits_per_s}")
        if not self.latency_s >= 0:
            raise ValueError(f"--net: latency must be >= 0 s, got {self.latency_s}")

    @property
    def bytes_per_s(self) -> float:
        """Bandwidth in bytes per second."""
        return self.bits_per_s / 8

    def __str__(self) -> str:
        return f"{_format(self.bits_per_s, _RATE)},{_format(self.latency_s, _TIME)}"


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


def parse_net(text: str | None) -> NetSpec | None:
    """``"1gbit,100us"`` (or a name in :data:`NAMED`) -> :class:`NetSpec`; ``""``/``"none"``/None -> None."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    text = NAMED.get(text.strip().lower(), text)
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"--net: expected BANDWIDTH,LATENCY such as 1gbit,100us (or one of "
                         f"{', '.join(NAMED)}, or none), got {text!r}")
    return NetSpec(_quantity(parts[0], _RATE, "bandwidth", "1gbit"), _quantity(parts[1], _TIME, "latency", "100us"))
