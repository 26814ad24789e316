"""The kernel warm-up compiles every fused kernel, in the signatures the codecs and Moniqua really call, so
that a run's first step compiles nothing (``mpicomm.algorithms.kernel_warmup``)."""

from __future__ import annotations

import torch

from mpicomm.algorithms import kernel_warmup
from mpicomm.codecs import ModuloCodec, QSGDCodec, TernGradCodec, UniformCodec


def signatures() -> dict:
    return {d.py_func.__qualname__ + d.py_func.__module__: len(d.signatures) for d in kernel_warmup._dispatchers()}


def test_warm_up_covers_every_kernel_and_the_signatures_runs_use():
    kernel_warmup.compile_all()
    assert kernel_warmup.kernels_cached()
    after_warm_up = signatures()
    assert all(after_warm_up.values()), after_warm_up  # every kernel compiled at least once
    x = torch.randn(100_003, dtype=torch.float32)
    for codec in (UniformCodec(1), UniformCodec(8, rounding="stochastic"), QSGDCodec(8), TernGradCodec()):
        codec.decode(codec.encode(x), x.numel(), out=torch.empty_like(x))
    for codec in (ModuloCodec(1), ModuloCodec(4, "stochastic")):
        codec.decode(codec.encode(x, 0.5), x, 0.5, out=x.clone())
    kernel_warmup._frames()
    assert signatures() == after_warm_up  # nothing new to compile
