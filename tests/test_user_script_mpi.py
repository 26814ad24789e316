"""The library in a user's own training script: the whole model kept in step, nothing silently untrained.

Each case is what a user of DDP writes and expects to work, or a mistake they make; each ends in the
documented behaviour: trained correctly, or the same one-line error on every rank (a
:class:`~mpicomm.errors.ScriptError` or an agreed error, which :func:`mpicomm.init`'s handler prints once
and turns into exit 2; tests/test_user_script.py runs those scripts to their exit). Runs at 2 and 3 ranks.
"""

import copy

import pytest
import torch

import mpicomm
from mpicomm.errors import ScriptError, agreed_of

from .conftest import run_all

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def _at_two_and_three_ranks(comm):
    """Runs in the 2- and 3-rank tiers: a pair, and an odd world where one rank can differ from two."""
    if comm.Get_size() not in (2, 3):
        pytest.skip("runs at 2 and 3 ranks")


def _model(rank: int, frozen: bool = True) -> torch.nn.Sequential:
    """A small net built differently on every rank (seeded by rank), its first layer frozen, BatchNorm statistics
    set to the rank."""
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                                torch.nn.Linear(6, 2))
    if frozen:
        model[0].requires_grad_(False)
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank))
        model[1].running_var.fill_(1.0 + rank)
    return model


def _train(algo, rank: int, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        algo.zero_grad()
        algo.model(x).pow(2).mean().backward()
        algo.step()


def _everyone_equal(comm, tensor: torch.Tensor) -> bool:
    return all(torch.equal(t, tensor) for t in comm.allgather(tensor.detach().clone()))


def _raises_everywhere(comm, kind, pattern: str, body) -> None:
    """``body()`` must raise ``kind`` matching ``pattern`` on every rank (an agreed error, or a ScriptError)."""
    with pytest.raises(kind, match=pattern) as caught:
        body()
    if kind is not ScriptError:
        assert agreed_of(caught.value) is not None, "not the same error on every rank"


@pytest.mark.parametrize("algorithm", ["dpsgd", "allreduce_sgd"])
def test_frozen_parameters_and_buffers_start_as_rank_0s_and_stay_in_step(comm, algorithm):
    def body():
        rank = comm.Get_rank()
        model = _model(rank)
        first_layer = model[0].weight.detach().clone()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # frozen ones included, as DDP allows
        algo = mpicomm.wrap(model, optimizer, algorithm)
        rank0 = comm.bcast(first_layer, root=0)
        wrapped = {"frozen weight is rank 0's": torch.equal(model[0].weight, rank0),
                   "BatchNorm statistics are rank 0's": float(model[1].running_mean[0]) == 0.0 and
                   float(model[1].running_var[0]) == 1.0,
                   "every parameter is equal on every rank":
                   _everyone_equal(comm, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))}
        before = algo.flat.data.clone()
        _train(algo, rank)
        with algo.averaged_model() as averaged:
            statistics_alike = _everyone_equal(comm, averaged[1].running_mean)  # collective: never short-circuited
            averaged_alike = torch.equal(averaged[0].weight, rank0) and statistics_alike
        trained = {"the frozen weight did not move": torch.equal(model[0].weight, rank0),
                   "the trainable ones did": not torch.equal(algo.flat.data, before),
                   "the averaged model holds the frozen weight and one set of statistics": averaged_alike}
        assert all({**wrapped, **trained}.values()), {**wrapped, **trained}  # after every collective

    run_all(comm, body)


def test_frozen_parameters_are_saved_and_restored(comm, tmp_path_factory):
    def body():
        rank = comm.Get_rank()
        root = comm.bcast(str(tmp_path_factory.mktemp("frozen")) if rank == 0 else None)
        algo = mpicomm.wrap(_model(rank), None, "dpsgd", lr=0.1)
        with torch.no_grad():
            algo.model[0].weight.fill_(0.5)  # a frozen weight set in place, e.g. loaded from elsewhere
        _train(algo, rank)
        mpicomm.save(root, algo, step=3)
        again = mpicomm.wrap(_model(rank), None, "dpsgd", lr=0.1)  # a later job builds it afresh
        assert float(again.model[0].weight[0, 0]) != 0.5
        step, _ = mpicomm.restore(root, again)
        assert step == 3 and bool((again.model[0].weight == 0.5).all()), "the frozen weight was not restored"
        assert torch.equal(again.flat.data, algo.flat.data)
        assert torch.equal(again.model[1].running_mean, algo.model[1].running_mean)

    run_all(comm, body)


