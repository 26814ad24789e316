"""The MPI collectives a sharded step uses, bare (mpi4py on numpy): seconds and peak memory each adds.

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/sharding/mpi_collectives.py [--params 25]'

On a vector of ``--params`` million fp32 (the MLP of memory.py), split into the shards of ``shard=True`` (chunks
of 8 ceil(d / 8n)): the replicated method's in-place Allreduce; the parameter allgather as the exchange runs it
(in-place Allgatherv) and as Allgather, one Bcast per owner; the all-to-all of one shard to each rank. Printed
by rank 0: each call's best of ``--repeats`` (the slowest rank's), and the rise of the peak resident memory
(VmHWM, reset before each call) it causes, largest over the ranks. Set MPICH's algorithm choice through its
environment (e.g. ``MPIR_CVAR_ALLGATHERV_INTRA_ALGORITHM=recursive_doubling``) to compare.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI


def hwm_mib() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=25.178112, help="millions of fp32 elements")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.size, comm.rank
    d = int(args.params * 1e6)
    chunk = 8 * -(-d // (8 * n))
    counts = [max(0, min(chunk, d - k * chunk)) for k in range(n)]
    displs = [min(k * chunk, d) for k in range(n)]
    vector = np.ones(d, np.float32)
    mine = vector[displs[rank]:displs[rank] + counts[rank]].copy()
    padded = np.ones(chunk * n, np.float32)
    landed = np.ones(counts[rank] * n, np.float32)

    def bcasts():
        for k in range(n):
            comm.Bcast(vector[displs[k]:displs[k] + counts[k]], root=k)

    calls = {
        "Allreduce, in place (replicated)": lambda: comm.Allreduce(MPI.IN_PLACE, vector),
        "Allgatherv, in place (the exchange's)": lambda: comm.Allgatherv(
            MPI.IN_PLACE, [vector, counts, displs, MPI.FLOAT]),
        "Allgather of equal padded shards": lambda: comm.Allgather(mine if counts[rank] == chunk else
                                                                   np.resize(mine, chunk), padded),
        "Bcast from each owner": bcasts,
        "Alltoallv, one shard to each rank": lambda: comm.Alltoallv(
            [vector, counts, displs, MPI.FLOAT], [landed, [counts[rank]] * n, [k * counts[rank] for k in range(n)],
                                                  MPI.FLOAT]),
    }
    if rank == 0:
        print(f"{n} ranks, {d:,} fp32 ({4 * d / 2**20:.0f} MiB), {MPI.Get_library_version().splitlines()[0]}")
    for name, call in calls.items():
        best, rise = float("inf"), 0.0
        for _ in range(args.repeats):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = hwm_mib()
            comm.Barrier()
            t0 = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t0)
            rise = max(rise, hwm_mib() - before)
        best = comm.allreduce(best, op=MPI.MAX)
        rise = comm.allreduce(rise, op=MPI.MAX)
        if rank == 0:
            print(f"  {name}: {best:.3f} s, peak +{rise:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
