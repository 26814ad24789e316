"""Serial pieces of Moniqua: config, t_mix, theta per tensor, the lattice codec and its dither, the part layout,
and AD-PSGD's expected pull matrix (Moniqua-AD-PSGD's message: tests/test_moniqua_adpsgd_serial.py)."""

import math

import numpy as np
import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms.decentralized.adpsgd import expected_pull_matrix
from mpicomm.algorithms.moniqua import MoniquaADPSGDConfig, MoniquaConfig
from mpicomm.algorithms.moniqua.theta import THETA_FLOOR, TensorTheta, mixing_time
from mpicomm.codecs import moniqua as lattice
from mpicomm.codecs.moniqua import PartLayout
from mpicomm.flat import Layer


def test_default_gamma_follows_the_bit_width():
    assert MoniquaConfig(bits=1).gamma == 0.5 and MoniquaConfig(bits=2).gamma == 0.5
    assert MoniquaConfig(bits=4).gamma == 1.0 and MoniquaConfig(bits=32, parts=1).gamma == 1.0
    assert MoniquaConfig(bits=1, gamma=0.2).gamma == 0.2
    default = MoniquaConfig()
    assert (default.bits, default.parts, default.rounding, default.theta_per, default.guard) == (
        4, 4, "dither", "tensor", "skip")


@pytest.mark.parametrize("options,match", [
    (dict(bits=0), "bits must be one of"),
    (dict(bits=True), "bits must be one of"),
    (dict(rounding="up"), "rounding must be"),
    (dict(parts=0), "parts must be an int >= 1"),
    (dict(theta_per="layer"), "theta_per must be"),
    (dict(bits=1, rounding="stochastic"), "stochastic.*needs bits >= 2"),
    (dict(theta=float("nan")), "theta must be"),
    (dict(theta=float("inf")), "theta must be"),
    (dict(theta_c=0.0), "theta_c must be"),
    (dict(theta_decay=1.5), "theta_decay must be"),
    (dict(theta_cap=0.5), "theta_cap must be"),
    (dict(gamma=-0.1), "gamma must be"),
])
def test_bad_config_names_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        MoniquaConfig(**options)
    with pytest.raises(ValueError, match=match):  # Moniqua-AD-PSGD checks the same
        MoniquaADPSGDConfig(**options)


def test_mixing_time_closed_forms():
    log4 = math.log(4)
    assert mixing_time(topo.ring(1), 1.0) == 1.0
    assert mixing_time(topo.ring(4), 1.0) == pytest.approx(log4 / (2 / 3))  # eigenvalues 1, 1/3, 1/3, -1/3
    assert mixing_time(topo.ring(4), 0.5) == pytest.approx(log4 / (1 / 3))  # damped: 1, 2/3, 2/3, 1/3
    assert mixing_time(topo.exponential(4), 1.0) == pytest.approx(log4)  # W = 11^T/4: rho = 0
    assert mixing_time(topo.one_peer_exponential(4), 1.0) == pytest.approx(log4)  # period product = 11^T/4
    assert mixing_time(topo.ring(2), 1.0) == pytest.approx(1.0)  # max(1, ln 2)


def test_coordinate_hashes_are_odd_20_bit_and_positional():
    h = lattice.coordinate_hashes(torch.arange(0, 1000))
    assert h.dtype == torch.int64 and bool((h % 2 == 1).all()) and int(h.max()) < 2**20
    assert torch.equal(lattice.coordinate_hashes(torch.arange(300, 700)), h[300:700])
    assert len(set(h.tolist())) > 990


def test_expected_pull_matrix():
    M = expected_pull_matrix(topo.ring(4), 1.0)
    assert np.allclose(M, [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]])
    assert np.allclose(expected_pull_matrix(topo.ring(4), 0.5).sum(1), 1.0)
    assert np.array_equal(expected_pull_matrix(topo.ring(1), 1.0), [[1.0]])


# ---------------------------------------------------------------------- theta per tensor
def test_theta_per_tensor_follows_each_tensors_step_down_and_up():
    rule = TensorTheta(3, MoniquaConfig(theta="adaptive", theta_c=1.5, theta_decay=0.5), t=2.0)
    assert not rule.ready()
    rule.observe(torch.tensor([1.0, 0.1, 4.0], dtype=torch.float64))
    assert torch.equal(rule.theta(), torch.tensor([1.0, 0.1, 4.0], dtype=torch.float64) * 2 * 1.5 * 2.0)
    rule.observe(torch.tensor([0.0, 1.0, 0.0]))  # each tensor on its own: decays, or follows a larger step
    assert torch.allclose(rule.theta(), torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64) * 6.0)
    floor = rule.statistic(torch.zeros(3), torch.tensor([0.0, 1e6, 0.0]))  # the floor share of ||x_l||
    assert float(floor[1]) * 2 * 1.5 * 2.0 == pytest.approx(THETA_FLOOR * 1e6) and float(floor[0]) == 0.0


