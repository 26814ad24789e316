"""Transport table: the Communicator against raw mpi4py on the same buffers, per collective and size (nccl-tests style).

For allreduce, reduce-scatter, allgather, the neighbour allgather and the neighbour alltoallv (4 ranks by default,
a ring graph for the neighbour collectives), each size from 4 KiB to 64 MiB is timed both ways on the same
buffers: raw mpi4py (``Allreduce``, ``Reduce_scatter``, ``Allgather``, ``Neighbor_allgather``,
``Neighbor_alltoallv`` with prebuilt numpy buffer specs: the floor a Python caller can reach) and
``Communicator`` (``allreduce``, ``reduce_scatter``, ``allgather``, ``neighbor_allgather``,
``neighbor_alltoallv``; cached receive buffers, Ledger booking, clock, hang guard, all as an algorithm runs them).
A timed batch is a barrier, then ``iters`` back-to-back calls; its time per call is the slowest rank's. Batches
alternate (raw, ours, ours, raw, raw, ours, ...) so machine noise hits both alike; each figure is the median of
``--repeat`` batches, and each row the median of ``--runs`` separate ``mpiexec`` runs (ratio: the median of the
runs' ratios, with their range).

Size, as nccl-tests counts it: allreduce the buffer; reduce-scatter the whole input vector (each rank keeps
size / n); allgather the whole output (each rank contributes size / n); neighbour allgather the message each rank
sends to each out-neighbour; neighbour alltoallv all a rank sends (size / degree to each out-neighbour).
algbw = size / time. busbw = algbw x 2(n-1)/n (allreduce), x (n-1)/n (reduce-scatter, allgather), x out-degree
(neighbour allgather: the bytes each rank puts on its links), x 1 (neighbour alltoallv).

    unshare -n bash -c 'ip link set lo up && python bench/transport/collectives.py --ranks 4 --runs 3'

It starts ``mpiexec -n RANKS`` itself (``--runs`` times, the load average read before and after each run),
then measures the Communicator's own CPU per call in one process (thread CPU time of a call on ``MPI.COMM_SELF``,
where MPI moves nothing, against raw mpi4py on the same buffers) and writes docs/results/NAME.{md,json}.
``--against DIR`` also runs every run with the mpicomm package of another checkout at DIR (alternating with this
one) and adds its ratio as a column: before/after figures of a change, measured under the same load.
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

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

SIZES = {"4KiB": 1 << 12, "16KiB": 1 << 14, "64KiB": 1 << 16, "256KiB": 1 << 18, "1MiB": 1 << 20, "4MiB": 1 << 22,
         "16MiB": 1 << 24, "64MiB": 1 << 26}
OPS = ("allreduce", "reduce_scatter", "allgather", "neighbor_allgather", "neighbor_alltoallv")
YIELD_VAR = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def busbw_factor(op: str, n: int, degree: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` at ``n`` ranks (the neighbour collectives: see the docstring)."""
    return {"allreduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "allgather": (n - 1) / n,
            "neighbor_allgather": float(degree), "neighbor_alltoallv": 1.0}[op]


