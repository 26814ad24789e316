"""Rank-r power-iteration compression of the flat vector's matrices, shared by PowerSGD and PowerGossip.

Vogels, Karimireddy, Jaggi. "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (Algorithm 1), and "PowerGossip: Practical Low-Rank Communication
Compression in Decentralized Deep Learning", NeurIPS 2020.

Every parameter tensor of shape (a, b, ...) is viewed as the matrix M of shape (a, b * ...) (a 1-D
tensor as (a, 1), a scalar as (1, 1)), the way torch's ``powerSGD_hook`` does. With
r = min(rank, a, cols) it is *compressed* when (a + cols) * r * min_compression_rate < a * cols (the
hook's ``_should_compress``); with the default rate 2 this leaves biases and small tensors alone.
One power step with a warm-started Q (cols x r) is::

    P = M Q;   P̂ = orthogonalize(P);   Q <- M^T P̂;   M ≈ P̂ Q^T

``orthogonalize`` is the hook's: for r <= 2 Gram-Schmidt on the columns, each divided by
(norm + epsilon) (epsilon = 0: plain Gram-Schmidt, a zero column gives NaN); for r > 2 Householder QR,
which stays orthonormal when M is rank-deficient (e.g. a softmax layer's gradient, whose rows sum to 0).

A zero column finds no direction: Gram-Schmidt leaves it 0 (epsilon > 0) or NaN (epsilon = 0), and then
Q <- M^T P̂ has a zero column, from which every later warm-started step finds nothing again (P = M Q = 0)
however M changes. So after orthogonalizing P̂, :func:`zero_lost_columns` sets such columns to 0 (nothing of
M is sent or applied along them), and once the step is done :meth:`LowRankLayout.lost_columns` finds the
columns of Q that came out zero (or not finite), matrix by matrix, which the caller redraws
(:meth:`LowRankLayout.redraw_columns`) from a generator both ends of the exchange share.
:class:`LowRankLayout` holds where each compressed matrix and its P and Q live in flat P / Q
buffers, and the slices left uncompressed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...flat import FlatParameters

__all__ = ["LowRankLayout", "Matrix", "gather_slices", "orthogonalize", "scatter_slices", "zero_lost_columns"]


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalize the columns of ``matrix`` (rows x r) in place (Gram-Schmidt for r <= 2, else QR); returns it."""
    if matrix.shape[1] > 2:
        return matrix.copy_(torch.linalg.qr(matrix).Q)
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        col.div_(torch.linalg.vector_norm(col) + epsilon)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest.sub_((col * rest).sum(dim=0, keepdim=True) * col)
    return matrix


def zero_lost_columns(matrix: torch.Tensor) -> torch.Tensor:
    """Set to 0, in place, the columns of the orthogonalized ``matrix`` that found no direction: norm at most 1/2
    (the column was within epsilon of 0) or not a number (it was 0 with epsilon = 0); returns ``matrix``."""
    return matrix.masked_fill_(~(torch.linalg.vector_norm(matrix, dim=0, keepdim=True) > 0.5), 0.0)


