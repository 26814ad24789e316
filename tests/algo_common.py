"""Shared pieces of the algorithm tests: a tiny model, per-rank data, the loop, a gradient oracle.

The reference simulations run every rank's iterate in one process: ``grad_at(x, rank, step)`` gives
the stochastic gradient rank ``rank`` computes at step ``step`` for flat parameters ``x``, so a
reference never needs MPI and can be compared with each rank's distributed result.
"""

import time

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from mpicomm import topology as topo

D_IN, D_HIDDEN, D_OUT, BATCH = 6, 8, 3, 16


def make_model(seed: int = 0) -> torch.nn.Module:
    """A 6-8-3 tanh MLP with seeded weights (different seeds give different starting points)."""
    # the CPU generator alone, which draws these weights: torch.manual_seed would also queue the seed for every
    # accelerator not yet initialised, formatting the call stack each time (~1 ms; thousands of calls a tier)
    torch.random.default_generator.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HIDDEN), torch.nn.Tanh(), torch.nn.Linear(D_HIDDEN, D_OUT))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mini-batch rank ``rank`` sees at ``step`` (non-IID: the label rule is shifted per rank)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0).long() + rank) % D_OUT
    return x, y


def loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    """Cross-entropy of ``model`` on ``batch(rank, step)``."""
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def train(algo, steps: int) -> None:
    """``steps`` iterations of the standard loop (zero_grad, backward, step) on this rank's data."""
    rank = algo.comm.rank
    for _ in range(steps):
        algo.zero_grad()
        loss(algo.model, rank, algo.step_count).backward()
        algo.step()


_ORACLE = make_model(0)


def grad_at(x: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """Flat gradient of rank ``rank``'s loss at step ``step``, evaluated at flat parameters ``x``."""
    vector_to_parameters(x.detach().clone(), _ORACLE.parameters())
    _ORACLE.zero_grad()
    loss(_ORACLE, rank, step).backward()
    return parameters_to_vector([p.grad for p in _ORACLE.parameters()]).detach()


def initial_flat() -> torch.Tensor:
    """Rank 0's starting parameters, which every rank starts from after the initial broadcast."""
    return parameters_to_vector(make_model(0).parameters()).detach()


def topologies_for(n: int) -> list:
    """The test topologies at world size ``n``: ring, exponential, 2x2 torus at n = 4, one-peer at n = 2^k, each
    graph once (at 1 and 2 ranks the ring and the exponential graph are the same graph: the same class, mixing
    matrix and neighbour lists, so the same run)."""
    candidates = [topo.ring(n), topo.exponential(n)]
    if n == 4:
        candidates.append(topo.torus(4, rows=2))
    if n & (n - 1) == 0:
        candidates.append(topo.one_peer_exponential(n))
    out, seen = [], set()
    for t in candidates:
        steps = [t.at(s) for s in range(t.period)]
        key = (type(t), tuple((torch.tensor(g.W).numpy().tobytes(), tuple(map(g.in_neighbors, range(n))),
                               tuple(map(g.out_neighbors, range(n)))) for g in steps))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def mixing(schedule, step: int) -> torch.Tensor:
    """W at ``step`` as a float32 tensor."""
    return torch.tensor(schedule.at(step).W, dtype=torch.float32)


def in_turns(comm, rounds: int, step) -> None:
    """``rounds`` times: rank 0 calls ``step()``, then rank 1, ... (a barrier between turns, where the ranks
    that wait sleep: spinning in ``Barrier`` they would take the cores from the one rank at work whenever
    ranks outnumber cores)."""
    for _ in range(rounds):
        for turn in range(comm.Get_size()):
            if comm.Get_rank() == turn:
                step()
            request = comm.Ibarrier()
            while not request.Test():
                time.sleep(0.0002)
