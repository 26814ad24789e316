"""Network settings (``--net``), the alpha-beta cost model, and the clock that applies it."""

from .clock import NetClock
from .model import CostModel
from .spec import LINKS, NAMED, NetLinks, NetSpec, parse_net

__all__ = ["LINKS", "NAMED", "CostModel", "NetClock", "NetLinks", "NetSpec", "parse_net"]
