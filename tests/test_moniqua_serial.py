"""Serial pieces of Moniqua: config validation, t_mix, the theta rule, the wrap fingerprint, the async pull matrix."""

import math

import numpy as np
import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms.adpsgd import expected_pull_matrix
from mpicomm.algorithms.moniqua import (
    THETA_FLOOR,
    LatticeFingerprint,
    MoniquaConfig,
    ThetaRule,
    coordinate_hashes,
    keeps_error,
    mixing_time,
    payload_slice,
)
from mpicomm.codecs import ModuloCodec


def test_default_gamma_follows_the_bit_width():
    assert MoniquaConfig(bits=1).gamma == 0.5 and MoniquaConfig(bits=2).gamma == 0.5
    assert MoniquaConfig(bits=4).gamma == 1.0 and MoniquaConfig(bits=32).gamma == 1.0
    assert MoniquaConfig(bits=1, gamma=0.2).gamma == 0.2


@pytest.mark.parametrize("options,match", [
    (dict(bits=0), "bits must be one of"),
    (dict(bits=True), "bits must be one of"),
    (dict(rounding="up"), "rounding must be"),
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


def test_mixing_time_closed_forms():
    log4 = math.log(4)
    assert mixing_time(topo.ring(1), 1.0) == 1.0
    assert mixing_time(topo.ring(4), 1.0) == pytest.approx(log4 / (2 / 3))  # eigenvalues 1, 1/3, 1/3, -1/3
    assert mixing_time(topo.ring(4), 0.5) == pytest.approx(log4 / (1 / 3))  # damped: 1, 2/3, 2/3, 1/3
    assert mixing_time(topo.exponential(4), 1.0) == pytest.approx(log4)  # W = 11^T/4: rho = 0
    assert mixing_time(topo.one_peer_exponential(4), 1.0) == pytest.approx(log4)  # period product = 11^T/4
    assert mixing_time(topo.ring(2), 1.0) == pytest.approx(1.0)  # max(1, ln 2)


def test_adaptive_theta_never_grows_by_itself():
    rule = ThetaRule(MoniquaConfig(theta_c=1.5, theta_decay=0.5), t_mix=2.0)
    assert not rule.ready()
    rule.observe(1.0, 0.0)
    assert rule.theta() == 2 * 1.5 * 1.0 * 2.0
    rule.observe(10.0, 0.0)  # a larger gradient raises the bound, not theta
    assert rule.bound == 10.0 and rule.theta() == 6.0
    for _ in range(5):
        rule.observe(0.0, 0.0)
    assert rule.bound == 10.0 * 0.5**5 and rule.theta() == pytest.approx(2 * 1.5 * rule.bound * 2.0)
    rule.observe(0.0, 1e6)  # floor: the grid stays above float32 resolution of the model
    assert rule.theta() == THETA_FLOOR * 1e6


def test_guard_scale_doubles_up_to_the_cap_and_round_trips():
    rule = ThetaRule(MoniquaConfig(theta=0.1, theta_cap=5.0), t_mix=1.0)
    assert rule.ready() and rule.theta() == 0.1
    assert [rule.enlarge() for _ in range(4)] == [2.0, 2.0, 1.25, 1.0]
    assert rule.theta() == pytest.approx(0.5)
    other = ThetaRule(MoniquaConfig(theta=0.1, theta_cap=5.0), t_mix=1.0)
    other.load_state_dict(rule.state_dict())
    assert other.theta() == rule.theta()


@pytest.mark.parametrize("bits,rounding,expected", [(1, "nearest", True), (2, "nearest", True),
                                                    (2, "stochastic", True), (4, "nearest", False),
                                                    (4, "stochastic", False), (8, "nearest", False)])
def test_gamma_follows_theta_only_at_low_bit_widths(bits, rounding, expected):
    assert keeps_error(ModuloCodec(bits, rounding)) is expected


def test_coordinate_hashes_are_odd_20_bit_and_positional():
    h = coordinate_hashes(0, 1000)
    assert h.dtype == torch.int64 and bool((h % 2 == 1).all()) and int(h.max()) < 2**20
    assert torch.equal(coordinate_hashes(300, 700), h[300:700])
    assert len(set(h.tolist())) > 990


@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (2, "nearest"), (2, "stochastic"), (4, "nearest"),
                                           (8, "nearest"), (8, "stochastic")])
def test_fingerprint_matches_iff_no_coordinate_wrapped(bits, rounding):
    """Receiver and sender fingerprints agree within the bound, and differ for 1 or 2 (opposite) wraps."""
    codec = ModuloCodec(bits, rounding, seed=1)
    fp = LatticeFingerprint(codec, chunk=64)  # several chunks
    g = torch.Generator().manual_seed(bits)
    theta, n = 0.05, 300
    B = codec.b_theta(theta)
    x = torch.randn(n, generator=g) * 3
    payload = codec.encode(x, B)
    sender, _ = fp.of(payload, x, B)
    near = x + (torch.rand(n, generator=g) * 2 - 1) * 0.95 * theta
    receiver, distance = fp.of(payload, near, B)
    assert receiver == sender and distance < B / 2
    for shifts in ({17: 1.0}, {5: 1.0, 250: -1.0}):  # one wrap; two wraps in opposite directions
        far = near.clone()
        for i, sign in shifts.items():
            far[i] = x[i] + sign * 0.9 * B  # beyond B/2 + delta B (<= 3B/4): the recovery lands one B away
        assert fp.of(payload, far, B)[0] != sender, shifts


def test_payload_slice_covers_chunks_exactly():
    payload = torch.arange(13, dtype=torch.uint8)  # 100 values at 1 bit
    assert payload_slice(payload, 1, 0, 64).tolist() == list(range(8))
    assert payload_slice(payload, 1, 64, 100).tolist() == list(range(8, 13))
    assert payload_slice(torch.arange(50, dtype=torch.uint8), 4, 16, 100).numel() == math.ceil(84 * 4 / 8)


def test_expected_pull_matrix():
    M = expected_pull_matrix(topo.ring(4), 1.0)
    assert np.allclose(M, [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]])
    assert np.allclose(expected_pull_matrix(topo.ring(4), 0.5).sum(1), 1.0)
    assert np.array_equal(expected_pull_matrix(topo.ring(1), 1.0), [[1.0]])
