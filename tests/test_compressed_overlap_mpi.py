"""Encode-during-backward (overlap=True) of the compressed centralized methods == the whole-gradient path."""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import loss, make_model
from .conftest import run_all
from .test_compressed_sgd_mpi import communicator

pytestmark = pytest.mark.mpi


def cnn(seed: int = 0) -> torch.nn.Module:
    """Two 3x3 convolutions and a linear layer on 2x8x8 inputs: 549 parameters in 6 tensors."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(64, 5))


def cnn_loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 2, 8, 8, generator=g)
    return torch.nn.functional.cross_entropy(model(x), torch.randint(0, 5, (8,), generator=g))


def run(algo, steps, loss_fn, micro=1):
    """The training loop, alternating algo.zero_grad() and set_to_none; buckets launched before each step()."""
    launched = []
    for t in range(steps * micro):
        if t % 2:
            algo.model.zero_grad(set_to_none=True)
        else:
            algo.zero_grad()
        loss_fn(algo.model, algo.comm.rank, t).backward()
        if (t + 1) % micro == 0:
            overlapped = getattr(algo, "overlapped", None)
            launched.append(len(overlapped.buckets.handles) if overlapped is not None else 0)
        algo.step()
    return launched


CASES = {
    "qsgd4-b7": ("qsgd", {"bits": 4, "bucket_size": 7}),
    "qsgd2-b16": ("qsgd", {"bits": 2, "bucket_size": 16}),
    "qsgd8-b512": ("qsgd", {"bits": 8, "bucket_size": 512}),
    "signsgd": ("signsgd", {}),
    "identity": ("compressed_sgd", {}),
    "bf16": ("compressed_sgd", {"codec": "bf16"}),
    "qsgd3-ef": ("compressed_sgd", {"codec": "qsgd", "codec_options": {"bits": 3, "bucket_size": 5},
                                    "error_feedback": True}),
}


def _pair(comm, name, options, model, micro=1, **extra):
    kwargs = {"lr": 0.02 if name == "signsgd" else 0.1, "momentum": 0.9, "weight_decay": 1e-3, "seed": 4,
              **options, **extra}
    plain = make_algorithm(name, model(comm.Get_rank()), communicator(comm), **kwargs)
    over = make_algorithm(name, model(comm.Get_rank()), communicator(comm), overlap=True, bucket_numel=4,
                          first_bucket_numel=4, **kwargs)
    plain.accumulate(micro)
    over.accumulate(micro)
    return plain, over


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlap_is_bit_identical_on_a_cnn(comm, case):
    def body():
        name, options = CASES[case]
        plain, over = _pair(comm, name, options, cnn)
        buckets = over.overlapped.buckets
        assert len(buckets.ranges) >= (2 if case == "qsgd8-b512" else 5), buckets.ranges
        assert run(plain, 5, cnn_loss) == [0] * 5
        assert run(over, 5, cnn_loss) == [len(buckets.ranges)] * 5  # all launched during backward
        assert torch.equal(over.flat.data, plain.flat.data)
        assert torch.equal(over.optimizer.state_dict()["state"][0]["momentum_buffer"],
                           plain.optimizer.state_dict()["state"][0]["momentum_buffer"])
        if plain.error is not None:
            assert torch.equal(over.error, plain.error)
        assert repr(over.codec.state_dict()) == repr(plain.codec.state_dict())  # the same random stream
        sent = sum(over.codec.payload_bytes(hi - lo) for lo, hi in buckets.ranges)
        assert over.stats()["step_bytes_contributed"] == sent

    run_all(comm, body)


@pytest.mark.parametrize("case", ["qsgd4-b7", "qsgd3-ef", "signsgd"])
def test_overlap_with_accumulation_is_bit_identical(comm, case):
    def body():
        name, options = CASES[case]
        plain, over = _pair(comm, name, options, cnn, micro=3)
        assert run(plain, 3, cnn_loss, micro=3) == [0] * 3
        assert run(over, 3, cnn_loss, micro=3) == [len(over.overlapped.buckets.ranges)] * 3
        assert torch.equal(over.flat.data, plain.flat.data)

    run_all(comm, body)


def test_buckets_straddle_parameters_on_scale_blocks(comm):
    """6-8-3 MLP, parameter buckets [W2,b2] [b1] [W1] (edges 83, 56, 48, 0): bucket_size 7 moves 48 to 42."""
    def body():
        plain, over = _pair(comm, "qsgd", {"bits": 4, "bucket_size": 7}, make_model)
        over_exact = make_algorithm("qsgd", make_model(0), communicator(comm), overlap=True, bucket_numel=5,
                                    bucket_size=7)
        assert over_exact.overlapped.buckets.ranges == [[56, 83], [42, 56], [0, 42]]
        assert over_exact.overlapped.buckets.size == [2, 2, 1]  # [42, 56) waits for W1 and b1
        assert run(plain, 4, loss) == [0] * 4
        run(over, 4, loss)
        assert torch.equal(over.flat.data, plain.flat.data)

    run_all(comm, body)


@pytest.mark.parametrize("case", ["qsgd4-b7", "qsgd3-ef"])
def test_overlap_state_round_trip_is_bit_exact(comm, case):
    def body():
        name, options = CASES[case]
        _, straight = _pair(comm, name, options, cnn)
        run(straight, 3, cnn_loss)
        state = straight.state_dict()
        run(straight, 2, cnn_loss)
        _, resumed = _pair(comm, name, options, cnn)
        resumed.load_state_dict(state)
        run(resumed, 2, cnn_loss)
        assert torch.equal(resumed.flat.data, straight.flat.data)

    run_all(comm, body)


@pytest.mark.parametrize("name,options,message", [
    ("terngrad", {}, "terngrad cannot overlap: its one max-norm scale"),
    ("ef_signsgd", {}, r"ef_signsgd cannot overlap: its scale \|\|p\|\|_1 / d"),
    ("compressed_sgd", {"codec": "sign"}, r"compressed_sgd cannot overlap with SignCodec\(scale='l2'\)"),
    ("compressed_sgd", {"codec": "uniform", "codec_options": {"bits": 4}}, "cannot overlap with UniformCodec"),
    ("compressed_sgd", {"codec": "qsgd", "codec_options": {"bits": 4, "bucket_size": None}}, "cannot overlap"),
])
def test_overlap_is_refused_where_the_scale_is_global(comm, name, options, message):
    def body():
        with pytest.raises(ValueError, match=message):
            make_algorithm(name, make_model(), communicator(comm), overlap=True, **options)
        make_algorithm(name, make_model(), communicator(comm), **options)  # without overlap: fine

    run_all(comm, body)


def test_overlap_refuses_a_second_backward(comm):
    def body():
        algo = make_algorithm("qsgd", make_model(), communicator(comm), overlap=True, bucket_numel=5)
        algo.zero_grad()
        loss(algo.model, comm.Get_rank(), 0).backward()
        with pytest.raises(RuntimeError, match=r"qsgd\(overlap=True\) takes one backward pass per step"):
            loss(algo.model, comm.Get_rank(), 1).backward()
        algo.step()

    run_all(comm, body)


def three_equal_layers(seed: int = 0) -> torch.nn.Module:
    """Three 8x8 linear layers: with bucket_numel=72 three buckets of equal size, all in flight together."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 8))


def equal_layers_loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return model(torch.randn(4, 8, generator=g)).square().mean()


@pytest.mark.parametrize("name,options", [("qsgd", {"bits": 4, "bucket_size": 8}), ("allreduce_sgd", {})])
def test_overlap_through_staged_host_buffers(comm, name, options):
    """stage="always" (the path of CUDA tensors with an MPI that is not CUDA-aware): same-sized buckets in
    flight together must not share a staging buffer."""
    def body():
        def build(**extra):
            c = Communicator(comm, topo.ring(comm.Get_size()), stage="always")
            return make_algorithm(name, three_equal_layers(), c, lr=0.1, momentum=0.9, **options, **extra)

        plain, over = build(), build(overlap=True, bucket_numel=72, first_bucket_numel=72)
        ranges = (over.buckets if name == "allreduce_sgd" else over.overlapped.buckets).ranges
        assert ranges == [[144, 216], [72, 144], [0, 72]]
        run(plain, 3, equal_layers_loss)
        run(over, 3, equal_layers_loss)
        assert torch.equal(over.flat.data, plain.flat.data)

    run_all(comm, body)
