"""Serial tests of mpicomm.topology: invariants of every builder, closed-form spectra, bad inputs."""

import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpicomm import topology as topo

NS = range(1, 17)
POW2 = [1, 2, 4, 8, 16]
COMPOSITE_OR_SMALL = [n for n in NS if n <= 3 or any(n % r == 0 for r in range(2, n))]


def _cases():
    """(label, builder thunk, expected symmetric) for every static builder and n in 1..16 where allowed."""
    out = []
    for n in NS:
        for w in topo.WEIGHT_RULES:
            out.append((f"ring({n},{w})", lambda n=n, w=w: topo.ring(n, w), True))
            out.append((f"exp({n},{w})", lambda n=n, w=w: topo.exponential(n, weights=w), True))
            out.append((f"star({n},{w})", lambda n=n, w=w: topo.star(n, w), True))
        hops = {1 << k for k in range((n - 1).bit_length())}
        closed = hops == {-h % n for h in hops}  # then i -> i + 2^k has its reverse edge too (n <= 3)
        out.append((f"exp_dir({n})", lambda n=n: topo.exponential(n, symmetric=False), closed))
        out.append((f"complete({n})", lambda n=n: topo.complete(n), True))
        for d in (2, 3, 4):
            if d < n and n * d % 2 == 0:
                out.append((f"rr({n},{d})", lambda n=n, d=d: topo.random_regular(n, d, seed=n), True))
    for n in COMPOSITE_OR_SMALL:
        for w in topo.WEIGHT_RULES:
            out.append((f"torus({n},{w})", lambda n=n, w=w: topo.torus(n, weights=w), True))
    for n in POW2:
        out.append((f"hypercube({n})", lambda n=n: topo.hypercube(n), True))
    return out


CASES = _cases()


def _check_invariants(t: topo.Topology) -> None:
    """Everything that must hold for any doubly stochastic, connected topology built here."""
    n = t.size
    W = t.W
    assert W.dtype == np.float64 and W.shape == (n, n) and not W.flags.writeable
    assert t.is_doubly_stochastic(tol=1e-12)
    assert t.is_connected()
    support = W > 0
    edges = set()
    for i in range(n):
        ins, outs = t.in_neighbors(i), t.out_neighbors(i)
        assert ins == tuple(j for j in range(n) if j != i and support[i, j])
        assert outs == tuple(k for k in range(n) if k != i and support[k, i])
        assert list(ins) == sorted(set(ins)) and list(outs) == sorted(set(outs))
        for j in ins:
            assert i in t.out_neighbors(j)
        for k in outs:
            assert i in t.in_neighbors(k)
        assert t.neighbor_weights(i) == tuple(W[i, j] for j in ins)
        assert t.self_weight(i) == W[i, i]
        assert math.isclose(t.self_weight(i) + sum(t.neighbor_weights(i)), 1.0, abs_tol=1e-12)
        edges |= {(j, i) for j in ins}
    assert t.edges() == frozenset(edges) == t.union_edges()
    assert t.max_degree() == max(max(len(t.in_neighbors(i)), len(t.out_neighbors(i))) for i in range(n))
    gap = t.spectral_gap()
    assert 0.0 < gap <= 1.0
    assert t.mixing_time() == (0.0 if n == 1 else pytest.approx(math.log(n) / gap))


def _second_eig_modulus(W: np.ndarray) -> float:
    """Largest |eigenvalue| of W once one eigenvalue 1 is removed (reference computed from eigvals)."""
    ev = np.linalg.eigvals(W)
    ev = np.delete(ev, np.argmin(np.abs(ev - 1.0)))
    return float(np.max(np.abs(ev))) if ev.size else 0.0


