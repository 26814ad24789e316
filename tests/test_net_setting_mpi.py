"""``mpicomm.wrap(..., net=...)`` with a setting it cannot model: the same one-line ``ValueError`` on every rank,
naming ``net`` and what it expects (agreed, so ``mpicomm.init``'s handler prints it once and exits 2).

In-process on every rank of the MPI tiers; the cases only parse, so they cost nothing.
"""

import pytest
import torch

import mpicomm
from mpicomm.errors import agreed_of

from .conftest import assert_all

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("net, line", [
    ("garbage", "net='garbage': expected BANDWIDTH,LATENCY such as 1gbit,100us (or one of fast, gbit, slow, ib, "
                "pcie, nvlink, or none, or intra=...,inter=...), got 'garbage'"),
    ("1gbit,1e300s", "net='1gbit,1e300s': latency must be in [0s, 10s], got 1e+300 s"),
    (5, "net must be a string such as '1gbit,100us' (or None), got int 5"),
])
def test_wrap_refuses_a_net_it_cannot_model_in_one_agreed_line(comm, net, line):
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError) as caught:
        mpicomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce_sgd", net=net)
    mark = agreed_of(caught.value)  # what mpicomm.init's handler prints, once, before exit 2
    said = mark.describe() if mark is not None else f"not agreed: {caught.value}"
    assert_all(comm, said == line, said)
