"""``shard=True`` (ZeRO-1: optimizer state sharded) for allreduce_sgd and allreduce_adam, at every world size

* Lossless (``shard_bits=32``) in the allreduce's order (``shard_order="exact"``): 20 steps bit for bit as the
  unsharded method, built-in optimizers and the user's torch SGD / AdamW over two parameter groups driven by an lr
  scheduler; each rank trains on its own data. In the pairwise order (``"fast"``, the default): bit for bit at 2
  ranks, within float32 rounding (2e-6 of the largest weight) from 3.
* The fp32 reduce-scatter alone, both orders, against MPI's own allreduce of six-decade gradients; what lands is
  one shard, and the messages per rank are n - 1 (fast), at most n (exact), by the Ledger.
* The optimizer state each rank holds is its shard's only, by the shard bounds worked out by hand
  (c = 8 ceil(d / 8n), rank r owns [min(rc, d), min((r+1)c, d))), and over the ranks it is the replicated state.
* The 4- and 8-bit reduce-scatter's bytes by the Ledger, against the QSGD payload computed by hand, and against
  the exact path's; 4-bit training reaches the unsharded loss.
* Checkpoints: exact resume at the same size (user AdamW; the 4-bit path's residual and generator), and resume
  at another size, against the saved states read with h5py and the unsharded method resumed alike.
* Bad combinations: one line, the same on every rank.
"""

import functools
import math
import time

import pytest
import torch
from mpi4py import MPI

import mpicomm
from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.algorithms.shared.shard_exchange import ShardedSum
from mpicomm.comm import Communicator

from .algo_common import D_IN, D_OUT, batch, train
from .conftest import assert_all, run_all
from .h5_state import saved_states

pytestmark = pytest.mark.mpi

STEPS = 20
HIDDEN = 256  # d = 6*256 + 256 + 256*3 + 3 = 2563: every shard boundary cuts a parameter at 2, 3 and 4 ranks


def make_net(seed: int = 0) -> torch.nn.Module:
    """A 6-256-3 tanh MLP (2563 parameters) with seeded weights, fed by ``algo_common.batch``."""
    torch.random.default_generator.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT))


def bounds(d: int, n: int, r: int) -> tuple[int, int]:
    """Rank r's shard by hand: chunks of c = 8 ceil(d / 8n)."""
    c = 8 * math.ceil(d / (8 * n))
    return min(r * c, d), min((r + 1) * c, d)


def two_groups(model: torch.nn.Module, decay: float) -> list[dict]:
    """The weights with ``decay``, the biases without (the biases' group first: not the flat order)."""
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [{"params": biases, "weight_decay": 0.0}, {"params": weights, "weight_decay": decay}]


USER = {
    "sgd": lambda m: torch.optim.SGD(two_groups(m, 0.01), lr=0.1, momentum=0.9, weight_decay=0.0),
    "adamw": lambda m: torch.optim.AdamW(two_groups(m, 0.1), lr=0.01),
    "adamw-foreach": lambda m: torch.optim.AdamW(two_groups(m, 0.1), lr=0.01, foreach=True),
    "adamw-fused": lambda m: torch.optim.AdamW(two_groups(m, 0.1), lr=0.01, fused=True),
}
CASES = {  # name: (method, options, user optimizer or None, state tensors per element)
    "sgd": ("allreduce_sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, None, 1),
    "sgd-user": ("allreduce_sgd", {}, "sgd", 1),
    "adam": ("allreduce_adam", {"lr": 0.01, "weight_decay": 0.05}, None, 2),
    "adamw-user": ("allreduce_adam", {}, "adamw", 2),  # torch's default on the CPU: the single-tensor path
    "adamw-foreach-user": ("allreduce_adam", {}, "adamw-foreach", 2),
    "adamw-fused-user": ("allreduce_adam", {}, "adamw-fused", 2),
}


def build(world, case: str, seed: int = 0, **shard):
    """(algo, scheduler or None) for ``case`` on ``world``; the user's optimizer gets a LambdaLR made before wrap."""
    name, options, user, _ = CASES[case]
    model = make_net(seed)
    optimizer = USER[user](model) if user else None
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.25 * s)) if user else None
    algo = make_algorithm(name, model, Communicator(world, topo.ring(world.Get_size())), optimizer=optimizer,
                          **options, **shard)
    return algo, schedule


