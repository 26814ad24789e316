"""The asynchronous job behind tests/test_adpsgd.py: AD-PSGD variants with one rank slowed.

usage: mpiexec -n 4 python -m mpi4py tests/adpsgd_job.py OUT.json [SECONDS] [SLEEP]

For each configuration every rank trains the non-IID least-squares problem of ``lsq_problem``. The
last rank is held first: it takes no step until every other rank has taken as many steps as it will take
in all (a non-blocking barrier the fast ranks join once they have), which a method whose step waited for
it would never allow (``ahead_while_held``: whether they got there within HELD_S seconds; after that the
slow rank goes on anyway, so the job ends either way). Then the last rank sleeps ``SLEEP`` seconds after
every step and takes SECONDS / SLEEP steps (about SECONDS of wall time, more on a loaded machine); the
other ranks step until it is done (a non-blocking barrier it joins last), however many steps that lets
them take. So the slow rank's work is fixed, whatever the load. Then all ranks meet and measure:
steps per rank, F(x̄) - F* relative to F(x_0) - F*, the same of each rank's own model, the consensus
distance and the bytes read. Then each
rank checks its own state round trip (state_dict -> fresh algorithm -> load_state_dict: same parameters,
same state, same next peers). Rank 0 writes everything to OUT.json.
"""

import json
import os
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpicomm import topology  # noqa: E402
from mpicomm.algorithms import make_algorithm  # noqa: E402
from mpicomm.comm import Communicator  # noqa: E402
from tests import lsq_problem as lsq  # noqa: E402

HELD_S = 60.0  # only to end a hang: how long the held rank waits for the others to get ahead of it

CONFIGS = [  # label, name, options, share of SECONDS
    ("adpsgd", "adpsgd", {}, 1.0),
    ("8bit", "moniqua_adpsgd", {"bits": 8, "parts": 1}, 1.0),
    ("default", "moniqua_adpsgd", {}, 1.0),  # 4 bits on a rotating quarter of each tensor, dither, theta per tensor
    ("paper", "moniqua_adpsgd", {"bits": 1, "parts": 1, "theta_per": "model", "rounding": "nearest"}, 1.0),
    ("guard", "moniqua_adpsgd", {"bits": 2, "parts": 1, "theta": 1e-5, "theta_cap": 4.0}, 0.3),  # every pull wraps
]


def same_state(a, b) -> bool:
    """Deep equality of two state dicts (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b


def run(comm, label: str, name: str, options: dict, seconds: float, sleep: float) -> dict:
    """Train against the clock; measure; check the state round trip on this rank."""
    n, rank = comm.Get_size(), comm.Get_rank()
    ring = topology.ring(n)
    algo = make_algorithm(name, lsq.make_model(), Communicator(comm, ring), lr=0.1, **options)
    comm.Barrier()
    steps, slow_steps, ahead_while_held = 0, max(1, round(seconds / sleep)), False
    if rank == n - 1:
        ahead = comm.Ibarrier()  # completes once every other rank has taken slow_steps steps
        deadline = time.monotonic() + HELD_S
        while not ahead_while_held and time.monotonic() < deadline:
            ahead_while_held = ahead.Test()
            time.sleep(0.01)
        while steps < slow_steps:
            lsq.train(algo, 1)
            steps += 1
            time.sleep(sleep)
        comm.Ibarrier().Wait()
        ahead.Wait()
    else:
        lsq.train(algo, slow_steps)  # while the slow rank is held: no step of it to wait for
        steps = slow_steps
        ahead = comm.Ibarrier()
        slow_done = comm.Ibarrier()  # completes once the slow rank has taken all its steps
        while not slow_done.Test():
            lsq.train(algo, 1)
            steps += 1
        ahead.Wait()
    stats = algo.stats()
    comm.Barrier()
    f0, fstar = lsq.objective(torch.zeros(lsq.D), n), lsq.objective(lsq.optimum(n), n)
    gap = (lsq.objective(algo.consensus_model(), n) - fstar) / (f0 - fstar)
    spread = algo.consensus_distance()
    state = algo.state_dict()
    fresh = make_algorithm(name, lsq.make_model(), Communicator(comm, ring), lr=0.1, **options)
    fresh.load_state_dict(state)
    round_trip = same_state(fresh.state_dict(), state) and [algo.next_peer() for _ in range(8)] == [
        fresh.next_peer() for _ in range(8)
    ]
    fresh.close()
    algo.close()
    return {
        "label": label,
        "name": name,
        "options": options,
        "steps": comm.allgather(steps),
        "ahead_while_held": comm.bcast(ahead_while_held, root=n - 1),
        "gap": gap,
        "consensus_distance": spread,
        "own_gaps": comm.allgather(lsq.relative_gap(algo.flat.data, n)),
        "bytes_read": comm.allgather(stats["total_bytes_contributed"]),
        "message_bytes": algo.message_bytes,
        "wrapped_parts": comm.allgather(stats.get("wrapped_parts", 0)),
        "pulls": comm.allgather(stats.get("pulls", 0)),
        "round_trip": comm.allgather(bool(round_trip)),
        "transport": algo.mailbox.transport,
        "params_finite": comm.allgather(bool(torch.isfinite(algo.flat.data).all())),
    }


def main() -> None:
    """Run every configuration and write the results (rank 0)."""
    comm = MPI.COMM_WORLD
    out = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    sleep = float(sys.argv[3]) if len(sys.argv) > 3 else 0.02
    results = [run(comm, label, name, options, share * seconds, sleep) for label, name, options, share in CONFIGS]
    if comm.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"size": comm.Get_size(), "seconds": seconds, "sleep": sleep, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