@pytest.mark.parametrize("label,make,symmetric", CASES, ids=[c[0] for c in CASES])
def test_builder_invariants(label, make, symmetric):
    t = make()
    _check_invariants(t)
    assert t.is_symmetric() == symmetric
    assert t.period == 1 and t.at(0) is t and t.at(12345) is t
    for i in range(t.size):
        assert t.union_in_neighbors(i) == t.in_neighbors(i)
        assert t.union_out_neighbors(i) == t.out_neighbors(i)
    # every builder here is normal (symmetric or circulant): the gap is 1 - |second eigenvalue|
    assert t.spectral_gap() == pytest.approx(1.0 - _second_eig_modulus(t.W), abs=1e-10)


@pytest.mark.parametrize("name", sorted(topo.TOPOLOGIES))
def test_n_equal_one_everywhere(name):
    kwargs = {"degree": 0} if name == "random_regular" else {}
    built = topo.build(name, 1, **kwargs)
    t = built.at(0)
    assert t.W.tolist() == [[1.0]]
    assert t.in_neighbors(0) == () and t.out_neighbors(0) == () and t.edges() == frozenset()
    assert built.union_in_neighbors(0) == () and built.union_out_neighbors(0) == ()
    assert t.spectral_gap() == 1.0 and t.mixing_time() == 0.0 and t.max_degree() == 0


def test_ring_two_has_one_neighbour():
    t = topo.ring(2)
    assert t.W.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert t.in_neighbors(0) == (1,) and t.out_neighbors(0) == (1,) and t.in_neighbors(1) == (0,)
    assert t.name == "ring(2)"


@pytest.mark.parametrize("n", range(3, 17))
def test_ring_uniform_spectrum_closed_form(n):
    t = topo.ring(n)
    k = np.arange(n)
    expected = 1 / 3 + 2 / 3 * np.cos(2 * np.pi * k / n)
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(t.W)), np.sort(expected), atol=1e-12)
    rho = np.max(np.abs(expected[1:]))
    assert t.spectral_gap() == pytest.approx(1 - rho, abs=1e-12)
    assert t.mixing_time() == pytest.approx(math.log(n) / (1 - rho), rel=1e-9)
    off = ~np.eye(n, dtype=bool) & (t.W > 0)
    assert np.all(t.W[off] == 1 / 3) and np.allclose(np.diag(t.W), 1 / 3, rtol=0, atol=1e-15)


@pytest.mark.parametrize("n", NS)
def test_complete_is_exact_average(n):
    t = topo.complete(n)
    assert np.all(t.W == 1.0 / n)
    assert t.spectral_gap() == pytest.approx(1.0, abs=1e-12)
    assert t.max_degree() == n - 1


@pytest.mark.parametrize("n", POW2)
def test_hypercube_degree_and_spectrum(n):
    t = topo.hypercube(n)
    d = n.bit_length() - 1
    for i in range(n):
        assert t.in_neighbors(i) == tuple(sorted(i ^ (1 << k) for k in range(d)))
        assert t.neighbor_weights(i) == (1 / (d + 1),) * d
    # hypercube adjacency eigenvalues are d - 2j, so W = (I + A)/(d + 1) has rho = (d - 1)/(d + 1)
    if n > 1:
        assert t.spectral_gap() == pytest.approx(2 / (d + 1), abs=1e-12)


def _cycle_adjacency_eigs(m: int) -> np.ndarray:
    """Eigenvalues of the collapsed cycle graph on m nodes (m = 1: no edge; m = 2: one edge)."""
    if m == 1:
        return np.zeros(1)
    if m == 2:
        return np.array([1.0, -1.0])
    return 2 * np.cos(2 * np.pi * np.arange(m) / m)


@pytest.mark.parametrize("n,rows", [(4, 2), (6, 2), (6, 3), (8, 2), (9, 3), (12, 3), (12, 4), (16, 4), (15, 5)])
def test_torus_spectrum_closed_form(n, rows):
    t = topo.torus(n, rows=rows)
    cols = n // rows
    a, b = _cycle_adjacency_eigs(rows), _cycle_adjacency_eigs(cols)
    delta = t.max_degree()
    expected = 1 + (a[:, None] + b[None, :] - delta) / (delta + 1)
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(t.W)), np.sort(expected.ravel()), atol=1e-12)
    assert t.name == f"torus({n}, {rows}x{cols})"


