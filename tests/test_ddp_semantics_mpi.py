"""A user's optimizer under ``wrap`` behaves as under DDP: against plain torch in one process, and one-line refusals.

A parameter no rank used in a step is not stepped (torch leaves a parameter whose ``.grad`` is None alone, and
DDP with ``find_unused_parameters=True`` keeps it None); one used on some ranks only gets the average with zeros
from the others, as DDP's allreduce gives. The reference is plain torch in one process: one model, the same
optimizer, the loss averaged over every rank's batch (DDP's gradient), ``optimizer.zero_grad()`` as torch does
it. The one-line cases: a parameter group added after ``wrap``, ranks of different dtypes, ``model.half()``
after ``wrap``, a sparse gradient.
"""

import pytest
import torch

import mpicomm
from mpicomm.errors import ScriptError, agreed_of

from .conftest import run_all

pytestmark = pytest.mark.mpi

STEPS = 12

SCHEDULES = {
    "first step only": lambda rank, step: step == 0,
    "rank 0 every third step": lambda rank, step: rank == 0 and step % 3 == 0,
}
"""When a rank's loss uses the auxiliary head: (rank, step) -> bool."""

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
}


def _net() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"body": torch.nn.Linear(4, 8), "head": torch.nn.Linear(8, 1),
                                "aux": torch.nn.Linear(8, 1)})


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(1000 * step + rank))


def _loss(net, rank: int, step: int, uses_aux: bool) -> torch.Tensor:
    hidden = torch.relu(net["body"](_batch(rank, step)))
    loss = (net["head"](hidden) - 1.0).pow(2).mean()
    return loss + net["aux"](hidden).pow(2).mean() if uses_aux else loss


def _flat(net, part: str) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net[part].parameters()]).clone()


def _plain_torch(n: int, build, uses) -> tuple[dict, torch.Tensor]:
    """One process: every rank's loss averaged (DDP's averaged gradient), torch's optimizer.zero_grad().

    Returns each part's parameters after the last step and the auxiliary head after its last use."""
    net = _net()
    optimizer = build(net.parameters())
    aux_after_use = _flat(net, "aux")
    for step in range(STEPS):
        optimizer.zero_grad()
        used = [uses(rank, step) for rank in range(n)]
        (sum(_loss(net, rank, step, used[rank]) for rank in range(n)) / n).backward()
        optimizer.step()
        if any(used):
            aux_after_use = _flat(net, "aux")
    return {part: _flat(net, part) for part in net}, aux_after_use


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_parameter_no_rank_used_is_not_stepped_as_in_plain_torch(comm, schedule, optimizer):
    _check_against_plain_torch(comm, schedule, optimizer)


def test_with_gradient_buckets_in_flight_as_well(comm):
    """Bucketed allreduce during backward (a bucket per layer): the agreement comes after the last bucket."""
    _check_against_plain_torch(comm, "rank 0 every third step", "sgd", overlap=True, bucket_numel=8,
                               first_bucket_numel=8)


def _check_against_plain_torch(comm, schedule: str, optimizer: str, **options) -> None:
    def body():
        rank, n = comm.Get_rank(), comm.Get_size()
        uses, build = SCHEDULES[schedule], OPTIMIZERS[optimizer]
        net = _net()
        torch_optimizer = build(net.parameters())
        algo = mpicomm.wrap(net, torch_optimizer, "allreduce_sgd", **options)
        aux_after_use = _flat(net, "aux")
        for step in range(STEPS):
            if optimizer == "adamw":
                algo.zero_grad()
            else:
                torch_optimizer.zero_grad()  # torch's usual: the gradients become None
            _loss(net, rank, step, uses(rank, step)).backward()
            algo.step()
            if any(uses(r, step) for r in range(n)):
                aux_after_use = _flat(net, "aux")
            else:
                assert net["aux"].weight.grad is None, "a parameter no rank used still has a gradient"
        expected, expected_after_use = _plain_torch(n, build, uses)
        assert torch.equal(expected["aux"], expected_after_use), "the reference itself stepped the unused head"
        assert torch.equal(_flat(net, "aux"), aux_after_use), \
            f"the unused head moved by {float((_flat(net, 'aux') - aux_after_use).abs().max()):.3g} after its last use"
        for part in ("body", "head", "aux"):
            torch.testing.assert_close(_flat(net, part), expected[part], rtol=1e-5, atol=1e-6, msg=part)

    run_all(comm, body)


