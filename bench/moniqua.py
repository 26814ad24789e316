"""Moniqua's options on the digits MLP: accuracy, bytes and guard events vs. D-PSGD (the data behind its defaults).

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/moniqua.py [--epochs 20] [--quick]'

Same setting as bench/decentralized.py (64-128-10 MLP, batch 16, SGD momentum 0.9, lr 0.1, a ring of all
ranks); rows vary Moniqua's bits, parts, rounding, gamma and theta_c around the default and the paper's
form. Reports the consensus model's test accuracy, bytes sent per rank during training (ratio to
D-PSGD's, measured in the same run), bits per parameter per step, and the guard's wrapped parts with the
final largest theta and gamma (wall time is not measured here: see bench/decentralized.py).
Writes bench/results/moniqua.json.
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

JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moniqua.json")
SGD = {"lr": 0.1, "momentum": 0.9}
PAPER = {"bits": 1, "parts": 1, "theta_per": "model", "rounding": "nearest"}
CASES = [  # label, algorithm, options
    ("D-PSGD", "dpsgd", SGD),
    ("Moniqua default (4-bit, 1/4)", "moniqua", SGD),
    ("Moniqua default C=0.5", "moniqua", {**SGD, "theta_c": 0.5}),
    ("Moniqua default C=0.25", "moniqua", {**SGD, "theta_c": 0.25}),
    ("Moniqua default C=2", "moniqua", {**SGD, "theta_c": 2.0}),
    ("Moniqua default nearest", "moniqua", {**SGD, "rounding": "nearest"}),
    ("Moniqua 4-bit 1/2", "moniqua", {**SGD, "parts": 2}),
    ("Moniqua 1-bit 1/1 per tensor", "moniqua", {**SGD, "bits": 1, "parts": 1}),
    ("Moniqua paper 1-bit", "moniqua", {**SGD, **PAPER}),
    ("Moniqua paper 1-bit gamma=1", "moniqua", {**SGD, **PAPER, "gamma": 1.0}),
    ("Moniqua 8-bit 1/1", "moniqua", {**SGD, "bits": 8, "parts": 1}),
]


def run(mpi_comm, label: str, algorithm: str, options: dict, epochs: int) -> dict:
    """Train one case on every rank; the consensus model's test accuracy, bytes and guard events."""
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
    sent = mpi_comm.allreduce(stats["total_bytes_sent"]) / n
    contributed = mpi_comm.allreduce(stats["total_bytes_contributed"]) / n
    algo.flat.data.copy_(algo.consensus_model())
    with torch.no_grad():
        acc = float((model(data.x_test).argmax(1) == data.y_test).float().mean())
        loss = float(torch.nn.functional.cross_entropy(model(data.x_test), data.y_test))
    return {"label": label, "algorithm": algorithm, "options": options, "steps": steps, "test_accuracy": acc,
            "test_loss": loss, "bytes_sent_per_rank": sent, "wall_seconds": 0.0,
            "bits_per_parameter_per_step": 8 * contributed / steps / algo.flat.numel,
            "wrapped_parts": stats.get("wrapped_parts", 0), "final_theta_max": stats.get("theta_max"),
            "final_gamma": stats.get("gamma")}


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