def test_torus_shapes_and_collapsed_edges():
    assert topo.torus(4).in_neighbors(0) == (1, 2)  # 2x2: right == left, down == up
    assert topo.torus(6).in_neighbors(0) == (1, 2, 3)  # 2x3
    assert topo.torus(16).max_degree() == 4 and topo.torus(16).name == "torus(16, 4x4)"
    assert topo.torus(12).name == "torus(12, 3x4)"
    assert topo.torus(8, rows=4).name == "torus(8, 4x2)"
    assert topo.torus(3).W.tolist() == topo.ring(3).W.tolist()


@pytest.mark.parametrize("n", NS)
def test_exponential_closed_forms(n):
    hops = [1 << k for k in range(math.floor(math.log2(n - 1)) + 1)] if n > 1 else []
    m = np.arange(n)
    directed = topo.exponential(n, symmetric=False)
    for i in range(n):
        assert directed.in_neighbors(i) == tuple(sorted((i - h) % n for h in hops))
        assert directed.out_neighbors(i) == tuple(sorted((i + h) % n for h in hops))
        assert directed.self_weight(i) == 1 / (len(hops) + 1)
    # circulant: eigenvalues (1 + sum_h w^{-m h}) / (#hops + 1)
    lam = (1 + sum(np.exp(-2j * np.pi * m * h / n) for h in hops)) / (len(hops) + 1)
    if n > 1:
        assert directed.spectral_gap() == pytest.approx(1 - np.max(np.abs(lam[1:])), abs=1e-12)
    sym = topo.exponential(n)
    offsets = sorted({h % n for h in hops} | {-h % n for h in hops})
    assert sym.in_neighbors(0) == tuple(offsets)
    lam_sym = (1 + sum(np.cos(2 * np.pi * m * s / n) for s in offsets)) / (len(offsets) + 1)
    if n > 1:
        assert sym.spectral_gap() == pytest.approx(1 - np.max(np.abs(lam_sym[1:])), abs=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_directed_exponential_gap_matches_ying_et_al(n):
    # Ying et al. (2021): for n a power of two, rho = 1 - 2 / (1 + log2 n)
    tau = n.bit_length() - 1
    assert topo.exponential(n, symmetric=False).spectral_gap() == pytest.approx(2 / (1 + tau), abs=1e-12)


@pytest.mark.parametrize("n", range(3, 17))
def test_star_metropolis_closed_form(n):
    t = topo.star(n)
    assert t.self_weight(0) == pytest.approx(1 / n) and t.neighbor_weights(0) == (1 / n,) * (n - 1)
    assert t.self_weight(1) == pytest.approx(1 - 1 / n) and t.in_neighbors(1) == (0,)
    # eigenvalues {1, 1 - 1/n (n - 2 times), 0}
    expected = [0.0] + [1 - 1 / n] * (n - 2) + [1.0]
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(t.W)), expected, atol=1e-12)
    assert t.spectral_gap() == pytest.approx(1 / n, abs=1e-12)


