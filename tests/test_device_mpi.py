"""Device placement and the fp16 overflow agreement across real MPI ranks (any rank count, CPU only)."""

import io

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator, local_rank, local_size, node_layout
from mpicomm.training.device import place
from mpicomm.training.precision import Precision

from .algo_common import loss, make_model
from .conftest import assert_all, run_all

pytestmark = pytest.mark.mpi

ALGORITHMS = {
    "dpsgd": {"momentum": 0.9},
    "moniqua": {"bits": 8},
    "allreduce_sgd": {"momentum": 0.9},
    "qsgd": {"bits": 4},
    "cpdsgdm": {"codec": "sign", "period": 2},
}


def test_node_local_rank_and_size_on_one_node(comm):
    # mpiexec here starts every rank on this one machine: the node is the whole world, in rank order
    def body():
        assert node_layout(comm) == (comm.Get_rank(), comm.Get_size())
        assert local_rank(comm) == comm.Get_rank() and local_size(comm) == comm.Get_size()

    run_all(comm, body)


def test_placement_with_a_fake_device_count_is_round_robin_by_local_rank_and_printed_once(comm):
    out = io.StringIO()
    device = place("auto", comm, device_count=2, out=out)
    expected = [f"{r} → cuda:{r % 2}" for r in range(comm.Get_size())]
    text = out.getvalue()
    ok = device == torch.device("cuda", comm.Get_rank() % 2)
    ok &= text == (f"placement {text.split()[1]} {', '.join(expected)}\n" if comm.Get_rank() == 0 else "")
    assert_all(comm, ok, f"{device} {text!r}")


def test_cuda_without_cuda_is_one_error_on_every_rank(comm):
    try:
        place("cuda", comm, device_count=0, out=False)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    everyone = comm.allgather(message)
    assert_all(comm, len(set(everyone)) == 1 and "--device cuda: CUDA is not available" in message, message)


def _step(algo, precision, inject_inf: bool) -> bool:
    algo.zero_grad()
    precision.backward(loss(algo.model, algo.comm.rank, algo.step_count))
    if inject_inf:
        algo.flat.grad[algo.flat.numel // 2] = float("inf")
    taken = precision.ready(algo.flat)
    if taken:
        algo.step()
    return taken


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_fp16_overflow_on_one_rank_makes_every_rank_skip_and_halve_the_scale(comm, name):
    def body():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        algo = make_algorithm(name, make_model(seed=comm.Get_rank()), c, lr=0.1, **ALGORITHMS[name])
        precision = Precision("fp16", "cpu", c, init_scale=2.0**12)
        assert _step(algo, precision, False) and _step(algo, precision, False)
        before = algo.flat.data.clone()
        steps = algo.step_count
        taken = _step(algo, precision, inject_inf=comm.Get_rank() == comm.Get_size() - 1)
        assert not taken, "the step was taken despite an overflow on the last rank"
        assert torch.equal(algo.flat.data, before) and algo.step_count == steps
        assert precision.scale == 2.0**11 and precision.skipped == 1
        if name == "allreduce_sgd":  # replicated parameters: still identical on every rank
            assert all(torch.equal(p, before) for p in comm.allgather(before))
        assert _step(algo, precision, False) and not torch.equal(algo.flat.data, before)

    run_all(comm, body)


@pytest.mark.parametrize("name", ["moniqua", "qsgd", "cpdsgdm"])
def test_fp16_loss_scale_is_removed_exactly_before_compression(comm, name):
    """Without autocast, a power-of-two loss scale and its exact removal give the fp32 run bit for bit."""

    def run(precision_mode):
        c = Communicator(comm, topology.ring(comm.Get_size()))
        algo = make_algorithm(name, make_model(seed=comm.Get_rank()), c, lr=0.1, **ALGORITHMS[name])
        precision = Precision(precision_mode, "cpu", c, init_scale=2.0**14)
        for _ in range(4):
            assert _step(algo, precision, False)
        return algo.flat.data.clone()

    def body():
        assert torch.equal(run("fp16"), run("fp32"))

    run_all(comm, body)


@pytest.mark.parametrize("name, precision", [("dpsgd", "fp16"), ("qsgd", "fp16"), ("moniqua", "bf16")])
def test_mixed_precision_resume_is_bit_exact(comm, name, precision, tmp_path_factory):
    """2N steps straight == N, checkpoint, resume, N more, under autocast (fp16: the loss scale is saved)."""
    from .test_resume_mpi import STEPS, _run

    root = comm.bcast(str(tmp_path_factory.mktemp("amp")) if comm.Get_rank() == 0 else None)

    def body():
        straight, end, _ = _run(comm, name, f"{root}/straight", precision=precision)
        _, first, _ = _run(comm, name, f"{root}/split", precision=precision, stop_at_step=STEPS // 2)
        resumed, last, _ = _run(comm, name, f"{root}/split", precision=precision, resume="latest")
        assert first["step"] == STEPS // 2 and last["step"] == STEPS
        assert torch.equal(resumed.flat.data, straight.flat.data)
        assert last.get("loss_scale") == end.get("loss_scale")
        if precision == "fp16":
            assert end["loss_scale"] == 2.0 ** (16 - end["skipped_steps"])

    run_all(comm, body)
