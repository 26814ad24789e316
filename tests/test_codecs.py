"""Tests for the registry codecs: exact payload sizes, round trips, error bounds, unbiasedness, state."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpicomm.codecs import (
    CODECS,
    Codec,
    IdentityCodec,
    QSGDCodec,
    RandomKCodec,
    SignCodec,
    TernGradCodec,
    TopKCodec,
    UniformCodec,
    _layout,
    _rng,
    bitpack,
    make_codec,
    sparse,
)

LENGTHS = (0, 1, 7, 9, 1000)
packed = bitpack.packed_bytes


def ceil(a, b):
    return -(-a // b)


def sparse_k(ratio, n):
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n - 1e-6)))


# (codec factory, independent payload-size formula)
CASES = {
    "identity": (lambda: IdentityCodec(), lambda n: 4 * n),
    "fp16": (lambda: make_codec("fp16"), lambda n: 2 * n),
    "bf16": (lambda: make_codec("bf16"), lambda n: 2 * n),
    "uniform1": (lambda: UniformCodec(1), lambda n: 8 + ceil(n, 8)),
    "uniform3s": (lambda: UniformCodec(3, rounding="stochastic", seed=3), lambda n: 8 + ceil(3 * n, 8)),
    "uniform4": (lambda: UniformCodec(4), lambda n: 8 + ceil(n, 2)),
    "uniform8fixed": (lambda: UniformCodec(8, lo=-1.0, hi=2.0), lambda n: n),
    "sign-l2": (lambda: SignCodec("l2"), lambda n: 4 + ceil(n, 8)),
    "sign-l1": (lambda: SignCodec("l1"), lambda n: 4 + ceil(n, 8)),
    "sign-none": (lambda: SignCodec("none"), lambda n: ceil(n, 8)),
    "qsgd4": (lambda: QSGDCodec(4), lambda n: 4 * ceil(n, 512) + ceil(n, 2)),
    "qsgd8b100": (lambda: QSGDCodec(8, bucket_size=100), lambda n: 4 * ceil(n, 100) + n),
    "qsgd5whole": (lambda: QSGDCodec(5, bucket_size=None), lambda n: 4 * (n > 0) + ceil(5 * n, 8)),
    "terngrad": (lambda: TernGradCodec(), lambda n: 4 * (n > 0) + ceil(n, 4)),
    "topk": (lambda: TopKCodec(0.1), lambda n: 8 * sparse_k(0.1, n)),
    "randomk": (lambda: RandomKCodec(0.3, unbiased=True), lambda n: 8 * sparse_k(0.3, n)),
}
STOCHASTIC = ("uniform3s", "qsgd4", "qsgd8b100", "qsgd5whole", "terngrad", "randomk")


def randn(n, seed=0, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("case", CASES)
def test_payload_size_is_exact(case):
    make, formula = CASES[case]
    codec = make()
    for n in LENGTHS:
        payload = codec.encode(randn(n, seed=n))
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        assert payload.numel() == codec.payload_bytes(n) == formula(n)
        y = codec.decode(payload, n)
        assert y.dtype == torch.float32 and y.shape == (n,)
        assert codec.bits_per_element(n) == 8.0 * formula(n) / max(n, 1)


@pytest.mark.parametrize("case", ["sign-l2", "uniform4", "qsgd4"])
def test_payload_size_large_awkward_length(case):
    make, formula = CASES[case]
    n = 2**20 + 3
    assert make().encode(randn(n)).numel() == formula(n)


@pytest.mark.parametrize("case", CASES)
def test_decode_into_out_and_chunk_size_independence(case, monkeypatch):
    """Chunked streaming must not change a single byte: tiny chunks give the same payload and values."""
    make, _ = CASES[case]
    x = randn(3001, seed=5)
    ref_payload = make().encode(x)
    ref = make().decode(ref_payload, 3001)
    monkeypatch.setattr(_layout, "CHUNK_CPU", 64)
    codec = make()
    payload = codec.encode(x)
    if case in ("sign-l2", "sign-l1"):  # the scale is a sum over chunks: only its rounding may change
        assert torch.equal(payload[4:], ref_payload[4:])
        scales = np.frombuffer(torch.cat([payload[:4], ref_payload[:4]]).numpy().tobytes(), dtype=np.float32)
        assert abs(scales[0] - scales[1]) <= 1e-6 * scales[1]
        payload = ref_payload
    assert torch.equal(payload, ref_payload)
    out = torch.full((3001,), float("nan"))
    assert codec.decode(payload, 3001, out=out) is out
    assert torch.equal(out, ref)


@pytest.mark.parametrize("case", CASES)
def test_torch_backend_matches_numpy_backend(case):
    """The pure-torch path (what CUDA runs) gives the same bytes and values as the CPU fast path."""
    make, _ = CASES[case]
    x = randn(5003, seed=11)
    payload = make().encode(x)
    with bitpack.use_backend("torch"):
        assert torch.equal(make().encode(x), payload)
        torch_decoded = make().decode(payload, 5003)
    assert torch.equal(torch_decoded, make().decode(payload, 5003))


@pytest.mark.parametrize("case", STOCHASTIC)
def test_generator_state_round_trip(case):
    make, _ = CASES[case]
    x = randn(4097, seed=2)
    codec = make()
    fresh_state = codec.state_dict()
    first = codec.encode(x)
    state = codec.state_dict()
    second = codec.encode(x)
    assert not torch.equal(first, second)  # the stream advanced
    restored = make()
    restored.load_state_dict(state)
    assert torch.equal(restored.encode(x), second)
    restarted = make()
    restarted.load_state_dict(fresh_state)  # state saved before the first encode
    assert torch.equal(restarted.encode(x), first)
    with pytest.raises(ValueError, match="missing keys"):
        restored.load_state_dict({"seed": 0})


@pytest.mark.parametrize("case", STOCHASTIC)
def test_seed_controls_the_stream(case):
    make, _ = CASES[case]
    x = randn(2048, seed=4)
    assert torch.equal(make().encode(x), make().encode(x))
    other = make()
    other._rng.seed = 12345
    assert not torch.equal(other.encode(x), make().encode(x))


def test_sixteen_bit_uniforms():
    """u = (r + 1/2)/2^16 on a 2^16-point lattice in (0, 1): uniform, so rounding bias <= 2^-17 of a step."""
    rng = _rng.SeededGenerator(3)
    u = rng.uniform_(torch.empty(2**20 + 3)).double()
    r = u * 2**16 - 0.5
    assert torch.equal(r, r.round()) and r.min() >= 0 and r.max() <= 2**16 - 1
    n = u.numel()
    assert abs(u.mean().item() - 0.5) <= 5 / math.sqrt(12 * n)
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert (counts - n / 16).abs().max().item() <= 5 * math.sqrt(n / 16 * 15 / 16)
    lattice = (torch.arange(2**16, dtype=torch.float64) + 0.5) / 2**16
    for frac in (0.1, 1 / 3, 0.5, 0.77777, 1 - 2**-18):
        p_up = (lattice >= 1 - frac).double().mean().item()  # P(floor(frac + u) = 1)
        assert abs(p_up - frac) <= 2**-17


def test_deterministic_codecs_have_empty_state():
    for name in ("identity", "uniform4", "sign-l2", "topk"):
        assert CASES[name][0]().state_dict() == {}


# ---- identity -------------------------------------------------------------------------------------


def test_identity_fp32_is_bit_exact():
    x = torch.tensor([0.0, -0.0, 1e-45, -3.4e38, float("inf"), float("-inf"), float("nan"), 1 / 3])
    codec = IdentityCodec()
    payload = codec.encode(x)
    x[0] = 5.0  # the payload must not alias the input
    x[0] = 0.0
    y = codec.decode(payload, 8)
    assert codec.lossless
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_identity_half_precisions(dtype):
    x = randn(1001)
    codec = IdentityCodec(dtype)
    assert not codec.lossless
    assert torch.equal(codec.decode(codec.encode(x), 1001), x.to(dtype).float())


def test_identity_payload_does_not_alias_input():
    x = randn(16)
    payload = IdentityCodec().encode(x)
    x.zero_()
    assert payload.view(torch.float32).abs().sum() > 0


def test_unaligned_payload_slice_decodes():
    """A payload cut from a larger receive buffer at an odd offset still decodes (header copied)."""
    x = randn(33)
    for codec in (IdentityCodec(), SignCodec(), UniformCodec(4), QSGDCodec(3, bucket_size=8), TopKCodec(0.5)):
        payload = codec.encode(x)
        buf = torch.zeros(payload.numel() + 1, dtype=torch.uint8)
        buf[1:].copy_(payload)
        assert torch.equal(codec.decode(buf[1:], 33), codec.decode(payload, 33))


# ---- uniform --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
def test_uniform_nearest_error_bound_and_grid(bits):
    x = randn(20001, seed=bits, scale=3.0) + 1.5
    codec = UniformCodec(bits)
    payload = codec.encode(x)
    lo, hi = np.frombuffer(payload[:8].numpy().tobytes(), dtype=np.float32).tolist()
    assert (lo, hi) == (x.min().item(), x.max().item())
    y = codec.decode(payload, x.numel())
    levels = 2**bits - 1
    step = (hi - lo) / levels
    bound = step / 2
    slack = 4 * 2**-24 * max(abs(lo), abs(hi))  # float32 rounding of (x - lo)/step and lo + k*step
    assert (y - x).abs().max().item() <= bound + slack
    k = (y.double() - lo) / step
    assert (k - k.round()).abs().max().item() < 1e-3 and k.min() > -1e-3 and k.max() < levels + 1e-3
    assert y.min().item() == lo and abs(y.max().item() - hi) <= slack  # both ends are levels


def test_uniform_fixed_range_clamps():
    codec = UniformCodec(4, lo=-1.0, hi=1.0)
    x = torch.tensor([-5.0, -1.0, 0.0, 0.99, 1.0, 7.0])
    y = codec.decode(codec.encode(x), 6)
    step = 2 / 15
    assert y[0].item() == -1.0 and abs(y[-1].item() - 1.0) < 1e-6
    assert ((y[1:5] - x[1:5]).abs() <= step / 2 + 1e-6).all()


def test_uniform_constant_tensor_is_exact():
    for rounding in ("nearest", "stochastic"):
        x = torch.full((100,), -2.5)
        assert torch.equal(UniformCodec(3, rounding=rounding).roundtrip(x), x)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_uniform_stochastic_is_unbiased(bits):
    d, reps = 64, 4000
    base = torch.linspace(-1.0, 1.0, d)  # contains lo and hi, so the per-tensor range is [-1, 1]
    codec = UniformCodec(bits, rounding="stochastic", seed=7)
    y = codec.roundtrip(base.repeat(reps)).view(reps, d)
    step = 2.0 / (2**bits - 1)
    # per sample variance <= step^2/4, so the standard error of the mean is <= step / (2 sqrt(reps))
    se = step / (2 * math.sqrt(reps))
    assert (y.mean(0) - base).abs().max().item() <= 5 * se
    # each sample is one of the two neighbouring grid points
    assert ((y - base).abs() <= step * (1 + 1e-5)).all()


# ---- sign -----------------------------------------------------------------------------------------


def test_sign_scales_closed_form():
    x = torch.tensor([3.0, -4.0, 0.0, -0.0, 1.0, -2.0, 5.0, -1.0, 2.0])
    n = x.numel()
    expect = {"l2": math.sqrt(60.0 / n), "l1": 18.0 / n, "none": 1.0}
    signs = torch.tensor([1.0, -1, 1, 1, 1, -1, 1, -1, 1])  # sign(0) = sign(-0.0) = +1
    for scale, s in expect.items():
        codec = SignCodec(scale)
        payload = codec.encode(x)
        if scale != "none":
            assert np.frombuffer(payload[:4].numpy().tobytes(), dtype=np.float32)[0] == pytest.approx(s, rel=1e-6)
        body = payload[codec.payload_bytes(n) - 2 :]
        assert body.tolist() == [0b01011101, 0b1]
        y = codec.decode(payload, n)
        assert torch.allclose(y, signs * s, rtol=1e-6, atol=0)
        assert len(set(y.abs().tolist())) == 1  # exactly +-s, one value


def test_sign_decode_exact_plus_minus_scale():
    x = randn(1003, seed=9)
    codec = SignCodec("l1")
    y = codec.decode(codec.encode(x), 1003)
    s = x.double().abs().mean().item()
    assert torch.equal(y.abs(), torch.full_like(y, y.abs()[0].item()))
    assert abs(y.abs()[0].item() - s) <= 1e-5 * s  # float32 accumulation order
    assert torch.equal(y > 0, x >= 0)


# ---- qsgd / terngrad ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,bucket", [(2, 16), (4, 16), (8, 16), (3, None)])
def test_qsgd_is_unbiased_and_on_grid(bits, bucket):
    d, reps = 16, 4000
    base = torch.linspace(-0.9, 1.3, d)
    codec = QSGDCodec(bits, bucket_size=bucket, seed=1)
    x = base.repeat(reps)  # every bucket is a copy of base, so every bucket has scale max|base|
    payload = codec.encode(x)
    scales = np.frombuffer(payload[: 4 * codec.num_buckets(x.numel())].numpy().tobytes(), dtype=np.float32)
    assert np.all(scales == np.float32(1.3))
    y = codec.decode(payload, x.numel()).view(reps, d)
    s = 2 ** (bits - 1) - 1
    q = y * s / 1.3
    assert (q - q.round()).abs().max().item() < 1e-4 and q.abs().max().item() <= s + 1e-4
    # Var of one sample <= (scale/s)^2 / 4, so the standard error of the mean is <= scale / (2 s sqrt(reps))
    se = 1.3 / (2 * s * math.sqrt(reps))
    assert (y.mean(0) - base).abs().max().item() <= 5 * se


def test_qsgd_zero_bucket_decodes_to_exact_zero():
    x = randn(48, seed=3)
    x[16:32] = 0.0
    x[40:] = -0.0
    codec = QSGDCodec(4, bucket_size=16)
    for _ in range(3):
        y = codec.roundtrip(x)
        assert torch.equal(y[16:32], torch.zeros(16))
        assert (y[40:] == 0).all()


def test_qsgd_scales_are_bucket_max_abs():
    x = randn(1000, seed=8)
    codec = QSGDCodec(3, bucket_size=300)
    scales = np.frombuffer(codec.encode(x)[:16].numpy().tobytes(), dtype=np.float32)
    expect = [x[i : i + 300].abs().max().item() for i in range(0, 1000, 300)]
    assert scales.tolist() == expect


def test_terngrad_levels_and_probabilities():
    d, reps = 8, 5000
    base = torch.tensor([0.8, -0.2, 0.0, 0.5, -0.8, 0.1, -0.65, 0.3])
    y = TernGradCodec(seed=2).roundtrip(base.repeat(reps)).view(reps, d)
    m = base.abs().max().item()  # float32(0.8)
    assert set(y.unique().tolist()) <= {-m, 0.0, m}
    assert torch.equal(torch.sign(y) * torch.sign(base), (y != 0).float())  # never the wrong sign
    p = base.abs() / m
    freq = (y != 0).float().mean(0)
    se = torch.sqrt(p * (1 - p) / reps).clamp_min(1e-12)
    assert ((freq - p).abs() <= 5 * se + 1e-12).all()


# ---- sparse ---------------------------------------------------------------------------------------


def test_sparse_k_formula():
    assert TopKCodec(0.07).k(100) == 7  # 0.07*100 = 7.000000000000001 in floating point
    assert TopKCodec(0.1).k(0) == 0 and TopKCodec(0.001).k(5) == 1 and TopKCodec(1.0).k(9) == 9
    assert RandomKCodec(0.25).k(9) == 3


def test_topk_picks_largest_magnitudes():
    x = randn(1000, seed=6)
    codec = TopKCodec(0.05)
    y = codec.roundtrip(x)
    k = codec.k(1000)
    expect = set(torch.argsort(x.abs(), descending=True)[:k].tolist())
    assert set(torch.nonzero(y).flatten().tolist()) == expect
    assert torch.equal(y[list(expect)], x[list(expect)])
    assert torch.equal(TopKCodec(1.0).roundtrip(x), x)


def test_randomk_distinct_indices_and_values():
    x = randn(500, seed=12)
    codec = RandomKCodec(0.1, seed=3)
    payload = codec.encode(x)
    idx = torch.from_numpy(np.frombuffer(payload[:200].numpy().tobytes(), dtype=np.int32).astype(np.int64))
    assert idx.unique().numel() == 50 and idx.min() >= 0 and idx.max() < 500
    y = codec.decode(payload, 500)
    assert torch.equal(y[idx], x[idx]) and (torch.count_nonzero(y) <= 50)


@pytest.mark.parametrize("n,ratio", [(40, 0.1), (20, 0.75)])  # draw-and-dedupe path, randperm path
def test_randomk_inclusion_is_uniform(n, ratio):
    codec = RandomKCodec(ratio, seed=21)
    k, reps = codec.k(n), 3000
    counts = torch.zeros(n)
    for _ in range(reps):
        idx = torch.nonzero(codec.roundtrip(torch.arange(1.0, n + 1))).flatten()
        assert idx.numel() == k
        counts[idx] += 1
    p = k / n
    sd = math.sqrt(reps * p * (1 - p))
    assert (counts - reps * p).abs().max().item() <= 5 * sd


def test_random_subset_redraws_when_draws_repeat(monkeypatch):
    real = torch.randint
    calls = []

    def repetitive(high, size, **kwargs):  # the first batch is one value repeated
        calls.append(size)
        return torch.zeros(size, dtype=torch.int64) if len(calls) == 1 else real(high, size, **kwargs)

    monkeypatch.setattr(torch, "randint", repetitive)
    idx = sparse._random_subset(1000, 30, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert len(calls) >= 2 and idx.numel() == 30 and idx.unique().numel() == 30
    assert 0 in idx.tolist()  # the first draw is kept: first occurrences in draw order


def test_randomk_unbiased_mean():
    n, reps = 20, 4000
    x = torch.linspace(-2.0, 3.0, n)
    codec = RandomKCodec(0.25, seed=5, unbiased=True)
    total = torch.zeros(n, dtype=torch.float64)
    sq = torch.zeros(n, dtype=torch.float64)
    for _ in range(reps):
        y = codec.roundtrip(x).double()
        total += y
        sq += y * y
    mean = total / reps
    # each sample is x_i * n/k with probability k/n, else 0: Var = x_i^2 (n/k - 1)
    se = x.double().abs() * math.sqrt(n / 5 - 1) / math.sqrt(reps)
    assert ((mean - x.double()).abs() <= 5 * se + 1e-9).all()


# ---- dtypes, registry, errors ---------------------------------------------------------------------


@pytest.mark.parametrize("case", ["uniform4", "sign-l2", "qsgd4", "terngrad", "identity"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_input_dtypes_match_float32_of_them(case, dtype):
    make, _ = CASES[case]
    x = randn(777, seed=1).to(dtype)
    assert torch.equal(make().encode(x), make().encode(x.float()))


def test_registry_and_make_codec():
    assert set(CODECS) == {"identity", "fp16", "bf16", "uniform", "sign", "qsgd", "terngrad", "topk", "randomk", "hsq"}
    assert isinstance(make_codec("uniform", bits=4, rounding="stochastic"), UniformCodec)
    assert make_codec("bf16").dtype == torch.bfloat16
    assert make_codec("terngrad").bits == 2
    for name in CODECS:
        kwargs = {"bits": 4} if name in ("uniform", "qsgd") else {"ratio": 0.5} if name in ("topk", "randomk") else {}
        kwargs = {"layout": [2000]} if name == "hsq" else kwargs
        codec = make_codec(name, **kwargs)
        assert isinstance(codec, Codec)
    with pytest.raises(ValueError, match="valid names: bf16, fp16, hsq, identity"):
        make_codec("nope")


@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: UniformCodec(0), "bits"),
        (lambda: UniformCodec(9), "bits"),
        (lambda: UniformCodec(4, rounding="floor"), "rounding"),
        (lambda: UniformCodec(4, lo=0.0), "both"),
        (lambda: UniformCodec(4, lo=1.0, hi=1.0), "lo < hi"),
        (lambda: UniformCodec(4, lo=0.0, hi=float("inf")), "lo < hi"),
        (lambda: UniformCodec(4, rounding="stochastic", seed=-1), "seed"),
        (lambda: SignCodec("l3"), "scale"),
        (lambda: IdentityCodec(torch.float64), "dtype"),
        (lambda: QSGDCodec(1), "bits"),
        (lambda: QSGDCodec(4, bucket_size=0), "bucket_size"),
        (lambda: TopKCodec(0.0), "ratio"),
        (lambda: TopKCodec(1.5), "ratio"),
        (lambda: RandomKCodec(0.5, seed=1.5), "seed"),
    ],
)
def test_bad_constructor_arguments(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


@pytest.mark.parametrize("case", CASES)
def test_bad_encode_decode_inputs(case):
    codec = CASES[case][0]()
    with pytest.raises(TypeError, match="floating-point"):
        codec.encode(torch.arange(8))
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode(torch.zeros(16)[::2])
    payload = codec.encode(randn(40))
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(torch.cat([payload, payload[:1]]), 40)
    with pytest.raises(TypeError, match="uint8"):
        codec.decode(payload.float(), 40)
    with pytest.raises(TypeError, match="float32"):
        codec.decode(payload, 40, out=torch.zeros(40, dtype=torch.float64))
    with pytest.raises(ValueError, match="40 elements"):
        codec.decode(payload, 40, out=torch.zeros(41))
    with pytest.raises(ValueError, match="numel"):
        codec.payload_bytes(-1)


def test_encode_accepts_requires_grad():
    x = randn(64).requires_grad_()
    for make, _ in CASES.values():
        codec = make()
        assert codec.decode(codec.encode(x), 64).shape == (64,)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 2500), bits=st.integers(1, 8), scale=st.floats(1e-3, 1e3), shift=st.floats(-10, 10))
def test_property_uniform_nearest_bound_and_size(n, bits, scale, shift):
    x = randn(n, seed=n) * scale + shift
    codec = UniformCodec(bits)
    payload = codec.encode(x)
    assert payload.numel() == 8 + ceil(n * bits, 8)
    y = codec.decode(payload, n)
    if n:
        lo, hi = x.min().item(), x.max().item()
        slack = 4 * 2**-24 * max(abs(lo), abs(hi))
        assert (y - x).abs().max().item() <= (hi - lo) / (2 * (2**bits - 1)) + slack


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 2500), bits=st.integers(2, 8), bucket=st.one_of(st.none(), st.integers(1, 700)))
def test_property_qsgd_size_and_range(n, bits, bucket):
    x = randn(n, seed=n + 1)
    codec = QSGDCodec(bits, bucket_size=bucket)
    payload = codec.encode(x)
    nb = 0 if n == 0 else 1 if bucket is None else ceil(n, bucket)
    assert payload.numel() == 4 * nb + ceil(n * bits, 8)
    y = codec.decode(payload, n)
    if n:  # every decoded value is within one level of x and never beyond its bucket's max|x|
        b = bucket or n
        for i in range(0, n, b):
            m = x[i : i + b].abs().max().item()
            assert (y[i : i + b] - x[i : i + b]).abs().max().item() <= m / (2 ** (bits - 1) - 1) * (1 + 1e-5)
            assert y[i : i + b].abs().max().item() <= m * (1 + 1e-6)
