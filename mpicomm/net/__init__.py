"""Network settings (``--net``), the alpha-beta cost model, a measured transport's model, and the clock that
applies a model."""

from .calibration import Calibration, MeasuredCostModel
from .clock import NetClock
from .model import CostModel
from .spec import LINKS, NAMED, NetLinks, NetSpec, parse_net

__all__ = ["LINKS", "NAMED", "Calibration", "CostModel", "MeasuredCostModel", "NetClock", "NetLinks", "NetSpec",
           "parse_net"]
