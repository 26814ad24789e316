"""The fp32 reduce-scatter's rounds: in each, a rank sends at most one shard-sized block to one peer and receives
at most one from one peer, so what lands is one block (one shard), whatever the number of ranks.

Blocks are the shards of :class:`~.shard_exchange.ShardLayout` (block k is rank k's range; empty blocks are never
sent). Two orders of the sum, on rank r of n:

``fast`` -- the pairwise exchange (as MPICH's long-message ``MPI_Reduce_scatter``): at round k = 1 .. n-1, rank r
sends block r+k to rank r+k and receives its own block from rank r-k (mod n), added at once::

    s_r = ((g_r + g_(r-1)) + g_(r-2)) + ... + g_(r-n+1)        n - 1 messages; the gradient is only read

``exact`` -- recursive halving in the order of MPICH's allreduce (:func:`.allgather_sum.tree_sum`): with p the
largest power of two <= n and rem = n - p, rank 2i+1 (i < rem) first sends its whole gradient, block by block, to
rank 2i, which adds it (leaf i = g_2i + g_2i+1; leaf j >= rem is g_(j+rem)); then for m = 1, 2, 4, ..., p/2 each
leaf v and its partner v XOR m swap the blocks of the owners in the other's half (the leaves u = partner mod 2m)
and add what they receive, so that after the last halving leaf v holds the sum of its own blocks, added as the
balanced tree of adjacent pairs, ``((l0 + l1) + (l2 + l3)) + ...`` -- the allreduce's association, so the result
equals the slice of MPICH's allreduce bit for bit; last, rank 2i sends rank 2i+1 its block. The partial sums are
kept in the gradient itself (spent), one message per block: n - 1 messages per rank when n is a power of two (each
of the other ranks' blocks once), otherwise at most n, on the ranks that fold their gradient into a neighbour's
(the whole vector, d elements instead of d (n - 1) / n), in about 2 n rounds.

Every rank runs the same number of rounds (a round is one collective call), idle where it has nothing to move.
Pure: no MPI, so that the schedule can be checked serially and its messages counted at any n.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ORDERS", "Round", "exact_rounds", "fast_rounds", "rounds"]

ORDERS = ("fast", "exact")
"""The fp32 reduce-scatter's orders of the sum: the pairwise exchange, or the allreduce's (bit for bit unsharded)."""


class Round(NamedTuple):
    """One round on one rank: send block ``send_block`` to ``send_to`` and receive block ``recv_block`` from
    ``recv_from`` (-1: nothing); ``keep``: what lands replaces the block instead of being added to it (the last
    round of the exact order, which hands a folded rank its sum)."""

    send_to: int
    send_block: int
    recv_from: int
    recv_block: int
    keep: bool = False


IDLE = Round(-1, -1, -1, -1)


def fast_rounds(n: int, rank: int, counts: list[int]) -> list[Round]:
    """The pairwise exchange on ``rank`` of ``n`` (``counts``: each block's length): n - 1 rounds."""
    out = []
    for k in range(1, n):
        to, source = (rank + k) % n, (rank - k) % n
        out.append(Round(to if counts[to] else -1, to, source if counts[rank] else -1, rank))
    return out


def exact_rounds(n: int, rank: int, counts: list[int]) -> list[Round]:
    """Recursive halving in the allreduce's order on ``rank`` of ``n`` (``counts``: each block's length)."""
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    blocks = [b for b in range(n) if counts[b]]
    out: list[Round] = []
    folded = rank < 2 * rem and rank % 2 == 1      # sends its gradient to rank - 1 and waits for its sum
    leaf = None if folded else (rank // 2 if rank < 2 * rem else rank - rem)

    def real(v: int) -> int:
        return 2 * v if v < rem else v + rem

    def owned(v: int) -> list[int]:
        return [b for b in ((2 * v, 2 * v + 1) if v < rem else (v + rem,)) if counts[b]]

    if rem:  # fold: leaf i = g_2i + g_(2i+1)
        for b in blocks:
            if folded:
                out.append(Round(rank - 1, b, -1, -1))
            elif rank < 2 * rem:
                out.append(Round(-1, -1, rank + 1, b))
            else:
                out.append(IDLE)
    m = 1
    while m < p:
        halves = [[b for u in range(residue, p, 2 * m) for b in owned(u)] for residue in range(2 * m)]
        length = max(map(len, halves))
        if leaf is None:
            out += [IDLE] * length
        else:
            partner = leaf ^ m
            sent, kept, peer = halves[partner % (2 * m)], halves[leaf % (2 * m)], real(partner)
            for i in range(length):
                out.append(Round(peer if i < len(sent) else -1, sent[i] if i < len(sent) else -1,
                                 peer if i < len(kept) else -1, kept[i] if i < len(kept) else -1))
        m *= 2
    if rem:  # rank 2i+1's sum, which rank 2i holds
        if folded:
            out.append(Round(-1, -1, rank - 1, rank, keep=True) if counts[rank] else IDLE)
        elif rank < 2 * rem:
            out.append(Round(rank + 1, rank + 1, -1, -1) if counts[rank + 1] else IDLE)
        else:
            out.append(IDLE)
    return out


def rounds(order: str, n: int, rank: int, counts: list[int]) -> list[Round]:
    """``rank``'s rounds of the fp32 reduce-scatter in ``order`` (:data:`ORDERS`); none for one rank."""
    if order not in ORDERS:
        raise ValueError(f"shard_order must be one of {', '.join(ORDERS)}, got {order!r}")
    if n == 1:
        return []
    return (fast_rounds if order == "fast" else exact_rounds)(n, rank, counts)
