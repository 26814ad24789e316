"""Checkpoint and resume your own loop: every rank's state to HDF5, and on from the latest checkpoint, bit for bit.

    mpiexec -n 2 python examples/resume.py --out-dir /tmp/run --steps 20 --stop-at 10   # stops after step 10
    mpiexec -n 2 python examples/resume.py --out-dir /tmp/run --steps 20                # resumes at step 10

``mpicomm.save`` commits the algorithm's whole state (parameters, your optimizer, the gossip's replicas
and error buffers), the random generators and anything you add (here the scheduler) atomically;
``mpicomm.restore`` loads the latest. The resumed run ends where an uninterrupted one does.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.nn import functional as F

import mpicomm


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: a pure function of both, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, (x.sum(dim=1) > 0).long()


def main(argv=None) -> torch.Tensor:
    """Train to ``--steps`` (from the latest checkpoint in ``--out-dir`` if any); return this rank's parameters."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stop-at", type=int, default=0, help="save and stop after this step (0: never)")
    parser.add_argument("--algorithm", default="choco")
    args = parser.parse_args(argv)

    job = mpicomm.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algo = mpicomm.wrap(model, optimizer, args.algorithm, topology="ring")
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    start = 0
    if os.path.exists(os.path.join(args.out_dir, "latest")):
        start, extra = mpicomm.restore(args.out_dir, algo)
        scheduler.load_state_dict(extra["scheduler"])
        if job.rank == 0:
            print(f"resumed at step {start}")
    for step in range(start, args.steps):
        x, y = batch(job.rank, step)
        algo.zero_grad()
        F.cross_entropy(model(x), y).backward()
        algo.step()
        scheduler.step()
        if step + 1 == args.stop_at:
            where = mpicomm.save(args.out_dir, algo, step=step + 1, scheduler=scheduler.state_dict())
            if job.rank == 0:
                print(f"stopped after step {step + 1}; checkpoint {where} (run again without --stop-at to resume)")
            break
    else:
        if job.rank == 0:
            print(f"finished step {args.steps}")
    return algo.flat.data.clone()


if __name__ == "__main__":
    main()
