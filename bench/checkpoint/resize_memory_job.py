"""One phase of bench/checkpoint/resize_memory.py, run by every rank of an ``mpiexec``.

    mpiexec -n N python resize_memory_job.py save DIR PARAMS_M ALGORITHM
    mpiexec -n M python resize_memory_job.py restore DIR PARAMS_M ALGORITHM OUT.json

``save``: builds ALGORITHM around an MLP of about PARAMS_M million parameters, takes one step (so Adam's state
exists) and saves it to DIR. ``restore``: builds the same, records this process's resident memory, restores DIR
(at this job's size, whatever size saved it) and records the peak resident memory of the process
(``ru_maxrss``: a fresh process per phase, so the peak is this phase's); rank 0 writes every rank's figures to
OUT.json. The repository imported is the one on ``PYTHONPATH`` (the benchmark can point it at another checkout).
"""

import json
import resource
import sys
import time

import torch
from mpi4py import MPI

import mpicomm
from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

WIDTH = 4096


def rss_mib() -> float:
    """This process's resident memory now, MiB (from /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build(params_m: float, algorithm: str):
    """ALGORITHM around Linear layers of WIDTH x WIDTH (about ``params_m`` million parameters in all)."""
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.random.default_generator.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    world = MPI.COMM_WORLD
    return make_algorithm(algorithm, model, Communicator(world, topology.ring(world.Get_size())), lr=1e-3)


def main() -> None:
    phase, directory, params_m, algorithm = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    algo = build(params_m, algorithm)
    if phase == "save":
        algo.zero_grad()
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(algo.comm.rank))
        algo.model(x).square().mean().backward()
        algo.step()
        mpicomm.save(directory, algo, step=1)
        return
    built = rss_mib()
    t0 = time.perf_counter()
    mpicomm.restore(directory, algo)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    numel = sum(p.numel() for p in algo.model.parameters())
    rows = MPI.COMM_WORLD.gather({"rank": algo.comm.rank, "rss_built_mib": built, "peak_rss_mib": peak,
                                  "restore_s": seconds, "params": numel}, root=0)
    if algo.comm.rank == 0:
        with open(sys.argv[5], "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
