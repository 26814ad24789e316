"""One rank's part of the exchange probe of ``progress_overlap.py``: how much of a non-blocking neighbour exchange
a stretch of compute outside MPI hides, under the process's ``MPICOMM_PROGRESS``.

    mpiexec -n 4 python bench/wallclock/progress_exchange.py [--numel 272474] [--repeats 5]

On a ring, each rank sends ``--numel`` float32 (default: ResNet-20's parameters, what D-PSGD sends) to both
neighbours. The blocking exchange is timed (median of ``--repeats``, the slowest rank's); then ``--repeats``
times the exchange is posted, the rank computes small matrix products (torch, the GIL taken and released as
a training step does) for 1.5 x that time without entering MPI, and the wait is timed. Hidden fraction = 1 -
wait / blocking time, per rank the median; rank 0 prints one JSON line with the smallest over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from mpicomm.comm import Communicator, progress, world  # noqa: E402
from mpicomm.topology import ring  # noqa: E402


def compute_for(seconds: float) -> None:
    """Small matrix products until ``seconds`` have passed (no MPI call)."""
    a = torch.randn(96, 96)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=272474)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = Communicator(world(), ring(world().size))
    x = torch.ones(args.numel)
    blocking = []
    for _ in range(args.repeats + 1):
        comm.barrier()
        t0 = time.perf_counter()
        comm.neighbor_allgather(x)
        blocking.append(time.perf_counter() - t0)
    t_block = max(comm.allgather_object(statistics.median(blocking[1:])))
    hidden, waits = [], []
    for _ in range(args.repeats):
        comm.barrier()
        handle = comm.ineighbor_allgather(x)
        compute_for(1.5 * t_block)
        t0 = time.perf_counter()
        handle.wait()
        waits.append(time.perf_counter() - t0)
        hidden.append(1 - waits[-1] / t_block)
    per_rank = comm.allgather_object((statistics.median(hidden), statistics.median(waits)))
    if comm.rank == 0:
        print(json.dumps({"mechanism": progress.progress_mode(), "blocking_s": t_block,
                          "hidden_fraction": min(h for h, _ in per_rank), "wait_s": max(w for _, w in per_rank)}))


if __name__ == "__main__":
    main()
