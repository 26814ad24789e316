"""Codecs: pure tensor maths turning a flat float tensor into a self-contained uint8 payload and back.

No communication happens here. ``CODECS`` maps a name to a factory and ``make_codec(name, **kwargs)``
builds one; Moniqua's codecs (:mod:`.moniqua`) are not in the registry because they are built for a
model's tensors and recover a message against the receiver's own model.
"""

from __future__ import annotations

import functools

import torch

from . import bitpack
from ._layout import chunk_elems, chunk_ranges
from .base import Codec
from .hsq import HSQCodec
from .identity import IdentityCodec
from .moniqua import MoniquaCodec, MoniquaPullCodec
from .qsgd import QSGDCodec, TernGradCodec
from .sign import SignCodec
from .sparse import RandomKCodec, TopKCodec
from .uniform import UniformCodec

__all__ = [
    "CODECS",
    "Codec",
    "HSQCodec",
    "IdentityCodec",
    "MoniquaCodec",
    "MoniquaPullCodec",
    "QSGDCodec",
    "RandomKCodec",
    "SignCodec",
    "TernGradCodec",
    "TopKCodec",
    "UniformCodec",
    "bitpack",
    "chunk_elems",
    "chunk_ranges",
    "make_codec",
]

CODECS = {
    "identity": IdentityCodec,
    "fp16": functools.partial(IdentityCodec, dtype=torch.float16),
    "bf16": functools.partial(IdentityCodec, dtype=torch.bfloat16),
    "uniform": UniformCodec,
    "sign": SignCodec,
    "qsgd": QSGDCodec,
    "terngrad": TernGradCodec,
    "topk": TopKCodec,
    "randomk": RandomKCodec,
    "hsq": HSQCodec,
}


def make_codec(name: str, **kwargs) -> Codec:
    """Build the codec registered as ``name`` with ``kwargs`` (ValueError listing valid names if unknown)."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; valid names: {', '.join(sorted(CODECS))}")
    return CODECS[name](**kwargs)
