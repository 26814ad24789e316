"""Mini-batch least squares y = A x* + noise with the same x* on every rank (the Adam-family convergence tests).

Each rank holds 64 rows of its own (seeded by the rank); the model is ``nn.Linear(10, 1)`` with a bias and
every step draws 16 of the rank's rows (seeded by rank and step), so runs are reproducible.
"""

import torch


def data(rank, rows=64, dim=10):
    """This rank's share of y = A x* + noise (x* and noise fixed by seeds; rows differ per rank)."""
    x_star = torch.linspace(-1, 1, dim)
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(rows, dim, generator=g)
    return a, a @ x_star + 0.05 * torch.randn(rows, generator=g)


def train(algo, shard, steps, lr=None):
    """``steps`` mini-batch steps (16 of the shard's rows each) of ``algo`` (step size ``lr(step)`` if given)."""
    a, y = shard
    for _ in range(steps):
        if lr is not None:
            algo.set_lr(lr(algo.step_count))
        idx = torch.Generator().manual_seed(1000 * algo.comm.rank + algo.step_count)
        pick = torch.randint(0, len(a), (16,), generator=idx)
        algo.zero_grad()
        (algo.model(a[pick]).squeeze(1) - y[pick]).pow(2).mean().backward()
        algo.step()


def global_loss(algo, shard):
    """Collective: the mean squared error of the (average) model over all ranks' rows."""
    a, y = shard
    saved = algo.flat.data.clone()
    algo.flat.data.copy_(algo.consensus_model())
    with torch.no_grad():
        local = torch.tensor([float((algo.model(a).squeeze(1) - y).pow(2).mean())], dtype=torch.float64)
    algo.flat.data.copy_(saved)
    return float(algo.comm.allreduce(local).item()) / algo.comm.size


def optimum(comm, shard):
    """The least-squares optimum L* over all ranks' rows (closed form, float64, with the bias column)."""
    a, y = (torch.cat(comm.allgather(t)).double() for t in shard)
    a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
    sol = torch.linalg.lstsq(a, y.unsqueeze(1)).solution
    return float((a @ sol - y.unsqueeze(1)).pow(2).mean())
