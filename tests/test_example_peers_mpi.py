"""examples/peers_idiom.py: with allreduce_sgd it equals one process on all ranks' data; moniqua learns too."""

import importlib.util
import os

import pytest
import torch

from .conftest import run_all

pytestmark = pytest.mark.mpi

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "peers_idiom.py")
_SPEC = importlib.util.spec_from_file_location("peers_idiom", _PATH)
example = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(example)


def _flat(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def test_allreduce_run_equals_one_process(comm):
    def body():
        model = example.train(comm)
        expected = example.reference(comm.Get_size())
        torch.testing.assert_close(_flat(model), _flat(expected), rtol=1e-4, atol=1e-5)
        assert example.held_out_loss(model) < 0.5 * example.held_out_loss(example.build_model())

    run_all(comm, body)


def test_moniqua_run_learns(comm):
    def body():
        model = example.train(comm, algorithm="moniqua")
        assert example.held_out_loss(model) < 0.5 * example.held_out_loss(example.build_model())

    run_all(comm, body)
