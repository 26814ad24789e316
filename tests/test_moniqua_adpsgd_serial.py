"""Serial pieces of Moniqua-AD-PSGD: its config, the message header, and the per-tensor pull against a pure-torch
reference written from the equations (float64; the dither values from ``lattice.dither``)."""

import pytest
import torch

from mpicomm.algorithms.moniqua import MoniquaADPSGDConfig
from mpicomm.codecs.moniqua import MoniquaPullCodec as PullMessage
from mpicomm.codecs.moniqua import dither, stream_key
from mpicomm.flat import Layer

from .moniqua_reference import parts_at

LAYERS = [Layer("a.weight", 0, (10,)), Layer("b.bias", 10, (3,)), Layer("c.weight", 13, (40,))]
SIZES = [10, 3, 40]
THETA = torch.tensor([0.1, 0.2, 0.05], dtype=torch.float64)


def models(seed: int, closeness: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x_j and an x_i within ``closeness`` theta_l of it on every coordinate of tensor l."""
    g = torch.Generator().manual_seed(seed)
    xj = torch.randn(53, generator=g)
    bound = THETA.repeat_interleave(torch.tensor(SIZES)).float() * closeness
    return xj, xj + (torch.rand(53, generator=g) * 2 - 1) * bound


def test_config_takes_moniquas_options_and_refuses_resync():
    paper = MoniquaADPSGDConfig(bits=1, parts=1, theta_per="model", rounding="nearest")
    assert paper.gamma == 0.5 and MoniquaADPSGDConfig().guard == "skip"
    assert (MoniquaADPSGDConfig().bits, MoniquaADPSGDConfig().parts) == (4, 4)
    with pytest.raises(ValueError, match="guard must be one of .*'skip', 'raise'.* for moniqua_adpsgd"):
        MoniquaADPSGDConfig(guard="resync")
    assert MoniquaADPSGDConfig().theta == "observed" and MoniquaADPSGDConfig(theta="adaptive").theta == "adaptive"


def test_header_layout():
    """int64 version, float32 s_l per tensor, int32 fingerprint per tensor, then the slots; 4-byte multiple."""
    m = PullMessage(LAYERS, bits=4, parts=4, rounding="dither", seed=0, rank_seed=0, device="cpu")
    assert m.prefix == 8 + 4 * 3
    # slots: ceil(ceil(n / 4) * 4 / 8) = 2, 1, 5 bytes after 12 fingerprint bytes: 20, a multiple of 4
    assert m.layout.message_bytes == 20 and m.nbytes == 40
    message = torch.zeros(m.nbytes, dtype=torch.uint8)
    xj, _ = models(0, 0.5)
    m.encode(xj, 7, THETA, message)
    assert message[:8].view(torch.int64).item() == 7 == m.version(message)
    s = message[8:20].view(torch.float32)
    assert torch.equal(s, ((16 * (1 - 2 * 2**-5)) / (2 * THETA)).float())
    assert torch.allclose(m.thetas(s), THETA, rtol=1e-6)
    assert torch.equal(m.fingerprints(message), message[20:32].view(torch.int32))
    assert bool((m.fingerprints(message) >= 0).all())
    m.empty(message)
    assert m.version(message) == -1 and not message[8:].any()


@pytest.mark.parametrize("bits,parts,rounding", [(4, 4, "dither"), (1, 1, "nearest"), (8, 2, "dither"),
                                                 (2, 3, "dither")])
@pytest.mark.parametrize("version", [0, 5])
def test_pull_recovers_each_tensor_on_the_publishers_grid(bits, parts, rounding, version):
    """Within theta_l: no wrap, and x̂_j - x̂_i per the equations (s_l from the header, dither (seed, v)); mixing
    moves exactly the parts of version v by alpha times that, and x̂_j - x̂_i is x_j - x_i to within 1/s_l."""
    m = PullMessage(LAYERS, bits, parts, rounding, seed=11, rank_seed=2, device="cpu")
    message = torch.zeros(m.nbytes, dtype=torch.uint8)
    xj, xi = models(bits + version, 0.99)
    m.encode(xj, version, THETA, message)
    increment, wrapped = m.pull(message, xi)
    assert not wrapped.any()
    scales = (2**bits * (1 - 2 * 2.0 ** -(bits + 1)) / (2 * THETA)).float().double()
    expected, parts_v = [], parts_at(version, parts, SIZES)
    for tensor, (a, b) in enumerate(parts_v):
        s = float(scales[tensor])
        u = dither(stream_key(11, version), torch.arange(a, b)).double() if rounding == "dither" else 0.0
        hat_j = (torch.round(xj[a:b].double() * s + u) - u) / s
        hat_i = (torch.round(xi[a:b].double() * s + u) - u) / s
        expected.append(hat_j - hat_i)
        error = (hat_j - hat_i - (xj[a:b] - xi[a:b]).double()).abs()
        assert b == a or float(error.max()) <= 1.0 / s * (1 + 1e-6)
    expected = torch.cat(expected)
    step = 1.0 / scales.min()
    assert increment.numel() == expected.numel() and float((increment.double() - expected).abs().max()) < 1e-5 * step
    x = xi.clone()
    m.mix(x, version, increment, wrapped, 0.5)
    inside = torch.zeros(53, dtype=torch.bool)
    for a, b in parts_v:
        inside[a:b] = True
    assert torch.equal(x[~inside], xi[~inside])
    assert torch.allclose(x[inside].double(), xi[inside].double() + 0.5 * expected, atol=1e-6)


@pytest.mark.parametrize("bits,rounding", [(4, "dither"), (1, "nearest"), (2, "stochastic")])
def test_a_wrap_is_detected_on_its_tensor_only_and_that_tensor_is_not_mixed(bits, rounding):
    """One coordinate of tensor c farther than B_c / 2 from x_j: c's fingerprint differs, a's and b's match; mix
    leaves c bit for bit and moves the others."""
    m = PullMessage(LAYERS, bits, 1, rounding, seed=3, rank_seed=4, device="cpu")
    message = torch.zeros(m.nbytes, dtype=torch.uint8)
    xj, xi = models(bits, 0.5)
    m.encode(xj, 2, THETA, message)
    assert not m.pull(message, xi)[1].any()
    far = xi.clone()
    far[13 + 17] = xj[13 + 17] + 3.0 * float(THETA[2]) / (1 - 2 * m.delta)  # 1.5 B_c away
    increment, wrapped = m.pull(message, far)
    assert wrapped.tolist() == [False, False, True]
    x = far.clone()
    m.mix(x, 2, increment, wrapped, 0.5)
    assert torch.equal(x[13:], far[13:]) and not torch.equal(x[:13], far[:13])


def test_stochastic_rounding_draws_from_the_ranks_generator_and_round_trips():
    m = PullMessage(LAYERS, 4, 2, "stochastic", seed=0, rank_seed=9, device="cpu")
    xj, _ = models(1, 0.5)
    first, second = torch.zeros(m.nbytes, dtype=torch.uint8), torch.zeros(m.nbytes, dtype=torch.uint8)
    state = m.noise.state_dict()
    m.encode(xj, 1, THETA, first)
    other = PullMessage(LAYERS, 4, 2, "stochastic", seed=0, rank_seed=9, device="cpu")
    other.noise.load_state_dict(state)
    other.encode(xj, 1, THETA, second)
    assert torch.equal(first, second)
