"""Network settings (``--net``), the alpha-beta cost model, and the clock that applies it."""

from .clock import NetClock
from .model import CostModel
from .spec import NAMED, NetSpec, parse_net

__all__ = ["NAMED", "CostModel", "NetClock", "NetSpec", "parse_net"]
