"""Moniqua-AD-PSGD on the digits MLP: accuracy and bytes vs. AD-PSGD (and synchronous D-PSGD for scale).

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/training/moniqua_adpsgd.py \
        [--epochs 20] [--quick]'

Same setting as bench/training/moniqua.py (64-128-10 MLP, batch 16, SGD momentum 0.9, lr 0.1, a ring of all ranks,
equal-speed ranks); rows: D-PSGD, AD-PSGD, Moniqua-AD-PSGD at its default (4 bits on a rotating quarter of
each tensor, nearest rounding, theta per tensor), in the paper's form (1 bit on every coordinate, one theta, nearest)
and at 8 bits on every coordinate. The asynchronous rows depend on the ranks' timing (one run, one seed).
Bytes: *received* per rank during training (AD-PSGD's traffic is one-sided reads, booked on the reader;
for the synchronous ring, received = sent). Writes bench/results/moniqua_adpsgd.json.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpi4py import MPI  # noqa: E402

from bench.common import BENCH_RESULTS  # noqa: E402
from bench.training.digits import benchmark_options, report, run_case  # noqa: E402

JSON = os.path.join(BENCH_RESULTS, "moniqua_adpsgd.json")
SGD = {"lr": 0.1, "momentum": 0.9}
CASES = [  # label, algorithm, options
    ("D-PSGD", "dpsgd", SGD),
    ("AD-PSGD", "adpsgd", SGD),
    ("Moniqua-AD-PSGD default", "moniqua_adpsgd", SGD),
    ("Moniqua-AD-PSGD paper 1-bit", "moniqua_adpsgd",
     {**SGD, "bits": 1, "parts": 1, "theta_per": "model", "rounding": "nearest"}),
    ("Moniqua-AD-PSGD 8-bit 1/1", "moniqua_adpsgd", {**SGD, "bits": 8, "parts": 1}),
]


def run(mpi_comm, label: str, algorithm: str, options: dict, epochs: int) -> dict:
    """Train one case on every rank (:func:`bench.common.run_case`); bytes received, wrapped parts of all ranks."""
    row = run_case(mpi_comm, label, algorithm, options, epochs=epochs, keep_stats=True)
    wrapped = mpi_comm.allreduce(row.pop("stats").get("wrapped_parts", 0))
    received = row["bytes_received_per_rank"]
    return {**row, "bytes_sent_per_rank": received, "wall_seconds": 0.0, "wrapped_parts": wrapped,
            "bits_per_parameter_per_step": 8 * received / row["steps"] / row["parameters"]}


def main() -> None:
    epochs = benchmark_options(__doc__.splitlines()[0]).epochs
    comm = MPI.COMM_WORLD
    rows = [run(comm, label, algorithm, options, epochs) for label, algorithm, options in CASES]
    if comm.Get_rank() == 0:
        report(rows, "D-PSGD", JSON, f"Moniqua-AD-PSGD, ring of {comm.Get_size()} ranks, {epochs} epochs, batch 16 "
               "(bytes: received per rank)")
        for r in rows:
            print(f"{r['label']:<30} wrapped parts (all ranks) {r['wrapped_parts']}")


if __name__ == "__main__":
    main()
