"""Peak resident memory per rank of each algorithm on ResNet-18, in model copies above its baseline.

    python bench/per_step/memory.py [--model resnet18] [--ranks 4] [--steps 3] [--algorithms ...] [--topology ring]
                           [--output memory]

Each algorithm runs as its own ``mpiexec`` job (peak RSS only grows, so jobs cannot share a process):
``--steps`` training steps of the apps' CIFAR model on the embedded digits (8 images a step, on
``--topology``: any name of :func:`mpicomm.topology.build`, a ring by default; ``complete`` on 5 ranks
gives degree 4, where state kept per neighbour would show), then every rank reports ``ru_maxrss``.
Reported per algorithm: the largest rank's peak, and the excess over its baseline in the same run, in
copies of the fp32 model (4 bytes x parameters): decentralized methods against D-PSGD, Adam-family
ones against AllReduce-Adam, SGD-family ones against AllReduce-SGD. Targets:
APMSqueeze <= Adam + 2 copies; CHOCO, DCD, CPD-SGDM <= D-PSGD + 2 copies; Moniqua <= D-PSGD.
Writes docs/results/<output>.{md,json} (``memory`` by default).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "apps")]

BASELINE = {"allreduce_sgd": None, "allreduce_adam": None, "dpsgd": None, "apmsqueeze": "allreduce_adam",
            "moniqua": "dpsgd", "choco": "dpsgd", "dcd": "dpsgd", "cpdsgdm": "dpsgd", "qsgd": "allreduce_sgd",
            "hsq": "allreduce_sgd"}
TARGET = {"apmsqueeze": 2.0, "choco": 2.0, "dcd": 2.0, "cpdsgdm": 2.0, "moniqua": 0.0}


def job(name: str, model_name: str, steps: int, topology_name: str) -> None:
    """Inside ``mpiexec``: train ``steps`` steps with algorithm ``name``; rank 0 prints the ranks' peaks as JSON."""
    import torch
    from data.image_task import ImageTask
    from data.images import load_digits32
    from models.resnet import build_model
    from mpi4py import MPI

    from mpicomm import topology
    from mpicomm.algorithms import make_algorithm
    from mpicomm.comm import Communicator

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    data = load_digits32(seed=0)
    model = build_model(model_name, data.num_classes, "batch", seed=0)
    task = ImageTask(model, data, rank=comm.rank, size=comm.size, batch_size=8, seed=0)
    options = {"lr": 1e-3} if name in ("allreduce_adam", "apmsqueeze") else {"lr": 0.1, "momentum": 0.9}
    if name == "apmsqueeze":
        options["warmup_steps"] = 1  # the compression phase (the one whose memory is in question) from step 2
    algo = make_algorithm(name, model, Communicator(comm, topology.build(topology_name, comm.size)), **options)
    for _, batch in zip(range(steps), task.train_batches(0)):
        algo.zero_grad()
        loss, _ = task.loss(model, batch)
        loss.backward()
        algo.step()
    algo.close()
    peaks = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, root=0)
    if comm.rank == 0:
        print("PEAKS " + json.dumps({"peaks": peaks, "parameters": algo.flat.numel}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--algorithms", default=",".join(BASELINE))
    parser.add_argument("--topology", default="ring", help="a name of mpicomm.topology.TOPOLOGIES")
    parser.add_argument("--output", default="memory", help="write docs/results/<output>.{md,json}")
    parser.add_argument("--job", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args.job, args.model, args.steps, args.topology)
    from bench.common import enter_loopback_namespace, markdown_table, write_table

    enter_loopback_namespace()
    peak, parameters = {}, 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in args.algorithms.split(","):
        out = subprocess.run(["mpiexec", "-n", str(args.ranks), sys.executable, os.path.abspath(__file__),
                              "--job", name, "--model", args.model, "--steps", str(args.steps),
                               "--topology", args.topology],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
        line = next((s for s in out.stdout.splitlines() if s.startswith("PEAKS ")), None)
        if out.returncode != 0 or line is None:
            raise SystemExit(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
        result = json.loads(line[6:])
        peak[name], parameters = max(result["peaks"]), result["parameters"]
        print(f"  {name:<16} peak {peak[name] / 2**20:8.1f} MiB", flush=True)
    copy = 4 * parameters
    rows, payload = [], {}
    for name, value in peak.items():
        base = BASELINE.get(name)
        excess = (value - peak[base]) / copy if base in peak else None
        target = TARGET.get(name)
        verdict = "–" if target is None or excess is None else (
            f"≤ {target:g}: {'met' if excess <= target else 'missed'}")
        rows.append([name, f"{value / 2**20:.0f}", base or "–", "–" if excess is None else f"{excess:+.2f}", verdict])
        payload[name] = {"peak_bytes": value, "baseline": base, "excess_model_copies": excess}
    table = markdown_table(["algorithm", "peak RSS per rank (MiB, largest rank)", "baseline",
                            "excess over baseline (model copies)", "target"], rows)
    title = (f"Peak RSS per rank, {args.model} ({parameters:,} parameters, one copy = {copy / 2**20:.1f} MiB), "
             f"{args.ranks} ranks, topology {args.topology}, {args.steps} steps of 8 images")
    write_table(args.output, title, table, {"results": payload})


if __name__ == "__main__":
    main()
