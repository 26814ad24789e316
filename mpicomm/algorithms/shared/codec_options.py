"""What CHOCO, CPD-SGDM and DCD share: codec options and a rank's codec (their public state: :mod:`.public_sum`).

``codec`` names any codec of :func:`mpicomm.codecs.make_codec`; ``codec_options`` is a mapping of its
keyword arguments (``{"bits": 4}`` for qsgd/uniform, ``{"ratio": 0.01}`` for topk/randomk, ``{"scale":
"l1"}`` for sign). ``seed`` is not an option: a stochastic codec on rank r is seeded with
``config.seed + r`` (different per rank, reproducible). A lossless codec (``identity``) keeps no public
state: the model itself is sent, so the methods reduce to their full-precision baselines bit for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...codecs import CODECS, Codec, make_codec
from ..base import AlgorithmConfig

__all__ = ["CodecConfig", "check_codec", "make_rank_codec"]


def _takes_seed(name: str) -> bool:
    return "seed" in inspect.signature(CODECS[name]).parameters


def check_codec(name: Any, options: Any, seed: int = 0) -> dict:
    """Return ``options`` as a dict after checking that ``make_codec(name, **options)`` builds; else ValueError."""
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"codec must be one of {sorted(CODECS)}, got {name!r}")
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"codec_options must be a mapping of keyword arguments of codec {name!r}, got {options!r}")
    options = dict(options)
    if "seed" in options:
        raise ValueError("codec_options must not contain 'seed': a rank's codec is seeded with seed + rank")
    try:
        make_codec(name, **options, **({"seed": seed} if _takes_seed(name) else {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"codec_options {options!r} do not fit codec {name!r}: {exc}") from None
    return options


@dataclass(frozen=True)
class CodecConfig(AlgorithmConfig):
    """Options of every compressed decentralized algorithm.

    codec: a name from ``mpicomm.codecs.CODECS``. codec_options: its keyword arguments (no ``seed``).
    """

    codec: str = "sign"
    codec_options: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        object.__setattr__(self, "codec_options", check_codec(self.codec, self.codec_options, self.seed))


def make_rank_codec(config: CodecConfig, rank: int) -> Codec:
    """The codec of ``config`` for ``rank`` (stochastic codecs seeded with ``config.seed + rank``)."""
    seed = {"seed": config.seed + rank} if _takes_seed(config.codec) else {}
    return make_codec(config.codec, **config.codec_options, **seed)