def test_decentralized_ranks_decide_on_their_own_gradient(comm):
    """D-PSGD: the auxiliary head, used at the first step only, is then moved by the gossip alone, whose doubly
    stochastic mixing keeps its average over the ranks (no optimizer step, no momentum or weight decay)."""
    def body():
        rank, n = comm.Get_rank(), comm.Get_size()
        net = _net()
        algo = mpicomm.wrap(net, OPTIMIZERS["adamw"](net.parameters()), "dpsgd", topology="ring")
        averages = []
        for step in range(STEPS):
            algo.zero_grad()
            _loss(net, rank, step, step == 0).backward()
            algo.step()
            averages.append(torch.tensor(comm.allreduce(_flat(net, "aux").numpy())) / n)
        torch.testing.assert_close(averages[-1], averages[0], rtol=0, atol=1e-6)

    run_all(comm, body)


def test_gradients_set_by_hand_are_stepped_as_torch_steps_them(comm):
    """``p.grad = tensor`` (zeros included) is stepped, as torch steps it; a parameter left without one is not."""
    def hand_set(net, step: int) -> None:
        net["body"].weight.grad = torch.full_like(net["body"].weight, 0.1 * (step + 1))
        net["head"].weight.grad = torch.zeros_like(net["head"].weight)  # zero, but a gradient: torch steps it

    def body():
        net, reference = _net(), _net()
        torch_optimizer = OPTIMIZERS["sgd"](net.parameters())
        algo = mpicomm.wrap(net, torch_optimizer, "allreduce_sgd")
        reference_optimizer = OPTIMIZERS["sgd"](reference.parameters())
        for step in range(3):
            torch_optimizer.zero_grad()
            hand_set(net, step)
            algo.step()
            reference_optimizer.zero_grad()
            hand_set(reference, step)
            reference_optimizer.step()
        for name, param in reference.named_parameters():
            torch.testing.assert_close(net.get_parameter(name), param, rtol=1e-6, atol=0, msg=name)
        assert not torch.equal(net["head"].weight, _net()["head"].weight), "a zero gradient set by hand was skipped"

    run_all(comm, body)


def _raises_everywhere(comm, kind, pattern: str, body) -> None:
    """``body()`` must raise ``kind`` matching ``pattern`` on every rank (an agreed error, or a ScriptError)."""
    with pytest.raises(kind, match=pattern) as caught:
        body()
    if kind is not ScriptError:
        assert agreed_of(caught.value) is not None, "not the same error on every rank"


def _step(algo, net, rank: int, zero=None) -> None:
    (zero or algo.zero_grad)()
    _loss(net, rank, 0, True).backward()
    algo.step()


def test_a_parameter_group_added_after_wrap_is_refused_at_the_next_step(comm):
    def body():
        net = _net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        algo = mpicomm.wrap(net, optimizer, "allreduce_sgd")
        _step(algo, net, comm.Get_rank())
        extra = torch.nn.Linear(8, 1)
        optimizer.add_param_group({"params": extra.parameters()})
        _raises_everywhere(comm, ScriptError, r"allreduce_sgd\.step\(\): .*add_param_group",
                           lambda: _step(algo, net, comm.Get_rank()))

    run_all(comm, body)


def test_ranks_of_different_dtypes_are_one_line_naming_both(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")

    def body():
        net = _net()
        if comm.Get_rank() == comm.Get_size() - 1:
            net.double()
        _raises_everywhere(comm, ValueError, r"parameter 'body.weight' is torch.float64 on this rank, "
                           r"torch.float32 on rank 0", lambda: mpicomm.wrap(net, None, "allreduce_sgd"))

    run_all(comm, body)


@pytest.mark.parametrize("zero", ["algo", "optimizer"])
def test_model_half_after_wrap_is_one_line_naming_autocast(comm, zero):
    def body():
        net = _net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        algo = mpicomm.wrap(net, optimizer, "allreduce_sgd")
        net.half()

        def half_step():
            (algo.zero_grad if zero == "algo" else optimizer.zero_grad)()
            net["head"](net["body"](_batch(0, 0).half())).float().sum().backward()
            algo.step()

        _raises_everywhere(comm, ScriptError, r"'body.weight' is torch.float16 now.*torch.autocast", half_step)

    run_all(comm, body)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_a_sparse_gradient_is_one_line(comm, overlap):
    def body():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        algo = mpicomm.wrap(net, optimizer, "allreduce_sgd", overlap=overlap)

        def sparse_step():
            optimizer.zero_grad()
            net(torch.tensor([1, 2, 3])).sum().backward()
            algo.step()

        _raises_everywhere(comm, ScriptError, r"'0.weight' has a sparse gradient.*sparse=False", sparse_step)

    run_all(comm, body)
