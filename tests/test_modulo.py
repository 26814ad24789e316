"""Tests for Moniqua's modulo codec: cmod, constants, the recovery guarantee on both sides of its bound."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mpicomm.codecs import ModuloCodec, _layout, bitpack, cmod

CONFIGS = [
    (1, "nearest"),
    (2, "nearest"),
    (4, "nearest"),
    (8, "nearest"),
    (2, "stochastic"),
    (4, "stochastic"),
    (8, "stochastic"),
    (3, "nearest"),
    (5, "stochastic"),
]
EPS = 2.0**-21  # stated float32 slack: 8 unit roundoffs times (|x|_inf + |r|_inf + B)


def slack(r, theta, B):
    """eps = EPS * (|x|_inf + |r|_inf + B), bounding |x|_inf by |r|_inf + theta."""
    m = r.abs().max().item()
    return EPS * (2 * m + theta + B)


def randn(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def uniform(n, lo, hi, seed=0):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * (hi - lo) + lo


def test_cmod_closed_form():
    assert cmod(0.7, 1.0) == pytest.approx(-0.3)
    assert cmod(0.5, 1.0) == -0.5 and cmod(-0.5, 1.0) == -0.5  # range is [-B/2, B/2)
    assert cmod(7.0, 4.0) == -1.0 and cmod(-7.0, 4.0) == 1.0 and cmod(1.9, 4.0) == pytest.approx(1.9)
    a = torch.tensor([0.7, 0.5, -0.5, 2.25, -3.75], dtype=torch.float64)
    assert torch.allclose(cmod(a, 1.0), torch.tensor([-0.3, -0.5, -0.5, 0.25, 0.25], dtype=torch.float64))


@settings(max_examples=100, deadline=None)
@given(a=st.floats(-1e6, 1e6), B=st.floats(1e-3, 1e3))
def test_cmod_range_and_congruence(a, B):
    r = cmod(a, B)
    slack = 1e-12 * (abs(a) + B)  # a - B*floor(.) rounds: cmod(2.0, 0.8) = -0.40000000000000036 in float64
    assert -B / 2 - slack <= r < B / 2 + slack
    k = (a - r) / B
    assert abs(k - round(k)) < 1e-6 * max(1.0, abs(a) / B)


@pytest.mark.parametrize("bits,rounding", CONFIGS)
def test_constants_and_payload_size(bits, rounding):
    codec = ModuloCodec(bits, rounding)
    delta = 2.0 ** -(bits + 1) if rounding == "nearest" else 2.0**-bits
    assert codec.delta == delta
    assert codec.b_theta(0.3) == pytest.approx(0.6 / (1 - 2 * delta), rel=1e-15)
    for n in (0, 1, 7, 9, 1000, 2**20 + 3):
        assert codec.payload_bytes(n) == math.ceil(n * bits / 8)
    assert codec.bits_per_element(8000) == bits


@pytest.mark.parametrize("bits,rounding", CONFIGS)
@pytest.mark.parametrize("theta,offset", [(0.01, 5.0), (0.5, 0.0), (3e-4, -40.0)])
def test_recovery_within_bound(bits, rounding, theta, offset):
    codec = ModuloCodec(bits, rounding, seed=bits)
    B = codec.b_theta(theta)
    for n in (1, 7, 9, 4099):
        r = (randn(n, seed=n) + offset).float()
        eps = slack(r, theta, B)
        assert eps < theta / 4
        x = (r.double() + uniform(n, -1, 1, seed=n + 1) * (theta - eps) * 0.98).float()
        assert (x.double() - r.double()).abs().max() < theta - eps
        x_hat = codec.decode(codec.encode(x, B), r, B)
        err = (x_hat.double() - x.double()).abs().max().item()
        assert err <= codec.delta * B + eps, (err, codec.delta * B)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 8),
    stochastic=st.booleans(),
    theta=st.floats(1e-4, 10.0),
    offset=st.floats(-100.0, 100.0),
    n=st.integers(1, 600),
)
def test_property_recovery_within_bound(bits, stochastic, theta, offset, n):
    rounding = "stochastic" if stochastic and bits > 1 else "nearest"
    codec = ModuloCodec(bits, rounding, seed=n)
    B = codec.b_theta(theta)
    r = (randn(n, seed=n) * 3 + offset).float()
    eps = slack(r, theta, B)
    assume(eps < theta / 4)  # float32 cannot resolve a modulus that is tiny next to |r|
    x = (r.double() + uniform(n, -1, 1, seed=n + 7) * (theta - eps) * 0.98).float()
    assume((x.double() - r.double()).abs().max() < theta - eps)
    x_hat = codec.decode(codec.encode(x, B), r, B)
    assert (x_hat.double() - x.double()).abs().max().item() <= codec.delta * B + eps


@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (2, "stochastic"), (4, "nearest"), (8, "stochastic")])
def test_recovery_fails_beyond_bound(bits, rounding):
    """Past |x - r| = B/2 + delta*B the residue wraps: x_hat is off by B (to within delta*B)."""
    codec = ModuloCodec(bits, rounding)
    theta = 0.05
    B = codec.b_theta(theta)
    n = 2000
    r = randn(n, seed=3)
    eps = slack(r, 2 * B, B)
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).double()
    edge = B / 2 + codec.delta * B + eps
    dist = edge + uniform(n, 0.001, 0.4, seed=4) * B  # beyond the bound, below 1.5 B
    x = (r.double() + sign * dist).float()
    x_hat = codec.decode(codec.encode(x, B), r, B).double()
    wrapped = x_hat - x.double() + sign * B  # x_hat = x - sign*B + e
    assert wrapped.abs().max().item() <= codec.delta * B + eps
    assert (x_hat - x.double()).abs().min().item() >= B - codec.delta * B - eps
    # on the good side of the bound (the same points moved inside theta - eps) recovery works
    x_in = (r.double() + sign * dist / dist.max() * (theta - eps) * 0.98).float()
    err = (codec.decode(codec.encode(x_in, B), r, B).double() - x_in.double()).abs().max().item()
    assert err <= codec.delta * B + eps


@pytest.mark.parametrize("bits,rounding", CONFIGS)
def test_grid_values(bits, rounding):
    """Decoding against a zero reference exposes v*B: cell centres (nearest) or grid points (stochastic)."""
    codec = ModuloCodec(bits, rounding)
    B = 0.75
    x = randn(3000, seed=bits) * 10
    v = codec.decode(codec.encode(x, B), torch.zeros(3000), B).double() / B
    assert v.min() >= -0.5 and v.max() < 0.5
    centre = 0.5 if rounding == "nearest" else 0.0
    k = (v + 0.5) * 2**bits - centre
    assert (k - k.round()).abs().max().item() < 1e-4
    dist = torch.remainder(v - cmod(x.double() / B, 1.0) + 0.5, 1.0) - 0.5  # distance on the circle
    assert dist.abs().max().item() <= codec.delta * (1 + 1e-4) + EPS * 10 * 2**bits / B


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_recovery_is_unbiased(bits):
    codec = ModuloCodec(bits, "stochastic", seed=11)
    d, reps = 32, 4000
    B = codec.b_theta(0.1)
    r = torch.linspace(-3.0, 3.0, d)
    base = r + torch.linspace(-0.099, 0.099, d)
    x = base.repeat(reps)
    x_hat = codec.decode(codec.encode(x, B), r.repeat(reps), B).view(reps, d).double()
    se = B / 2**bits / (2 * math.sqrt(reps))  # one sample's variance <= (grid step * B)^2 / 4
    assert (x_hat.mean(0) - base.double()).abs().max().item() <= 5 * se + EPS * 4


def test_out_may_alias_reference_and_chunks_do_not_matter(monkeypatch):
    codec = ModuloCodec(4)
    B = codec.b_theta(0.2)
    r = randn(5001, seed=1)
    x = r + 0.1 * torch.tanh(randn(5001, seed=2))
    payload = codec.encode(x, B)
    expect = codec.decode(payload, r, B)
    monkeypatch.setattr(_layout, "CHUNK_CPU", 64)
    assert torch.equal(codec.encode(x, B), payload)
    r2 = r.clone()
    assert codec.decode(payload, r2, B, out=r2) is r2
    assert torch.equal(r2, expect)


def test_allocates_no_model_sized_temporaries(monkeypatch):
    """Every torch allocation in encode/decode is chunk-sized, except the payload itself (out is given)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(_layout, "CHUNK_CPU", 512)
    n = 1 << 13  # the model: 32 KiB of float32; a float32 chunk buffer: 2 KiB
    x, r = randn(n, seed=1), randn(n, seed=2)
    out = torch.empty(n)
    codecs = [ModuloCodec(8), ModuloCodec(4, "stochastic"), ModuloCodec(3), ModuloCodec(1)]
    payload_sizes = {c.payload_bytes(n) for c in codecs}
    for codec in codecs:  # warm the small constant caches (byte lookup tables) outside the profile
        codec.decode(codec.encode(x[:64], 0.5), r[:64], 0.5)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for codec in codecs:
            codec.decode(codec.encode(x, 0.5), r, 0.5, out=out)
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert sizes, "the profiler recorded no allocations"
    assert max(s for s in sizes if s not in payload_sizes) <= 2 * 4 * 512  # two float32 chunks at most


