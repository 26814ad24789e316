"""The library as users meet it: ``examples/`` and the snippets of the README and docs/library.md, run in-process
on the 2-rank tier.

Each example must do what it says: the plain loop's Moniqua reaches the accuracy of full-precision
gossip on the digits, the Hugging Face classifier learns its task, and the resumed run ends bit for bit
where the uninterrupted one does. The facade's own promises are checked beside them: the averaged model
is the average (and is put back), an optimizer stepped outside the algorithm is refused, the sampler
deals equal disjoint shares.
"""

import importlib.util
import os
import re

import pytest
import torch

import mpicomm

from .app_runs import REPO
from .conftest import assert_all, run_all

pytestmark = pytest.mark.mpi


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _two_ranks(comm):
    if comm.Get_size() != 2:
        pytest.skip("runs once, in the 2-rank tier")


def test_plain_loop_moniqua_trains_like_full_precision_gossip(comm):
    _two_ranks(comm)
    main = _example("plain_loop").main
    moniqua, dpsgd = main(["--epochs", "4"]), main(["--algorithm", "dpsgd", "--epochs", "4"])
    assert_all(comm, moniqua > 0.85 and moniqua > dpsgd - 0.03, f"moniqua {moniqua:.3f}, dpsgd {dpsgd:.3f}")


def test_huggingface_classifier_learns_its_task(comm):
    _two_ranks(comm)
    accuracy = _example("huggingface").main(["--steps", "60"])
    assert_all(comm, accuracy > 0.9, f"accuracy {accuracy:.3f}")


def test_resume_example_ends_where_the_uninterrupted_run_does(comm, tmp_path_factory):
    _two_ranks(comm)
    main = _example("resume").main
    root = comm.bcast(str(tmp_path_factory.mktemp("resume")) if comm.Get_rank() == 0 else None)
    straight = main(["--out-dir", f"{root}/straight", "--steps", "12"])
    main(["--out-dir", f"{root}/split", "--steps", "12", "--stop-at", "6"])
    resumed = main(["--out-dir", f"{root}/split", "--steps", "12"])
    assert_all(comm, torch.equal(straight, resumed), f"max diff {float((straight - resumed).abs().max())}")


@pytest.mark.parametrize("page", ["README.md", "docs/library.md"])
def test_the_library_snippet_runs(comm, page):
    """The first ``python`` block of the page, as written: it must run and train."""
    _two_ranks(comm)
    with open(os.path.join(REPO, page)) as f:
        block = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    scope: dict = {}
    exec(compile(block, page, "exec"), scope)  # noqa: S102 - the page's own example
    assert_all(comm, "algo" in scope and scope["algo"].step_count > 0, f"the snippet of {page} trained no step")


def _algo(comm, name="dpsgd", optimizer=True):
    torch.manual_seed(comm.Get_rank())  # different models on the ranks: the average is not any one of them
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean.fill_(float(comm.Get_rank()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    return mpicomm.wrap(model, opt, name, broadcast_init=False), opt


def test_averaged_model_is_the_average_and_is_put_back(comm):
    def body():
        algo, _ = _algo(comm)
        mine = algo.flat.data.clone()
        expected = sum(comm.allgather(mine)) / comm.Get_size()
        with algo.averaged_model() as model:
            assert torch.allclose(torch.nn.utils.parameters_to_vector(model.parameters()), expected, atol=1e-6)
            assert float(model[1].running_mean[0]) == pytest.approx((comm.Get_size() - 1) / 2)
        assert torch.equal(algo.flat.data, mine) and float(algo.model[1].running_mean[0]) == comm.Get_rank()

    run_all(comm, body)


def test_an_optimizer_stepped_outside_the_algorithm_is_refused(comm):
    def body():
        algo, opt = _algo(comm)
        algo.zero_grad()
        algo.model(torch.randn(5, 4)).sum().backward()
        algo.step()
        before = algo.flat.data.clone()
        with pytest.raises(RuntimeError, match=r"optimizer.step\(\) was called outside dpsgd's step\(\)"):
            opt.step()
        assert torch.equal(algo.flat.data, before)  # refused before it moved anything

    run_all(comm, body)


def test_sampler_deals_equal_disjoint_shares(comm):
    def body():
        share = list(iter(mpicomm.sampler(list(range(103)), seed=3)))
        everyone = comm.allgather(share)
        assert len({len(s) for s in everyone}) == 1 and len(share) == 103 // comm.Get_size()
        assert len(set().union(*map(set, everyone))) == sum(map(len, everyone))

    run_all(comm, body)
