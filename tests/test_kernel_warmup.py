"""The kernel warm-up compiles every fused kernel, in the signatures the codecs and Moniqua really call, so
that a run's first step compiles nothing (``mpicomm.algorithms.kernel_warmup``)."""

from __future__ import annotations

import pytest
import torch

from mpicomm.algorithms import kernel_warmup
from mpicomm.codecs import HSQCodec, ModuloCodec, QSGDCodec, TernGradCodec, UniformCodec


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
    codec = HSQCodec([3000, 97_003], d=16)
    codec.decode(codec.encode(x), x.numel(), out=torch.empty_like(x))
    kernel_warmup._frames()
    assert signatures() == after_warm_up  # nothing new to compile


@pytest.mark.mpi
def test_rank_zero_compiles_and_says_so_once_while_the_others_wait(monkeypatch, capsys):
    """Without a cache, rank 0 compiles and prints one line; every rank returns (no rank is left waiting);
    with the cache, nothing is printed."""
    from mpi4py import MPI

    from .conftest import run_all

    comm = MPI.COMM_WORLD

    def body():
        monkeypatch.setattr(kernel_warmup, "kernels_cached", lambda: False)
        kernel_warmup.prepare_kernels(comm, torch.device("cpu"))
        printed = capsys.readouterr().err
        expected = 1 if comm.Get_rank() == 0 else 0
        assert printed.count("compiling the codec kernels once") == expected, printed
        assert printed.count("codec kernels compiled in") == expected, printed
        monkeypatch.setattr(kernel_warmup, "kernels_cached", lambda: True)
        kernel_warmup.prepare_kernels(comm, torch.device("cpu"))
        kernel_warmup.prepare_kernels(comm, torch.device("meta"))  # not a CPU: not even a broadcast
        assert capsys.readouterr().err == ""

    run_all(comm, body)
