"""Compile the codecs' fused CPU kernels once, before training, instead of inside the first step.

The kernels are compiled by numba on first use and cached on disk; all of them take about 20 s on one
core. Left to the first step, every rank of a job would compile the same kernels at once (4 ranks on 2
cores: a silent 15 s first step). :func:`prepare_kernels` (called by ``make_algorithm`` for a model on a
CPU) has rank 0 compile them, saying so in one line, while the other ranks sleep; they then load the
cache in milliseconds. ``scripts/setup_env.sh`` compiles them ahead with :func:`compile_all`.

The warm-up runs the codecs' real CPU paths on tiny tensors, so the compiled signatures are those a run
uses. It draws from no random stream a run can see (see :func:`_random_streams_kept`): rank 0 compiles
only when the cache is cold, and a draw would make that run differ from every later one.
"""

from __future__ import annotations

import os
import random
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

from .. import bitpack

__all__ = ["compile_all", "kernels_cached", "prepare_kernels"]


def _dispatchers() -> list:
    from . import hsq, moniqua, packing, qsgd, uniform

    return [uniform.encode_nearest, uniform.encode_stochastic, uniform.encode_stochastic_segments, uniform.decode,
            hsq.argmax_magnitude, hsq.decode_layers, qsgd.bucket_scales, qsgd.encode,
            qsgd.encode_with_uniforms, qsgd.decode, moniqua.dither, moniqua.encode, moniqua.recover,
            moniqua.coordinates, packing.pack, packing.unpack]


def kernels_cached() -> bool:
    """Whether every kernel has a compiled entry in numba's on-disk cache (True if this numba hides where)."""
    try:
        return all(os.path.exists(d._cache._cache_file._index_path) for d in _dispatchers())
    except AttributeError:  # another numba's cache layout: leave the kernels to compile on first use
        return True


@contextmanager
def _random_streams_kept():
    """Restore, on exit, every random stream a run draws from: torch's CPU generator and its CUDA generators
    (if CUDA is initialised), numpy's global generator and Python's ``random``."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _frames(gen: torch.Generator | None = None) -> None:
    """Moniqua's frame kernels in every variant a run uses: dither, nearest and stochastic rounding, theta
    observed or not, and the torch path's coordinates (Moniqua-AD-PSGD's pull)."""
    from ...flat import Layer
    from ..moniqua import MoniquaCodec, MoniquaPullCodec

    gen = torch.Generator().manual_seed(0) if gen is None else gen
    x = torch.randn(16, generator=gen)
    layers = [Layer("a", 0, (7,)), Layer("b", 7, (9,))]  # slots longer than their tensors: gaps
    theta = torch.tensor([0.5, 2.0], dtype=torch.float64)
    for rounding, observed in (("dither", False), ("nearest", True), ("stochastic", False), ("dither", True)):
        codec = MoniquaCodec(layers, 4, rounding=rounding)
        payload = codec.encode(x, 1, theta)
        codec.recover(payload.unsqueeze(0), [0.5], torch.zeros(codec.layout.codes), observed)
    pull = MoniquaPullCodec(layers, 4, 2, "dither", seed=0, rank_seed=0, device="cpu")
    message = torch.zeros(pull.nbytes, dtype=torch.uint8)
    pull.encode(x, 1, theta, message)
    pull.decode(message, x.numel())


def compile_all() -> float:
    """Compile (or load from the cache) every kernel by running the codecs on tiny CPU tensors; seconds taken.

    Draws nothing from any shared random stream (see :func:`_random_streams_kept`)."""
    from .. import HSQCodec, QSGDCodec, UniformCodec
    from ..moniqua import dither, stream_key

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, generator=gen)
    with _random_streams_kept(), bitpack.use_backend("kernels"):
        for codec in (UniformCodec(2), UniformCodec(2, rounding="stochastic"), QSGDCodec(4), QSGDCodec(4, None)):
            codec.decode(codec.encode(x), x.numel())
        QSGDCodec(4).encode(x, uniforms=torch.rand(40, generator=gen))
        for codec in (HSQCodec([32, 8], d=8, min_compress=0), HSQCodec([32], d=8, K=512, min_compress=0)):
            codec.decode(codec.encode(x[:codec.numel]), codec.numel)
        dither(stream_key(0, 1), torch.arange(8))
        _frames(gen)
    return time.perf_counter() - start


def prepare_kernels(comm, device: torch.device) -> None:
    """Collective over the :class:`~mpicomm.comm.Communicator` ``comm``: rank 0 compiles the kernels if the
    cache lacks them (one line on stderr) while the others wait in a barrier that sleeps rather than spins
    on the cores it compiles on. With the cache present this is one broadcast of rank 0's answer. Nothing
    for a model not on a CPU."""
    if torch.device(device).type != "cpu":
        return
    cold = not kernels_cached() if comm.rank == 0 else None
    if not comm.bcast_object(cold, 0, "the codec kernels' cache check"):
        return
    if comm.rank == 0:
        print("mpicomm: compiling the codec kernels once (numba, about 20 s; cached for later runs) …",
              file=sys.stderr, flush=True)
        print(f"mpicomm: codec kernels compiled in {compile_all():.1f} s", file=sys.stderr, flush=True)
    comm.sleeping_barrier()
