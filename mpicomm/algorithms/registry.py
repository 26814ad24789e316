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

__all__ = ["ALGORITHMS", "DEFAULT_LR", "FAMILIES", "default_lr", "lr_family", "make_algorithm", "register",
           "sharded_methods"]

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

DEFAULT_LR: dict[str, float] = {"sgd": 0.1, "adam": 1e-3, "lamb": 1e-2, "sign": 1e-3}
"""The step size each family of methods starts from when no ``lr`` is given. ``sgd``: every method whose step is
SGD's, ``-lr`` times a gradient or an averaged, decoded or mixed one (0.1, the results' momentum-SGD recipes);
``adam``: the methods whose step is Adam's, scaled by the second moment (1e-3, Kingma & Ba's, the 1-bit Adam
papers' and DeepSpeed's), and the local-update methods with ``inner_optimizer="adamw"``; ``lamb``: LAMB and 1-bit
LAMB, whose trust ratio makes lr the relative change of each layer per step (1e-2: at 1e-3 LAMB reached 50.1 % on
the ResNet app's digits in 120 steps and a BERT validation loss of 8.07, a uniform guess's 8.29; at 1e-2 98.9 %
and 5.81); ``sign``: SignSGD, whose majority vote moves every coordinate by lr whatever the gradient's size, as
Adam's step does (1e-3). An Adam- or sign-type step taken at SGD's 0.1 moves every coordinate by about 0.1 per
step: the BERT app's APMSqueeze reached a validation loss of 2.78e4 and then NaN, SignSGD 159 (1e-3: 6.3 and
5.5)."""

FAMILIES = {"adam": frozenset({"allreduce_adam", "apmsqueeze", "zeroone_adam"}),
            "lamb": frozenset({"lamb", "onebit_lamb"}), "sign": frozenset({"signsgd"})}
"""The registered methods of each family but ``sgd`` (every other one registered here is ``sgd``)."""

_BUILT_IN = frozenset(ALGORITHMS)


def sharded_methods() -> list[str]:
    """The registered methods that take ``shard=True``."""
    return sorted(n for n, c in ALGORITHMS.items() if "shard" in {f.name for f in dataclasses.fields(c.config_class)})


def lr_family(name: str, options: dict | None = None) -> str | None:
    """The step-size family (a key of :data:`DEFAULT_LR`) of algorithm ``name`` with config ``options``; None for
    an algorithm registered by the user (its config's own ``lr`` default applies)."""
    if name not in _BUILT_IN:
        return None
    if (options or {}).get("inner_optimizer") == "adamw":
        return "adam"
    return next((family for family, names in FAMILIES.items() if name in names), "sgd")


def default_lr(name: str, options: dict | None = None) -> float:
    """The ``lr`` algorithm ``name`` takes when none is given, with config ``options`` (``inner_optimizer``
    decides the family of the local-update methods): its family's :data:`DEFAULT_LR`, else its config's default.

    The apps' ``--lr`` defaults to it and :func:`make_algorithm` fills it in when it builds the optimizer; an
    explicit ``lr`` always wins.
    """
    family = lr_family(name, options)
    if family is not None:
        return DEFAULT_LR[family]
    return next(f.default for f in dataclasses.fields(ALGORITHMS[name].config_class) if f.name == "lr")


def make_algorithm(name: str, model, comm, optimizer=None, **options) -> Algorithm:
    """Build algorithm ``name`` around ``model`` on ``comm`` with its config fields given as ``options``.

    ``optimizer``: a ``torch.optim.Optimizer`` over ``model``'s parameters to use as the local step
    (:meth:`Algorithm.use_optimizer`); without one the algorithm builds its own from ``lr``,
    ``momentum`` and ``weight_decay``, ``lr`` defaulting to :func:`default_lr` (its family's). Collective: an
    unknown name or option, an invalid value, or an optimizer this algorithm refuses raises the same
    ``ValueError`` on every rank (naming the option and what is allowed) instead of leaving ranks out of step.
    """
    error, config, cls = None, None, ALGORITHMS.get(name)
    try:
        if cls is None:
            raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
        if optimizer is not None:
            cls.check_takes_optimizer()
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        unknown = sorted(set(options) - fields)
        if {"shard", "shard_bits"} & set(unknown) and options.get("shard", True) is not False:
            why = cls.shard_refusal or ("sharding splits the one optimizer state that the ranks of a centralized "
                                        "method share" + ("" if cls.centralized else ", and a decentralized method's "
                                                          "ranks each keep their own model and state"))
            raise ValueError(f"{name} does not take shard=True: {why}; it is for {', '.join(sharded_methods())}")
        if unknown:
            raise ValueError(f"{name}: unknown option(s) {unknown}; valid options are {sorted(fields)}")
        if optimizer is None and "lr" not in options:
            options = {**options, "lr": default_lr(name, options)}
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