def run_steps(algo, schedule, steps: int) -> None:
    """``steps`` steps on this rank's own batches (``batch(rank, step)``), the scheduler stepped after each."""
    for _ in range(steps):
        train(algo, 1)
        if schedule is not None:
            schedule.step()


def held_state(algo) -> int:
    """Elements of the optimizer's non-scalar state tensors on this rank."""
    return sum(t.numel() for state in algo.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


EXACT = {"shard": True, "shard_order": "exact"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lossless_shard_trains_bit_for_bit_as_unsharded(comm, case):
    def body():
        runs = {}
        for sharded in (False, True):
            algo, schedule = build(comm, case, seed=comm.Get_rank(), **(EXACT if sharded else {}))
            run_steps(algo, schedule, STEPS)
            runs[sharded] = algo, schedule
        (plain, plain_schedule), (sharded, schedule) = runs[False], runs[True]
        assert sharded.step_count == STEPS
        assert not torch.equal(sharded.flat.data, build(comm, case)[0].flat.data)  # it trained
        diff = float((sharded.flat.data - plain.flat.data).abs().max())
        assert torch.equal(sharded.flat.data, plain.flat.data), f"max difference {diff}"
        if schedule is not None:  # the scheduler drove the groups of pieces: lr = base / (1 + 0.25 * 20)
            base = {"sgd": 0.1, "adamw": 0.01, "adamw-foreach": 0.01, "adamw-fused": 0.01}[CASES[case][2]]
            assert [g["lr"] for g in sharded.optimizer.param_groups] == pytest.approx([base / 6] * 2, rel=1e-12)
            assert [g["weight_decay"] for g in sharded.optimizer.param_groups] == \
                [g["weight_decay"] for g in plain_schedule.optimizer.param_groups]

    run_all(comm, body)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_order_trains_as_unsharded_within_rounding(comm, case):
    """The default pairwise order: the same sums as the allreduce at 2 ranks (a + b), another order from 3."""
    def body():
        plain, _ = build(comm, case, seed=comm.Get_rank())
        fast, _ = build(comm, case, seed=comm.Get_rank(), shard=True)
        assert fast.sharding.exchange.order == "fast"
        run_steps(plain, None, STEPS)
        run_steps(fast, None, STEPS)
        diff = float((fast.flat.data - plain.flat.data).abs().max())
        scale = float(plain.flat.data.abs().max())
        if comm.Get_size() <= 2:
            assert torch.equal(fast.flat.data, plain.flat.data), f"max difference {diff}"
        assert diff <= 2e-6 * scale, (diff, scale)

    run_all(comm, body)


@pytest.mark.parametrize("order", ["exact", "fast"])
def test_fp32_reduce_scatter_is_the_allreduce_slice(comm, order):
    """d = 64 n + 1001 elements whose magnitudes span six decades: the exact order's shard is bit for bit the slice
    of MPI's own allreduce (mpi4py, on numpy), the fast order's within n float32 roundings of the largest term (bit
    for bit at 2 ranks). One block lands at a time; the Ledger books n - 1 messages a rank (fast), at most n
    (exact)."""
    def body():
        n, r = comm.Get_size(), comm.Get_rank()
        d = 64 * n + 1001
        draw = torch.Generator().manual_seed(r)
        grad = torch.randn(d, generator=draw) * 10.0 ** torch.randint(-3, 3, (d,), generator=draw)
        communicator = Communicator(comm, topo.ring(n))
        exchange = ShardedSum(communicator, d, 32, 0, grad, order)
        assert (exchange.lo, exchange.hi) == bounds(d, n, r)
        c = bounds(d, n, 0)[1]
        assert exchange.received.numel() == (c if n > 1 else 0)  # the landing buffer: one shard
        kept = grad.clone()
        out = exchange.reduce_scatter(kept, torch.empty(exchange.hi - exchange.lo))
        expected = grad.numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, expected)
        expected = torch.from_numpy(expected)[exchange.lo:exchange.hi]
        if order == "exact" or n <= 2:
            assert torch.equal(out, expected)
        else:  # another order of n terms: within n roundings of the largest term (the sums cancel)
            largest = comm.allreduce(float(grad.abs().max()), MPI.MAX)
            torch.testing.assert_close(out, expected, rtol=0, atol=n * 2.0**-23 * largest)
            assert torch.equal(kept, grad)  # the fast order only reads the gradient
        messages = communicator.ledger.messages_sent("alltoallv")
        assert messages == (n - 1 if order == "fast" else messages) and messages <= n, messages
        if order == "exact" and n & (n - 1) == 0:
            assert messages == n - 1  # a power of two: each other rank's block once

    run_all(comm, body)


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_state_is_the_ranks_shard(comm, case):
    def body():
        n, r, k = comm.Get_size(), comm.Get_rank(), CASES[case][3]
        algo, schedule = build(comm, case, shard=True)
        plain, plain_schedule = build(comm, case)
        run_steps(algo, schedule, 2)
        run_steps(plain, plain_schedule, 2)
        d = algo.flat.numel
        lo, hi = bounds(d, n, r)
        assert held_state(plain) == k * d  # replicated
        assert held_state(algo) == k * (hi - lo), (held_state(algo), lo, hi)
        assert hi - lo <= d / n + 8
        assert comm.allreduce(held_state(algo)) == k * d

    run_all(comm, body)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_reduce_scatter_bytes_by_the_ledger(comm, bits):
    """Per step: one all-to-all of n rows of the QSGD payload of the longest shard, 4 bytes per 512-element
    block's scale plus ``bits`` per element (c = 648, 856 and 1288 at 4, 3 and 2 ranks: two or three blocks); the
    parameters back in one allgather of n equal parts of c fp32 elements."""
    def body():
        n, r, steps = comm.Get_size(), comm.Get_rank(), 3
        sent = {}
        for shard_bits in (32, bits):
            algo, _ = build(comm, "sgd", shard=True, shard_bits=shard_bits)
            run_steps(algo, None, steps)
            ledger = algo.comm.ledger
            sent[shard_bits] = {op: ledger.bytes_sent(op) for op in ("alltoall", "alltoallv", "allgather")}
        d = algo.flat.numel
        lo, hi = bounds(d, n, r)
        c = bounds(d, n, 0)[1]  # the longest shard
        row = 4 * math.ceil(c / 512) + math.ceil(c * bits / 8)
        exact, quantized = sent[32], sent[bits]
        assert quantized["alltoall"] == steps * (n - 1) * row and quantized["alltoallv"] == 0, quantized
        assert exact["alltoallv"] == steps * 4 * (d - (hi - lo)) and exact["alltoall"] == 0, exact
        assert quantized["alltoall"] <= 0.3 * exact["alltoallv"]
        # the fp32 parameter gather: one allgather of equal padded parts, the longest shard's c each
        assert exact["allgather"] == quantized["allgather"] == steps * (n - 1) * 4 * c

    run_all(comm, body)


@functools.cache
def teacher() -> torch.nn.Module:
    """The regression's fixed random 6-256-3 MLP."""
    return make_net(99).requires_grad_(False)


def regression_loss(model: torch.nn.Module, rank: int, step: int, seed: int) -> torch.Tensor:
    """MSE against a fixed random teacher MLP plus noise, on this rank's batch of 32 (seeded by rank and step)."""
    g = torch.Generator().manual_seed(100_000 * seed + 1000 * rank + step)
    x = torch.randn(32, D_IN, generator=g)
    with torch.no_grad():
        y = teacher()(x) + 0.1 * torch.randn(32, D_OUT, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("seed", [0, 1])
def test_four_bit_shards_train_as_the_unsharded_method(comm, seed):
    """40 steps of SGD with momentum on the regression: the 4-bit sharded model's held-out loss within 10 % of
    the unsharded one's from the same start and data. Measured (5-6 seeds at 2, 3, 4 ranks) the ratio stayed in
    [0.987, 1.025], while the unsharded loss itself moved between 0.0038 and 0.0075 from seed to seed."""
    def body():
        held_out = torch.randn(512, D_IN, generator=torch.Generator().manual_seed(7))
        losses = {}
        for shard in ({}, {"shard": True, "shard_bits": 4}):
            algo = make_algorithm("allreduce_sgd", make_net(seed), Communicator(comm, topo.ring(comm.Get_size())),
                                  lr=0.05, momentum=0.9, **shard)
            with torch.no_grad():
                start = float(torch.nn.functional.mse_loss(algo.model(held_out), teacher()(held_out)))
            for step in range(40):
                algo.zero_grad()
                regression_loss(algo.model, comm.Get_rank(), step, seed).backward()
                algo.step()
            with torch.no_grad():
                losses[bool(shard)] = float(torch.nn.functional.mse_loss(algo.model(held_out), teacher()(held_out)))
        assert losses[True] < 0.1 * start, (start, losses)
        assert losses[True] <= 1.10 * losses[False], losses

    run_all(comm, body)


def shared_dir(comm, tmp_path_factory) -> str:
    """One temporary directory for every rank (rank 0's)."""
    return comm.bcast(str(tmp_path_factory.mktemp("sharding")) if comm.Get_rank() == 0 else None)


@pytest.mark.parametrize("case,shard", [("adamw-user", {"shard": True}),
                                        ("sgd", {"shard": True, "shard_bits": 4})], ids=["adamw-user", "sgd-4bit"])
def test_checkpoint_resumes_exactly_at_the_same_size(comm, case, shard, tmp_path_factory):
    """3 steps, save, 3 more equals 6 straight, bit for bit (the 4-bit path: residual and codec generator too)."""
    root = shared_dir(comm, tmp_path_factory)

    def body():
        straight, schedule = build(comm, case, **shard)
        run_steps(straight, None, 6)
        first, _ = build(comm, case, **shard)
        run_steps(first, None, 3)
        mpicomm.save(f"{root}/{case}", first, step=3)
        run_steps(first, None, 1)  # must not reach the checkpoint
        resumed, _ = build(comm, case, seed=5, **shard)
        step, _ = mpicomm.restore(f"{root}/{case}", resumed)
        assert step == 3 and resumed.step_count == 3
        run_steps(resumed, None, 3)
        diff = float((resumed.flat.data - straight.flat.data).abs().max())
        assert torch.equal(resumed.flat.data, straight.flat.data), f"max difference {diff}"

    run_all(comm, body)


def _in_world(comm, size: int, phase) -> None:
    """``phase(world)`` on a world of the first ``size`` ranks (the others wait asleep); all leave together."""
    world = comm.Split(0 if comm.Get_rank() < size else MPI.UNDEFINED, comm.Get_rank())
    error = None
    if world != MPI.COMM_NULL:
        try:
            phase(world)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = repr(exc)
        world.Free()
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)
    errors = [e for e in comm.allgather(error) if e]
    assert not errors, errors


def _adam_vectors(algo) -> tuple[dict, list]:
    """This rank's (offset -> (exp_avg, exp_avg_sq)) of its AdamW pieces, found by where they lie in the flat
    buffer, and the pieces' Adam steps."""
    out, steps, base = {}, [], algo.flat.data.data_ptr()
    for group in algo.optimizer.param_groups:
        for piece in group["params"]:
            state = algo.optimizer.state[piece]
            out[(piece.data_ptr() - base) // piece.element_size()] = (state["exp_avg"].clone(),
                                                                      state["exp_avg_sq"].clone())
            steps.append(float(state["step"]))
    return out, steps


def test_resume_at_another_size_recuts_the_state(comm, tmp_path_factory):
    """AdamW over two groups saved at 2 ranks (1 in the 2-rank job), sharded and unsharded, resumed at this
    job's size: the new ranks' m and v, put together by where their pieces lie, are the saved ranks' flat
    vectors (read with h5py) end to end; then both train 3 more steps and stay bit for bit equal."""
    root, n = shared_dir(comm, tmp_path_factory), comm.Get_size()
    old = 2 if n > 2 else 1

    def save(world):
        for tag, shard in (("plain", {}), ("sharded", EXACT)):
            algo, _ = build(world, "adamw-user", seed=world.Get_rank(), **shard)
            run_steps(algo, None, 4)
            mpicomm.save(f"{root}/{tag}", algo, step=4)
            algo.close()

    _in_world(comm, old, save)

    def body():
        algos = {}
        for tag, shard in (("plain", {}), ("sharded", EXACT)):
            algo, _ = build(comm, "adamw-user", seed=7, **shard)
            assert mpicomm.restore(f"{root}/{tag}", algo)[0] == 4
            algos[tag] = algo
        saved = saved_states(f"{root}/sharded")
        assert len(saved) == old
        d = algos["sharded"].flat.numel
        expected = [torch.cat([s["extra"]["shard"]["flat"][key] for s in saved]) for key in ("exp_avg", "exp_avg_sq")]
        assert expected[0].shape == (d,)
        mine, steps = _adam_vectors(algos["sharded"])
        got, covered = [torch.full((d,), float("nan")) for _ in range(2)], torch.zeros(d, dtype=torch.int64)
        for pieces in comm.allgather(mine):
            for at, vectors in pieces.items():
                covered[at:at + vectors[0].numel()] += 1
                for whole, part in zip(got, vectors):
                    whole[at:at + part.numel()] = part
        assert torch.equal(covered, torch.ones(d, dtype=torch.int64)), "the new pieces do not tile the model"
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert steps and set(steps) == {4.0}, steps
        for algo in algos.values():
            run_steps(algo, None, 3)
        assert torch.equal(algos["sharded"].flat.data, algos["plain"].flat.data)

    run_all(comm, body)


def _refusal(comm, make) -> str:
    """The one message ``make()`` raised on every rank (asserted the same everywhere, one line)."""
    try:
        make()
        message = ""
    except ValueError as exc:
        message = str(exc)
    messages = comm.allgather(message)
    assert_all(comm, messages[0] and len(set(messages)) == 1 and "\n" not in messages[0], messages)
    return messages[0]


def test_bad_combinations_are_one_line_on_every_rank(comm):
    def world():
        return Communicator(comm, topo.ring(comm.Get_size()))

    message = _refusal(comm, lambda: make_algorithm("dpsgd", make_net(), world(), lr=0.1, shard=True))
    assert "dpsgd" in message and "allreduce_adam, allreduce_sgd" in message, message
    message = _refusal(comm, lambda: make_algorithm("allreduce_sgd", make_net(), world(), lr=0.1, shard_bits=4))
    assert "shard_bits=4" in message and "shard=True" in message, message
    message = _refusal(comm, lambda: make_algorithm("allreduce_sgd", make_net(), world(), lr=0.1, shard=True,
                                                    overlap=True))
    assert "overlap" in message and "shard=True" in message, message
    model = make_net()
    message = _refusal(comm, lambda: make_algorithm("allreduce_adam", model, world(), shard=True,
                                                    optimizer=torch.optim.LBFGS(model.parameters())))
    assert "LBFGS" in message and "elementwise" in message, message

    model = make_net()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(batch(0, 0)[0]).sum().backward()
    stepped.step()
    message = _refusal(comm, lambda: make_algorithm("allreduce_sgd", model, world(), optimizer=stepped, shard=True))
    assert "already holds state" in message, message
    # unsharded, the same stepped optimizer is taken: the refusal is the shard's
    make_algorithm("allreduce_sgd", model, world(), optimizer=stepped).close()


@pytest.mark.parametrize("user", [False, True], ids=["adam", "adamw-user"])
def test_ranks_past_a_small_model_own_empty_shards(comm, user, tmp_path_factory):
    """An 8-element model (c = 8): rank 0 owns it all, the others empty shards. Sharded AdamW trains bit for bit
    as unsharded, and a checkpoint resumes exactly (the empty ranks save and load no state)."""
    root = shared_dir(comm, tmp_path_factory)

    def build_small(seed=0, **shard):
        torch.random.default_generator.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01) if user else None
        return make_algorithm("allreduce_adam", model, Communicator(comm, topo.ring(comm.Get_size())),
                              optimizer=optimizer, **({} if user else {"lr": 0.01}), **shard)

    def steps(algo, count):
        for _ in range(count):
            algo.zero_grad()
            x, y = batch(comm.Get_rank(), algo.step_count)
            torch.nn.functional.cross_entropy(algo.model(x[:, :3]), y % 2).backward()
            algo.step()

    def body():
        plain, sharded = build_small(), build_small(**EXACT)
        steps(plain, 6)
        steps(sharded, 3)
        assert held_state(sharded) == (16 if comm.Get_rank() == 0 else 0)
        mpicomm.save(f"{root}/small", sharded, step=3)
        resumed = build_small(seed=3, **EXACT)
        mpicomm.restore(f"{root}/small", resumed)
        steps(sharded, 3)
        steps(resumed, 3)
        assert torch.equal(sharded.flat.data, plain.flat.data) and torch.equal(resumed.flat.data, plain.flat.data)

    run_all(comm, body)
