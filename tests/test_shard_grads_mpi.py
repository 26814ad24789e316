"""What ``shard=True`` promises about the user's optimizer and the gradient, at every world size.

* Adagrad, whose constructor creates state (``sum`` filled with ``initial_accumulator_value``, ``step`` 0), is taken
  sharded and unsharded, and trains as torch's Adagrad on the whole model fed MPI's own average of the ranks'
  gradients: unsharded and sharded in the allreduce's order bit for bit, in the fast order within 1e-6. Each rank
  holds its shard's ``sum`` only, and a state round trip resumes it exactly. An Adagrad that has stepped, or whose
  state was changed, is refused in one line.
* ``p.grad`` after ``step()``: unsharded the averaged gradient (as DDP); sharded the averaged gradient on this
  rank's shard and zero elsewhere (summed over the ranks: the averaged gradient); with ``full_grad=True`` the whole
  averaged gradient, bit for bit the unsharded one, for one more fp32 allgather (bytes and messages by the Ledger).
* ``torch.nn.utils.clip_grad_norm_`` called by the user before ``step()`` clips each rank's local gradient (the
  average of the clipped gradients is stepped), not the averaged one as ``algo.clip_grad_norm_`` does.
"""

import pytest
import torch
from mpi4py import MPI

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import D_OUT, batch
from .conftest import assert_all, run_all
from .test_sharding_mpi import bounds, make_net, two_groups

pytestmark = pytest.mark.mpi

STEPS = 12
ADAGRAD = {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-10}


def _world(comm) -> Communicator:
    return Communicator(comm, topo.ring(comm.Get_size()))


def adagrad(model: torch.nn.Module) -> torch.optim.Adagrad:
    """Adagrad over two groups (weight decay on the weights only): state made in its constructor."""
    return torch.optim.Adagrad(two_groups(model, 0.01), **ADAGRAD)


def local_loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y % D_OUT)


def steps(algo, count: int) -> None:
    for _ in range(count):
        algo.zero_grad()
        local_loss(algo.model, algo.comm.rank, algo.step_count).backward()
        algo.step()


def flat_of(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference_adagrad(comm, count: int) -> torch.Tensor:
    """torch's Adagrad on the whole model, each step fed MPI's own allreduce of the ranks' gradients over n."""
    model = make_net(0)
    optimizer = adagrad(model)
    n, rank = comm.Get_size(), comm.Get_rank()
    for step in range(count):
        model.zero_grad()
        local_loss(model, rank, step).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, grad)
        at = 0
        for p in model.parameters():
            p.grad.copy_(torch.from_numpy(grad[at:at + p.numel()]).view_as(p)).div_(n)
            at += p.numel()
        optimizer.step()
    return flat_of(model)


def build_adagrad(comm, **shard):
    model = make_net(0)
    return make_algorithm("allreduce_sgd", model, _world(comm), optimizer=adagrad(model), **shard)


def test_adagrad_trains_as_torch_adagrad_sharded_and_not(comm):
    def body():
        expected = reference_adagrad(comm, STEPS)
        runs = {}
        for tag, shard in (("plain", {}), ("exact", {"shard": True, "shard_order": "exact"}),
                           ("fast", {"shard": True})):
            algo = build_adagrad(comm, **shard)
            steps(algo, STEPS)
            runs[tag] = algo
        assert not torch.equal(expected, flat_of(make_net(0)))  # it trained
        for tag in ("plain", "exact"):
            diff = float((runs[tag].flat.data - expected).abs().max())
            assert torch.equal(runs[tag].flat.data, expected), (tag, diff)
        torch.testing.assert_close(runs["fast"].flat.data, expected, rtol=1e-6, atol=1e-6)
        if comm.Get_size() <= 2:  # one sum, a + b: the fast order is the allreduce's
            assert torch.equal(runs["fast"].flat.data, expected)
        # each rank keeps its shard's sum (and each piece's step, a scalar), together the whole model's
        sharded = runs["exact"]
        lo, hi = bounds(sharded.flat.numel, comm.Get_size(), comm.Get_rank())
        sums = sum(state["sum"].numel() for state in sharded.optimizer.state.values())
        assert sums == hi - lo and comm.allreduce(sums) == sharded.flat.numel
        assert all(float(state["step"]) == STEPS for state in sharded.optimizer.state.values())

    run_all(comm, body)


def test_sharded_adagrad_state_round_trip(comm):
    """3 + 3 steps through ``state_dict`` equal 6 straight, bit for bit: the shard's ``sum`` and the pieces' ``step``
    are saved and restored (into an Adagrad built afresh, whose constructor's state they replace)."""
    def body():
        straight = build_adagrad(comm, shard=True)
        steps(straight, 6)
        first = build_adagrad(comm, shard=True)
        steps(first, 3)
        state = first.state_dict()
        assert "sum" in state["extra"]["shard"]["flat"]
        resumed = build_adagrad(comm, shard=True)
        resumed.load_state_dict(state)
        steps(resumed, 3)
        assert torch.equal(resumed.flat.data, straight.flat.data)

    run_all(comm, body)


def _refusal(comm, make) -> str:
    """The one message ``make()`` raised on every rank ('' if it built), asserted the same everywhere."""
    try:
        make().close()
        message = ""
    except ValueError as exc:
        message = str(exc)
    messages = comm.allgather(message)
    assert_all(comm, len(set(messages)) == 1 and "\n" not in messages[0], messages)
    return messages[0]


