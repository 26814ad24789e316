"""AllReduce-Adam against a single-process Adam on the averaged gradient, its traffic, state and config errors."""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import grad_at, initial_flat, make_model, train
from .conftest import run_all

pytestmark = pytest.mark.mpi


def reference_adam(n, steps, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
    """Plain-torch AdamW (decoupled decay) on the mean of all n ranks' gradients; returns x after each step."""
    x = initial_flat()
    m, v = torch.zeros_like(x), torch.zeros_like(x)
    out = []
    for t in range(1, steps + 1):
        g = torch.stack([grad_at(x, r, t - 1) for r in range(n)]).mean(0)
        x = x * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        x = x - lr * m_hat / (v_hat.sqrt() + eps)
        out.append(x)
    return out


def _comm(comm):
    return Communicator(comm, topo.ring(comm.Get_size()))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_allreduce_adam_matches_reference(comm, weight_decay):
    def body():
        n, steps = comm.Get_size(), 6
        options = {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": weight_decay}
        algo = make_algorithm("allreduce_adam", make_model(seed=comm.Get_rank()), _comm(comm), **options)
        expected = reference_adam(n, steps, **options)
        for t in range(steps):
            train(algo, 1)
            torch.testing.assert_close(algo.flat.data, expected[t], rtol=1e-5, atol=1e-6, msg=f"step {t + 1}")
        assert algo.adam_state()["step"].item() == steps

    run_all(comm, body)


def test_allreduce_adam_bytes_per_step(comm):
    def body():
        n = comm.Get_size()
        algo = make_algorithm("allreduce_adam", make_model(), _comm(comm), lr=0.01)
        train(algo, 2)
        d, stats = algo.flat.numel, algo.stats()
        assert stats["step_bytes_contributed"] == 4 * d
        assert stats["step_bytes_sent"] == 2 * (n - 1) * 4 * d // n
        assert algo.comm.ledger.bytes_sent("allreduce") == 2 * stats["step_bytes_sent"]

    run_all(comm, body)


def test_allreduce_adam_state_round_trip_is_bit_exact(comm):
    def body():
        options = {"lr": 0.02, "weight_decay": 0.05}
        straight = make_algorithm("allreduce_adam", make_model(), _comm(comm), **options)
        train(straight, 6)
        first = make_algorithm("allreduce_adam", make_model(), _comm(comm), **options)
        train(first, 3)
        state = first.state_dict()
        train(first, 1)  # must not disturb the saved state
        resumed = make_algorithm("allreduce_adam", make_model(seed=5), _comm(comm), **options)
        resumed.load_state_dict(state)
        train(resumed, 3)
        assert torch.equal(resumed.flat.data, straight.flat.data)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed.adam_state()[key], straight.adam_state()[key]), key

    run_all(comm, body)


@pytest.mark.parametrize("option, message", [
    ({"beta1": 1.0}, r"beta1 must be in \[0.0, 1.0\)"),
    ({"beta2": -0.1}, r"beta2 must be in \[0.0, 1.0\)"),
    ({"eps": 0.0}, r"eps must be in \(0.0, inf\)"),
    ({"momentum": 0.9}, "momentum must be 0"),
])
def test_bad_adam_config_fails_on_every_rank(comm, option, message):
    def body():
        with pytest.raises(ValueError, match=message):
            make_algorithm("allreduce_adam", make_model(), _comm(comm), **option)

    run_all(comm, body)
