"""Moniqua's options on the digits MLP: accuracy, bytes and guard events vs. D-PSGD (the data behind its defaults).

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/training/moniqua.py [--epochs 20] [--quick]'

Same setting as bench/training/decentralized.py (64-128-10 MLP, batch 16, SGD momentum 0.9, lr 0.1, a ring of all
ranks); rows vary Moniqua's bits, parts, rounding, gamma and theta_c around the default and the paper's
form. Reports the consensus model's test accuracy, bytes sent per rank during training (ratio to
D-PSGD's, measured in the same run), bits per parameter per step, and the guard's wrapped parts with the
final largest theta and gamma (wall time is not measured here: see bench/training/decentralized.py).
Writes bench/results/moniqua.json.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpi4py import MPI  # noqa: E402

from bench.common import BENCH_RESULTS  # noqa: E402
from bench.training.digits import benchmark_options, report, run_case  # noqa: E402

JSON = os.path.join(BENCH_RESULTS, "moniqua.json")
SGD = {"lr": 0.1, "momentum": 0.9}
PAPER = {"bits": 1, "parts": 1, "theta_per": "model", "theta": "adaptive", "rounding": "nearest"}
CASES = [  # label, algorithm, options
    ("D-PSGD", "dpsgd", SGD),
    ("Moniqua default (4-bit, 1/4)", "moniqua", SGD),
    ("Moniqua default C=0.5", "moniqua", {**SGD, "theta_c": 0.5}),
    ("Moniqua default C=0.25", "moniqua", {**SGD, "theta_c": 0.25}),
    ("Moniqua default C=0.1", "moniqua", {**SGD, "theta_c": 0.1}),
    ("Moniqua default C=2", "moniqua", {**SGD, "theta_c": 2.0}),
    ("Moniqua default nearest", "moniqua", {**SGD, "rounding": "nearest"}),
    ("Moniqua 4-bit 1/2", "moniqua", {**SGD, "parts": 2}),
    ("Moniqua 1-bit 1/1 per tensor", "moniqua", {**SGD, "bits": 1, "parts": 1}),
    ("Moniqua paper 1-bit", "moniqua", {**SGD, **PAPER}),
    ("Moniqua paper 1-bit gamma=1", "moniqua", {**SGD, **PAPER, "gamma": 1.0}),
    ("Moniqua 8-bit 1/1", "moniqua", {**SGD, "bits": 8, "parts": 1}),
]


def run(mpi_comm, label: str, algorithm: str, options: dict, epochs: int) -> dict:
    """Train one case on every rank (:func:`bench.common.run_case`); add the guard's events and final theta."""
    row = run_case(mpi_comm, label, algorithm, options, epochs=epochs, keep_stats=True)
    stats = row.pop("stats")
    return {**row, "wall_seconds": 0.0, "wrapped_parts": stats.get("wrapped_parts", 0),
            "final_theta_max": stats.get("theta_max"), "final_gamma": stats.get("gamma")}


def main() -> None:
    epochs = benchmark_options(__doc__.splitlines()[0]).epochs
    comm = MPI.COMM_WORLD
    rows = []
    for label, algorithm, options in CASES:
        rows.append(run(comm, label, algorithm, options, epochs))
    if comm.Get_rank() == 0:
        report(rows, "D-PSGD", JSON, f"Moniqua options, ring of {comm.Get_size()} ranks, {epochs} epochs, batch 16")
        for r in rows:
            print(f"{r['label']:<30} wrapped parts {r['wrapped_parts']:>4}  final theta max {r['final_theta_max']}  "
                  f"gamma {r['final_gamma']}")


if __name__ == "__main__":
    main()
