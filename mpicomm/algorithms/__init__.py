"""Training algorithms, one sub-package per family (see ``docs/architecture.md``), every one by name in
:data:`ALGORITHMS` (the explicit list of :mod:`.registry`)."""

from .base import Algorithm, AlgorithmConfig
from .registry import ALGORITHMS, make_algorithm, register

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfig", "make_algorithm", "register"]
