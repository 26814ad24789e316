"""Cost of a user optimizer in ``algo.step()``: torch SGD / AdamW over the model's parameters vs the built-in SGD.

Times only ``algo.step()`` (communication + update; forward and backward excluded) of a 4-layer MLP,
for each algorithm with the built-in momentum SGD (the baseline), a user ``torch.optim.SGD`` with the same
momentum over two parameter groups, and a user ``torch.optim.AdamW``. Decentralized algorithms pay one
model-sized scratch copy per step for the update at the pre-mixing iterate; centralized ones none. The
variants alternate step by step, so machine noise hits them alike; each figure is the median over
``--steps`` timed steps (after warm-up) of the slowest rank. Read the ratios to the built-in column.

    unshare -n bash -c 'ip link set lo up && mpiexec -n 2 python bench/per_step/user_optimizer.py'
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator
from mpicomm.training.param_groups import decay_groups


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


VARIANTS = {
    "built-in": lambda m: None,
    "torch SGD": lambda m: torch.optim.SGD(decay_groups(m, 1e-4), lr=0.01, momentum=0.9),
    "torch AdamW": lambda m: torch.optim.AdamW(decay_groups(m, 1e-2), lr=1e-3),
}


def main() -> None:
    """Measure every (algorithm, variant) and print one row per algorithm on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="dpsgd,moniqua,allreduce_sgd")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(world.Get_rank()))
    for name in args.algorithms.split(","):
        algos = {}
        for label, build in VARIANTS.items():
            model = _model(args.width)
            opt = build(model)
            options = {"momentum": 0.9} if opt is None else {}
            algos[label] = make_algorithm(name, model, Communicator(world, topology.ring(world.Get_size())),
                                          optimizer=opt, **options)
        times: dict[str, list[float]] = {label: [] for label in algos}
        for step in range(args.steps + 3):
            for label, algo in algos.items():
                algo.zero_grad()
                algo.model(x).square().mean().backward()
                world.Barrier()
                t0 = time.perf_counter()
                algo.step()
                elapsed = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if step >= 3:
                    times[label].append(elapsed)
        med = {label: statistics.median(t) for label, t in times.items()}
        if world.Get_rank() == 0:
            base = med["built-in"]
            cells = "  ".join(f"{label} {1e3 * t:7.2f} ms ({t / base:4.2f}x)" for label, t in med.items())
            d = algos["built-in"].flat.numel
            print(f"{name:14s} d={d}  {cells}", flush=True)
        for algo in algos.values():
            algo.close()


if __name__ == "__main__":
    main()