def test_metropolis_differs_from_uniform_on_irregular_graph():
    # path 0-1-2-3: degrees 1, 2, 2, 1
    m = topo.from_edges(4, [(0, 1), (1, 2), (2, 3)], weights="metropolis")
    u = topo.from_edges(4, [(0, 1), (1, 2), (2, 3)], weights="uniform")
    assert m.W[0, 1] == 1 / 3 and m.W[1, 2] == 1 / 3 and m.W[0, 0] == pytest.approx(2 / 3)
    assert u.W[0, 1] == u.W[1, 2] == u.W[2, 3] == 1 / 3 and u.W[0, 0] == pytest.approx(2 / 3)
    assert u.W[1, 1] == pytest.approx(1 / 3) and m.W[1, 1] == pytest.approx(1 / 3)
    m5 = topo.from_edges(5, [(0, 1), (0, 2), (0, 3), (3, 4)], weights="metropolis")  # degrees 3,1,1,2,1
    assert m5.W[0, 1] == 1 / 4 and m5.W[3, 4] == 1 / 3 and m5.W[4, 4] == pytest.approx(2 / 3)
    assert m5.W[1, 1] == pytest.approx(3 / 4) and m5.W[3, 3] == pytest.approx(1 - 1 / 4 - 1 / 3)
    u5 = topo.from_edges(5, [(0, 1), (0, 2), (0, 3), (3, 4)], weights="uniform")
    assert u5.W[3, 4] == 1 / 4 and u5.W[4, 4] == pytest.approx(3 / 4)
    star_u = topo.star(5, weights="uniform")
    assert star_u.name == "star(5, uniform)" and topo.star(5).name == "star(5)"


@pytest.mark.parametrize("n,degree", [(2, 1), (3, 2), (6, 3), (8, 3), (10, 4), (16, 3), (16, 5), (40, 2)])
def test_random_regular_degree_and_reproducibility(n, degree):
    t = topo.random_regular(n, degree, seed=7)
    assert all(len(t.in_neighbors(i)) == degree for i in range(n))
    assert t.is_symmetric() and t.is_connected()
    assert t == topo.random_regular(n, degree, seed=7)
    assert t.name == f"random_regular({n}, {degree}, seed=7)"


def test_random_regular_seeds_differ():
    graphs = {topo.random_regular(16, 3, seed=s).edges() for s in range(5)}
    assert len(graphs) > 1


@pytest.mark.parametrize("n", POW2)
def test_one_peer_exponential(n):
    s = topo.one_peer_exponential(n)
    tau = max(n.bit_length() - 1, 1)
    assert s.period == tau and s.size == n and s.name == f"one_peer_exponential({n})"
    prod = np.eye(n)
    for t in range(s.period):
        step = s.at(t)
        assert step is s.at(t + s.period) and step.is_doubly_stochastic()
        if n > 1:
            h = 1 << t
            for i in range(n):
                assert step.in_neighbors(i) == ((i - h) % n,) and step.out_neighbors(i) == ((i + h) % n,)
                assert step.self_weight(i) == 0.5 and step.neighbor_weights(i) == (0.5,)
        prod = step.W @ prod
    # entries are dyadic rationals, so the exact average comes out bit-exact
    assert np.array_equal(prod, np.full((n, n), 1.0 / n))
    for i in range(n):
        hops = [1 << k for k in range(n.bit_length() - 1)]
        assert s.union_in_neighbors(i) == tuple(sorted({(i - h) % n for h in hops}))
        assert s.union_out_neighbors(i) == tuple(sorted({(i + h) % n for h in hops}))
    assert s.union_edges() == frozenset().union(*(s.at(t).edges() for t in range(s.period)))


def _check_pairwise_step(step: topo.Topology, sit_out=()) -> None:
    """A pairwise one-peer step: symmetric, doubly stochastic, one partner (weight 1/2) per rank but those
    in ``sit_out``, which keep W_ii = 1."""
    n = step.size
    assert step.is_symmetric(tol=0.0) and step.is_doubly_stochastic(tol=1e-12)
    for i in range(n):
        if i in sit_out:
            assert step.out_neighbors(i) == step.in_neighbors(i) == () and step.self_weight(i) == 1.0
        else:
            (j,) = step.out_neighbors(i)
            assert step.in_neighbors(i) == (j,) and step.out_neighbors(j) == (i,)
            assert step.self_weight(i) == 0.5 and step.neighbor_weights(i) == (0.5,)


