"""Overhead of ``Communicator.neighbor_allgather`` over raw mpi4py ``Neighbor_allgather`` on the same bytes.

Both run on the same distributed-graph ring of all ranks, on the same send buffer, alternating
(raw, ours, raw, ours, ...) so machine noise hits both alike; each is the median of ``--repeat``
timed calls (after warm-up), each call bracketed by barriers. The ratio ours / raw is what to read.

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/comm.py'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from mpi4py import MPI

from mpicomm import topology
from mpicomm.comm import Communicator

SIZES = {"1KB": 1 << 10, "16KB": 1 << 14, "256KB": 1 << 18, "1MB": 1 << 20, "4MB": 1 << 22,
         "16MB": 1 << 24, "64MB": 1 << 26}


def _timed(fn, comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t0
    return comm.allreduce(elapsed, op=MPI.MAX)


def main() -> None:
    """Measure and print the table; rank 0 writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma list of " + ",".join(SIZES))
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", default="bench/results/comm.json")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    ring = topology.ring(world.Get_size())
    ours = Communicator(world, ring)
    rank = world.Get_rank()
    raw_graph = world.Create_dist_graph_adjacent(list(ring.in_neighbors(rank)), list(ring.out_neighbors(rank)),
                                                 reorder=False)
    rows = []
    for label in args.sizes.split(","):
        nbytes = SIZES[label]
        send = torch.full((nbytes,), rank, dtype=torch.uint8)
        raw_recv = torch.empty((len(ring.in_neighbors(rank)), nbytes), dtype=torch.uint8)
        send_np, recv_np = send.numpy(), raw_recv.numpy()
        repeat = args.repeat if nbytes < (1 << 25) else max(5, args.repeat // 3)

        def raw(send_np=send_np, recv_np=recv_np):
            raw_graph.Neighbor_allgather([send_np, MPI.BYTE], [recv_np, MPI.BYTE])

        def wrapped(send=send):
            ours.neighbor_allgather(send)

        for _ in range(3):
            raw()
            wrapped()
        t_raw, t_ours = [], []
        for _ in range(repeat):
            t_raw.append(_timed(raw, world))
            t_ours.append(_timed(wrapped, world))
        got = ours.neighbor_allgather(send)
        correct = all(bool((row == src).all()) for row, src in zip(got, ring.in_neighbors(rank)))
        correct = world.allreduce(correct, op=MPI.LAND)
        r, o = statistics.median(t_raw), statistics.median(t_ours)
        rows.append({"size": label, "bytes": nbytes, "raw_us": r * 1e6, "communicator_us": o * 1e6,
                     "ratio": o / r, "correct": correct, "repeat": repeat})
    if rank == 0:
        print(f"ring of {world.Get_size()} ranks, neighbor_allgather, median of timed calls")
        print(f"{'size':>6}{'raw mpi4py us':>16}{'Communicator us':>18}{'ratio':>8}{'correct':>9}")
        for row in rows:
            print(f"{row['size']:>6}{row['raw_us']:>16.1f}{row['communicator_us']:>18.1f}"
                  f"{row['ratio']:>8.3f}{row['correct']!s:>9}")
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"ranks": world.Get_size(), "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
