"""Shared pieces of the convergence benchmarks: the digits data, a small MLP, a training run, the report.

Data: scikit-learn's handwritten digits (1,797 real 8x8 images, shipped inside the package, no
download), standardised, split 80/20 into train/test with a fixed seed; each rank trains on its own
IID shard of the training set. Model: a 64-128-10 MLP (9,610 parameters, most of them in one
8,192-element layer, so per-layer codecs see a realistic large layer).

Every benchmark script runs under ``mpiexec -n N python bench/<name>.py`` and calls
:func:`run_case` once per algorithm, then :func:`report` on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator
from mpicomm.net import parse_net

__all__ = ["DigitsData", "benchmark_options", "make_mlp", "report", "run_case"]


class DigitsData:
    """The digits dataset split into train/test, with this rank's IID shard of the training set."""

    def __init__(self, rank: int, size: int, seed: int = 0):
        from sklearn.datasets import load_digits

        data = load_digits()
        x = (data.data - data.data.mean(0)) / (data.data.std(0) + 1e-6)
        order = np.random.default_rng(seed).permutation(len(x))
        n_test = len(x) // 5
        test, train = order[:n_test], order[n_test:]
        self.x_test = torch.tensor(x[test], dtype=torch.float32)
        self.y_test = torch.tensor(data.target[test], dtype=torch.long)
        mine = train[rank::size]
        self.x = torch.tensor(x[mine], dtype=torch.float32)
        self.y = torch.tensor(data.target[mine], dtype=torch.long)

    def batches(self, epoch: int, batch_size: int, seed: int):
        """This rank's shuffled mini-batches for ``epoch`` (same order on every run with the same seed)."""
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(len(self.x), generator=g)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield self.x[idx], self.y[idx]


def benchmark_options(description: str, default: int = 20) -> argparse.Namespace:
    """Parse the convergence benchmarks' shared options: ``--epochs N`` or ``--quick`` (3 epochs), ``--net``.

    Returns ``epochs`` and ``net`` (a :class:`~mpicomm.net.NetSpec` or None) on the namespace.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=default, help=f"training epochs per case (default {default})")
    parser.add_argument("--quick", action="store_true", help="3 epochs, for a smoke run")
    parser.add_argument("--net", default="", help="model a network under every case, e.g. 1gbit,100us (wall_seconds "
                        "then include its cost; see docs/network.md)")
    args = parser.parse_args()
    args.epochs = 3 if args.quick else args.epochs
    if args.epochs < 1:
        raise SystemExit(f"--epochs must be >= 1, got {args.epochs}")
    try:
        args.net = parse_net(args.net)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return args


def make_mlp(seed: int = 0) -> torch.nn.Module:
    """The 64-128-10 ReLU MLP every benchmark trains."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _evaluate(model: torch.nn.Module, flat_params: torch.Tensor, algo, data: DigitsData) -> tuple[float, float]:
    """Test loss and accuracy of ``model`` with its flat buffer temporarily set to ``flat_params``."""
    saved = algo.flat.data.clone()
    algo.flat.data.copy_(flat_params)
    with torch.no_grad():
        logits = model(data.x_test)
        loss = float(torch.nn.functional.cross_entropy(logits, data.y_test))
        acc = float((logits.argmax(1) == data.y_test).float().mean())
    algo.flat.data.copy_(saved)
    return loss, acc


def run_case(mpi_comm, label: str, algorithm: str, options: dict, *, epochs: int, batch_size: int = 16,
             topo: str = "ring", seed: int = 0, net=None, keep_stats: bool = False) -> dict:
    """Train the MLP with ``algorithm`` for ``epochs`` on every rank; return one result row (all ranks).

    ``keep_stats``: add ``stats``, this rank's ``algo.stats()`` at the end of training (before evaluation).

    ``net``: a network setting modelled under the run (``Communicator(net=...)``), or None.
    """
    n, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    data = DigitsData(rank, n, seed)
    comm = Communicator(mpi_comm, topology.build(topo, n), net=net)
    model = make_mlp(seed)
    algo = make_algorithm(algorithm, model, comm, seed=seed, **options)
    mpi_comm.Barrier()
    t0 = time.perf_counter()
    steps = 0
    for epoch in range(epochs):
        for x, y in data.batches(epoch, batch_size, seed + rank):
            algo.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            algo.step()
            steps += 1
    mpi_comm.Barrier()
    wall = time.perf_counter() - t0
    totals = comm.ledger.totals()  # training traffic only: read before the evaluation's allreduces
    stats = algo.stats()
    average = algo.consensus_model()
    loss, acc = _evaluate(model, average, algo, data)
    spread = algo.consensus_distance()
    sent = mpi_comm.allreduce(totals["bytes_sent"]) / n
    received = mpi_comm.allreduce(totals["bytes_received"]) / n
    contributed = mpi_comm.allreduce(totals["bytes_contributed"]) / n
    algo.close()
    return {
        "label": label, "algorithm": algorithm, "options": options, "topology": topo, "ranks": n,
        "epochs": epochs, "steps": steps, "test_loss": loss, "test_accuracy": acc,
        "consensus_distance": spread, "bytes_sent_per_rank": sent, "bytes_received_per_rank": received,
        "bits_per_parameter_per_step": 8 * contributed / max(steps, 1) / algo.flat.numel,
        "bits_per_parameter_sent_per_step": 8 * sent / max(steps, 1) / algo.flat.numel,
        "wall_seconds": wall, "parameters": algo.flat.numel, **({"stats": stats} if keep_stats else {}),
    }


def report(rows: list[dict], baseline_label: str, json_path: str, title: str) -> None:
    """Print a table (bytes as a ratio of the baseline's, measured in the same run) and write JSON."""
    base = next(r for r in rows if r["label"] == baseline_label)
    print(f"\n{title}")
    print(f"{'case':<28}{'test acc %':>11}{'test loss':>10}{'MB sent/rank':>14}{'bytes vs base':>15}"
          f"{'bits/param/step':>17}{'wall s':>8}")
    for r in rows:
        ratio = base["bytes_sent_per_rank"] / r["bytes_sent_per_rank"] if r["bytes_sent_per_rank"] else float("inf")
        r["bytes_reduction_vs_baseline"] = ratio
        print(f"{r['label']:<28}{100 * r['test_accuracy']:>11.2f}{r['test_loss']:>10.4f}"
              f"{r['bytes_sent_per_rank'] / 1e6:>14.3f}{ratio:>14.1f}x{r['bits_per_parameter_per_step']:>17.3f}"
              f"{r['wall_seconds']:>8.2f}")
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump({"title": title, "baseline": baseline_label, "rows": rows}, f, indent=2)
    print(f"wrote {json_path}")
