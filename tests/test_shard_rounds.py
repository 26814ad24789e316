"""The fp32 sharded reduce-scatter's rounds (``shard_rounds``), run serially: every rank's rounds executed against
the others' with in-memory messages.

* Both orders deliver every shard's sum to its owner, each message matched by its peer in the same round, for
  n = 1 .. 33 and models small enough that the last ranks own empty shards.
* ``exact`` adds in the order of MPICH's allreduce: bit for bit :func:`tree_sum` (itself checked against MPICH).
* ``fast`` adds g_r, g_(r-1), ... in turn: bit for bit that left-to-right sum, and not ``tree_sum`` somewhere.
* What lands is one block, and the messages per rank are n - 1 (fast), at most n (exact).
"""

import pytest
import torch

from mpicomm.algorithms.shared.allgather_sum import tree_sum
from mpicomm.algorithms.shared.shard_exchange import ShardLayout
from mpicomm.algorithms.shared.shard_rounds import rounds


def simulate(order: str, grads: list[torch.Tensor], layout: ShardLayout) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank's sum of its shard after running ``order``'s rounds together, and the messages each sent."""
    n = len(grads)
    counts = layout.counts
    plans = [rounds(order, n, r, counts) for r in range(n)]
    assert len({len(plan) for plan in plans}) == 1, "every rank must run the same number of rounds"
    work = [g.clone() for g in grads]
    sums = [g[slice(*layout.bounds(r))].clone() for r, g in enumerate(grads)]
    sent = [0] * n

    def block(b: int) -> slice:
        return slice(*layout.bounds(b))

    for t in range(len(plans[0])):
        messages = {}
        for r, plan in enumerate(plans):
            step = plan[t]
            if step.send_to >= 0:
                assert counts[step.send_block] > 0, "an empty block is never sent"
                source = work[r] if order == "exact" else grads[r]
                messages[(r, step.send_to)] = (step.send_block, source[block(step.send_block)].clone())
                sent[r] += 1
        for r, plan in enumerate(plans):
            step = plan[t]
            if step.recv_from < 0:
                continue
            got_block, payload = messages.pop((step.recv_from, r))
            assert got_block == step.recv_block
            assert payload.numel() <= layout.chunk  # what lands: one block
            if order == "fast":
                assert step.recv_block == r
                sums[r] += payload
            elif step.keep:
                work[r][block(step.recv_block)] = payload
            else:
                work[r][block(step.recv_block)] += payload
        assert not messages, f"round {t}: sent but never received: {sorted(messages)}"
    if order == "exact":
        sums = [w[block(r)].clone() for r, w in enumerate(work)]
    return sums, sent


def gradients(n: int, d: int) -> list[torch.Tensor]:
    """n gradients whose magnitudes span six decades, so that another order of the sum shows in the bits."""
    g = torch.Generator().manual_seed(n * 1000 + d)
    return [torch.randn(d, generator=g) * 10.0 ** torch.randint(-3, 3, (d,), generator=g) for _ in range(n)]


@pytest.mark.parametrize("n", range(1, 34))
@pytest.mark.parametrize("d", [40, 1001])
def test_exact_rounds_add_in_the_allreduce_order(n, d):
    layout = ShardLayout(d, n)
    grads = gradients(n, d)
    sums, sent = simulate("exact", grads, layout)
    rows = torch.stack(grads)
    expected = tree_sum(n, lambda r, buf: buf.copy_(rows[r]), torch.empty(d), [])
    for r in range(n):
        assert torch.equal(sums[r], expected[slice(*layout.bounds(r))]), r
    assert max(sent) <= (n - 1 if n & (n - 1) == 0 else n)


@pytest.mark.parametrize("n", range(1, 34))
@pytest.mark.parametrize("d", [40, 1001])
def test_fast_rounds_add_the_ranks_in_turn(n, d):
    layout = ShardLayout(d, n)
    grads = gradients(n, d)
    sums, sent = simulate("fast", grads, layout)
    differs = False
    rows = torch.stack(grads)
    tree = tree_sum(n, lambda r, buf: buf.copy_(rows[r]), torch.empty(d), [])
    for r in range(n):
        shard = slice(*layout.bounds(r))
        expected = grads[r][shard].clone()
        for k in range(1, n):
            expected += grads[(r - k) % n][shard]
        assert torch.equal(sums[r], expected), r
        differs |= not torch.equal(sums[r], tree[shard])
        assert sent[r] == sum(1 for k in range(n) if k != r and layout.counts[k])
    assert differs or n <= 2  # at 2 ranks both orders are the one sum a + b


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="shard_order must be one of fast, exact"):
        rounds("ring", 4, 0, [1, 1, 1, 1])
