"""Where the fused CPU kernels save time, part by part: the same work on the ``kernels`` backend and on the
``numpy`` backend (the op-at-a-time path they replaced), in one process, thread CPU time, median of rounds.

    mpiexec -n 4 python bench/codecs/kernel_breakdown.py          # all three parts (rank 0 prints)

* ``frames``: Moniqua 1-bit on ResNet-20, 4 ranks on a ring, per step: the encode (``MoniquaCodec.encode``,
  building the frames included) and the recoveries of both neighbours (``MoniquaCodec.recover``).
* ``hsq``: one HSQ d=16 encode and one decode of ResNet-20's layout (one process).
* ``lattice``: Moniqua's codec as the algorithm runs it (``MoniquaCodec``, one tensor) at 16M
  elements, with the dither and with nearest rounding, encode + decode against one copy of the tensor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))

from mpicomm.codecs import bitpack  # noqa: E402

BACKENDS = ("kernels", "numpy")


def cpu_ms(fn, rounds: int) -> float:
    """Median thread CPU time of ``fn()`` in ms."""
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return 1e3 * statistics.median(times)


def frames_part(steps: int) -> dict:
    """Per-step ms of the encode and the recoveries of Moniqua 1-bit, by backend (collective)."""
    from models.resnet import build_model
    from mpi4py import MPI

    from mpicomm import topology
    from mpicomm.algorithms import make_algorithm
    from mpicomm.codecs import MoniquaCodec
    from mpicomm.comm import Communicator

    spent: dict[str, float] = {}

    def timed(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - start
        setattr(owner, name, wrapper)
        return original

    saved = [(MoniquaCodec, "encode", timed(MoniquaCodec, "encode", "encode")),
             (MoniquaCodec, "recover", timed(MoniquaCodec, "recover", "recoveries"))]
    world, out = MPI.COMM_WORLD, {}
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for backend in BACKENDS:
        with bitpack.use_backend(backend):
            model = build_model("resnet20")
            algo = make_algorithm("moniqua", model, Communicator(world, topology.ring(world.Get_size())),
                                  lr=0.05, momentum=0.9, bits=1)
            for step in range(steps + 3):
                if step == 3:
                    spent.clear()
                algo.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                algo.step()
            algo.close()
        out[backend] = {k: 1e3 * v / steps for k, v in spent.items()}
    for owner, name, original in saved:
        setattr(owner, name, original)
    return out


def hsq_part(rounds: int) -> dict:
    """ms of one HSQ d=16 encode and decode of ResNet-20's layout, by backend."""
    from models.resnet import build_model

    from mpicomm.codecs import HSQCodec

    params = list(build_model("resnet20").parameters())
    x = torch.cat([p.detach().reshape(-1) for p in params])
    out = {}
    for backend in BACKENDS:
        with bitpack.use_backend(backend):
            codec = HSQCodec([p.numel() for p in params], d=16)
            payload = codec.encode(x)
            decoded = torch.empty_like(x)
            out[backend] = {"encode": cpu_ms(lambda: codec.encode(x), rounds),  # noqa: B023
                            "decode": cpu_ms(lambda: codec.decode(payload, x.numel(), out=decoded), rounds)}  # noqa: B023
    return out


def lattice_part(rounds: int, n: int = 1 << 24) -> dict:
    """(encode + decode) / copy of the 1-bit lattice codec at ``n`` elements, dither and nearest (kernels)."""
    from mpicomm.codecs import MoniquaCodec
    from mpicomm.flat import Layer

    x, dst, out = torch.randn(n) * 1e-3, torch.empty(n), torch.empty(n)
    copy = cpu_ms(lambda: dst.copy_(x), rounds)
    ratios = {}
    for rounding in ("dither", "nearest"):
        codec = MoniquaCodec([Layer("x", 0, (n,))], 1, rounding=rounding, theta=0.01)
        payload = codec.encode(x)
        total = cpu_ms(lambda: codec.encode(x), rounds) + cpu_ms(lambda: codec.decode(payload, n, out=out), rounds)  # noqa: B023
        ratios[rounding] = total / copy
    return {"copy_ms": copy, "ratio_to_copy": ratios}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed Moniqua steps per backend")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds of the single-process parts")
    args = p.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    frames = frames_part(args.steps)
    if rank != 0:
        return 0
    print("Moniqua 1-bit, ResNet-20, per step (ms, thread CPU):")
    for backend, parts in frames.items():
        print(f"  {backend:8s}", "  ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items())))
    print("HSQ d=16, ResNet-20 (ms):")
    for backend, parts in hsq_part(args.rounds).items():
        print(f"  {backend:8s} encode {parts['encode']:.2f}  decode {parts['decode']:.2f}")
    lattice = lattice_part(args.rounds)
    print(f"lattice 1-bit at 16M, (encode + decode) / copy ({lattice['copy_ms']:.2f} ms): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in lattice["ratio_to_copy"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
