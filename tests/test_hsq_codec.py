"""Serial tests of the HSQ codec: codebooks, greedy closed form, unbiasedness, sampling, norms, bytes, errors."""

import math

import pytest
import torch

from mpicomm.codecs import bitpack
from mpicomm.codecs.hsq import (
    HSQCodec,
    codebook,
    coefficient_map,
    greedy_select,
    index_bits,
    inverse_cdf_sample,
)
from mpicomm.plan.wire import hsq_payload

KINDS = ("gaussian", "kmeans", "orthonormal", "rotation", "identity")


def ceil(a, b):
    return -(-a // b)


def formula_bytes(sizes, d, k, n_bit, min_compress):
    """Independent payload size: raw 4*D, compressed 8 + ceil(N*n_bit/8) + ceil(N*ceil(log2 K)/8)."""
    return hsq_payload(sizes, d, k, n_bit, min_compress)


# ---- codebooks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [3, 16])
def test_codebook_rows_are_unit_and_seeded(kind, d):
    k = d if kind in ("orthonormal", "rotation", "identity") else 64
    c = codebook(kind, d, k, seed=5)
    assert c.shape == (k, d) and c.dtype == torch.float32
    torch.testing.assert_close(c.norm(dim=1), torch.ones(k), rtol=0, atol=2e-7)
    assert torch.equal(c, codebook(kind, d, k, seed=5))
    if kind != "identity":
        assert not torch.equal(c, codebook(kind, d, k, seed=6))
    if kind in ("orthonormal", "rotation", "identity"):
        torch.testing.assert_close(c.double() @ c.double().T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-6)


def test_rotation_is_orthonormal_alias_and_digest_tracks_the_codebook():
    assert torch.equal(codebook("rotation", 8, seed=1), codebook("orthonormal", 8, seed=1))
    a = HSQCodec([2000], d=8, K=64, codebook_seed=1, seed=0)
    b = HSQCodec([2000], d=8, K=64, codebook_seed=1, seed=9)  # a different RNG seed: same codebook
    c = HSQCodec([2000], d=8, K=64, codebook_seed=2)
    assert a.codebook_digest() == b.codebook_digest() != c.codebook_digest()


def test_kmeans_beats_gaussian_codebook_on_greedy_capture():
    """Spherical k-means spreads codewords better: larger mean max |<c, g>| on fresh unit vectors."""
    g = torch.nn.functional.normalize(torch.randn(4000, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    cap = {kind: greedy_select(g, codebook(kind, 8, 64, seed=3))[1].abs().mean().item()
           for kind in ("kmeans", "gaussian")}
    assert cap["kmeans"] > cap["gaussian"] + 0.01, cap


# ---- greedy ---------------------------------------------------------------------------------------------


def test_greedy_on_orthonormal_basis_picks_largest_coordinate():
    c = codebook("orthonormal", 16, seed=2)
    g = torch.randn(500, 16, generator=torch.Generator().manual_seed(1))
    idx, u = greedy_select(g, c)
    coords = g @ c.T
    assert torch.equal(idx, coords.abs().argmax(dim=1))
    torch.testing.assert_close(u, coords.gather(1, idx[:, None]).squeeze(1))


def test_greedy_decode_is_projection_on_chosen_codeword():
    """Layers of exactly 2 chunks: the quantized norms are min and max, hence exact (closed form check)."""
    d, layers = 16, 40
    codec = HSQCodec([2 * d] * layers, d=d, K=64, min_compress=0, seed=1, codebook_seed=4)
    c = codebook("gaussian", d, 64, seed=4)
    x = torch.randn(codec.numel, generator=torch.Generator().manual_seed(2))
    got = codec.decode(codec.encode(x), codec.numel).view(-1, d)
    chunks = x.view(-1, d)
    k = (chunks @ c.T).abs().argmax(dim=1)
    proj = (chunks * c[k]).sum(dim=1, keepdim=True) * c[k]
    torch.testing.assert_close(got, proj, rtol=1e-5, atol=1e-6)


# ---- unbiased -------------------------------------------------------------------------------------------


def _tiled_samples(codec, g, copies, draws):
    """Decode ``draws`` encodes of one layer holding ``copies`` chunk-aligned copies of ``g`` (zero-padded to a
    multiple of d): (draws * copies, len(g)) samples, independent given the layer's norm range."""
    block = torch.zeros(ceil(g.numel(), codec.d) * codec.d)
    block[: g.numel()] = g
    x = block.repeat(copies)
    out = [codec.decode(codec.encode(x), codec.numel).view(copies, -1)[:, : g.numel()] for _ in range(draws)]
    return torch.cat(out)


@pytest.mark.parametrize("kind,k", [("gaussian", 32), ("orthonormal", None)])
def test_unbiased_mode_is_unbiased_and_greedy_is_not(kind, k):
    """Mean of 4000 decodes is within 5 standard errors of g in every coordinate (fixed seeds)."""
    g = torch.randn(40, generator=torch.Generator().manual_seed(3))  # 3 chunks of d = 16, the last one padded
    copies, draws = 800, 5
    kw = dict(d=16, K=k, codebook=kind, n_bit=4, min_compress=0, seed=7)
    s = _tiled_samples(HSQCodec([48 * copies], mode="unbiased", **kw), g, copies, draws).double()
    z = ((s.mean(dim=0) - g.double()) / (s.std(dim=0) / math.sqrt(s.shape[0]))).abs()
    assert z.max() < 5.0, z.max()
    sg = _tiled_samples(HSQCodec([48 * copies], mode="greedy", **kw), g, copies, draws).double()
    zg = ((sg.mean(dim=0) - g.double()) / (sg.std(dim=0) / math.sqrt(sg.shape[0]) + 1e-12)).abs()
    assert zg.max() > 20.0, zg.max()  # the test has power: a biased codec fails it


def test_inverse_cdf_frequencies_match_weights():
    """Chi-square of 200,000 draws over 7 non-zero buckets below df + 8 sqrt(2 df); zero buckets never drawn."""
    w = torch.tensor([0.0, 3.0, 0.5, 0.0, 1.0, 2.0, 0.0, 0.25, 0.05, 4.0])
    n = 200_000
    r = torch.rand(n, generator=torch.Generator().manual_seed(11))
    idx = inverse_cdf_sample(w.repeat(n, 1), r)
    counts = torch.bincount(idx, minlength=w.numel()).double()
    assert counts[w == 0].sum() == 0
    expected = n * w.double() / w.sum()
    nz = w > 0
    chi2 = (((counts - expected)[nz]) ** 2 / expected[nz]).sum().item()
    df = int(nz.sum()) - 1
    assert chi2 < df + 8 * math.sqrt(2 * df), chi2


def test_inverse_cdf_edges():
    """All-zero row -> 0; r close to 1 or exactly 0 (torch.rand can return 0) never picks a zero weight."""
    w = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1e-30, 0.0], [0.0, 0.0, 2.0]])
    r = torch.tensor([0.5, 0.9999999, 0.9999999, 0.9999999, 0.0])
    assert inverse_cdf_sample(w, r).tolist() == [0, 2, 0, 1, 2]


