"""The low-rank layout's lost directions: which columns of P̂ count as none, and which columns of Q are redrawn."""

import torch

from mpicomm.algorithms.lowrank.layout import LowRankLayout, orthogonalize, zero_lost_columns
from mpicomm.flat import FlatParameters


def _layout() -> LowRankLayout:
    """Matrices (8 x 6) at r = 2 and (1 x 8) at r = 1: Q columns 0, 1 of the first and 2 of the second."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Linear(8, 1, bias=False))
    lay = LowRankLayout(FlatParameters(model), rank=2, min_compression_rate=0.0)
    assert [(m.rows, m.cols, m.rank) for m in lay.matrices] == [(8, 6, 2), (1, 8, 1)] and lay.q_numel == 20
    return lay


def test_zero_or_nan_columns_of_q_are_found_and_redrawn_alike_from_one_seed():
    lay = _layout()
    q = torch.randn(lay.q_numel, generator=torch.Generator().manual_seed(1))
    assert lay.lost_columns(q) is None
    first, second = lay.matrices
    first.q(q)[:, 1] = 0.0
    second.q(q)[3, 0] = float("nan")
    assert lay.lost_columns(q) == [False, True, True]
    kept = first.q(q)[:, 0].clone()
    other_end = q.clone()
    lay.redraw_columns(q, [False, True, True], torch.Generator().manual_seed(7))
    lay.redraw_columns(other_end, [False, True, True], torch.Generator().manual_seed(7))
    assert torch.equal(q, other_end), "the same seed must give both ends of an edge the same columns"
    assert torch.equal(first.q(q)[:, 0], kept), "a column that was not lost is kept"
    assert torch.isfinite(q).all() and lay.lost_columns(q) is None


def test_a_zero_column_of_p_hat_is_zero_whatever_epsilon():
    p = torch.zeros(5, 2)
    p[:, 1] = torch.tensor([3.0, 0.0, 4.0, 0.0, 0.0])
    with_eps = zero_lost_columns(orthogonalize(p.clone(), 1e-8))
    assert torch.equal(with_eps[:, 0], torch.zeros(5))
    torch.testing.assert_close(with_eps[:, 1], torch.tensor([0.6, 0.0, 0.8, 0.0, 0.0]))
    plain = orthogonalize(p.clone(), 0.0)
    assert plain.isnan().all(), "Gram-Schmidt divides 0 by 0 in the first column and carries it on"
    assert torch.equal(zero_lost_columns(plain), torch.zeros(5, 2))
    small = zero_lost_columns(orthogonalize(torch.full((4, 1), 1e-9), 1e-8))  # within epsilon of 0: no direction
    assert torch.equal(small, torch.zeros(4, 1))
