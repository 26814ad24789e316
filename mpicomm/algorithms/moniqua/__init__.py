"""Moniqua's family: modulo-quantized gossip on D-PSGD, D² and AD-PSGD, sharing one codec
(:mod:`mpicomm.codecs.moniqua`), one theta rule (:mod:`.theta`) and one guard (:mod:`.guard`)."""

from .adpsgd import MoniquaADPSGD, MoniquaADPSGDConfig
from .config import GUARDS, IDENTITY_BITS, MoniquaConfig, MoniquaDPSGDConfig, default_gamma
from .d2 import MoniquaD2, MoniquaD2Config
from .gossip import ModuloGossip
from .guard import ThetaBoundError
from .moniqua import Moniqua

__all__ = ["GUARDS", "IDENTITY_BITS", "ModuloGossip", "Moniqua", "MoniquaADPSGD", "MoniquaADPSGDConfig",
           "MoniquaConfig", "MoniquaD2", "MoniquaD2Config", "MoniquaDPSGDConfig", "ThetaBoundError",
           "default_gamma"]