def _pair_matrix(n, pairs):
    W = np.eye(n)
    for a, b in pairs:
        W[a, a] = W[b, b] = W[a, b] = W[b, a] = 0.5
    return W


def _period_product(s) -> np.ndarray:
    prod = np.eye(s.size)
    for t in range(s.period):
        prod = s.at(t).W @ prod
    return prod


def test_alternating_ring_by_hand():
    h = 0.5
    s4 = topo.alternating_ring(4)
    assert s4.period == 2 and s4.name == "alternating_ring(4)"
    assert [t.name for t in s4.topologies] == ["alternating_ring(4)[even]", "alternating_ring(4)[odd]"]
    even4 = [[h, h, 0, 0], [h, h, 0, 0], [0, 0, h, h], [0, 0, h, h]]  # (0, 1), (2, 3)
    odd4 = [[h, 0, 0, h], [0, h, h, 0], [0, h, h, 0], [h, 0, 0, h]]  # (1, 2), (3, 0)
    assert np.array_equal(s4.at(0).W, even4) and np.array_equal(s4.at(1).W, odd4)
    assert s4.at(2) is s4.at(0) and s4.at(3) is s4.at(1)
    for t in range(2):
        _check_pairwise_step(s4.at(t))
    s5 = topo.alternating_ring(5)
    even5 = [[h, h, 0, 0, 0], [h, h, 0, 0, 0], [0, 0, h, h, 0], [0, 0, h, h, 0], [0, 0, 0, 0, 1]]  # 4 sits out
    odd5 = [[1, 0, 0, 0, 0], [0, h, h, 0, 0], [0, h, h, 0, 0], [0, 0, 0, h, h], [0, 0, 0, h, h]]  # 0 sits out
    assert np.array_equal(s5.at(0).W, even5) and np.array_equal(s5.at(1).W, odd5)
    _check_pairwise_step(s5.at(0), sit_out=(4,))
    _check_pairwise_step(s5.at(1), sit_out=(0,))


@pytest.mark.parametrize("n", NS)
def test_alternating_ring(n):
    s = topo.alternating_ring(n)
    assert s.size == n and s.name == f"alternating_ring({n})" and s == topo.build("alternating_ring", n)
    if n == 1:
        assert s.period == 1 and np.array_equal(s.at(0).W, [[1.0]])
        return
    even = [(i, i + 1) for i in range(0, n - 1, 2)]
    odd = [(i, (i + 1) % n) for i in range(1, n - 1 if n % 2 else n, 2)]
    assert s.period == 2
    assert np.array_equal(s.at(0).W, _pair_matrix(n, even)) and np.array_equal(s.at(1).W, _pair_matrix(n, odd))
    _check_pairwise_step(s.at(0), sit_out=(n - 1,) if n % 2 else ())
    _check_pairwise_step(s.at(1), sit_out=(0,) if n % 2 else ())
    # the union is the ring for even n, the path 0 - 1 - ... - n-1 for odd n: consensus over the period
    ring_edges = topo.ring(n).edges()
    assert s.union_edges() == (ring_edges - {(0, n - 1), (n - 1, 0)} if n % 2 and n > 2 else ring_edges)
    assert topo.from_matrix(_period_product(s)).spectral_gap() > 0.0


