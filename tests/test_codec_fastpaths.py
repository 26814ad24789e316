"""The codecs' fast paths against their plain references, bit for bit.

* ``bitpack.unpack_lookup`` moves a byte's floats as whole 8/16-byte words when ``out`` is aligned and as
  float rows otherwise: both must equal ``table[codes]`` byte for byte, NaN payloads included.
* ``lattice.dither`` (the fused kernel or numpy uint64 slices on a CPU, torch slices elsewhere, the
  finaliser's last xor skipped) must equal splitmix64 computed on Python ints.
* ``lattice.lattice_encode`` / ``lattice_decode`` / ``lattice_value`` must equal the formulas of the module
  docstring written out in plain torch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpicomm.codecs import bitpack
from mpicomm.codecs import moniqua as lattice

MASK64 = (1 << 64) - 1


def splitmix_finaliser(z: int) -> int:
    """splitmix64's finaliser (without the golden-ratio increment) on a Python int."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def dither_reference(key: int, coords: list[int]) -> torch.Tensor:
    """u = top 24 bits of the finaliser of c * golden + key, times 2^-24, minus 1/2."""
    top = [splitmix_finaliser(c * 0x9E3779B97F4A7C15 + key) >> 40 for c in coords]
    return torch.tensor(top, dtype=torch.float64).mul_(2.0**-24).sub_(0.5).to(torch.float32)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_unpack_lookup_wide_and_row_paths_copy_the_table_bytes(bits, offset):
    g = torch.Generator().manual_seed(10 * bits + offset)
    table = torch.randn(1 << bits, generator=g)
    table.view(torch.int32)[0] = 0x7FA00001  # a NaN with a payload: bytes must move untouched
    for n in (1, 7, 8, 9, 1000, 4099):
        codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
        buf = torch.full((n + offset,), 7.0)
        out = buf[offset:]
        bitpack.unpack_lookup(bitpack.pack(codes, bits), bits, n, table, out)
        assert torch.equal(out.view(torch.int32), table[codes.long()].view(torch.int32)), (n, offset)
        assert torch.equal(buf[:offset], torch.full((offset,), 7.0))


@pytest.mark.parametrize("backend", ["kernels", "numpy", "torch"])
def test_dither_equals_splitmix_on_python_ints(backend):
    g = torch.Generator().manual_seed(1)
    coords = torch.cat([torch.arange(0, 50), torch.randint(0, 1 << 40, (200,), generator=g)])
    for seed, step in ((0, 0), (3, 7), (12345, 2**40 + 3)):
        key = lattice.stream_key(seed, step)
        with bitpack.use_backend(backend):
            got = lattice.dither(key, coords)
        assert torch.equal(got, dither_reference(key & MASK64, coords.tolist())), (seed, step)


def test_dither_slices_backends_and_out_agree():
    n = 3 * lattice.DITHER_CHUNK + 17  # several slices and a short last one
    coords = torch.arange(5, 5 + n)
    key = lattice.stream_key(9, 4)
    ref = dither_reference(key & MASK64, coords[-300:].tolist())
    fast = lattice.dither(key, coords)
    with bitpack.use_backend("torch"):
        plain = lattice.dither(key, coords)
    out = torch.full((n,), 2.0)
    assert lattice.dither(key, coords, out=out) is out
    assert torch.equal(fast, plain) and torch.equal(out, fast) and torch.equal(fast[-300:], ref)
    with pytest.raises(ValueError, match="out"):
        lattice.dither(key, coords, out=torch.empty(n - 1))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rounding", ["dither", "nearest", "stochastic"])
