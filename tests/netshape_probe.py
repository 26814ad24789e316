"""Timing probe for tests/test_netshape.py: plain mpi4py + numpy (no torch, so it starts fast).

    python tests/netshape_probe.py NBYTES                 # rank 0 -> rank 1 Send/Recv of NBYTES
    python tests/netshape_probe.py NBYTES --dest 2        # rank 0 -> rank 2
    python tests/netshape_probe.py NBYTES --op allreduce  # Allreduce (sum) of an NBYTES float32 buffer

Run under ``scripts/netshape.sh mpirun --ranks N --net SPEC -- python tests/netshape_probe.py ...``.
A warm-up of the same operation on a small message comes first (connections set up); the timed
operation is bracketed by a barrier before and (send) the receiver's one-byte acknowledgement or
(allreduce) the slowest rank's time. Rank 0 prints one JSON line: op, bytes, ranks, seconds, and
``classes``: the bytes each traffic class of its link's qdisc sent (``tc -s class show dev mc0``; empty for a
classless qdisc).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time

import numpy as np
from mpi4py import MPI


def _send(world, nbytes: int, dest: int) -> float:
    rank = world.Get_rank()
    ack = np.zeros(1, dtype=np.uint8)
    for size in (4096, nbytes):  # warm-up, then the timed message
        buf = np.zeros(size, dtype=np.uint8) if rank else np.full(size, 7, dtype=np.uint8)
        world.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            world.Send(buf, dest=dest, tag=size % 32768)
            world.Recv(ack, source=dest, tag=1)
        elif rank == dest:
            world.Recv(buf, source=0, tag=size % 32768)
            if buf[0] != 7 or buf[-1] != 7:
                raise SystemExit("netshape_probe: received wrong bytes")
            world.Send(ack, dest=0, tag=1)
        elapsed = time.perf_counter() - t0
    return elapsed


def _allreduce(world, nbytes: int) -> float:
    n = max(nbytes // 4, 1)
    for count in (1024, n):  # warm-up, then the timed call
        buf = np.full(count, world.Get_rank() + 1, dtype=np.float32)
        world.Barrier()
        t0 = time.perf_counter()
        world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        elapsed = time.perf_counter() - t0
        size = world.Get_size()
        if buf[0] != size * (size + 1) / 2:
            raise SystemExit("netshape_probe: wrong allreduce result")
    return world.allreduce(elapsed, op=MPI.MAX)


def _class_bytes() -> dict:
    """Bytes sent by each class of mc0's qdisc, by class id (``{"1:10": ..., "1:20": ...}``)."""
    out = subprocess.run(["tc", "-s", "class", "show", "dev", "mc0"], capture_output=True, text=True).stdout
    return {m[0]: int(m[1]) for m in re.findall(r"class \S+ (\S+) .*?\n\s*Sent (\d+) bytes", out)}


def main() -> None:
    """Time the operation and print the JSON line on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nbytes", type=int)
    parser.add_argument("--op", choices=("send", "allreduce"), default="send")
    parser.add_argument("--dest", type=int, default=1, help="the receiving rank of --op send")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    if args.op == "send" and not 0 < args.dest < world.Get_size():
        raise SystemExit(f"netshape_probe: --op send needs a --dest between 1 and {world.Get_size() - 1}")
    seconds = _send(world, args.nbytes, args.dest) if args.op == "send" else _allreduce(world, args.nbytes)
    if world.Get_rank() == 0:
        print(json.dumps({"op": args.op, "bytes": args.nbytes, "ranks": world.Get_size(), "seconds": seconds,
                          "classes": _class_bytes()}), flush=True)


if __name__ == "__main__":
    main()