def test_one_peer_hypercube_by_hand():
    s = topo.one_peer_hypercube(8)
    assert s.period == 3 and s.name == "one_peer_hypercube(8)"
    assert [t.name for t in s.topologies] == [f"one_peer_hypercube(8)[{d}]" for d in range(3)]
    pairs = [[(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (1, 3), (4, 6), (5, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)]]
    for t, p in enumerate(pairs):
        step = s.at(t)
        assert np.array_equal(step.W, _pair_matrix(8, p)) and s.at(t + 3) is step
        _check_pairwise_step(step)  # a perfect matching: every rank has exactly one partner
        assert len(step.edges()) == 8
    assert np.abs(_period_product(s) - np.full((8, 8), 1 / 8)).max() <= 1e-12


@pytest.mark.parametrize("n", POW2)
def test_one_peer_hypercube(n):
    s = topo.one_peer_hypercube(n)
    assert s.size == n and s.period == max(n.bit_length() - 1, 1) and s == topo.build("one_peer_hypercube", n)
    for t in range(s.period):
        _check_pairwise_step(s.at(t), sit_out=(0,) if n == 1 else ())
        for i in range(n if n > 1 else 0):
            assert s.at(t).out_neighbors(i) == (i ^ (1 << t),)
    # entries are dyadic rationals: the exact average, bit for bit
    assert np.array_equal(_period_product(s), np.full((n, n), 1.0 / n))
    if n > 1:
        assert s.union_edges() == topo.hypercube(n).edges()


def test_one_period_product_is_not_exact_for_ring():
    # the exact-average property is special: gossip on a static ring only approaches the average
    W = topo.ring(8).W
    assert not np.allclose(np.linalg.matrix_power(W, 3), 1 / 8)


def test_disconnected_and_periodic_graphs():
    two_blocks = np.kron(np.eye(2), np.full((2, 2), 0.5))
    t = topo.from_matrix(two_blocks, "blocks")
    assert not t.is_connected() and t.spectral_gap() == 0.0 and t.mixing_time() == math.inf
    # reachable from rank 0 but not back: weakly, not strongly, connected (only a raw Topology can be)
    assert not topo.Topology(np.array([[0.5, 0.5], [0.0, 1.0]])).is_connected()
    assert not topo.Topology(np.array([[1.0, 0.0], [0.5, 0.5]])).is_connected()
    cycle = topo.from_matrix(np.roll(np.eye(4), 1, axis=1), "directed-cycle")  # permutation: connected, rho 1
    assert cycle.is_connected() and not cycle.is_symmetric()
    assert cycle.spectral_gap() == pytest.approx(0.0, abs=1e-12) and cycle.mixing_time() == math.inf


def test_topology_equality_hash_copy_and_pickle():
    src = topo.ring(5).W.copy()
    a = topo.from_matrix(src, "r")
    src[0, 0] = 7.0  # the Topology holds its own copy
    b = topo.from_matrix(topo.ring(5).W, "r")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != topo.from_matrix(a.W, "other") and a != topo.ring(6)
    neg_zero, pos_zero = topo.from_matrix([[1.0, -0.0], [-0.0, 1.0]]), topo.from_matrix(np.eye(2))
    assert neg_zero == pos_zero and hash(neg_zero) == hash(pos_zero)
    with pytest.raises(ValueError, match="read-only"):
        a.W[0, 0] = 1.0
    with pytest.raises(AttributeError):
        a.name = "x"
    c = pickle.loads(pickle.dumps(a))
    assert c == a and not c.W.flags.writeable
    s = topo.one_peer_exponential(4)
    assert pickle.loads(pickle.dumps(s)) == s and hash(s) == hash(topo.one_peer_exponential(4))
    assert repr(a) == "Topology(name='r', size=5)"


def test_non_doubly_stochastic_topology_is_allowed_but_has_no_gap():
    t = topo.Topology(np.array([[0.5, 0.5], [0.5, 0.0]]), "raw")
    assert not t.is_doubly_stochastic() and t.in_neighbors(1) == (0,)
    with pytest.raises(ValueError, match="row 1 sums to 0.5"):
        t.spectral_gap()


def test_build_and_registry():
    assert set(topo.TOPOLOGIES) == {"ring", "torus", "exponential", "hypercube", "complete", "star",
                                     "random_regular", "one_peer_exponential", "alternating_ring",
                                     "one_peer_hypercube"}
    assert topo.build("ring", 8) == topo.ring(8)
    assert topo.build("torus", 8, rows=4) == topo.torus(8, rows=4)
    assert topo.build("random_regular", 8, degree=3, seed=1) == topo.random_regular(8, 3, 1)
    assert topo.build("one_peer_exponential", 8) == topo.one_peer_exponential(8)
    assert topo.build("alternating_ring", 6) == topo.alternating_ring(6)
    assert topo.build("one_peer_hypercube", 8) == topo.one_peer_hypercube(8)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: topo.build("mesh", 4), r"unknown topology 'mesh'; valid names: alternating_ring, complete, "),
        (lambda: topo.ring(0), r"^n must be an int >= 1, got 0"),
        (lambda: topo.ring(-3), r"^n must be"),
        (lambda: topo.ring(2.0), r"^n must be an int >= 1, got float"),
        (lambda: topo.complete(True), r"^n must be"),
        (lambda: topo.star("4"), r"^n must be"),
        (lambda: topo.ring(4, weights="max"), r"weights must be one of 'uniform', 'metropolis', got 'max'"),
        (lambda: topo.torus(7), r"n=7 is prime.*\{1, 2, 3\} or a composite n"),
        (lambda: topo.torus(8, rows=3), r"rows must divide n=8 and be one of \[2, 4\], got 3"),
        (lambda: topo.torus(8, rows=1), r"rows must"),
        (lambda: topo.exponential(4, symmetric="yes"), r"symmetric must be a bool"),
        (lambda: topo.exponential(4, symmetric=False, weights="metropolis"), r"weights must be 'uniform'"),
        (lambda: topo.hypercube(6), r"n must be a power of two .* got 6"),
        (lambda: topo.one_peer_exponential(12), r"n must be a power of two .* got 12"),
        (lambda: topo.one_peer_hypercube(12),
         r"^n must be a power of two \(1, 2, 4, 8, \.\.\.\) for one_peer_hypercube, got 12$"),
        (lambda: topo.one_peer_hypercube(0), r"^n must be an int >= 1, got 0"),
        (lambda: topo.alternating_ring(0), r"^n must be an int >= 1, got 0"),
        (lambda: topo.alternating_ring(2.0), r"^n must be an int >= 1, got float"),
        (lambda: topo.random_regular(5, 3), r"n \* degree must be even.*n=5, degree=3"),
        (lambda: topo.random_regular(4, 4), r"degree must be an int in \[0, 4\), got 4"),
        (lambda: topo.random_regular(4, -1), r"degree must be"),
        (lambda: topo.random_regular(6, 1), r"degree must be >= 2 for a connected graph on n=6"),
        (lambda: topo.random_regular(4, 0), r"degree must be >= 2"),
        (lambda: topo.random_regular(4, 2, seed=-1), r"seed must be an int >= 0"),
        (lambda: topo.from_matrix(np.ones(3)), r"W must be a non-empty square 2-D array, got shape \(3,\)"),
        (lambda: topo.from_matrix(np.ones((2, 3)) / 3), r"W must be a non-empty square"),
        (lambda: topo.from_matrix(np.zeros((0, 0))), r"W must be a non-empty square"),
        (lambda: topo.from_matrix([[1, 0], [0]]), r"W must be a square 2-D array"),
        (lambda: topo.from_matrix([[np.nan, 1], [1, 0]]), r"W\[0, 0\] = nan is not finite"),
        (lambda: topo.from_matrix([[1.1, -0.1], [-0.1, 1.1]]), r"W\[0, 1\] = -0.1 is negative"),
        (lambda: topo.from_matrix([[1, 0, 0], [0, 1, 0], [0.3, 0, 0.4]]), r"row 2 sums to 0.7, expected 1"),
        (lambda: topo.from_matrix([[1, 0], [1, 0]]), r"column 0 sums to 2, expected 1"),
        (lambda: topo.from_matrix(np.eye(2), tol=-1), r"tol must be a finite number >= 0"),
        (lambda: topo.from_edges(3, [(0, 3)]), r"edges endpoint must be an int in \[0, 3\), got 3"),
        (lambda: topo.from_edges(3, [(1, 1)]), r"edges must not contain self-loops"),
        (lambda: topo.from_edges(3, [(0, 1, 2)]), r"edges must hold pairs"),
        (lambda: topo.ring(4).in_neighbors(4), r"rank must be an int in \[0, 4\), got 4"),
        (lambda: topo.ring(4).self_weight(-1), r"rank must be"),
        (lambda: topo.ring(4).at(-1), r"step must be an int >= 0"),
        (lambda: topo.one_peer_exponential(4).at(1.5), r"step must be an int >= 0, got float"),
        (lambda: topo.ring(4).is_doubly_stochastic(tol=float("nan")), r"tol must be"),
        (lambda: topo.Schedule(()), r"topologies must be a non-empty"),
        (lambda: topo.Schedule((topo.ring(3), topo.ring(4))), r"same size, got sizes \[3, 4\]"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: topo.from_matrix([["a", "b"], ["c", "d"]]), r"W must hold real numbers"),
        (lambda: topo.from_matrix(np.eye(2) + 0j), r"W must hold real numbers"),
        (lambda: topo.Topology(np.eye(2), name=""), r"name must be a non-empty str"),
        (lambda: topo.Schedule((topo.ring(3), "ring")), r"topologies\[1\] must be a Topology"),
    ],
)
def test_bad_type_raises_type_error(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def _birkhoff(n: int, weights: list, seed: int) -> np.ndarray:
    """A doubly stochastic matrix: a convex combination of random permutation matrices (Birkhoff)."""
    rng = np.random.default_rng(seed)
    w = np.asarray(weights) / np.sum(weights)
    return sum(wk * np.eye(n)[rng.permutation(n)] for wk in w)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 9),
    weights=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_property_spectral_gap_is_contraction_for_any_doubly_stochastic_w(n, weights, seed):
    t = topo.from_matrix(_birkhoff(n, weights, seed), "birkhoff")
    assert t.is_doubly_stochastic(tol=1e-12)
    gap = t.spectral_gap()
    assert 0.0 <= gap <= 1.0
    rho = 1.0 - gap
    if t.is_connected():
        # one gossip step contracts the disagreement by rho (singular value), and rho >= |lambda_2|
        x = np.random.default_rng(seed).standard_normal((n, 5))
        dev = x - x.mean(axis=0)
        assert np.linalg.norm(t.W @ dev) <= rho * np.linalg.norm(dev) + 1e-9
        assert rho >= _second_eig_modulus(t.W) - 1e-9
        # and rho is attained: the top right singular vector of W - J (made mean-free) shrinks by rho
        v = np.linalg.svd(t.W - 1.0 / n)[2][0]
        v -= v.mean()
        assert np.linalg.norm(t.W @ v) == pytest.approx(rho * np.linalg.norm(v), abs=1e-9)
    else:
        assert gap == 0.0
    for i in range(n):
        for j in t.in_neighbors(i):
            assert i in t.out_neighbors(j)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    pairs=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 11)), max_size=40),
    rule=st.sampled_from(topo.WEIGHT_RULES),
)
def test_property_weight_rules_give_symmetric_doubly_stochastic_w(n, pairs, rule):
    edges = {(a % n, b % n) for a, b in pairs if a % n != b % n}
    t = topo.from_edges(n, edges, weights=rule)
    assert t.is_symmetric(tol=0.0) and t.is_doubly_stochastic(tol=1e-12)
    assert t.edges() == frozenset(edges | {(b, a) for a, b in edges})
    assert np.all(np.diag(t.W) > 0)  # both rules keep a positive self weight
    deg = np.array([len(t.in_neighbors(i)) for i in range(n)])
    for a, b in edges:
        expected = 1 / (deg.max() + 1) if rule == "uniform" else 1 / (1 + max(deg[a], deg[b]))
        assert t.W[a, b] == expected