@pytest.mark.parametrize("how", ["p.data =", "channels_last", "replaced layer"])
def test_a_parameter_re_homed_after_wrap_is_one_line_at_the_next_step(comm, how):
    def body():
        rank = comm.Get_rank()
        if how == "channels_last":
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(12, 1))
            data = torch.randn(4, 2, 4, 4)
        else:
            model, data = _model(rank, frozen=False), torch.randn(8, 4)
        algo = mpicomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "dpsgd")
        if how == "p.data =":
            model[3].weight.data = model[3].weight.data.clone()
        elif how == "channels_last":
            model.to(memory_format=torch.channels_last)
        else:
            model[3] = torch.nn.Linear(6, 2)
        algo.zero_grad()
        model(data).sum().backward()
        name = "'0.weight'" if how == "channels_last" else "'3.weight'" if how == "p.data =" else "replaced"
        _raises_everywhere(comm, ScriptError, name, algo.step)
        _raises_everywhere(comm, ScriptError, name, lambda: mpicomm.save("unused", algo, step=1))

    run_all(comm, body)


@pytest.mark.parametrize("change", ["frozen", "unfrozen"])
def test_requires_grad_changed_after_wrap_is_refused(comm, change):
    def body():
        model = _model(comm.Get_rank(), frozen=True)
        algo = mpicomm.wrap(model, None, "dpsgd", lr=0.1)
        _train(algo, comm.Get_rank(), steps=1)
        if change == "frozen":
            model[3].weight.requires_grad_(False)
        else:
            model[0].weight.requires_grad_(True)
        _raises_everywhere(comm, ScriptError, f"was {change} .*after mpicomm.wrap", lambda: _train(algo, 0, 1))

    run_all(comm, body)


def test_wrapping_again_trains_with_the_newest_wrap_and_refuses_the_earlier_one(comm):
    def body():
        rank = comm.Get_rank()
        model = _model(rank, frozen=False)
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        first = mpicomm.wrap(model, optimizer, "dpsgd")
        second = mpicomm.wrap(model, optimizer, "dpsgd")  # the first one's step hook must not refuse this one
        _train(second, rank)
        ref_algo = mpicomm.wrap(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), "dpsgd")
        _train(ref_algo, rank)
        assert torch.equal(second.flat.data, ref_algo.flat.data), "the second wrap did not train like a single one"
        _raises_everywhere(comm, ScriptError, "wrapped again", first.step)
        _raises_everywhere(comm, ScriptError, "wrapped again", lambda: first.state_dict())

    run_all(comm, body)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_is_refused_at_wrap_naming_autocast(comm, dtype):
    def body():
        model = _model(comm.Get_rank()).to(dtype)
        _raises_everywhere(comm, ValueError, "torch.autocast", lambda: mpicomm.wrap(model, None, "dpsgd", lr=0.1))

    run_all(comm, body)


def test_restore_refuses_other_settings_listing_each(comm, tmp_path_factory):
    def body():
        rank = comm.Get_rank()
        root = comm.bcast(str(tmp_path_factory.mktemp("settings")) if rank == 0 else None)
        algo = mpicomm.wrap(_model(rank), None, "dpsgd", lr=0.1, topology="ring")
        _train(algo, rank, steps=1)
        mpicomm.save(root, algo, step=1)
        changed = mpicomm.wrap(_model(rank), None, "dpsgd", lr=0.05, momentum=0.5, topology="complete")
        kept = changed.flat.data.clone()
        _raises_everywhere(comm, ValueError, r"lr=0.05 \(the checkpoint's: 0.1\).*momentum=0.5",
                           lambda: mpicomm.restore(root, changed))
        assert "topology='complete" in str(_error(lambda: mpicomm.restore(root, changed)))
        assert torch.equal(changed.flat.data, kept), "a refused restore changed the model"
        other = mpicomm.wrap(_model(rank), None, "allreduce_sgd", lr=0.1)
        _raises_everywhere(comm, ValueError, "algorithm", lambda: mpicomm.restore(root, other))

    run_all(comm, body)


def _error(body) -> BaseException | None:
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - returned for inspection
        return exc
    return None


def test_save_with_pending_micro_batches_is_refused(comm, tmp_path_factory):
    def body():
        rank = comm.Get_rank()
        root = comm.bcast(str(tmp_path_factory.mktemp("pending")) if rank == 0 else None)
        algo = mpicomm.wrap(_model(rank), None, "allreduce_sgd", lr=0.1)
        algo.accumulate(2)
        _train(algo, rank, steps=3)  # one update and one micro-batch pending
        _raises_everywhere(comm, ValueError, "1 micro-batch", lambda: mpicomm.save(root, algo, step=1))
        _train(algo, rank, steps=1)
        assert mpicomm.save(root, algo, step=2).endswith("step-000000002")

    run_all(comm, body)


def test_a_different_frozen_layout_on_one_rank_is_one_error(comm):
    def body():
        model = _model(comm.Get_rank(), frozen=comm.Get_rank() != comm.Get_size() - 1)
        _raises_everywhere(comm, ValueError, "model mismatch", lambda: mpicomm.wrap(model, None, "dpsgd", lr=0.1))

    run_all(comm, body)
