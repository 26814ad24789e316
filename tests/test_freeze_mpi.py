"""The 1-bit family given only the run's length: the variance freezes once it has settled, inside the run's
[20 %, 50 %], the same step on every rank; the method compresses from the next step on; and a run resumed from a
state_dict in the middle of the settling window freezes at the same step and ends bit for bit alike."""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .algo_common import make_model, train
from .conftest import run_all

pytestmark = pytest.mark.mpi

TOTAL = 40  # earliest step 8, latest 20, window 2
METHODS = {"apmsqueeze": {"lr": 1e-2}, "onebit_lamb": {"lr": 1e-2}, "zeroone_adam": {"lr": 1e-2}}


def _build(comm, name):
    return make_algorithm(name, make_model(), Communicator(comm, topo.ring(comm.Get_size())), total_steps=TOTAL,
                          **METHODS[name])


@pytest.mark.parametrize("name", list(METHODS))
def test_the_variance_freezes_once_settled_and_a_resume_agrees(comm, name):
    def body():
        straight = _build(comm, name)
        bits = []
        for _ in range(TOTAL):
            train(straight, 1)
            bits.append(straight.stats()["bits_per_parameter"])
        frozen = straight.metrics()["variance_frozen_at"]
        assert 8 <= frozen <= 20, straight.metrics()
        assert straight.metrics()["variance_frozen_because"] in ("settled", "latest")
        assert comm.allgather(frozen) == [frozen] * comm.Get_size()
        if comm.Get_size() > 1:  # the fp32 allreduces of the variance's steps (32 bits a parameter) end there
            assert bits[frozen - 1] >= 32 or name == "zeroone_adam", (name, frozen, bits)
            assert max(bits[:frozen]) >= 32 and max(bits[frozen:]) < 8, (name, frozen, bits)
        first = _build(comm, name)
        train(first, 9)
        state = first.state_dict()
        resumed = _build(comm, name)
        resumed.load_state_dict(state)
        train(resumed, TOTAL - 9)
        assert resumed.metrics()["variance_frozen_at"] == frozen
        assert torch.equal(resumed.flat.data, straight.flat.data)

    run_all(comm, body)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_run_too_short_to_compress_is_refused_on_every_rank(comm, name):
    def body():
        with pytest.raises(ValueError, match="too short to compress"):
            make_algorithm(name, make_model(), Communicator(comm, topo.ring(comm.Get_size())), total_steps=1)

    run_all(comm, body)
