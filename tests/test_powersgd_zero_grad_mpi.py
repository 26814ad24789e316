"""PowerSGD on a matrix whose gradient is exactly zero for a while (frozen, then trained): it trains again.

Two bias-free layers A, B (8 x 6) and a loss linear in each, sum_k (u_rk^T B x_k + v_rk^T A x_k) over
k < r on rank r, so every gradient is the rank-r matrix sum_k u_rk x_k^T (v_rk for A), and so is its mean
over ranks, G_B = sum_k ū_k x_k^T. One power step of rank r recovers a rank-r mean exactly (the residuals e_i
it leaves sum to 0), so each update is the mean gradient and, with plain SGD, the weights after T steps are
written out by hand: A_T = A_0 - lr T G_A, B_T = B_0 - lr (T - F) G_B when B's gradient is multiplied by 0
for its first F steps. A zero gradient
gives P = 0 there; torch's ``powerSGD_hook`` then turns the matrix to NaN (epsilon 0) or leaves it where it
is for good (epsilon > 0), and so did this PowerSGD before it redrew the lost columns of Q.
"""

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .conftest import run_all

pytestmark = pytest.mark.mpi

STEPS, FROZEN, LR = 5, 2, 0.1


def _vectors(rank: int, r: int):
    """(x, u, v) of ``rank``: the inputs x (r x 6, the same on every rank) and its u, v (r x 8 each)."""
    g = torch.Generator().manual_seed(70 + rank)
    return torch.randn(r, 6, generator=torch.Generator().manual_seed(69)), torch.randn(r, 8, generator=g), \
        torch.randn(r, 8, generator=g)


def _mean_gradient(n: int, r: int, which: int) -> torch.Tensor:
    """sum_k (mean over ranks of u_k, or v_k for ``which`` 2) x_k^T."""
    x = _vectors(0, r)[0]
    return torch.stack([_vectors(rank, r)[which] for rank in range(n)]).mean(0).t() @ x


@pytest.mark.parametrize("rank, epsilon, overlap", [(1, 0.0, False), (1, 1e-8, False), (2, 0.0, True)])
def test_a_matrix_frozen_for_a_while_trains_after(comm, rank, epsilon, overlap):
    def body():
        n, me = comm.Get_size(), comm.Get_rank()
        torch.random.default_generator.manual_seed(3)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(6, 8, bias=False), "b": torch.nn.Linear(6, 8, bias=False)})
        a0, b0 = model["a"].weight.detach().clone(), model["b"].weight.detach().clone()
        algo = make_algorithm("powersgd", model, Communicator(comm, topology.ring(n)), lr=LR, momentum=0.0,
                              rank=rank, min_compression_rate=1.0, epsilon=epsilon, overlap=overlap)
        assert len(algo.layout.matrices) == 2 and algo.layout.plain_numel == 0
        x, u, v = _vectors(me, rank)
        for t in range(STEPS):
            algo.zero_grad()
            used = 0.0 if t < FROZEN else 1.0
            (used * (u * model["b"](x)).sum() + (v * model["a"](x)).sum()).backward()
            algo.step()
        torch.testing.assert_close(model["a"].weight.detach(), a0 - LR * STEPS * _mean_gradient(n, rank, 2),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"A (always trained): {m}")
        torch.testing.assert_close(model["b"].weight.detach(),
                                   b0 - LR * (STEPS - FROZEN) * _mean_gradient(n, rank, 1),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"B (zero gradient at first): {m}")

    run_all(comm, body)
