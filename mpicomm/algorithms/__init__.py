"""Training algorithms: one module per family, each registering its classes in :data:`ALGORITHMS`.

Every module of this package is imported here (in name order), so adding a file with a
``@register``-ed class is all it takes to make an algorithm available by name.
"""

import importlib
import pkgutil

from .base import Algorithm, AlgorithmConfig
from .registry import ALGORITHMS, make_algorithm, register

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_module}")

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfig", "make_algorithm", "register"]
