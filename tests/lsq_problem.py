"""A least-squares problem with a known optimum and different data on every rank (for convergence tests).

Rank r holds ``A_r`` (M x D, seeded by r) and ``b_r = A_r x_r + noise`` where the planted ``x_r`` differs per
rank (non-IID). The global objective is ``F(x) = (1/n) sum_r ||A_r x - b_r||^2 / (2M)``; its minimiser
``x*`` solves the normal equations. Each rank trains a bias-free ``nn.Linear(D, 1)`` on full batches, so
the gradient is deterministic and references can be exact.
"""

import functools

import torch

D, M = 12, 48


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_r, b_r) of rank ``rank``."""
    g = torch.Generator().manual_seed(500 + rank)
    A = torch.randn(M, D, generator=g)
    planted = torch.linspace(-1.0, 1.0, D) + 0.2 * torch.randn(D, generator=g)
    return A, A @ planted + 0.1 * torch.randn(M, generator=g)


def objective(x: torch.Tensor, n: int) -> float:
    """F(x) over ranks 0..n-1 (float64)."""
    x = x.double()
    total = 0.0
    for r in range(n):
        A, b = data(r)
        total += float(((A.double() @ x - b.double()) ** 2).sum()) / (2 * M)
    return total / n


def optimum(n: int) -> torch.Tensor:
    """x* of F over ranks 0..n-1 (float64)."""
    AtA = sum(data(r)[0].double().T @ data(r)[0].double() for r in range(n))
    Atb = sum(data(r)[0].double().T @ data(r)[1].double() for r in range(n))
    return torch.linalg.solve(AtA, Atb)


def make_model() -> torch.nn.Module:
    """The bias-free linear model, starting at zero."""
    model = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model


def local_loss(model: torch.nn.Module, rank: int) -> torch.Tensor:
    """Rank ``rank``'s full-batch loss ||A_r w - b_r||^2 / (2M)."""
    A, b = data(rank)
    return ((model(A)[:, 0] - b) ** 2).sum() / (2 * M)


def alone(rank: int, steps: int, lr: float) -> torch.Tensor:
    """Rank ``rank``'s model after ``steps`` full-batch gradient steps at ``lr`` on its own data with no
    communication (a decentralized method with its averaging taken out): it heads for the rank's own optimum."""
    A, b = data(rank)
    x = torch.zeros(D)
    for _ in range(steps):
        x -= lr * (A.T @ (A @ x - b)) / M
    return x


@functools.cache
def _start_and_optimum(n: int) -> tuple[float, float]:
    return objective(torch.zeros(D), n), objective(optimum(n), n)


def relative_gap(x: torch.Tensor, n: int) -> float:
    """(F(x) - F*) / (F(0) - F*) over ranks 0..n-1: 1 at the zero start, 0 at the optimum."""
    f0, fstar = _start_and_optimum(n)
    return (objective(x, n) - fstar) / (f0 - fstar)


def train(algo, steps: int, lr=None) -> None:
    """``steps`` full-batch steps of ``algo`` on this rank's data (step size ``lr(step)`` if given)."""
    for _ in range(steps):
        if lr is not None:
            algo.set_lr(lr(algo.step_count))
        algo.zero_grad()
        local_loss(algo.model, algo.comm.rank).backward()
        algo.step()