def test_lattice_functions_equal_their_formulas(bits, rounding):
    g = torch.Generator().manual_seed(bits)
    n, s = 3001, 2.0**bits / 0.1
    x = torch.randn(n, generator=g)
    r = x + (torch.rand(n, generator=g) - 0.5) * 0.09
    u = lattice.dither(lattice.stream_key(1, bits), torch.arange(n)) if rounding == "dither" else None
    noise = torch.rand(n, generator=g) if rounding == "stochastic" else None
    t = x * s
    L_ref = (t + noise).floor() if noise is not None else (t + u if u is not None else t).round()
    L_ref = L_ref.to(torch.int64)
    codes = (L_ref & ((1 << bits) - 1)).to(torch.uint8)
    packed, L = lattice.lattice_encode(x, s, bits, u, noise)
    assert torch.equal(L, L_ref) and torch.equal(packed, bitpack.pack(codes, bits))
    k = codes.to(torch.float32)
    base = r * s + u if u is not None else r * s
    L_dec = (((base - k) * (1.0 / 2**bits)).round() * 2**bits + k).to(torch.int64)
    assert torch.equal(lattice.lattice_decode(packed, r, s, bits, u), L_dec)
    v_ref = ((L_dec.to(torch.float32) - u) if u is not None else L_dec.to(torch.float32)) * (1.0 / s)
    out = torch.empty(n)
    assert lattice.lattice_value(L_dec, s, u, out=out) is out
    assert torch.equal(out, v_ref) and torch.equal(lattice.lattice_value(L_dec, s, u), v_ref)


@pytest.mark.parametrize("d", [8, 16])
def test_hsq_decode_gathers_into_out_as_the_formula(d):
    """Whole chunks are gathered straight into ``out``, the padded last chunk apart: u_hat * c_k, padding dropped."""
    from mpicomm.codecs import HSQCodec

    layout = [1001, 37, 4099, 2048]  # padded, raw, padded, whole chunks
    c = HSQCodec(layout, d=d, seed=3)
    x = torch.randn(sum(layout), generator=torch.Generator().manual_seed(d))
    payload = c.encode(x)
    out = torch.full((x.numel(),), 5.0)
    assert c.decode(payload, x.numel(), out=out) is out
    cb = c._on(torch.device("cpu"))[0]
    for offset, size, n, pos in c._plan:
        got = out[offset:offset + size]
        if n == 0:
            assert torch.equal(got, x[offset:offset + size])
            continue
        nb = c._norms.payload_bytes(n)
        u = c._norms.decode(payload[pos:pos + nb], n)
        idx = c._unpack_indices(payload[pos + nb:pos + c._layer_bytes(size, n)], n)
        assert torch.equal(got, (cb[idx] * u[:, None]).reshape(-1)[:size])


def _topk_cases():
    rng = np.random.default_rng(0)
    n = 1 << 17
    normal = rng.standard_normal(n).astype(np.float32)
    zeros = normal.copy()
    zeros[: n - 1000] = 0.0  # k beyond the non-zeros: the k-th largest is a tie of many zeros
    ties = np.round(normal * 4).astype(np.float32)  # few distinct values: ties at the cut
    nans = normal.copy()
    nans[rng.integers(0, n, 50)] = np.nan  # NaN sorts as the largest
    infs = normal.copy()
    infs[rng.integers(0, n, 50)] = np.inf
    periodic = np.tile(np.arange(64, dtype=np.float32), n // 64)  # the strided sample sees one value only
    ramp = np.arange(n, dtype=np.float32)
    return {"normal": normal, "zeros": zeros, "ties": ties, "nans": nans, "infs": infs, "periodic": periodic,
            "ramp": ramp, "small": normal[:1000]}


@pytest.mark.parametrize("case", sorted(_topk_cases()))
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2, 0.3])
def test_top_k_indices_is_the_argpartition_set(case, ratio):
    """The candidate shortcut keeps exactly the set that np.argpartition keeps (ties and NaN included)."""
    from mpicomm.codecs.sparse import top_k_indices

    a = np.abs(_topk_cases()[case])
    k = max(1, int(ratio * a.shape[0]))
    want = np.sort(np.argpartition(a, a.shape[0] - k)[a.shape[0] - k:])
    assert np.array_equal(np.sort(top_k_indices(a, k)), want)


def test_top_k_shortcut_is_taken_on_a_large_tensor(monkeypatch):
    """On a large tensor with distinct magnitudes the full argpartition is not run (the shortcut pays)."""
    from mpicomm.codecs import sparse

    a = np.abs(np.random.default_rng(1).standard_normal(1 << 18).astype(np.float32))
    calls = []
    real = np.argpartition
    monkeypatch.setattr(sparse.np, "argpartition", lambda v, kth: calls.append(v.shape[0]) or real(v, kth))
    idx = sparse.top_k_indices(a, 2621)
    assert max(calls) < a.shape[0] // 10, calls
    assert np.array_equal(np.sort(idx), np.sort(real(a, a.shape[0] - 2621)[a.shape[0] - 2621:]))
