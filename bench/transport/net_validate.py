"""Validate the alpha-beta model (mpicomm/net/model.py) against real traffic shaping (scripts/netshape.sh).

For each setting (default 100mbit and 1gbit) this runs 4 MPI ranks, each in its own network namespace
with a tbf-shaped veth to a bridge, MPI on TCP between them, and times the project's Communicator on a
ring topology: ``neighbor_allgather`` (2 neighbours), ``allreduce`` and ``allgather`` of 1, 4 and 16 MB
float32 tensors (the median of ``--repeat`` timed calls after a warm-up call of each operation; each call
bracketed by a barrier, the slowest rank's time). The prediction is ``CostModel`` with the setting's
bandwidth and alpha = the measured one-way latency of a 1-byte message between two ranks over the same
shaped link, the other ranks sleeping (half the median ping-pong round trip; tbf does not delay a lone
tiny packet, so this is the MPI-over-TCP latency of the veth path, ~10-20 us). The same ping-pong with
the other ranks spinning in MPI's busy-polling progress loop (as during a collective) is reported as
"loaded alpha": with 4 ranks on fewer cores it includes scheduler time slices (30 us to over 1 ms).

Then the same check end to end: ResNet-20 trained for a few steps with D-PSGD and AllReduce-SGD under
real shaping, and again on shared memory with ``--net`` set to the same bandwidth and the measured
alpha; the seconds per step of both are compared.

Read the ratio measured / predicted. The shaper's rate counts wire bytes: a 1448-byte TCP payload
travels as a 1514-byte frame, so a bandwidth-bound transfer takes at least ~1.046x the payload model.

    python bench/transport/net_validate.py [--no-apps]   # both settings, about 5 minutes; enters `unshare -n` itself

Writes docs/results/net_validate.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench.apprun import launch  # noqa: E402
from bench.common import RESULTS, RUNS, enter_loopback_namespace, machine, markdown_table  # noqa: E402

NETSHAPE = os.path.join(ROOT, "scripts", "netshape.sh")
SETTINGS = ("100mbit,0us", "1gbit,0us")
OPS = ("neighbor_allgather", "allreduce", "allgather")
WIRE_OVERHEAD = 1514 / 1448  # Ethernet + IP + TCP (with timestamps) bytes per MSS-sized payload
MB = 1 << 20


# ------------------------------------------------------------------ worker (one per rank, under mpiexec)
def _ping_pong(world, quiet_others: bool) -> float:
    """One-way latency of a 1-byte message between ranks 0 and 1: half the median round trip.

    With ``quiet_others`` the other ranks wait sleeping (not in MPI's busy-polling progress loop), so
    the two ranks have the CPUs to themselves: the link's latency. Without it they spin in a barrier,
    as they do during a collective, which on an oversubscribed machine costs scheduler time slices.
    """
    import numpy as np

    rank = world.Get_rank()
    byte = np.zeros(1, dtype=np.uint8)
    rtts = []
    world.Barrier()
    if rank < 2:
        for i in range(220):
            t0 = time.perf_counter()
            if rank == 0:
                world.Send(byte, dest=1)
                world.Recv(byte, source=1)
            else:
                world.Recv(byte, source=0)
                world.Send(byte, dest=0)
            if i >= 20:
                rtts.append(time.perf_counter() - t0)
    if quiet_others:
        request = world.Ibarrier()
        while not request.Test():
            time.sleep(0.002)
    else:
        world.Barrier()
    return world.bcast(statistics.median(rtts) / 2 if rank == 0 else None, root=0)


def _worker(args) -> None:
    import torch
    from mpi4py import MPI

    from mpicomm.comm import Communicator
    from mpicomm.topology import build

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    comm = Communicator(world, build("ring", n))

    alpha = _ping_pong(world, quiet_others=True)
    alpha_loaded = _ping_pong(world, quiet_others=False)

    def timed(fn) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        fn()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    rows = []
    for op in OPS:
        for size_mb in args.sizes:
            nbytes = int(size_mb * MB)
            t = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
            call = {"neighbor_allgather": lambda t=t: comm.neighbor_allgather(t),
                    "allreduce": lambda t=t: comm.allreduce(t),
                    "allgather": lambda t=t: comm.allgather(t)}[op]
            if size_mb == args.sizes[0]:
                timed(call)  # warm-up: connections, buffers
            times = [timed(call) for _ in range(args.repeat)]
            rows.append({"op": op, "bytes": nbytes, "size_mb": size_mb, "times_s": times,
                         "measured_s": statistics.median(times),
                         "out_neighbors": len(comm.out_neighbors()), "in_neighbors": len(comm.in_neighbors())})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": n, "alpha_s": alpha, "alpha_loaded_s": alpha_loaded, "rows": rows}, f)


# ------------------------------------------------------------------ driver
def _predict(row: dict, model, n: int) -> float:
    m = row["bytes"]
    if row["op"] == "neighbor_allgather":
        return model.neighbor(m * row["out_neighbors"], m * row["in_neighbors"])
    if row["op"] == "allreduce":
        return model.allreduce(m, n)
    return model.allgather(m, n)


def measure(setting: str, args) -> dict:
    """Run the worker on ``args.ranks`` shaped ranks at ``setting``; return its JSON plus predictions."""
    from mpicomm.net import CostModel, NetSpec, parse_net

    spec = parse_net(setting)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "worker.json")
        cmd = [NETSHAPE, "mpirun", "--ranks", str(args.ranks), "--net", setting, "--", sys.executable,
               os.path.abspath(__file__), "--worker", "--out", out, "--repeat", str(args.repeat),
               "--sizes", ",".join(f"{s:g}" for s in args.sizes)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, timeout=600)
        wall = time.perf_counter() - t0
        with open(out) as f:
            result = json.load(f)
    model = CostModel(NetSpec(spec.bits_per_s, result["alpha_s"]))
    for row in result["rows"]:
        row["predicted_s"] = _predict(row, model, result["ranks"])
        row["ratio"] = row["measured_s"] / row["predicted_s"]
    result.update({"net": setting, "bits_per_s": spec.bits_per_s, "wall_s": wall})
    return result


def _plot(results: list[dict], path: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        for i, op in enumerate(OPS):
            rows = [r for r in res["rows"] if r["op"] == op]
            x = [r["size_mb"] for r in rows]
            color = f"C{i}"
            ax.plot(x, [r["predicted_s"] for r in rows], "--", color=color, label=f"{op} model")
            ax.plot(x, [r["measured_s"] for r in rows], "o-", color=color, label=f"{op} measured")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["size_mb"] for r in res["rows"] if r["op"] == OPS[0]])
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_yscale("log")
        ax.set_xlabel("message size per rank (MB)")
        ax.set_ylabel("seconds (slowest rank, median)")
        ax.set_title(f"{res['ranks']} ranks, ring, tbf {res['net'].split(',')[0]}, "
                     f"alpha {res['alpha_s'] * 1e6:.0f} us")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


APP = ["--model", "resnet20", "--batch-size", "32", "--lr", "0.1", "--momentum", "0.9", "--max-steps", "24",
       "--log-every", "1", "--eval-limit", "32"]
APP_CASES = (("D-PSGD", "dpsgd"), ("AllReduce-SGD", "allreduce_sgd"))
SKIP_STEPS = 4  # the first steps open TCP connections and warm caches: left out of the per-step means


def validate_training(results: list[dict], ranks: int) -> list[dict]:
    """Train ResNet-20 for a few steps under real shaping and under ``--net`` with the same bandwidth and
    the measured alpha; return seconds per step of both (steps after the first ``SKIP_STEPS``)."""
    from mpicomm.net import parse_net

    rows = []
    for res in results:
        spec = parse_net(res["net"])
        modelled_net = f"{spec.bits_per_s:.0f}bit,{res['alpha_s'] * 1e6:.1f}us"
        for label, algorithm in APP_CASES:
            where = os.path.join(RUNS, "net_validate", res["net"].replace(",", "_"), algorithm)
            shaped = launch(f"{label} shaped", "train_resnet.py", ranks, [*APP, "--algorithm", algorithm],
                            os.path.join(where, "shaped"), fresh=True,
                            launcher=[NETSHAPE, "mpirun", "--ranks", str(ranks), "--net", res["net"], "--"])
            modelled = launch(f"{label} modelled", "train_resnet.py", ranks,
                              [*APP, "--algorithm", algorithm, "--net", modelled_net],
                              os.path.join(where, "modelled"), fresh=True)
            real, model = shaped.per_step(SKIP_STEPS), modelled.per_step(SKIP_STEPS)
            rows.append({"net": res["net"], "case": label, "modelled_net": modelled_net,
                         "shaped_step_s": real["step_s"], "modelled_step_s": model["step_s"],
                         "shaped_compute_s": real["compute_s"], "modelled_compute_s": model["compute_s"],
                         "shaped_comm_s": real["comm_s"] + real["wait_s"],
                         "modelled_comm_s": model["comm_s"] + model["wait_s"],
                         "ratio": real["step_s"] / model["step_s"]})
    return rows


def main() -> None:
    """Measure every setting under scripts/netshape.sh, print the table, write JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=" ".join(SETTINGS),
                        help="--net settings separated by ' ' or ';' (default: %(default)s)")
    parser.add_argument("--sizes", default="1,4,16", help="message sizes in MB (comma list)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per case (median)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--json", default=os.path.join(RESULTS, "net_validate.json"))
    parser.add_argument("--png", default=os.path.join(RESULTS, "net_validate.png"))
    parser.add_argument("--no-apps", action="store_true", help="skip the training runs (collectives only)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [float(s) for s in args.sizes.split(",")]
    if args.repeat < 1 or args.ranks < 2:
        raise SystemExit("--repeat must be >= 1 and --ranks >= 2")
    if args.worker:
        _worker(args)
        return
    enter_loopback_namespace()
    settings = args.settings.replace(";", " ").split()
    results = [measure(s, args) for s in settings]

    table = markdown_table(
        ["net", "alpha (us)", "operation", "size (MB)", "measured (ms)", "model (ms)", "measured / model"],
        [[res["net"], f"{res['alpha_s'] * 1e6:.0f}", r["op"], f"{r['size_mb']:g}", f"{r['measured_s'] * 1e3:.1f}",
          f"{r['predicted_s'] * 1e3:.1f}", f"{r['ratio']:.3f}"] for res in results for r in res["rows"]])
    title = f"alpha-beta model vs real shaping ({args.ranks} ranks, ring, tbf both directions, MPI over TCP)"
    print(f"\n## {title}\n\n{table}")
    training = [] if args.no_apps else validate_training(results, args.ranks)
    app_table = markdown_table(
        ["net (shaped)", "case", "--net (modelled)", "shaped s/step", "modelled s/step", "shaped / modelled",
         "compute s/step shaped / modelled", "comm+wait s/step shaped / modelled"],
        [[r["net"], r["case"], r["modelled_net"], f"{r['shaped_step_s']:.3f}", f"{r['modelled_step_s']:.3f}",
          f"{r['ratio']:.3f}", f"{r['shaped_compute_s']:.3f} / {r['modelled_compute_s']:.3f}",
          f"{r['shaped_comm_s']:.3f} / {r['modelled_comm_s']:.3f}"] for r in training])
    app_title = (f"ResNet-20 training steps ({args.ranks} ranks, {APP[APP.index('--max-steps') + 1]} steps, "
                 f"first {SKIP_STEPS} left out): real shaping vs the model")
    if training:
        print(f"\n## {app_title}\n\n{app_table}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "net_validate.md"), "w") as f:
        f.write(f"{title}\n\n{table}\n")
        if training:
            f.write(f"\n{app_title}\n\n{app_table}\n")
    print(f"\nwire overhead alone (1514-byte frames per 1448-byte payload): {WIRE_OVERHEAD:.3f}x; "
          f"{os.cpu_count()} CPU cores for {args.ranks} busy-polling ranks")
    for res in results:
        print(f"{res['net']}: alpha {res['alpha_s'] * 1e6:.1f} us (others sleeping), loaded alpha "
              f"{res['alpha_loaded_s'] * 1e6:.1f} us (others spinning); run took {res['wall_s']:.0f} s")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"title": "alpha-beta model vs real shaping", "ranks": args.ranks, "topology": "ring",
                   "repeat": args.repeat, "wire_overhead": WIRE_OVERHEAD, "settings": results,
                   "training": training, "machine": machine()}, f, indent=2)
    print(f"wrote {args.json}")
    _plot(results, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
