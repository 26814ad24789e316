"""D²'s condition on the mixing matrix (smallest eigenvalue above -1/3), on graphs whose spectra are known by hand."""

import pytest

from mpicomm import topology
from mpicomm.algorithms.decentralized.d2 import d2_gamma


@pytest.mark.parametrize("graph,expected", [
    # uniform ring: eigenvalues 1/3 + 2/3 cos(2 pi k / n); at even n the smallest is -1/3 (k = n/2), so gamma =
    # 1 / (1 + 1/3) = 3/4; at odd n it is 1/3 - 2/3 cos(pi / n) > -1/3 and gamma stays 1
    (topology.ring(2), 1.0), (topology.ring(3), 1.0), (topology.ring(4), 0.75), (topology.ring(5), 1.0),
    (topology.ring(8), 0.75),
    # 4x4 torus, weights 1/5: 1/5 (1 + 2 cos a + 2 cos b), smallest -3/5, gamma 1 / (1 + 3/5) = 5/8
    (topology.torus(16, rows=4), 0.625),
    # the complete graph averages exactly (eigenvalues 1 and 0)
    (topology.complete(6), 1.0),
])
def test_auto_gamma_on_graphs_with_known_spectra(graph, expected):
    assert d2_gamma(None, 1.0, graph) == pytest.approx(expected)


def test_a_smaller_default_is_kept_where_it_meets_the_condition():
    # Moniqua-D² at 1-2 bits defaults to 0.5: on ring(4) the mixing's smallest eigenvalue is 1 - 0.5 (4/3) = 1/3
    assert d2_gamma(None, 0.5, topology.ring(4)) == 0.5


def test_a_given_gamma_is_kept_or_refused_by_the_condition():
    # ring(4): 1 - gamma (4/3) > -1/3 exactly when gamma < 1
    assert d2_gamma(0.9, 1.0, topology.ring(4)) == 0.9
    refused = r"gamma=1\.0 breaks D²'s condition on ring\(4\).*use gamma < 1\.0000.*0\.7500"
    with pytest.raises(ValueError, match=refused):
        d2_gamma(1.0, 1.0, topology.ring(4))


def test_time_varying_graphs_are_not_checked():
    # one-peer exponential: each step's W is asymmetric and the schedule varies; the analysis covers neither
    assert d2_gamma(None, 1.0, topology.one_peer_exponential(8)) == 1.0
    assert d2_gamma(1.0, 1.0, topology.one_peer_exponential(8)) == 1.0
