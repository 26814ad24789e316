"""Moniqua-AD-PSGD on the digits MLP: accuracy and bytes vs. AD-PSGD (and synchronous D-PSGD for scale).

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/moniqua_adpsgd.py [--epochs 20] [--quick]'

Same setting as bench/moniqua.py (64-128-10 MLP, batch 16, SGD momentum 0.9, lr 0.1, a ring of all ranks,
equal-speed ranks); rows: D-PSGD, AD-PSGD, Moniqua-AD-PSGD at its default (4 bits on a rotating quarter of
each tensor, nearest rounding, theta per tensor), in the paper's form (1 bit on every coordinate, one theta, nearest)
and at 8 bits on every coordinate. The asynchronous rows depend on the ranks' timing (one run, one seed).
Bytes: *received* per rank during training (AD-PSGD's traffic is one-sided reads, booked on the reader;
for the synchronous ring, received = sent). Writes bench/results/moniqua_adpsgd.json.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from bench.common import DigitsData, benchmark_options, make_mlp, report  # noqa: E402
from mpicomm import topology  # noqa: E402
from mpicomm.algorithms import make_algorithm  # noqa: E402
from mpicomm.comm import Communicator  # noqa: E402

JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moniqua_adpsgd.json")
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
    """Train one case on every rank; the consensus model's test accuracy, bytes received and wrapped parts."""
    n, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    data = DigitsData(rank, n)
    model = make_mlp()
    algo = make_algorithm(algorithm, model, Communicator(mpi_comm, topology.ring(n)), **options)
    steps = 0
    for epoch in range(epochs):
        for x, y in data.batches(epoch, 16, rank):
            algo.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            algo.step()
            steps += 1
    stats = algo.stats()
    received = mpi_comm.allreduce(stats["total_bytes_received"]) / n
    wrapped = mpi_comm.allreduce(stats.get("wrapped_parts", 0))
    algo.flat.data.copy_(algo.consensus_model())
    with torch.no_grad():
        acc = float((model(data.x_test).argmax(1) == data.y_test).float().mean())
        loss = float(torch.nn.functional.cross_entropy(model(data.x_test), data.y_test))
    algo.close()
    return {"label": label, "algorithm": algorithm, "options": options, "steps": steps, "test_accuracy": acc,
            "test_loss": loss, "bytes_sent_per_rank": received, "wall_seconds": 0.0,
            "bits_per_parameter_per_step": 8 * received / steps / algo.flat.numel, "wrapped_parts": wrapped}


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
