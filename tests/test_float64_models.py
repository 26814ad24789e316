"""A float64 model (the library takes float32 or float64 parameters): the methods that exchange codec payloads,
whose codecs decode to float32, refuse it in one line when built; the others train it (AD-PSGD's mailbox holds
the model in its own dtype)."""

import pytest
import torch
from mpi4py import MPI

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator


def _build(name, **options):
    model = torch.nn.Linear(6, 3).double()
    return model, make_algorithm(name, model, Communicator(MPI.COMM_SELF, topology.ring(1)), **options)


@pytest.mark.parametrize("name, options", [("qsgd", {}), ("signsgd", {}), ("ef_signsgd", {}), ("terngrad", {}),
                                           ("compressed_sgd", {}), ("choco", {}), ("dcd", {}), ("cpdsgdm", {}),
                                           ("allreduce_adam", {"shard": True, "gather_bits": 8})])
def test_codec_methods_refuse_a_float64_model_when_built(name, options):
    with pytest.raises((TypeError, ValueError)) as caught:
        _build(name, **options)
    message = str(caught.value)
    assert f"{name} needs float32 parameters" in message and "got torch.float64" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["adpsgd", "dpsgd", "allreduce_sgd"])
def test_float64_models_train_where_no_codec_is_involved(name):
    model, algo = _build(name, lr=0.1)
    start = algo.flat.data.clone()
    for step in range(3):
        algo.zero_grad()
        g = torch.Generator().manual_seed(step)
        model(torch.randn(4, 6, dtype=torch.float64, generator=g)).pow(2).mean().backward()
        algo.step()
    assert algo.flat.data.dtype == torch.float64 and torch.isfinite(algo.flat.data).all()
    assert not torch.equal(algo.flat.data, start)
