"""Compile the codecs' fused CPU kernels once, before training, instead of inside the first step.

The kernels (:mod:`mpicomm.codecs.kernels`) are compiled by numba on first use and cached on disk. Compiling
all of them takes about 20 s on one core; left to the first step, every rank of a job compiles the same
kernels at once (4 ranks on 2 cores: a silent 15 s first step). :func:`prepare_kernels` (called by
``make_algorithm`` for a model on a CPU) has rank 0 compile them, saying so in one line, while the other
ranks wait; they then load the cache in milliseconds. With the cache present it only checks the files.
``scripts/setup_env.sh`` compiles them ahead with :func:`compile_all`.

The warm-up runs the codecs' real CPU paths on tiny tensors, so the compiled signatures are those a run uses.
It draws its inputs from a generator of its own and leaves every random stream a run can see as it found it
(torch's CPU generator and, if initialised, its CUDA generators; numpy's and Python's global generators):
rank 0 compiles only when the cache is cold, so a draw from a shared stream would make the first run after an
install differ from every later run with the same seed, and rank 0 differ from the other ranks.
"""

from __future__ import annotations

import os
import random
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

from ..codecs import bitpack

__all__ = ["compile_all", "kernels_cached", "prepare_kernels"]


def _dispatchers() -> list:
    from ..codecs.kernels import dither, hsq, lattice_frame, modulo, qsgd, uniform

    return [uniform.encode_nearest, uniform.encode_stochastic, uniform.encode_stochastic_segments, uniform.decode,
            hsq.argmax_magnitude, hsq.decode_layers, qsgd.bucket_scales, qsgd.encode,
            qsgd.encode_with_uniforms, qsgd.decode, modulo.encode, modulo.decode, dither.dither,
            lattice_frame.encode, lattice_frame.recover, lattice_frame.pack_codes, lattice_frame.unpack_codes,
            lattice_frame.coordinates]


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
    """Moniqua's frame kernels in every variant a run uses (dither, nearest, stochastic; theta observed)."""
    from ..codecs import lattice
    from .moniqua_frame import Frame, per_run
    from .moniqua_parts import Chunk

    gen = torch.Generator().manual_seed(0) if gen is None else gen
    x = torch.randn(24, generator=gen)
    chunk = Chunk(0, 16, (8, 8), (0, 1), (0, None), (0, 0), (7, 15))  # a tensor's run and a gap
    scale, inverse = per_run(torch.tensor([3.0]), x.device), per_run(torch.tensor([1 / 3.0]), x.device)
    noise16 = torch.rand(16, generator=gen)
    for key, noise, distance in ((lattice.stream_key(0, 1), None, None), (None, None, torch.zeros(2)),
                                 (None, noise16, None), (lattice.stream_key(0, 1), None, torch.zeros(2))):
        frame, codes = Frame(chunk, x.device, key), torch.zeros(16, dtype=torch.uint8)
        fingerprints, out = torch.zeros(2, dtype=torch.int64), torch.zeros(16)
        frame.encode(x, scale, inverse, noise, 4, codes, fingerprints, -1.0, out)
        frame.recover_into(codes, 4, inverse, 0.5, fingerprints, distance, out)
        frame.hashes  # noqa: B018 - the coordinates kernel of the torch path (Moniqua-AD-PSGD)


def compile_all() -> float:
    """Compile (or load from the cache) every kernel by running the codecs on tiny CPU tensors; seconds taken.

    Draws nothing from any shared random stream (see :func:`_random_streams_kept`)."""
    from ..codecs import HSQCodec, ModuloCodec, QSGDCodec, UniformCodec, lattice

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, generator=gen)
    with _random_streams_kept(), bitpack.use_backend("kernels"):
        for codec in (UniformCodec(2), UniformCodec(2, rounding="stochastic"), QSGDCodec(4), QSGDCodec(4, None)):
            codec.decode(codec.encode(x), x.numel())
        QSGDCodec(4).encode(x, uniforms=torch.rand(40, generator=gen))
        for codec in (ModuloCodec(2), ModuloCodec(2, "stochastic")):
            codec.decode(codec.encode(x, 1.0), x, 1.0)
        for codec in (HSQCodec([32, 8], d=8, min_compress=0), HSQCodec([32], d=8, K=512, min_compress=0)):
            codec.decode(codec.encode(x[:codec.numel]), codec.numel)
        lattice.dither(lattice.stream_key(0, 1), torch.arange(8))
        _frames(gen)
    return time.perf_counter() - start


def prepare_kernels(comm, device: torch.device) -> None:
    """Collective over the mpi4py communicator ``comm``: rank 0 compiles the kernels if the cache lacks them
    (one line on stderr) while the others wait, sleeping rather than spinning on the cores it compiles on.
    With the cache present this is one broadcast of rank 0's answer. Nothing for a model not on a CPU."""
    if torch.device(device).type != "cpu":
        return
    rank = comm.Get_rank()
    if not comm.bcast(not kernels_cached() if rank == 0 else None, root=0):
        return
    if rank == 0:
        print("mpicomm: compiling the codec kernels once (numba, about 20 s; cached for later runs) …",
              file=sys.stderr, flush=True)
        print(f"mpicomm: codec kernels compiled in {compile_all():.1f} s", file=sys.stderr, flush=True)
    waiting = comm.Ibarrier()
    while not waiting.Test():
        time.sleep(0.05)