def gather_slices(slices, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy the ``(offset, numel)`` slices of ``flat`` one after another into ``out``; returns ``out``."""
    at = 0
    for offset, numel in slices:
        out[at:at + numel].copy_(flat[offset:offset + numel])
        at += numel
    return out


def scatter_slices(slices, packed: torch.Tensor, flat: torch.Tensor) -> None:
    """The inverse of :func:`gather_slices`: write ``packed`` back into the ``(offset, numel)`` slices of ``flat``."""
    at = 0
    for offset, numel in slices:
        flat[offset:offset + numel].copy_(packed[at:at + numel])
        at += numel


@dataclass(frozen=True)
class Matrix:
    """One compressed parameter: its flat slice viewed as rows x cols, and its P (rows x r) and Q (cols x r)."""

    offset: int
    rows: int
    cols: int
    rank: int
    p_offset: int
    q_offset: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This matrix as a (rows, cols) view of the flat vector ``flat``."""
        return flat[self.offset:self.offset + self.rows * self.cols].view(self.rows, self.cols)

    def p(self, buffer: torch.Tensor) -> torch.Tensor:
        """Its P as a (rows, r) view of a P buffer."""
        return buffer[self.p_offset:self.p_offset + self.rows * self.rank].view(self.rows, self.rank)

    def q(self, buffer: torch.Tensor) -> torch.Tensor:
        """Its Q as a (cols, r) view of a Q buffer."""
        return buffer[self.q_offset:self.q_offset + self.cols * self.rank].view(self.cols, self.rank)


class LowRankLayout:
    """Which parameters of ``flat`` are compressed at ``rank`` (``matrices``) and which are not (``plain``).

    ``p_numel`` / ``q_numel``: total length of the P / Q buffers; ``plain``: (offset, numel) slices
    sent uncompressed, ``plain_numel`` their total length.
    """

    def __init__(self, flat: FlatParameters, rank: int, min_compression_rate: float):
        self.matrices: list[Matrix] = []
        self.plain: list[tuple[int, int]] = []
        p_numel = q_numel = 0
        for layer in flat.layers:
            rows = layer.shape[0] if layer.shape else 1
            cols = layer.numel // rows if rows else 0
            r = min(rank, rows, cols)
            if r and (rows + cols) * r * min_compression_rate < rows * cols:
                self.matrices.append(Matrix(layer.offset, rows, cols, r, p_numel, q_numel))
                p_numel, q_numel = p_numel + rows * r, q_numel + cols * r
            elif layer.numel:
                self.plain.append((layer.offset, layer.numel))
        self.p_numel, self.q_numel = p_numel, q_numel
        self.plain_numel = sum(n for _, n in self.plain)
        self._column_of: dict[torch.device, torch.Tensor] = {}  # Q buffer entry -> index of its column

    def lost_columns(self, q: torch.Tensor) -> list[bool] | None:
        """Which columns of the Q buffer ``q`` are all zero or hold a non-finite entry, r per matrix in order
        (one reduction over the buffer, one read back); None when there is none."""
        if not self.matrices:
            return None
        ids = self._column_of.get(q.device)
        if ids is None:
            ids = torch.cat([torch.arange(mat.rank).repeat(mat.cols) + at
                             for mat, at in zip(self.matrices, self._column_starts())])
            ids = self._column_of[q.device] = ids.to(q.device)
        sums = torch.zeros(sum(m.rank for m in self.matrices), dtype=q.dtype, device=q.device)
        lost = ~(sums.index_add_(0, ids, q * q) > 0)
        return lost.tolist() if bool(lost.any()) else None

    def redraw_columns(self, q: torch.Tensor, lost: list[bool], generator: torch.Generator) -> None:
        """Refill the ``lost`` columns (as :meth:`lost_columns` gives them) of the Q buffer ``q`` with standard
        normal entries: one (cols x r) draw from ``generator`` per matrix with a lost column, in layout order."""
        for mat, at in zip(self.matrices, self._column_starts()):
            which = [k for k in range(mat.rank) if lost[at + k]]
            if which:
                fresh = torch.randn(mat.cols, mat.rank, generator=generator, dtype=q.dtype).to(q.device)
                mat.q(q)[:, which] = fresh[:, which]

    def _column_starts(self) -> list[int]:
        starts, at = [], 0
        for mat in self.matrices:
            starts.append(at)
            at += mat.rank
        return starts

    def gather_plain(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy the uncompressed slices of ``flat`` one after another into ``out``; returns ``out``."""
        return gather_slices(self.plain, flat, out)

    def scatter_plain(self, packed: torch.Tensor, flat: torch.Tensor) -> None:
        """The inverse of :meth:`gather_plain`: write ``packed`` back into the uncompressed slices of ``flat``."""
        scatter_slices(self.plain, packed, flat)

    def draw_q(self, q: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the Q buffer with standard normal entries, matrix by matrix (one draw per Q)."""
        for mat in self.matrices:
            mat.q(q).copy_(torch.randn(mat.cols, mat.rank, generator=generator, dtype=q.dtype))
