"""The peers' idiom with mpicomm: your model, your AdamW with two parameter groups, a cosine scheduler,
gradient clipping and accumulation, under any algorithm that takes an optimizer.

    mpiexec -n 2 python examples/peers_idiom.py                 # AllReduce: same maths as one process
    mpiexec -n 2 python examples/peers_idiom.py --algorithm moniqua

Each rank fits its own shard of a synthetic regression problem. With ``allreduce_sgd`` the run equals
one process training on all ranks' micro-batches at once (``reference`` below; the test checks it).
"""

from __future__ import annotations

import argparse

import torch
from mpi4py import MPI

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

STEPS, ACCUMULATE, MICRO_BATCH, CLIP = 30, 2, 16, 1.0


def build_model() -> torch.nn.Module:
    """A small MLP with a LayerNorm (the same initial weights on every rank)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on the weight matrices only (biases and the LayerNorm in a group without)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=0.03)


def micro_batch(rank: int, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``k`` of ``step`` on ``rank``: y = sin(x . w) + noise, w fixed."""
    g = torch.Generator().manual_seed(10_000 * rank + 10 * step + k)
    x = torch.randn(MICRO_BATCH, 8, generator=g)
    w = torch.linspace(-1.0, 1.0, 8)
    return x, torch.sin(x @ w).unsqueeze(1) + 0.05 * torch.randn(MICRO_BATCH, 1, generator=g)


def held_out_loss(model: torch.nn.Module) -> float:
    """Mean squared error on a fixed held-out set."""
    x, y = micro_batch(rank=999, step=0, k=0)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def train(comm=MPI.COMM_WORLD, algorithm: str = "allreduce_sgd") -> torch.nn.Module:
    """The loop a Horovod or DDP user writes, with mpicomm underneath; returns the trained model."""
    model = build_model()
    optimizer = build_optimizer(model)
    algo = make_algorithm(algorithm, model, Communicator(comm, topology.ring(comm.Get_size())), optimizer=optimizer)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    algo.accumulate(ACCUMULATE)  # one update (and one round of communication) per ACCUMULATE micro-batches
    algo.clip_grad_norm_(CLIP)   # allreduce_sgd: the norm of the averaged gradient, the same on every rank
    for step in range(STEPS):
        for k in range(ACCUMULATE):
            x, y = micro_batch(comm.Get_rank(), step, k)
            algo.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            algo.step()
        scheduler.step()
    algo.close()
    return model


def reference(ranks: int) -> torch.nn.Module:
    """One process, every rank's micro-batches in one batch per step: what ``train`` with allreduce_sgd equals."""
    model = build_model()
    optimizer = build_optimizer(model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    for step in range(STEPS):
        optimizer.zero_grad()
        xs, ys = zip(*(micro_batch(r, step, k) for r in range(ranks) for k in range(ACCUMULATE)))
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
    return model


def main() -> None:
    """Train on every rank; rank 0 prints the held-out loss before and after."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="allreduce_sgd", help="allreduce_sgd, allreduce_adam, dpsgd or moniqua")
    args = parser.parse_args()
    before = held_out_loss(build_model())
    model = train(algorithm=args.algorithm)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"held-out MSE {before:.4f} -> {held_out_loss(model):.4f} ({args.algorithm}, "
              f"{MPI.COMM_WORLD.Get_size()} ranks)")


if __name__ == "__main__":
    main()