def test_codec_sampling_frequencies_through_payload():
    """Identity codebook, unbiased: pinv(I) = I, so index k is drawn w.p. |g_k| / ||g||_1; read k off the decode."""
    g = torch.tensor([0.5, -2.0, 0.0, 1.0, -0.25, 0.0, 0.25, 1.0])
    copies = 4000
    codec = HSQCodec([8 * copies], d=8, codebook="identity", mode="unbiased", min_compress=0, seed=5)
    s = _tiled_samples(codec, g, copies, 1)
    k = s.abs().argmax(dim=1)
    # every u is +-||g||_1 and both signs occur, so min and max are the norms: exact
    assert torch.equal(s.gather(1, k[:, None]).squeeze(1), torch.sign(g[k]) * g.abs().sum())
    counts = torch.bincount(k, minlength=8).double()
    expected = s.shape[0] * g.abs().double() / g.abs().sum()
    nz = g != 0
    assert counts[~nz].sum() == 0
    chi2 = (((counts - expected)[nz]) ** 2 / expected[nz]).sum().item()
    df = int(nz.sum()) - 1
    assert chi2 < df + 8 * math.sqrt(2 * df), chi2


# ---- norm quantization --------------------------------------------------------------------------------


def test_norm_quantizer_within_one_step_and_unbiased():
    """Identity codebook, one non-zero per chunk: the projection is exact, so the error is the norm quantizer's."""
    d, n, n_bit = 4, 300, 3
    gen = torch.Generator().manual_seed(8)
    u = torch.randn(n, generator=gen)
    x = torch.zeros(n, d)
    x[torch.arange(n), torch.randint(0, d, (n,), generator=gen)] = u
    x = x.view(-1)
    codec = HSQCodec([n * d], d=d, codebook="identity", n_bit=n_bit, min_compress=0, seed=3)
    step = (u.max() - u.min()).item() / (2**n_bit - 1)
    draws = torch.stack([codec.decode(codec.encode(x), codec.numel) for _ in range(400)])
    support = x != 0
    assert torch.all(draws[:, ~support] == 0)
    err = (draws[:, support] - x[support]).abs()
    assert err.max() <= step * (1 + 1e-5)
    # Analytic standard error of the mean of lo + step*floor(y + U): step * sqrt(f(1-f)/draws), f = frac(y).
    y = (u.double() - u.min().double()) / step
    f = y - y.floor()
    se = step * torch.sqrt(f * (1 - f) / draws.shape[0])
    bias = draws[:, support].double().mean(dim=0) - x[support].double()  # support is in chunk order, like u
    assert torch.all(bias.abs() <= 5 * se + 1e-6 * step), (bias.abs() / (se + 1e-30)).max()