def test_adagrad_with_other_state_than_its_constructors_is_refused(comm):
    def stepped():
        model = make_net(0)
        optimizer = adagrad(model)
        local_loss(model, 0, 0).backward()
        optimizer.step()
        return make_algorithm("allreduce_sgd", model, _world(comm), optimizer=optimizer, shard=True)

    def changed():
        model = make_net(0)
        optimizer = adagrad(model)
        last = list(model.parameters())[-1]
        optimizer.state[last]["sum"][-1] += 1.0  # the model's last element: the last rank with a shard checks it
        return make_algorithm("allreduce_sgd", model, _world(comm), optimizer=optimizer, shard=True)

    def fresh():
        return build_adagrad(comm, shard=True)

    assert _refusal(comm, fresh) == ""
    for make, name in ((stepped, ""), (changed, "'2.bias'")):  # only the last rank holds any of 2.bias
        message = _refusal(comm, make)
        assert "already holds state other than its constructor's" in message and name in message, message


@pytest.mark.parametrize("clip", [None, 0.5], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("method", ["allreduce_sgd", "allreduce_adam"])
def test_p_grad_after_step_holds_the_averaged_gradient(comm, method, clip):
    """After each of 3 steps: unsharded p.grad is MPI's average of the ranks' gradients (clipped as the step
    clipped it); sharded it is that on this rank's shard and zero elsewhere; with full_grad the whole of it, bit for
    bit the unsharded p.grad in the allreduce's order (clipped: within rounding, the sharded norm being summed in
    another order), for 4 c (n - 1) bytes and n - 1 messages more a step."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        options = {"lr": 0.05} if method == "allreduce_sgd" else {"lr": 0.01}
        runs = {}
        for tag, shard in (("plain", {}), ("shard", {"shard": True, "shard_order": "exact"}),
                           ("full", {"shard": True, "shard_order": "exact", "full_grad": True})):
            algo = make_algorithm(method, make_net(0), _world(comm), **options, **shard)
            algo.clip_grad_norm_(clip)
            runs[tag] = algo
        same = torch.equal if clip is None else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7)
        for step in range(3):
            grads, sent = {}, {}
            for tag, algo in runs.items():
                algo.zero_grad()
                local_loss(algo.model, rank, step).backward()
                if tag == "plain":
                    local = algo.flat.grad.clone()
                before = (algo.comm.ledger.bytes_sent("allgather"), algo.comm.ledger.messages_sent("allgather"))
                algo.step()
                sent[tag] = (algo.comm.ledger.bytes_sent("allgather") - before[0],
                             algo.comm.ledger.messages_sent("allgather") - before[1])
                grads[tag] = torch.cat([p.grad.reshape(-1) for p in algo.model.parameters()])
                assert torch.equal(grads[tag], algo.flat.grad)
            average = local.numpy().copy()
            comm.Allreduce(MPI.IN_PLACE, average)
            average = torch.from_numpy(average).div_(n)
            if clip is None:
                assert torch.equal(grads["plain"], average)
            else:
                norm = float(runs["plain"].last_grad_norm)
                assert step > 0 or norm > clip, norm
                torch.testing.assert_close(grads["plain"], average * min(1.0, clip / (norm + 1e-6)), rtol=1e-6, atol=0)
            lo, hi = bounds(algo.flat.numel, n, rank)
            assert same(grads["shard"][lo:hi], grads["plain"][lo:hi]), step
            assert not grads["shard"][:lo].any() and not grads["shard"][hi:].any()
            summed = grads["shard"].numpy().copy()
            comm.Allreduce(MPI.IN_PLACE, summed)  # one non-zero term per element: exact
            assert same(torch.from_numpy(summed), grads["plain"])
            assert same(grads["full"], grads["plain"]), step
            assert torch.equal(torch.from_numpy(summed), grads["full"])
            c = bounds(algo.flat.numel, n, 0)[1]
            assert sent["full"][0] - sent["shard"][0] == 4 * c * (n - 1), sent
            assert sent["full"][1] - sent["shard"][1] == n - 1, sent

    run_all(comm, body)


def test_users_clip_before_step_clips_the_local_gradient(comm):
    """``torch.nn.utils.clip_grad_norm_`` on the model before ``algo.step()`` (the DDP habit): each rank's own
    gradient is clipped to the norm and the average of those is stepped -- not the clip of the average, which
    ``algo.clip_grad_norm_`` gives. The ranks' gradients differ here, so the two differ."""
    def body():
        n, rank, lr, limit = comm.Get_size(), comm.Get_rank(), 0.1, 0.05
        for shard in ({}, {"shard": True}):
            users, ours = (make_algorithm("allreduce_sgd", make_net(0), _world(comm), lr=lr, **shard)
                           for _ in range(2))
            ours.clip_grad_norm_(limit)
            start = ours.flat.data.clone()
            for algo in (users, ours):
                algo.zero_grad()
                local_loss(algo.model, rank, 0).backward()
            local = users.flat.grad.clone()
            torch.nn.utils.clip_grad_norm_(users.model.parameters(), limit)
            users.step()
            ours.step()
            local_norm = float(local.norm())
            assert local_norm > limit, local_norm
            each = (local * min(1.0, limit / (local_norm + 1e-6))).numpy().copy()
            comm.Allreduce(MPI.IN_PLACE, each)
            average = local.numpy().copy()
            comm.Allreduce(MPI.IN_PLACE, average)
            average = torch.from_numpy(average).div_(n)
            global_clip = average * min(1.0, limit / (float(average.norm()) + 1e-6))
            torch.testing.assert_close(users.flat.data, start - lr * torch.from_numpy(each) / n, rtol=0, atol=1e-6)
            torch.testing.assert_close(ours.flat.data, start - lr * global_clip, rtol=0, atol=1e-6)
            if n > 1:
                assert float((users.flat.data - ours.flat.data).abs().max()) > 1e-4

    run_all(comm, body)
