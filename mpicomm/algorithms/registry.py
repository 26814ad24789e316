"""The algorithms by name (an explicit list), and ``make_algorithm`` that builds one from keyword options."""

from __future__ import annotations

import dataclasses

import torch

from ..codecs.kernels.warmup import prepare_kernels
from ..comm import raise_together
from ..errors import agreed_of
from .base import Algorithm
from .centralized.adam import AllReduceAdam
from .centralized.allreduce_sgd import AllReduceSGD
from .centralized.compressed_sgd import QSGD, CompressedSGD, EFSignSGD, SignSGD, TernGrad
from .centralized.hsq import HSQ
from .centralized.lamb import LAMB
from .decentralized.adpsgd import ADPSGD
from .decentralized.choco import CHOCO
from .decentralized.d2 import D2
from .decentralized.dcd import DCD
from .decentralized.dpsgd import DPSGD
from .local.decentralized_diloco import DecentralizedDiLoCo
from .local.diloco import DiLoCo
from .local.pdsgdm import CPDSGDM, PDSGDM
from .local.sparseloco import SparseLoCo
from .local.streaming_diloco import StreamingDiLoCo
from .lowrank.powergossip import PowerGossip
from .lowrank.powersgd import PowerSGD
from .moniqua import Moniqua, MoniquaADPSGD, MoniquaD2
from .onebit.apmsqueeze import APMSqueeze
from .onebit.lamb import OneBitLAMB
from .onebit.zeroone_adam import ZeroOneAdam

__all__ = ["ALGORITHMS", "make_algorithm", "register"]

ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Add ``cls`` to :data:`ALGORITHMS` under ``cls.name`` (usable as a class decorator for your own)."""
    if cls.name in ALGORITHMS:
        raise ValueError(f"algorithm name {cls.name!r} is registered twice")
    ALGORITHMS[cls.name] = cls
    return cls


for _cls in (
    DPSGD, D2, ADPSGD, CHOCO, DCD,                              # decentralized
    Moniqua, MoniquaD2, MoniquaADPSGD,                          # Moniqua on D-PSGD, D², AD-PSGD
    PDSGDM, CPDSGDM,                                            # local updates
    DiLoCo, SparseLoCo, DecentralizedDiLoCo,                    # local updates with an outer step
    StreamingDiLoCo,                                            # the outer step per fragment, overlapped
    AllReduceSGD, CompressedSGD, QSGD, TernGrad, SignSGD, EFSignSGD, AllReduceAdam, LAMB, HSQ,  # centralized
    APMSqueeze, ZeroOneAdam, OneBitLAMB,                        # 1-bit Adam family
    PowerSGD, PowerGossip,                                      # low rank
):
    register(_cls)


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
    prepare_kernels(comm, next(model.parameters(), torch.empty(0)).device)
    algo = None
    try:
        algo = cls(model, comm, config)
        algo.check_resize_rules()
    except (ValueError, TypeError) as exc:
        if agreed_of(exc) is not None:
            raise  # already raised on every rank alike
        error = exc
    raise_together(comm, error, None)  # a check inside the constructor that every rank reached
    if optimizer is not None:
        algo.use_optimizer(optimizer)
    return algo
