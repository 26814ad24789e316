"""``shard=True`` without a job: the shard bounds, the resize rule on hand-computed shards, the memory refusal.

The multi-rank behaviour (bit for bit training, bytes, checkpoints) is in ``tests/test_sharding_mpi.py``.
"""

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.algorithms.shared import sharding
from mpicomm.algorithms.shared.shard_exchange import ShardLayout
from mpicomm.algorithms.shared.sharding import fit_problem
from mpicomm.checkpoint.resize_rules import Resize, sharded_optimizer_state

GIB = 1 << 30


@pytest.mark.parametrize("numel,size,expected", [
    (83, 4, [(0, 24), (24, 48), (48, 72), (72, 83)]),    # c = 8 ceil(83 / 32) = 24
    (40, 3, [(0, 16), (16, 32), (32, 40)]),              # c = 8 ceil(40 / 24) = 16
    (10, 4, [(0, 8), (8, 10), (10, 10), (10, 10)]),      # c = 8: the last ranks own nothing
])
def test_shard_bounds_by_hand(numel, size, expected):
    layout = ShardLayout(numel, size)
    assert [layout.bounds(r) for r in range(size)] == expected
    assert layout.counts == [hi - lo for lo, hi in expected]


def _saved(lo: int, hi: int, params: list[str], error: float) -> dict:
    """A saved rank's sharded state over [lo, hi) of a 40-element model: m[i] = 100 + i, v[i] = 1000 + i, Adam's
    step 4 for each parameter it held a piece of, a reduce-scatter residual of ``error`` everywhere."""
    index = torch.arange(lo, hi, dtype=torch.float32)
    return {"flat": {"exp_avg": 100 + index, "exp_avg_sq": 1000 + index},
            "scalars": {p: {"step": torch.tensor(4.0)} for p in params},
            "groups": [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.0}],
            "bounds": torch.tensor([lo, hi]),
            "exchange": {"error": torch.full((40,), error), "codec": {"seed": torch.tensor(lo)}},
            "gather": {}}


def _built(lo: int, hi: int) -> dict:
    """A new rank's sharded state as built over [lo, hi): zeros, no steps, its own codec seed."""
    state = _saved(lo, hi, [], 0.0)
    state["flat"] = {}
    state["exchange"]["codec"] = {"seed": torch.tensor(-1)}
    return state


# 40 elements: saved at 2 ranks with c = 24 (parameters "0" on [0, 30), "1" on [30, 40)), resumed at 3 with c = 16
SAVED = [_saved(0, 24, ["0"], 2.0), _saved(24, 40, ["0", "1"], 4.0)]
NEW = [(0, 16), (16, 32), (32, 40)]


def _recut(values: list, rank: int) -> dict:
    lo, hi = NEW[rank]
    built = _built(lo, hi)
    resize = Resize([{"algorithm": {"extra": {"shard": v}}} for v in values], {"extra": {"shard": built}}, rank, 3)
    return sharded_optimizer_state(values, built, resize, "extra.shard")


@pytest.mark.parametrize("rank", range(3))
def test_resize_rule_recuts_two_saved_shards_into_three(rank):
    lo, hi = NEW[rank]
    new = _recut(SAVED, rank)
    index = torch.arange(lo, hi, dtype=torch.float32)
    assert torch.equal(new["flat"]["exp_avg"], 100 + index)  # rank 1's [16, 32) takes 8 from each saved rank
    assert torch.equal(new["flat"]["exp_avg_sq"], 1000 + index)
    assert torch.equal(new["bounds"], torch.tensor([lo, hi]))
    assert set(new["scalars"]) == {"0", "1"} and all(float(s["step"]) == 4.0 for s in new["scalars"].values())
    assert new["groups"] == SAVED[0]["groups"]
    assert torch.equal(new["exchange"]["error"], torch.full((40,), 3.0))  # the mean of 2 and 4
    assert int(new["exchange"]["codec"]["seed"]) == (SAVED[rank]["exchange"]["codec"]["seed"] if rank < 2 else -1)


def test_resize_rule_restarts_a_lost_ranks_range_at_zero():
    """Only saved rank 0's state (rank 1 lost): [24, 40) restarts at zero; rank 0's elements are kept. The pieces
    that hold restarted coordinates restart whole (no scalars: step 0 at the next step, 2740976's rule), the others
    keep the saved step."""
    expected = {0: 100 + torch.arange(0, 16.0), 1: torch.cat([100 + torch.arange(16, 24.0), torch.zeros(8)]),
                2: torch.zeros(8)}
    for rank, m in expected.items():
        new = _recut(SAVED[:1], rank)
        assert torch.equal(new["flat"]["exp_avg"], m), (rank, new["flat"]["exp_avg"])
        assert new["flat"]["exp_avg_sq"].shape == m.shape
        assert set(new["scalars"]) == ({"0"} if rank == 0 else set()), (rank, new["scalars"])
        assert torch.equal(new["exchange"]["error"], torch.full((40,), 2.0))


