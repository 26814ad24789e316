"""Mini-batch least squares y = A x*_r + noise with its own optimum x*_r on every rank (the Adam-family
convergence tests).

Each rank holds 64 rows of its own (seeded by the rank) around its own x*_r (a line, plus on every rank but 0
an offset of 0.3 per coordinate), so the global optimum is none of the ranks' own: a rank that never
communicates ends near its x*_r, with about twice the global optimum's loss over all ranks' rows. The model is
``nn.Linear(10, 1)`` with a bias and every step draws 16 of the rank's rows (seeded by rank and step), so runs
are reproducible.
"""

import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

SHIFT = 0.3  # per-coordinate spread of the ranks' own optima
ALONE_MARGIN = 10  # a method's excess loss over L* must be this many times below that of ranks that never talk


def data(rank, rows=64, dim=10):
    """This rank's share of y = A x*_r + noise (x*_r, A and noise fixed by seeds; all differ per rank)."""
    x_star = torch.linspace(-1, 1, dim)
    if rank:  # rank 0 keeps the line itself: a world of one rank solves the same problem at any SHIFT
        x_star = x_star + SHIFT * torch.randn(dim, generator=torch.Generator().manual_seed(10_000 + rank))
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(rows, dim, generator=g)
    return a, a @ x_star + 0.05 * torch.randn(rows, generator=g)


def train(algo, shard, steps, lr=None, rank=None):
    """``steps`` mini-batch steps (16 of the shard's rows each) of ``algo`` (step size ``lr(step)`` if given);
    the rows drawn depend on ``rank`` (default: the algorithm's rank)."""
    a, y = shard
    rank = algo.comm.rank if rank is None else rank
    for _ in range(steps):
        if lr is not None:
            algo.set_lr(lr(algo.step_count))
        idx = torch.Generator().manual_seed(1000 * rank + algo.step_count)
        pick = torch.randint(0, len(a), (16,), generator=idx)
        algo.zero_grad()
        (algo.model(a[pick]).squeeze(1) - y[pick]).pow(2).mean().backward()
        algo.step()


def loss_of_each_model(comm, algo, shard):
    """Collective over ``comm`` (the world): the mean over ranks of the squared error of each rank's own model
    over all ranks' rows (for a method whose ranks hold one model, that model's loss)."""
    a, y = (torch.cat(comm.allgather(t)) for t in shard)
    with torch.no_grad():
        mine = float((algo.model(a).squeeze(1) - y).pow(2).mean())
    return sum(comm.allgather(mine)) / comm.Get_size()


def alone(name, steps, shard, lr, schedule=None, **options):
    """``name`` trained by this rank alone (a world of one: no communication) on its own rows, as the
    distributed run is: same seed, same rows drawn, same step sizes."""
    from mpi4py import MPI

    torch.manual_seed(0)
    algo = make_algorithm(name, torch.nn.Linear(10, 1), Communicator(MPI.COMM_SELF, topo.ring(1)), lr=lr, **options)
    train(algo, shard, steps, schedule, rank=MPI.COMM_WORLD.Get_rank())
    return algo


def optimum(comm, shard):
    """The least-squares optimum L* over all ranks' rows (closed form, float64, with the bias column)."""
    a, y = (torch.cat(comm.allgather(t)).double() for t in shard)
    a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
    sol = torch.linalg.lstsq(a, y.unsqueeze(1)).solution
    return float((a @ sol - y.unsqueeze(1)).pow(2).mean())


def check_beats_alone(loss, loss_alone, best, n):
    """With peers (``n`` > 1), the method's excess over ``best`` is ``ALONE_MARGIN`` times below that of the same
    method run by every rank alone, which ends near each rank's own optimum."""
    if n > 1:
        assert loss_alone - best >= ALONE_MARGIN * (loss - best), (loss, loss_alone, best)