def iters_for(nbytes: int, iters: int) -> int:
    """Calls per timed batch: ``iters`` at 4 KiB, fewer as the size grows (one call per batch from 4 MiB)."""
    return max(1, min(iters, (4 << 20) // nbytes))


# ---------------------------------------------------------------------------------------------- under mpiexec
def _cases(op: str, nbytes: int, world, ours, graph, ring):
    """(raw, ours, check) for ``op`` at ``nbytes``: two callables on the same buffers, and a check of both results."""
    import torch
    from mpi4py import MPI

    rank, n = world.Get_rank(), world.Get_size()
    sources, dests = ring.in_neighbors(rank), ring.out_neighbors(rank)
    if op == "allreduce":
        t = torch.zeros(nbytes // 4)  # zeros: every call sums to zeros again
        spec = [t.numpy(), MPI.FLOAT]

        def check():
            t.fill_(rank + 1)
            ours.allreduce(t)
            ok = bool((t == n * (n + 1) / 2).all())
            t.fill_(rank + 1)
            world.Allreduce(MPI.IN_PLACE, spec, MPI.SUM)
            ok &= bool((t == n * (n + 1) / 2).all())
            t.zero_()
            return ok

        return (lambda: world.Allreduce(MPI.IN_PLACE, spec, MPI.SUM)), (lambda: ours.allreduce(t)), check
    if op == "reduce_scatter":
        part = nbytes // 4 // n
        send = torch.zeros(part * n)
        out = torch.empty(part)
        counts = [part] * n
        sspec, rspec = [send.numpy(), MPI.FLOAT], [out.numpy(), MPI.FLOAT]

        def check():
            base = torch.arange(part * n, dtype=torch.float32) % 5
            send.copy_(base + rank)
            want = (base * n + n * (n - 1) / 2)[rank * part:(rank + 1) * part]
            ok = torch.equal(ours.reduce_scatter(send, counts), want)
            world.Reduce_scatter(sspec, rspec, counts, MPI.SUM)
            ok &= torch.equal(out, want)
            send.zero_()
            return ok

        return ((lambda: world.Reduce_scatter(sspec, rspec, counts, MPI.SUM)),
                (lambda: ours.reduce_scatter(send, counts)), check)
    if op == "allgather":
        send = torch.full((nbytes // n,), rank, dtype=torch.uint8)
        out = torch.empty((n, nbytes // n), dtype=torch.uint8)
        sspec, rspec = [send.numpy(), MPI.BYTE], [out.numpy(), MPI.BYTE]
        want = torch.arange(n, dtype=torch.uint8)[:, None].expand(n, nbytes // n)

        def check():
            ok = torch.equal(ours.allgather(send), want)
            out.zero_()
            world.Allgather(sspec, rspec)
            return ok and torch.equal(out, want)

        return (lambda: world.Allgather(sspec, rspec)), (lambda: ours.allgather(send)), check
    if op == "neighbor_allgather":
        send = torch.full((nbytes,), rank, dtype=torch.uint8)
        out = torch.empty((len(sources), nbytes), dtype=torch.uint8)
        sspec, rspec = [send.numpy(), MPI.BYTE], [out.numpy(), MPI.BYTE]
        want = torch.tensor(sources, dtype=torch.uint8)[:, None].expand(len(sources), nbytes)

        def check():
            ok = torch.equal(ours.neighbor_allgather(send), want)
            out.zero_()
            graph.Neighbor_allgather(sspec, rspec)
            return ok and torch.equal(out, want)

        return ((lambda: graph.Neighbor_allgather(sspec, rspec)), (lambda: ours.neighbor_allgather(send)), check)
    # neighbor_alltoallv: part k (size / degree bytes, the value 10 * rank + k) to out-neighbour k; the Communicator
    # gets the parts as separate tensors (as PowerGossip sends them), raw mpi4py the same bytes packed in one buffer
    part = nbytes // len(dests)
    sends = [torch.full((part,), 10 * rank + k, dtype=torch.uint8) for k in range(len(dests))]
    packed = torch.cat(sends)
    out = torch.empty(part * len(sources), dtype=torch.uint8)
    displs = [k * part for k in range(len(dests))]
    sspec = [packed.numpy(), [part] * len(dests), displs, MPI.BYTE]
    rspec = [out.numpy(), [part] * len(sources), [k * part for k in range(len(sources))], MPI.BYTE]
    recv_numels = [part] * len(sources)
    # what source s sent to this rank: its part number = this rank's index among s's out-neighbours
    want = torch.cat([torch.full((part,), 10 * s + ring.out_neighbors(s).index(rank), dtype=torch.uint8)
                      for s in sources])

    def check():
        ok = torch.equal(torch.cat(ours.neighbor_alltoallv(sends, recv_numels)), want)
        out.zero_()
        graph.Neighbor_alltoallv(sspec, rspec)
        return ok and torch.equal(out, want)

    return ((lambda: graph.Neighbor_alltoallv(sspec, rspec)), (lambda: ours.neighbor_alltoallv(sends, recv_numels)),
            check)


def worker(args) -> None:
    """Under mpiexec: time every (op, size) both ways; rank 0 writes the run's JSON."""
    import numpy as np
    from mpi4py import MPI

    from mpicomm import topology
    from mpicomm.comm import Communicator

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    ring = topology.ring(n)
    graph = world.Create_dist_graph_adjacent(list(ring.in_neighbors(rank)), list(ring.out_neighbors(rank)),
                                             reorder=False)
    rows = []
    for op in args.ops.split(","):
        ours = Communicator(world, ring)  # one per collective: its cached receive buffers go with it
        for label in args.sizes.split(","):
            nbytes = SIZES[label]
            raw, wrapped, check = _cases(op, nbytes, world, ours, graph, ring)
            k = iters_for(nbytes, args.iters)
            repeat = args.repeat if nbytes < (32 << 20) else max(5, args.repeat // 2)
            for fn in (raw, wrapped, raw, wrapped):  # warm-up: caches, plans, first-touch pages
                fn()
            times = {"raw": np.empty(repeat), "ours": np.empty(repeat)}
            for r in range(repeat):
                for name in (("raw", "ours") if r % 2 == 0 else ("ours", "raw")):
                    fn = raw if name == "raw" else wrapped
                    world.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(k):
                        fn()
                    times[name][r] = (time.perf_counter() - t0) / k
            for name in times:  # the slowest rank's time per batch
                world.Allreduce(MPI.IN_PLACE, times[name], MPI.MAX)
            correct = world.allreduce(check(), op=MPI.LAND)
            r_us, o_us = float(np.median(times["raw"])) * 1e6, float(np.median(times["ours"])) * 1e6
            rows.append({"op": op, "size": label, "bytes": nbytes, "iters": k, "repeat": repeat, "raw_us": r_us,
                         "communicator_us": o_us, "ratio": o_us / r_us, "correct": bool(correct),
                         "raw_batches_us": [t * 1e6 for t in times["raw"]],
                         "communicator_batches_us": [t * 1e6 for t in times["ours"]]})
            if rank == 0 and args.verbose:
                print(f"{op:>20} {label:>7} raw {r_us:10.1f} us  ours {o_us:10.1f} us  {o_us / r_us:6.3f}",
                      flush=True)
            del raw, wrapped, check
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "degree": len(ring.out_neighbors(0)), "rows": rows}, f)


# ---------------------------------------------------------------------------------------------- one process
def own_cpu(args) -> None:
    """Thread CPU µs per call of raw mpi4py and of the Communicator on ``MPI.COMM_SELF`` (MPI moves nothing)."""
    import torch
    from mpi4py import MPI

    from mpicomm import topology
    from mpicomm.comm import Communicator

    self_comm = MPI.COMM_SELF
    ours = Communicator(self_comm, topology.ring(1))
    graph = self_comm.Create_dist_graph_adjacent([], [], reorder=False)
    nbytes = SIZES["4KiB"]
    send = torch.zeros(nbytes, dtype=torch.uint8)
    recv = torch.empty((0, nbytes), dtype=torch.uint8)
    t = torch.zeros(nbytes // 4)
    ag_out = torch.empty((1, nbytes), dtype=torch.uint8)
    pairs = {
        "allreduce": ((lambda: self_comm.Allreduce(MPI.IN_PLACE, [t.numpy(), MPI.FLOAT], MPI.SUM)),
                      (lambda: ours.allreduce(t))),
        "allgather": ((lambda: self_comm.Allgather([send.numpy(), MPI.BYTE], [ag_out.numpy(), MPI.BYTE])),
                      (lambda: ours.allgather(send))),
        "neighbor_allgather": ((lambda: graph.Neighbor_allgather([send.numpy(), MPI.BYTE], [recv.numpy(), MPI.BYTE])),
                               (lambda: ours.neighbor_allgather(send))),
    }

    def per_call(fn) -> float:
        t0 = time.thread_time_ns()
        for _ in range(args.calls):
            fn()
        return (time.thread_time_ns() - t0) / args.calls / 1e3

    out = {}
    for op, (raw, wrapped) in pairs.items():
        per_call(raw), per_call(wrapped)  # warm-up
        t_raw, t_ours = [], []
        for _ in range(args.cpu_rounds):
            t_raw.append(per_call(raw))
            t_ours.append(per_call(wrapped))
        r, o = statistics.median(t_raw), statistics.median(t_ours)
        out[op] = {"bytes": nbytes, "raw_cpu_us": r, "communicator_cpu_us": o, "own_cpu_us": o - r}
    with open(args.json, "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------------------------------------- the driver
def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _wait_for_load(args) -> float:
    """With ``--wait-load L``: sleep until the 1-minute load average is at most L (at most ``--wait-s`` seconds in
    all per run); returns the seconds waited."""
    waited = 0.0
    while args.wait_load is not None and os.getloadavg()[0] > args.wait_load and waited < args.wait_s:
        time.sleep(15)
        waited += 15
    return waited


def _launch(args, tree: str | None, out: str, mpiexec: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree:
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), "--worker", "--json", out,
           "--ops", args.ops, "--sizes", args.sizes, "--repeat", str(args.repeat), "--iters", str(args.iters)]
    waited = _wait_for_load(args)
    before = _loadavg()
    subprocess.run(cmd, env=env, check=True, timeout=3600)
    with open(out) as f:
        run = json.load(f)
    run["loadavg_before"], run["loadavg_after"], run["waited_s"] = before, _loadavg(), waited
    return run


def _own_cpu_run(args, tree: str | None, out: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree:
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--own-cpu", "--json", out, "--calls",
                    str(args.calls), "--cpu-rounds", str(args.cpu_rounds)], env=env, check=True, timeout=600)
    with open(out) as f:
        return json.load(f)


def _summary(runs: list[dict]) -> list[dict]:
    """Per (op, size): medians over the runs of raw and ours µs and of the ratio, and the ratio's range."""
    rows = []
    for i, first in enumerate(runs[0]["rows"]):
        per_run = [run["rows"][i] for run in runs]
        ratios = [r["ratio"] for r in per_run]
        rows.append({"op": first["op"], "size": first["size"], "bytes": first["bytes"], "iters": first["iters"],
                     "repeat": first["repeat"], "raw_us": statistics.median(r["raw_us"] for r in per_run),
                     "communicator_us": statistics.median(r["communicator_us"] for r in per_run),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "correct": all(r["correct"] for r in per_run)})
    return rows


def _fmt_us(us: float) -> str:
    return f"{us:,.1f}"


def _fmt_bw(nbytes: int, us: float, factor: float) -> str:
    return f"{nbytes / us / 1e3 * factor:.2f}"  # bytes / µs / 1e3 = GB/s


def drive(args) -> None:
    """Start the runs, aggregate, write docs/results/NAME.{md,json}."""
    sys.path.insert(0, REPO)  # the driver only: the workers import the mpicomm under test (PYTHONPATH, --against)
    from bench.common import RESULTS, enter_loopback_namespace, machine, markdown_table, write_json

    enter_loopback_namespace()

    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("no mpiexec on PATH")
    trees = {"ours": None} if not args.against else {"ours": None, "against": os.path.abspath(args.against)}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    cpu: dict[str, list[dict]] = {name: [] for name in trees}
    started = _loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                out = os.path.join(tmp, f"{name}-{r}.json")
                runs[name].append(_launch(args, trees[name], out, mpiexec))
                print(f"run {r + 1}/{args.runs} ({name}) done, load average {runs[name][-1]['loadavg_after']}",
                      flush=True)
        for r in range(args.cpu_runs):
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                cpu[name].append(_own_cpu_run(args, trees[name], os.path.join(tmp, f"cpu-{name}-{r}.json")))
    ended = _loadavg()
    n, degree = runs["ours"][0]["ranks"], runs["ours"][0]["degree"]
    summary = {name: _summary(rs) for name, rs in runs.items()}
    own = {name: {op: {key: statistics.median(c[op][key] for c in cs) for key in cs[0][op]} for op in cs[0]}
           for name, cs in cpu.items()}
    loads = [x for rs in runs.values() for run in rs for x in (run["loadavg_before"][0], run["loadavg_after"][0])]
    heavy = os.environ.get(YIELD_VAR, "unset")
    header = ["collective", "size", "raw µs", "mpicomm µs", "ratio", "ratio per run", "algbw GB/s", "busbw GB/s"]
    if args.against:
        header.append(f"ratio, {args.against_label}")
    rows = []
    for i, row in enumerate(summary["ours"]):
        factor = busbw_factor(row["op"], n, degree)
        cells = [row["op"], row["size"], _fmt_us(row["raw_us"]), _fmt_us(row["communicator_us"]),
                 f"**{row['ratio']:.2f}**" if row["ratio"] <= target(row["bytes"]) else f"{row['ratio']:.2f}",
                 f"{row['ratio_min']:.2f}–{row['ratio_max']:.2f}",
                 _fmt_bw(row["bytes"], row["communicator_us"], 1.0),
                 _fmt_bw(row["bytes"], row["communicator_us"], factor)]
        if not row["correct"]:
            cells[1] += " (wrong result)"
        if args.against:
            other = summary["against"][i]
            cells.append(f"{other['ratio']:.2f} ({other['ratio_min']:.2f}–{other['ratio_max']:.2f})")
        rows.append(cells)
    command = ("unshare -n bash -c 'ip link set lo up && python bench/transport/collectives.py "
               + " ".join(args.argv) + "'")
    title = (f"Transport: the Communicator against raw mpi4py on the same buffers, {n} ranks "
             f"(neighbour collectives on the ring, out-degree {degree}), loopback, MPICH, {YIELD_VAR}={heavy}")
    cpu_header = ["collective (4 KiB, MPI.COMM_SELF)", "raw mpi4py CPU µs", "mpicomm CPU µs", "mpicomm's own µs"]
    if args.against:
        cpu_header.append(f"own µs, {args.against_label}")
    cpu_rows = []
    for op, o in own["ours"].items():
        cells = [op, f"{o['raw_cpu_us']:.2f}", f"{o['communicator_cpu_us']:.2f}", f"{o['own_cpu_us']:.2f}"]
        if args.against:
            cells.append(f"{own['against'][op]['own_cpu_us']:.2f}")
        cpu_rows.append(cells)
    text = (f"{title}\n\n{markdown_table(header, rows)}\n\n"
            f"Ratio = mpicomm µs / raw µs; bold where it meets the target (≤ 1.05 from 1 MiB, ≤ 1.5 below). "
            f"Each µs figure: median over {args.runs} runs of the median of {args.repeat} interleaved batches "
            f"(half as many from 32 MiB) of `iters` back-to-back calls (up to {args.iters} at 4 KiB, one from 4 MiB), "
            f"a batch's time per call being its slowest rank's; ratio: median of the runs' ratios, with their range. "
            f"algbw and busbw from the mpicomm time; busbw = algbw × 2(n−1)/n (allreduce), × (n−1)/n "
            f"(reduce-scatter, allgather), × out-degree {degree} (neighbour allgather: the bytes each rank puts on "
            f"its links), × 1 (neighbour alltoallv: size is all a rank sends). Size: allreduce the buffer, "
            f"reduce-scatter the input vector, allgather the output, neighbour allgather the message to each "
            f"out-neighbour, neighbour alltoallv all of a rank's parts.\n\n"
            f"Own CPU per call (thread CPU time, one process, median of {args.cpu_rounds} interleaved rounds of "
            f"{args.calls} calls, median of {args.cpu_runs} processes):\n\n{markdown_table(cpu_header, cpu_rows)}\n\n"
            f"Load average (1 min) {min(loads):.1f}–{max(loads):.1f} during the runs "
            f"({started[0]:.1f} at the start, {ended[0]:.1f} at the end) on {os.cpu_count()} cores.\n\n"
            f"Command: `{command}`\n")
    name = args.name
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(text)
    write_json(os.path.join(RESULTS, f"{name}.json"),
               {"title": title, "machine": machine(), "command": command, "ranks": n, "degree": degree,
                "heavy_yield": heavy, "loadavg_start": started, "loadavg_end": ended,
                "loadavg_runs": {k: [[run["loadavg_before"], run["loadavg_after"]] for run in rs]
                                 for k, rs in runs.items()},
                "against": args.against, "against_label": args.against_label,
                "rows": summary["ours"], "rows_against": summary.get("against"), "own_cpu": own,
                "runs": {k: [run["rows"] for run in rs] for k, rs in runs.items()}})
    print(text)
    print(f"wrote {RESULTS}/{name}.{{md,json}}")


def target(nbytes: int) -> float:
    """The ratio this table aims at: 1.05 from 1 MiB, 1.5 below."""
    return 1.05 if nbytes >= (1 << 20) else 1.5


def main() -> None:
    """Drive the runs (default), or be one of them (``--worker`` under mpiexec, ``--own-cpu`` in one process)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="separate mpiexec runs (default 3)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma list of " + ",".join(OPS))
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma list of " + ",".join(SIZES))
    parser.add_argument("--repeat", type=int, default=15, help="timed batches per variant, size and run")
    parser.add_argument("--iters", type=int, default=32, help="calls per batch at 4 KiB (fewer for larger sizes)")
    parser.add_argument("--calls", type=int, default=5000, help="calls per round of the own-CPU measurement")
    parser.add_argument("--cpu-rounds", type=int, default=7)
    parser.add_argument("--cpu-runs", type=int, default=3, help="processes of the own-CPU measurement")
    parser.add_argument("--against", default=None, metavar="DIR",
                        help="also run the mpicomm package found in DIR (another checkout), alternating")
    parser.add_argument("--against-label", default="other tree")
    parser.add_argument("--wait-load", type=float, default=None, metavar="L",
                        help="before each run, wait until the 1-minute load average is at most L (shared machines)")
    parser.add_argument("--wait-s", type=float, default=1800, help="the longest wait for --wait-load, per run")
    parser.add_argument("--name", default="transport", help="results go to docs/results/NAME.{md,json}")
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--own-cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true", help="print each row as it is measured (rank 0)")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    unknown = [s for s in args.sizes.split(",") if s not in SIZES] + [o for o in args.ops.split(",") if o not in OPS]
    if unknown:
        parser.error(f"unknown sizes or ops {unknown}")
    if min(args.ranks, args.runs, args.repeat, args.iters, args.calls, args.cpu_rounds, args.cpu_runs) < 1:
        parser.error("counts must be >= 1")
    if args.worker:
        worker(args)
    elif args.own_cpu:
        own_cpu(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
