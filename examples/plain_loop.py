"""Your own training loop on mpicomm: a DataLoader over this rank's share, Moniqua at about 1 bit per parameter.

    mpiexec -n 2 python examples/plain_loop.py                     # Moniqua on a ring
    mpiexec -n 2 python examples/plain_loop.py --algorithm dpsgd   # full-precision gossip, to compare

A small MLP on scikit-learn's handwritten digits (they ship inside the package: nothing to download);
prints the test accuracy of the average of the ranks' models.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import mpicomm


def main(argv=None) -> float:
    """Train, evaluate the averaged model, return its test accuracy (the same on every rank)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="moniqua")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)

    job = mpicomm.init()
    digits = load_digits()
    x, y = torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
    train, x_test, y_test = TensorDataset(x[:1500], y[:1500]), x[1500:].to(job.device), y[1500:].to(job.device)

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(job.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algo = mpicomm.wrap(model, optimizer, args.algorithm, topology="ring")

    sampler = mpicomm.sampler(train, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            algo.zero_grad()
            F.cross_entropy(model(xb.to(job.device)), yb.to(job.device)).backward()
            algo.step()

    with algo.averaged_model() as averaged, torch.no_grad():
        accuracy = float((averaged(x_test).argmax(1) == y_test).float().mean())
    if job.rank == 0:
        print(f"{args.algorithm}: test accuracy of the averaged model {100 * accuracy:.1f} %, "
              f"{algo.comm.ledger.totals()['bytes_sent'] / 1e6:.2f} MB sent by rank 0")
    return accuracy


if __name__ == "__main__":
    main()
