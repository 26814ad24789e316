"""Seconds per element each codec takes to encode and decode on this machine: measured once, then cached.

:func:`measure` times every codec the candidates use on one vector of ``2**20`` float32 (the best of a
few runs, after a warm-up that compiles the kernels); :func:`codec_costs` returns the cached numbers
(``~/.cache/mpicomm/plan_codec_costs.json``, or ``MPICOMM_PLAN_CACHE``) and measures when there are none.
Keys: ``qsgd4``, ``terngrad``, ``sign``, ``moniqua4`` (decode = recovering one neighbour's message),
``hsq``, ``chunked_topk`` and ``powersgd`` (per element of ``rows x cols x rank``: the products
``M Q`` and ``M^T P``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

__all__ = ["CODEC_KEYS", "cache_path", "codec_costs", "measure"]

CODEC_KEYS = ("qsgd4", "terngrad", "sign", "moniqua4", "hsq", "chunked_topk", "powersgd")
_N = 2 ** 20


def cache_path() -> Path:
    """Where the measured costs are kept."""
    return Path(os.environ.get("MPICOMM_PLAN_CACHE", Path.home() / ".cache" / "mpicomm" / "plan_codec_costs.json"))


def _best(fn, repeats: int = 3) -> float:
    fn()  # warm-up: compiles kernels, allocates buffers
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _pair(codec, x) -> tuple[float, float]:
    payload = codec.encode(x)
    out = torch.empty_like(x)
    return _best(lambda: codec.encode(x)) / x.numel(), _best(lambda: codec.decode(payload, x.numel(), out)) / x.numel()


def _moniqua(x) -> tuple[float, float]:
    from ..codecs.moniqua import MoniquaCodec
    from ..flat import Layer

    codec = MoniquaCodec([Layer("x", 0, (x.numel(),))], 4, 1)
    mixing = torch.zeros(codec.layout.codes)

    def recover():
        codec.encode(x, 0, theta=1.0, mixing=mixing)
        codec.recover(row, [0.5], mixing)

    row = codec.encode(x, 0, theta=1.0).unsqueeze(0)
    encode = _best(lambda: codec.encode(x, 0, theta=1.0, mixing=mixing))
    codec.recover(row, [0.5], mixing)
    return encode / x.numel(), max(_best(recover) - encode, 0.0) / x.numel()


def _powersgd() -> tuple[float, float]:
    m, r = torch.randn(1024, 1024), 4
    q = torch.randn(1024, r)
    seconds = _best(lambda: m.t() @ (m @ q))
    return seconds / (2 * m.numel() * r), seconds / (2 * m.numel() * r)


def measure() -> dict[str, list[float]]:
    """Time every codec here: ``{key: [encode seconds per element, decode seconds per element]}``."""
    from ..codecs import QSGDCodec, SignCodec, TernGradCodec
    from ..codecs.chunked_topk import ChunkedTopKCodec
    from ..codecs.hsq import HSQCodec

    x = torch.randn(_N, generator=torch.Generator().manual_seed(0))
    costs = {
        "qsgd4": _pair(QSGDCodec(4, 512), x),
        "terngrad": _pair(TernGradCodec(), x),
        "sign": _pair(SignCodec("l1"), x),
        "moniqua4": _moniqua(x),
        "hsq": _pair(HSQCodec([_N]), x),
        "chunked_topk": _pair(ChunkedTopKCodec(), x),
        "powersgd": _powersgd(),
    }
    return {k: [float(a), float(b)] for k, (a, b) in costs.items()}


def codec_costs(refresh: bool = False) -> dict[str, list[float]]:
    """The cached costs (measured and written now if there are none, they lack a key, or ``refresh``)."""
    path = cache_path()
    if not refresh and path.is_file():
        try:
            costs = json.loads(path.read_text())
            if all(key in costs for key in CODEC_KEYS):
                return costs
        except (OSError, ValueError):
            pass
    costs = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(costs, indent=1))
    except OSError:
        pass  # a read-only home still gets this run's numbers
    return costs
