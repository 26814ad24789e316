"""The kernel warm-up compiles every fused kernel, in the signatures the codecs and Moniqua really call, so
that a run's first step compiles nothing (``mpicomm.codecs.kernels.warmup``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mpicomm.codecs import HSQCodec, MoniquaCodec, QSGDCodec, TernGradCodec, UniformCodec
from mpicomm.codecs.kernels import warmup as kernel_warmup
from mpicomm.flat import Layer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COLD_CHILD = r"""
import json, random, sys
import numpy as np, torch
from mpi4py import MPI
from mpicomm import topology
from mpicomm.codecs import HSQCodec, MoniquaCodec, QSGDCodec, UniformCodec, bitpack
from mpicomm.codecs.kernels import warmup as kernel_warmup
from mpicomm.comm import Communicator
from mpicomm.flat import Layer

torch.manual_seed(1); np.random.seed(2); random.seed(3)

def streams():
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state().numpy().tobytes().hex(),
            "numpy": [np_state[0], np_state[1].tobytes().hex(), *map(float, np_state[2:])],
            "python": repr(random.getstate())}

cold = not kernel_warmup.kernels_cached()
before = streams()
kernel_warmup.prepare_kernels(Communicator(MPI.COMM_SELF, topology.complete(1)), torch.device("cpu"))  # as runs do
after = streams()
x = torch.randn(1001, generator=torch.Generator().manual_seed(7)) * 3
right = {}
for name, make in {"uniform 2 stochastic": lambda: UniformCodec(2, rounding="stochastic", seed=3),
                   "qsgd 4": lambda: QSGDCodec(4, seed=5), "hsq": lambda: HSQCodec([1001], d=8, seed=1)}.items():
    out = {}
    for backend in ("kernels", "torch"):
        with bitpack.use_backend(backend):
            codec = make()
            payload = codec.encode(x)
            out[backend] = (payload.view(torch.uint8), codec.decode(payload, x.numel()))
    right[name] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                      for a, b in zip(out["kernels"], out["torch"]))
moniqua = {}
for backend in ("kernels", "torch"):
    with bitpack.use_backend(backend):
        codec = MoniquaCodec([Layer("x", 0, (1001,))], 4)
        payload = codec.encode(x)
        moniqua[backend] = (payload, codec.decode(payload, x.numel()))
right["moniqua 4"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                         for a, b in zip(moniqua["kernels"], moniqua["torch"]))
print(json.dumps({"cold": cold, "cached_after": kernel_warmup.kernels_cached(),
                  "unchanged": {k: before[k] == after[k] for k in before}, "right": right}))
"""


@pytest.mark.timeout(900)  # a hang guard: the cold compile takes ~30 s alone and several minutes on a loaded machine
def test_cold_cache_warm_up_draws_from_no_shared_random_stream(tmp_path):
    """With numba's cache empty (a fresh install), the warm-up compiles every kernel and leaves torch's, numpy's
    and Python's global generators exactly as it found them (rank 0 compiles alone: a draw would make its run
    differ from the other ranks' and from every later run), and the kernels it compiled encode and decode bit
    for bit as the torch path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", COLD_CHILD], capture_output=True, text=True, timeout=880, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cold"] and got["cached_after"], got
    assert "compiling the codec kernels once" in proc.stderr
    assert got["unchanged"] == {"torch": True, "numpy": True, "python": True}, got
    assert all(got["right"].values()), got


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
    for codec in (MoniquaCodec([Layer("x", 0, (x.numel(),))], 1),
                  MoniquaCodec([Layer("x", 0, (x.numel(),))], 4, rounding="stochastic")):
        codec.decode(codec.encode(x), x.numel(), out=torch.empty_like(x))
    codec = HSQCodec([3000, 97_003], d=16)
    codec.decode(codec.encode(x), x.numel(), out=torch.empty_like(x))
    kernel_warmup._frames()
    assert signatures() == after_warm_up  # nothing new to compile


@pytest.mark.mpi
def test_rank_zero_compiles_and_says_so_once_while_the_others_wait(monkeypatch, capsys):
    """Without a cache, rank 0 compiles and prints one line; every rank returns (no rank is left waiting);
    with the cache, nothing is printed."""
    from mpi4py import MPI

    from mpicomm import topology
    from mpicomm.comm import Communicator

    from .conftest import run_all

    comm = MPI.COMM_WORLD
    communicator = Communicator(comm, topology.complete(comm.Get_size()))

    def body():
        monkeypatch.setattr(kernel_warmup, "kernels_cached", lambda: False)
        kernel_warmup.prepare_kernels(communicator, torch.device("cpu"))
        printed = capsys.readouterr().err
        expected = 1 if comm.Get_rank() == 0 else 0
        assert printed.count("compiling the codec kernels once") == expected, printed
        assert printed.count("codec kernels compiled in") == expected, printed
        monkeypatch.setattr(kernel_warmup, "kernels_cached", lambda: True)
        kernel_warmup.prepare_kernels(communicator, torch.device("cpu"))
        kernel_warmup.prepare_kernels(communicator, torch.device("meta"))  # not a CPU: not even a broadcast
        assert capsys.readouterr().err == ""

    run_all(comm, body)
