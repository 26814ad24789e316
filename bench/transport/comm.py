"""Overhead of ``Communicator.neighbor_allgather`` over raw mpi4py ``Neighbor_allgather`` on the same bytes.

Both run on the same distributed-graph ring of all ranks, on the same send buffer, alternating
(raw, ours, raw, ours, ...) so machine noise hits both alike; each is the median of ``--repeat``
timed calls (after warm-up), each call bracketed by barriers. The ratio ours / raw is what to read.

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/transport/comm.py'

The table of every collective (allreduce, reduce-scatter, allgather, the neighbour allgather and alltoallv) from
4 KiB to 64 MiB, with algbw and busbw as nccl-tests reports them, is ``bench/transport/collectives.py``.

It also reports the Communicator's own CPU per call: thread CPU time per ``neighbor_allgather`` of 1 KB
on a graph with no neighbours (``MPI.COMM_SELF``), where the MPI call itself does nothing, against raw
mpi4py on the same graph (median of interleaved rounds; CPU time, so other processes' load hardly
moves it).

With ``--compare-yield N`` (run without mpiexec) it starts ``mpiexec -n N`` itself, alternately without
and with ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (MPICH: a rank waiting in MPI sleeps instead of spinning),
``--rounds`` times each, on the small sizes, and prints both sets of rows side by side. Open MPI's
equivalent setting is ``OMPI_MCA_mpi_yield_when_idle=1``.

    unshare -n bash -c 'ip link set lo up && python bench/transport/comm.py --compare-yield 4'
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {"1KB": 1 << 10, "16KB": 1 << 14, "256KB": 1 << 18, "1MB": 1 << 20, "4MB": 1 << 22,
         "16MB": 1 << 24, "64MB": 1 << 26}
YIELD_VAR = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def _timed(fn, comm) -> float:
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t0
    return comm.allreduce(elapsed, op=MPI.MAX)


def own_cpu_per_call(nbytes: int = 1024, calls: int = 5000, rounds: int = 7) -> dict:
    """Thread CPU µs per call of raw mpi4py and of the Communicator on a neighbourless graph (MPI does nothing)."""
    import torch
    from mpi4py import MPI

    from mpicomm import topology
    from mpicomm.comm import Communicator

    ours = Communicator(MPI.COMM_SELF, topology.ring(1))
    graph = MPI.COMM_SELF.Create_dist_graph_adjacent([], [], reorder=False)
    send = torch.zeros(nbytes, dtype=torch.uint8)
    recv = torch.empty((0, nbytes), dtype=torch.uint8)

    def raw():
        graph.Neighbor_allgather([send.numpy(), MPI.BYTE], [recv.numpy(), MPI.BYTE])

    def wrapped():
        ours.neighbor_allgather(send)

    def per_call(fn) -> float:
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - t0) / calls * 1e6

    per_call(raw), per_call(wrapped)  # warm-up
    t_raw, t_ours = [], []
    for _ in range(rounds):
        t_raw.append(per_call(raw))
        t_ours.append(per_call(wrapped))
    r, o = statistics.median(t_raw), statistics.median(t_ours)
    return {"bytes": nbytes, "raw_cpu_us": r, "communicator_cpu_us": o, "own_cpu_us": o - r}


def measure(args) -> None:
    """Under mpiexec: measure and print the table; rank 0 writes JSON."""
    import torch
    from mpi4py import MPI

    from mpicomm import topology
    from mpicomm.comm import Communicator

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
    world.Barrier()
    own = own_cpu_per_call() if rank == 0 else None
    if rank == 0:
        heavy = os.environ.get(YIELD_VAR, "unset")
        print(f"ring of {world.Get_size()} ranks, neighbor_allgather, median of timed calls ({YIELD_VAR}={heavy})")
        print(f"{'size':>6}{'raw mpi4py us':>16}{'Communicator us':>18}{'ratio':>8}{'correct':>9}")
        for row in rows:
            print(f"{row['size']:>6}{row['raw_us']:>16.1f}{row['communicator_us']:>18.1f}"
                  f"{row['ratio']:>8.3f}{row['correct']!s:>9}")
        print(f"own CPU per call ({own['bytes']} B, no neighbours): raw mpi4py {own['raw_cpu_us']:.2f} us, "
              f"Communicator {own['communicator_cpu_us']:.2f} us, its own work {own['own_cpu_us']:.2f} us")
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"ranks": world.Get_size(), "heavy_yield": heavy, "rows": rows, "own_cpu": own}, f, indent=2)
        print(f"wrote {args.json}")


def compare_yield(args) -> None:
    """Start ``mpiexec -n N`` on the small sizes without and with the MPICH yield setting; print both."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("--compare-yield: no mpiexec on PATH")
    runs: dict[str, list[dict]] = {"unset": [], "1": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for setting in runs:
                env = {k: v for k, v in os.environ.items() if k != YIELD_VAR}
                if setting == "1":
                    env[YIELD_VAR] = "1"
                out = os.path.join(tmp, f"{setting}-{r}.json")
                cmd = [mpiexec, "-n", str(args.compare_yield), sys.executable, os.path.abspath(__file__),
                       "--sizes", args.sizes, "--repeat", str(args.repeat), "--json", out]
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
                with open(out) as f:
                    runs[setting].append(json.load(f))
    rows = []
    for i, label in enumerate(args.sizes.split(",")):
        row = {"size": label, "bytes": SIZES[label]}
        for setting, key in (("unset", "spin"), ("1", "yield")):
            for field in ("raw_us", "communicator_us"):
                row[f"{field}_{key}"] = statistics.median(run["rows"][i][field] for run in runs[setting])
        row["speedup_raw"] = row["raw_us_spin"] / row["raw_us_yield"]
        row["speedup_communicator"] = row["communicator_us_spin"] / row["communicator_us_yield"]
        rows.append(row)
    cores = os.cpu_count()
    print(f"ring of {args.compare_yield} ranks on {cores} cores, neighbor_allgather, median of {args.repeat} calls, "
          f"median of {args.rounds} runs each; spin = {YIELD_VAR} unset, yield = {YIELD_VAR}=1")
    print(f"{'size':>6}{'raw spin us':>13}{'raw yield us':>14}{'ours spin us':>14}{'ours yield us':>15}"
          f"{'speed-up raw':>14}{'speed-up ours':>15}")
    for row in rows:
        print(f"{row['size']:>6}{row['raw_us_spin']:>13.1f}{row['raw_us_yield']:>14.1f}"
              f"{row['communicator_us_spin']:>14.1f}{row['communicator_us_yield']:>15.1f}"
              f"{row['speedup_raw']:>13.2f}x{row['speedup_communicator']:>14.2f}x")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"ranks": args.compare_yield, "cores": cores, "rounds": args.rounds, "repeat": args.repeat,
                   "loadavg_at_end": os.getloadavg(), "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


def main() -> None:
    """Measure (under mpiexec) or, with ``--compare-yield N``, start the spin/yield runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="comma list of " + ",".join(SIZES)
                        + " (default: all; 1KB,16KB,256KB with --compare-yield)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", default=None, help="default bench/results/comm.json (comm_yield.json)")
    parser.add_argument("--compare-yield", type=int, default=0, metavar="N",
                        help="run mpiexec -n N without and with MPIR_CVAR_ENABLE_HEAVY_YIELD=1")
    parser.add_argument("--rounds", type=int, default=2, help="runs per setting with --compare-yield")
    args = parser.parse_args()
    if args.repeat < 1 or args.rounds < 1 or args.compare_yield < 0:
        parser.error("--repeat and --rounds must be >= 1 and --compare-yield >= 0")
    unknown = [s for s in (args.sizes or "").split(",") if s and s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {','.join(SIZES)}")
    if args.compare_yield:
        args.sizes = args.sizes or "1KB,16KB,256KB"
        args.json = args.json or "bench/results/comm_yield.json"
        compare_yield(args)
    else:
        args.sizes = args.sizes or ",".join(SIZES)
        args.json = args.json or "bench/results/comm.json"
        measure(args)


if __name__ == "__main__":
    main()
