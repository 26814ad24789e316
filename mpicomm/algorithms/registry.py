"""A plain dict from algorithm name to class, and ``make_algorithm`` that builds one from keyword options."""

from __future__ import annotations

import dataclasses

import torch

from ..comm import raise_together
from ..errors import agreed_of
from .base import Algorithm
from .kernel_warmup import prepare_kernels

__all__ = ["ALGORITHMS", "make_algorithm", "register"]

ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: add ``cls`` to :data:`ALGORITHMS` under ``cls.name``."""
    if cls.name in ALGORITHMS:
        raise ValueError(f"algorithm name {cls.name!r} is registered twice")
    ALGORITHMS[cls.name] = cls
    return cls


def make_algorithm(name: str, model, comm, optimizer=None, **options) -> Algorithm:
    """Build algorithm ``name`` around ``model`` on ``comm`` with its config fields given as ``options``.

    ``optimizer``: a ``torch.optim.Optimizer`` over ``model``'s parameters to use as the local step
    (:meth:`Algorithm.use_optimizer`); without one the algorithm builds its own from ``lr``,
    ``momentum`` and ``weight_decay``. Collective: an unknown name or option, an invalid value, or an
    optimizer this algorithm refuses raises the same ``ValueError`` on every rank (naming the option
    and what is allowed) instead of leaving ranks out of step.
    """
    error, config, cls = None, None, ALGORITHMS.get(name)
    try:
        if cls is None:
            raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
        if optimizer is not None:
            cls.check_takes_optimizer()
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"{name}: unknown option(s) {unknown}; valid options are {sorted(fields)}")
        config = cls.config_class(**options)
        cls.check_communicator(config, comm)
    except (ValueError, TypeError) as exc:
        error = exc
    raise_together(comm, error)
    prepare_kernels(comm.comm, next(model.parameters(), torch.empty(0)).device)
    algo = None
    try:
        algo = cls(model, comm, config)
    except (ValueError, TypeError) as exc:
        if agreed_of(exc) is not None:
            raise  # already raised on every rank alike
        error = exc
    raise_together(comm, error, None)  # a check inside the constructor that every rank reached
    if optimizer is not None:
        algo.use_optimizer(optimizer)
    return algo