def test_theta_per_model_is_one_theta():
    rule = TensorTheta(3, MoniquaConfig(theta="adaptive", theta_per="model"), t=1.0)
    rule.observe(torch.tensor([1.0, 0.1, 4.0]))
    assert torch.equal(rule.theta(), torch.full((3,), 8.0, dtype=torch.float64))
    rule.guard(torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(rule.scale, torch.full((3,), 2.0, dtype=torch.float64))


def test_guard_scale_grows_on_a_wrap_and_shrinks_back_within_bounds():
    rule = TensorTheta(2, MoniquaConfig(theta=0.1, theta_cap=5.0, theta_shrink=0.5), t=1.0)
    for _ in range(4):
        rule.guard(torch.tensor([1.0, 0.0]))
    assert rule.scale.tolist() == [5.0, 1.0]  # 2, 4, 5 (cap), 5; the clean tensor stays at 1
    rule.guard(torch.tensor([0.0, 0.0]))
    assert rule.scale.tolist() == [2.5, 1.0] and rule.theta().tolist() == pytest.approx([0.25, 0.1])
    other = TensorTheta(2, MoniquaConfig(theta=0.1), t=1.0)
    other.load_state_dict(rule.state_dict())
    assert torch.equal(other.theta(), rule.theta())
    with pytest.raises(ValueError, match="theta for 2 tensors, the model has 3"):
        TensorTheta(3, MoniquaConfig(), t=1.0).load_state_dict(rule.state_dict())


# ---------------------------------------------------------------------- the lattice codec
@pytest.mark.parametrize("bits,rounding", [(1, "dither"), (1, "nearest"), (2, "stochastic"), (4, "dither"),
                                           (8, "nearest")])
def test_lattice_recovery_is_exact_within_theta_and_wraps_beyond(bits, rounding):
    """|x - r| < theta: L' = L and |x̂ - x| <= delta B; a coordinate moved by B lands on another L'."""
    g = torch.Generator().manual_seed(bits)
    theta, n = 0.05, 5000
    B = 2 * theta / (1 - 2 * lattice.delta(bits, rounding))
    s = 2**bits / B
    x = torch.randn(n, generator=g) * 3
    u = lattice.dither(lattice.stream_key(0, 5), torch.arange(0, n)) if rounding == "dither" else None
    noise = torch.rand(n, generator=g) if rounding == "stochastic" else None
    packed, L = lattice.lattice_encode(x, s, bits, u, noise)
    assert packed.numel() == math.ceil(n * bits / 8)
    r = x + (torch.rand(n, generator=g) * 2 - 1) * 0.999 * theta
    assert torch.equal(lattice.lattice_decode(packed, r, s, bits, u), L)
    error = (lattice.lattice_value(L, s, u) - x).abs().max()
    assert error <= lattice.delta(bits, rounding) * B * (1 + 1e-5)
    far = r.clone()
    far[17] = x[17] + B
    assert lattice.lattice_decode(packed, far, s, bits, u)[17] != L[17]


def test_dither_removes_the_dead_zone_and_its_error_is_zero_mean():
    """Two values in one 1-bit cell: nearest rounding gives both the same point (no pull); dithered, the
    expected difference of the recoveries is the true difference, and the error has mean 0, variance 1/12."""
    n, s = 200_000, 1.0
    u = lattice.dither(lattice.stream_key(3, 0), torch.arange(0, n))
    xi, xj = torch.full((n,), 0.1), torch.full((n,), 0.4)
    assert torch.equal(lattice.lattice_encode(xi, s, 1)[1], lattice.lattice_encode(xj, s, 1)[1])
    vi = lattice.lattice_value(lattice.lattice_encode(xi, s, 1, u)[1], s, u)
    vj = lattice.lattice_value(lattice.lattice_encode(xj, s, 1, u)[1], s, u)
    assert float((vj - vi).mean()) == pytest.approx(0.3, abs=5e-3)
    error = vi - xi
    assert abs(float(error.mean())) < 5e-3 and float(error.var()) == pytest.approx(1 / 12, rel=0.02)
    assert float(u.min()) >= -0.5 and float(u.max()) < 0.5


def test_dither_is_keyed_by_seed_step_and_coordinate():
    key = lattice.stream_key(1, 2)
    u = lattice.dither(key, torch.arange(0, 100))
    halves = [lattice.dither(key, torch.arange(0, 40)), lattice.dither(key, torch.arange(40, 100))]
    assert torch.equal(torch.cat(halves), u)
    assert not torch.equal(lattice.dither(lattice.stream_key(1, 3), torch.arange(0, 100)), u)
    assert not torch.equal(lattice.dither(lattice.stream_key(2, 2), torch.arange(0, 100)), u)


# ---------------------------------------------------------------------- rotating parts
def test_parts_rotate_and_cover_every_tensor_once_per_period():
    layers = [Layer("a", 0, (10,)), Layer("b", 10, (3,)), Layer("c", 13, (1,))]
    layout = PartLayout(layers, parts=4, bits=4)
    for tensor, layer in enumerate(layers):
        covered = sorted(i for step in range(4) for i in range(*layout.part(tensor, step)))
        assert covered == list(range(layer.offset, layer.offset + layer.numel))
    assert layout.part(0, 0) == (0, 2) and layout.part(1, 0) == (10, 11) and layout.part(0, 1) == (2, 5)
    # header 3 x 4 bytes, slots ceil(ceil(n/4) * 4 / 8): 2 + 1 + 1, total 16 (a multiple of 4)
    assert layout.slots == [12, 14, 15] and layout.message_bytes == 16


@pytest.mark.parametrize("parts,bits,chunk", [(4, 4, 8), (3, 1, 16), (1, 8, 1 << 18), (4, 2, 24)])
def test_plan_runs_cover_every_code_position_once(parts, bits, chunk):
    """Per step the chunks tile the body's code positions; each tensor's run(s) hold its part's coordinates at its
    slot, in order; everything else is gap."""
    layers = [Layer("a", 0, (10,)), Layer("b", 10, (3,)), Layer("c", 13, (1,)), Layer("d", 14, (37,))]
    layout = PartLayout(layers, parts=parts, bits=bits)
    assert layout.codes * bits == 8 * (layout.message_bytes - layout.header_bytes)
    for step in range(parts + 1):
        owner = [None] * layout.codes
        chunks = layout.plan(step, chunk)
        assert [c.lo for c in chunks] == list(range(0, layout.codes, chunk)) and chunks[-1].hi == layout.codes
        for c in chunks:
            assert sum(c.lengths) == c.hi - c.lo and all(n > 0 for n in c.lengths)
            assert list(c.ends) == [sum(c.lengths[:r + 1]) - 1 for r in range(len(c.lengths))]
            q = c.lo
            for n, tensor, start, shift in zip(c.lengths, c.tensors, c.starts, c.shifts):
                for i in range(n):
                    owner[q + i] = None if start is None else (tensor, start + i)
                    assert start is None or start + i == q + i + shift
                assert (start is None) == (tensor == len(layers))
                q += n
        for tensor, position in enumerate(layout.positions):
            a, b = layout.part(tensor, step)
            assert owner[position:position + b - a] == [(tensor, c) for c in range(a, b)]
        assert sum(o is not None for o in owner) == sum(b - a for a, b in layout.parts_at(step))


def test_tensor_inf_numpy_and_torch_paths_agree():
    """max |t_l| per tensor: the numpy reduceat path and the torch path, with empty tensors (-inf), -0.0 and NaN."""
    from mpicomm.algorithms.moniqua.theta import tensor_inf
    from mpicomm.codecs import bitpack

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, generator=g)
    x[12:15] = -0.0
    x[30] = math.nan
    sizes = [0, 5, 7, 3, 0, 10, 15, 0]
    expected = [-math.inf if n == 0 else float(t.abs().max()) for t, n in zip(x.split(sizes), sizes)]
    with bitpack.use_backend("torch"):
        on_torch = tensor_inf(x, sizes)
    on_numpy = tensor_inf(x, sizes)
    for got in (on_numpy, on_torch):
        assert got.dtype == torch.float64
        assert got[[0, 1, 2, 3, 4, 5, 7]].tolist() == [expected[i] for i in (0, 1, 2, 3, 4, 5, 7)]
        assert math.isnan(got[6]) and str(got[3].item()) == "0.0"