# ---- payload layout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("d,k,n_bit,kind", [(16, 256, 6, "gaussian"), (7, None, 3, "orthonormal"),
                                             (16, 1024, 5, "gaussian"), (5, 8, 1, "gaussian"),
                                             (12, None, 8, "identity")])
def test_payload_bytes_match_formula(d, k, n_bit, kind):
    sizes = [0, 1, 1000, 1001, 1017, 999, 4096, 5003, 3]
    codec = HSQCodec(sizes, d=d, K=k, codebook=kind, n_bit=n_bit)
    k_eff = d if k is None else k
    assert codec.bits == math.ceil(math.log2(k_eff))
    expected = formula_bytes(sizes, d, k_eff, n_bit, 1000)
    assert codec.payload_bytes(sum(sizes)) == expected
    x = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == expected
    y = codec.decode(payload, sum(sizes))
    raw = torch.cat([torch.full((s,), s <= 1000, dtype=torch.bool) for s in sizes])
    assert torch.equal(y[raw], x[raw])  # small layers travel as exact float32


def test_payload_structure_header_norms_indices():
    """Byte-level layout of one compressed layer: [lo, hi][norm codes][indices] after a raw layer."""
    d, k = 4, 16
    codec = HSQCodec([3, 10], d=d, K=k, n_bit=2, min_compress=5)
    x = torch.randn(13, generator=torch.Generator().manual_seed(4))
    p = codec.encode(x)
    assert torch.equal(p[:12].view(torch.float32), x[:3])
    c = codebook("gaussian", d, k)
    chunks = torch.cat([x[3:], torch.zeros(2)]).view(3, d)
    idx, u = greedy_select(chunks, c)
    lohi = p[12:20].clone().view(torch.float32)
    assert lohi.tolist() == [u.min().item(), u.max().item()]
    assert p.numel() == 12 + 8 + bitpack.packed_bytes(3, 2) + bitpack.packed_bytes(3, 4)
    assert torch.equal(bitpack.unpack(p[21:], 4, 3).long(), idx)


def test_wide_indices_round_trip():
    """K = 1024 (10-bit indices: low byte + 2 packed high bits) decodes to the greedy codewords."""
    codec = HSQCodec([2 * 8] * 30, d=8, K=1024, min_compress=0, seed=2)
    assert index_bits(1024) == codec.bits == 10
    x = torch.randn(codec.numel, generator=torch.Generator().manual_seed(5))
    c = codebook("gaussian", 8, 1024)
    idx, u = greedy_select(x.view(-1, 8), c)
    assert idx.max() > 255
    torch.testing.assert_close(codec.roundtrip(x).view(-1, 8), u[:, None] * c[idx], rtol=1e-5, atol=1e-6)


def test_zero_payload_decodes_to_zero_and_out_is_used():
    codec = HSQCodec([5, 2000, 17], d=16, min_compress=10)
    out = torch.full((codec.numel,), 3.0)
    res = codec.decode(torch.zeros(codec.payload_bytes(codec.numel), dtype=torch.uint8), codec.numel, out=out)
    assert res is out and torch.equal(out, torch.zeros(codec.numel))


def test_float64_input_and_layer_objects():
    from mpicomm.flat import FlatParameters

    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))
    flat = FlatParameters(model)
    a = HSQCodec(flat.layers, seed=1)
    b = HSQCodec([layer.numel for layer in flat.layers], seed=1)
    x = torch.randn(flat.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.encode(x), b.encode(x.float()))


