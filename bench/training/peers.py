"""The peers' compressed methods next to their full-precision baselines, over several seeds (mean and spread).

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/training/peers.py [--epochs 20] [--seeds 3]'

Trains bench/training/digits.py's 64-128-10 MLP on the digits data (IID shards, batch 16 per rank) with every
case for seeds 0 .. S-1 (the seed sets the initial model, the batch order and the algorithm's own
draws: PowerSGD's and PowerGossip's initial Q) and reports the test accuracy of the (average) model as
mean and sample standard deviation over the seeds, with bits per parameter per step (contributed, from
the Ledger) and the ratio of bytes sent to the group's baseline. Groups:

* centralized SGD (momentum 0.9, lr 0.1): AllReduce-SGD; PowerSGD rank 1, 2, 4 (error feedback,
  warm start, no fp32 warm-up; the 64 x 128 and 10 x 128 weights are compressed, biases sent in fp32);
* decentralized SGD on a ring: D-PSGD; PowerGossip rank 1, 2, 4;
* Adam (lr 1e-3): AllReduce-Adam; APMSqueeze (paper form) and its DeepSpeed 1-bit Adam form, 20 % warm-up;
  0/1 Adam (variance frozen after 20 % of the steps, local interval doubling every 5 %, up to 16);
* LAMB (lr 0.01): LAMB; 1-bit LAMB with a 20 % LAMB warm-up.

Writes bench/results/peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpi4py import MPI  # noqa: E402

from bench.common import BENCH_RESULTS  # noqa: E402
from bench.training.digits import DigitsData, run_case  # noqa: E402

JSON = os.path.join(BENCH_RESULTS, "peers.json")
BATCH = 16
SGD = {"lr": 0.1, "momentum": 0.9}
LAMB = {"lr": 0.01}


def cases(total_steps: int) -> list[tuple[str, str, str, dict, str]]:
    """(group, label, algorithm, options, topology); the first case of each group is its baseline."""
    adam = {"lr": 1e-3, "total_steps": total_steps}
    return [
        ("centralized SGD", "AllReduce-SGD", "allreduce_sgd", SGD, "ring"),
        *[("centralized SGD", f"PowerSGD r={r}", "powersgd", {**SGD, "rank": r}, "ring") for r in (1, 2, 4)],
        ("decentralized SGD (ring)", "D-PSGD", "dpsgd", SGD, "ring"),
        *[("decentralized SGD (ring)", f"PowerGossip r={r}", "powergossip", {**SGD, "rank": r}, "ring")
          for r in (1, 2, 4)],
        ("Adam", "AllReduce-Adam", "allreduce_adam", {"lr": 1e-3}, "ring"),
        ("Adam", "APMSqueeze", "apmsqueeze", adam, "ring"),
        ("Adam", "1-bit Adam (DeepSpeed form)", "apmsqueeze", {**adam, "variant": "deepspeed"}, "ring"),
        ("Adam", "0/1 Adam", "zeroone_adam", {"lr": 1e-3, **zeroone_schedule(total_steps)}, "ring"),
        ("LAMB", "LAMB", "lamb", LAMB, "ring"),
        ("LAMB", "1-bit LAMB", "onebit_lamb", {**LAMB, "freeze_step": round(0.2 * total_steps)}, "ring"),
    ]


def zeroone_schedule(total_steps: int) -> dict:
    """0/1 Adam's schedules scaled to a short run: variance frozen after 20 % of the steps (kappa = 16),
    the local interval doubling every 5 % of the steps up to H = 16."""
    return {"var_freeze_step": round(0.2 * total_steps), "var_update_scaler": 16,
            "local_step_scaler": max(1, round(0.05 * total_steps)), "local_step_clipper": 16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    total_steps = args.epochs * (len(DigitsData(comm.Get_rank(), comm.Get_size()).x) // BATCH)
    total_steps = comm.allreduce(total_steps, op=MPI.MIN)
    rows = []
    for group, label, algorithm, options, topo in cases(total_steps):
        runs = [run_case(comm, label, algorithm, options, epochs=args.epochs, batch_size=BATCH, topo=topo, seed=s)
                for s in range(args.seeds)]
        accs = [100 * r["test_accuracy"] for r in runs]
        rows.append({"group": group, "label": label, "algorithm": algorithm, "options": options,
                     "accuracy_mean": statistics.mean(accs),
                     "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0, "accuracies": accs,
                     "bits_per_parameter_per_step": runs[0]["bits_per_parameter_per_step"],
                     "bytes_sent_per_rank": runs[0]["bytes_sent_per_rank"],
                     "consensus_distance": statistics.mean(r["consensus_distance"] for r in runs)})
    if comm.Get_rank() != 0:
        return
    print(f"{comm.Get_size()} ranks, {args.epochs} epochs, batch {BATCH}, seeds 0..{args.seeds - 1}")
    print(f"{'group':<26}{'case':<30}{'test acc % (mean ± std)':>25}{'bits/param/step':>17}{'fewer bytes':>13}")
    base = {}
    for r in rows:
        b = base.setdefault(r["group"], r)
        fewer = b["bytes_sent_per_rank"] / r["bytes_sent_per_rank"]
        r["fewer_bytes_than_baseline"] = fewer
        print(f"{r['group']:<26}{r['label']:<30}{r['accuracy_mean']:>17.2f} ± {r['accuracy_std']:<5.2f}"
              f"{r['bits_per_parameter_per_step']:>17.3f}{fewer:>12.1f}x")
    os.makedirs(os.path.dirname(JSON), exist_ok=True)
    with open(JSON, "w") as f:
        json.dump({"ranks": comm.Get_size(), "epochs": args.epochs, "seeds": args.seeds, "rows": rows}, f, indent=2)
    print(f"wrote {JSON}")


if __name__ == "__main__":
    main()
