"""The Algorithm interface shared by every training algorithm (:mod:`.algorithm`), the options every
algorithm has and their checks (:mod:`.config`), and the parts of :class:`Algorithm` kept in files of their
own: a user's optimizer, the overlapped exchange, the averaged model, the checkpointed state."""

from .algorithm import Algorithm
from .config import AlgorithmConfig, GossipOverlapConfig, check_bool, check_int, check_range
from .state import clone_optimizer_state

__all__ = ["Algorithm", "AlgorithmConfig", "GossipOverlapConfig", "check_bool", "check_int", "check_range",
           "clone_optimizer_state"]