def test_state_round_trip_gives_same_bytes():
    for mode in ("greedy", "unbiased"):
        codec = HSQCodec([3000, 10], d=16, K=32, mode=mode, seed=4)
        x = torch.randn(codec.numel, generator=torch.Generator().manual_seed(1))
        codec.encode(x)
        state = codec.state_dict()
        first = codec.encode(x)
        fresh = HSQCodec([3000, 10], d=16, K=32, mode=mode, seed=99)
        fresh.load_state_dict(state)
        assert torch.equal(fresh.encode(x), first), mode
        assert not torch.equal(codec.encode(x), first)  # draws do advance


# ---- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"d": 0}, "d must be"),
    ({"d": -3}, "d must be"),
    ({"d": 2.0}, "d must be"),
    ({"K": 100}, "K must be a power of two"),
    ({"K": 1}, "K must be an int in 2..65536"),
    ({"K": 1 << 17}, "K must be an int in 2..65536"),
    ({"codebook": "orthonormal", "K": 32}, "K must equal d"),
    ({"n_bit": 0}, "n_bit must be"),
    ({"n_bit": 9}, "n_bit must be"),
    ({"mode": "unbiased", "K": 8}, "K must be >= d"),
    ({"mode": "fancy"}, "mode must be"),
    ({"codebook": "lattice"}, "codebook must be"),
    ({"min_compress": -1}, "min_compress must be"),
    ({"seed": -1}, "seed must be"),
    ({"codebook_seed": -2}, "seed must be"),
])
def test_bad_config_raises_value_error_naming_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HSQCodec([2000], **kwargs)


def test_bad_layout_and_sizes():
    with pytest.raises(ValueError, match="layout must be"):
        HSQCodec([10, -1])
    with pytest.raises(ValueError, match="layout must be"):
        HSQCodec("abc")
    codec = HSQCodec([10, 2000])
    with pytest.raises(ValueError, match="layout total 2010"):
        codec.payload_bytes(2000)
    with pytest.raises(ValueError, match="layout total"):
        codec.encode(torch.zeros(5))
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(torch.zeros(3, dtype=torch.uint8), 2010)
    with pytest.raises(ValueError, match="keys"):
        codec.load_state_dict({"norms": {}})


def test_coefficient_map_inverts_and_rejects_rank_deficient_codebooks():
    c = codebook("gaussian", 4, 8, seed=1)
    g = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close((g @ coefficient_map(c)) @ c, g, rtol=1e-5, atol=1e-5)  # g = C^T a
    bad = codebook("gaussian", 4, 4, seed=1)
    bad[3] = bad[2]
    with pytest.raises(ValueError, match="rank 3 < d = 4"):
        coefficient_map(bad)


@pytest.mark.parametrize("mode", ["greedy", "unbiased"])
def test_torch_backend_gives_the_same_bytes(mode):
    """The pure-torch path (what CUDA tensors take) encodes and decodes exactly like the numpy CPU path."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(6))
    kw = dict(d=16, K=1024 if mode == "greedy" else 32, mode=mode, n_bit=5, seed=3)
    ref = HSQCodec([3000, 17, 1983], **kw).encode(x)
    ref_decoded = HSQCodec([3000, 17, 1983], **kw).decode(ref, 5000)
    with bitpack.use_backend("torch"):
        codec = HSQCodec([3000, 17, 1983], **kw)
        assert torch.equal(codec.encode(x), ref)
        assert torch.equal(codec.decode(ref, 5000), ref_decoded)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_greedy_with_scratch_is_bit_identical_and_reuses_the_buffer(rows):
    """The reused products/magnitudes buffer gives the same indices and values as fresh temporaries, also when it
    holds stale numbers and is longer than needed."""
    g = torch.Generator().manual_seed(rows)
    cb = codebook("gaussian", 8, 64, seed=3)
    chunks = torch.randn(rows, 8, generator=g)
    scratch = torch.randn(2 * 300 * 64 + 5, generator=g)
    i0, v0 = greedy_select(chunks, cb)
    i1, v1 = greedy_select(chunks, cb, scratch)
    assert torch.equal(i0, i1) and torch.equal(v0, v1)
    assert i0.tolist() == (chunks @ cb.T).abs().argmax(dim=1).tolist()