@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (3, "stochastic"), (8, "nearest")])
def test_torch_backend_matches(bits, rounding):
    x, r = randn(3001, seed=5), randn(3001, seed=6)
    B = 0.37
    payload = ModuloCodec(bits, rounding).encode(x, B)
    with bitpack.use_backend("torch"):
        assert torch.equal(ModuloCodec(bits, rounding).encode(x, B), payload)
        y = ModuloCodec(bits, rounding).decode(payload, r, B)
    assert torch.equal(y, ModuloCodec(bits, rounding).decode(payload, r, B))


def test_half_precision_inputs_match_their_float32_values():
    x, r = randn(999, seed=7).half(), randn(999, seed=8).half()
    codec = ModuloCodec(4)
    payload = codec.encode(x, 0.5)
    assert torch.equal(payload, codec.encode(x.float(), 0.5))
    assert torch.equal(codec.decode(payload, r, 0.5), codec.decode(payload, r.float(), 0.5))


def test_generator_state_round_trip():
    codec = ModuloCodec(4, "stochastic", seed=9)
    x = randn(3000)
    codec.encode(x, 0.3)
    state = codec.state_dict()
    expect = codec.encode(x, 0.3)
    other = ModuloCodec(4, "stochastic", seed=0)
    other.load_state_dict(state)
    assert torch.equal(other.encode(x, 0.3), expect)
    assert ModuloCodec(4).state_dict() == {}


def test_errors():
    with pytest.raises(ValueError, match="infinite"):
        ModuloCodec(1, "stochastic")
    with pytest.raises(ValueError, match="bits"):
        ModuloCodec(0)
    with pytest.raises(ValueError, match="rounding"):
        ModuloCodec(2, "up")
    codec = ModuloCodec(2)
    x = randn(10)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="B must be"):
            codec.encode(x, bad)
    with pytest.raises(TypeError, match="B must be"):
        codec.encode(x, "1.0")
    with pytest.raises(ValueError, match="b_theta"):
        codec.b_theta(0.0)
    payload = codec.encode(x, 1.0)
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(payload, torch.zeros(13), 1.0)
    with pytest.raises(ValueError, match="1-D"):
        codec.decode(payload, torch.zeros(2, 5), 1.0)
    with pytest.raises(TypeError, match="floating-point"):
        codec.encode(torch.arange(10), 1.0)
    with pytest.raises(TypeError, match="float32"):
        codec.decode(payload, torch.zeros(10), 1.0, out=torch.zeros(10, dtype=torch.float16))