def test_fit_problem_names_the_gib_needed_and_free():
    line = fit_problem(3 * GIB + GIB // 2, GIB // 4, "cuda:0")
    assert "3.50 GiB" in line and "0.25 GiB" in line and "cuda:0" in line and "shard=True" in line, line
    assert "\n" not in line
    assert fit_problem(GIB, 2 * GIB, "cpu") == "" and fit_problem(GIB, GIB, "cpu") == ""
    assert fit_problem(10 * GIB, None, "cpu") == ""  # free memory unknown: not refused


def test_a_shard_that_does_not_fit_is_refused_when_built(monkeypatch):
    """At one rank the shard is the whole 6-8-3 MLP, 83 elements in a chunk of 88: 88 x (4 reduced gradient + 8 Adam)
    = 1056 bytes needed (one rank exchanges nothing, so nothing lands), checked before anything is allocated."""
    from mpi4py import MPI

    from mpicomm.comm import Communicator

    from .algo_common import make_model

    def build():
        return make_algorithm("allreduce_adam", make_model(0), Communicator(MPI.COMM_SELF, topology.ring(1)),
                              lr=0.01, shard=True)

    build().close()
    monkeypatch.setattr(sharding, "_free_bytes", lambda device: 1056)
    build().close()
    monkeypatch.setattr(sharding, "_free_bytes", lambda device: 1055)
    with pytest.raises(ValueError, match=r"needs 0\.00 GiB more .* only 0\.00 GiB of cpu memory is free"):
        build()


def test_a_float64_model_with_quantized_shards_trains_or_is_refused_in_one_line():
    """A float64 model with ``shard_bits=4``: refused when built, in one line naming the dtype, or trained."""
    from mpi4py import MPI

    from mpicomm.comm import Communicator

    from .algo_common import batch

    model = torch.nn.Linear(6, 3).double()
    try:
        algo = make_algorithm("allreduce_sgd", model, Communicator(MPI.COMM_SELF, topology.ring(1)), lr=0.1,
                              shard=True, shard_bits=4)
    except (ValueError, TypeError) as exc:
        assert "float64" in str(exc) and "\n" not in str(exc), str(exc)
        return
    x, y = batch(0, 0)
    torch.nn.functional.cross_entropy(algo.model(x.double()), y).backward()
    algo.step()
    assert torch.isfinite(algo.flat.data).all()


@pytest.mark.parametrize("n", range(1, 10))
def test_the_in_place_row_sum_adds_in_the_streaming_sums_order(n):
    """``tree_sum_rows`` (the exact reduce-scatter's, no scratch) equals ``tree_sum`` (the order checked against MPICH's
    allreduce) bit for bit; and it differs from a plain left-to-right sum somewhere at n >= 4 (at 3 both are
    (a0 + a1) + a2), so the order is real."""
    from mpicomm.algorithms.shared.allgather_sum import tree_sum, tree_sum_rows

    g = torch.Generator().manual_seed(n)
    rows = torch.randn(n, 4096, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)
    expected = tree_sum(n, lambda r, buf: buf.copy_(rows[r]), torch.empty(4096), [])
    got = tree_sum_rows(rows.clone(), torch.empty(4096))
    assert torch.equal(got, expected)
    if n >= 4:
        left_to_right = rows[0].clone()
        for r in range(1, n):
            left_to_right += rows[r]
        assert not torch.equal(got, left_to_right)


@pytest.mark.parametrize("n", [2, 3, 64, 1024])
def test_the_memory_check_counts_one_shard_landing_at_any_size(n):
    """The fp32 exchange lands one block at a time: 4 c bytes for 10^9 parameters at any n (at 1,024 ranks 3.7 MiB,
    where the all-to-alls in segments landed 1 GiB), and the check counts it beside the reduced shard and Adam."""
    from mpicomm.algorithms.shared.shard_exchange import ShardedSum
    from mpicomm.algorithms.shared.sharding import ShardConfig, Sharding

    layout = ShardLayout(10**9, n)
    c = layout.chunk
    assert ShardedSum.planned_bytes(layout, 32, 4) == 4 * c
    assert Sharding.planned_bytes(layout, ShardConfig(shard=True), 4, 8) == c * (4 + 8) + 4 * c
    assert ShardedSum.planned_bytes(ShardLayout(10**9, 1), 32, 4) == 0  # one rank exchanges nothing


@pytest.mark.parametrize("options,words", [
    ({"shard": True, "shard_order": "ring"}, ["shard_order must be one of fast, exact", "'ring'"]),
    ({"shard_order": "exact"}, ["shard_order='exact'", "needs shard=True"]),
    ({"full_grad": True}, ["full_grad=True", "needs shard=True"]),
    ({"shard": True, "full_grad": 1}, ["full_grad"]),
])
def test_the_shard_options_are_checked_in_one_line(options, words):
    from mpicomm.algorithms.centralized.allreduce_sgd import AllReduceSGDConfig

    with pytest.raises(ValueError) as caught:
        AllReduceSGDConfig(lr=0.1, **options)
    message = str(caught.value)
    assert all(w in message for w in words) and "\n" not in message, message
