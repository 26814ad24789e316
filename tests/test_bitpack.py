"""Tests for mpicomm.codecs.bitpack: exact layout, round trips, backend equality, errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpicomm.codecs import bitpack

BACKENDS = ("numpy", "torch")
LENGTHS = (0, 1, 7, 8, 9, 15, 16, 17, 63, 1000, 1003)


def reference_pack(values: np.ndarray, bits: int) -> np.ndarray:
    """The documented layout, built independently: bit j of value i is stream bit i*bits + j (LSB first)."""
    stream = ((values[:, None].astype(np.int64) >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(stream, bitorder="little")


def random_values(n, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("bits", range(1, 9))
def test_packed_bytes_formula(bits):
    for n in LENGTHS + (2**20 + 3,):
        assert bitpack.packed_bytes(n, bits) == -(-n * bits // 8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", range(1, 9))
def test_roundtrip_and_layout(bits, backend):
    for n in LENGTHS:
        v = random_values(n, bits, seed=n)
        packed = bitpack.pack(v, bits, backend=backend)
        assert packed.dtype == torch.uint8 and packed.numel() == bitpack.packed_bytes(n, bits)
        np.testing.assert_array_equal(packed.numpy(), reference_pack(v.numpy(), bits))
        assert torch.equal(bitpack.unpack(packed, bits, n, backend=backend), v)


@pytest.mark.parametrize("bits", range(1, 9))
def test_numpy_and_torch_give_identical_bytes(bits):
    for n in LENGTHS + (2**16 + 5,):
        v = random_values(n, bits, seed=100 + n)
        a = bitpack.pack(v, bits, backend="numpy")
        b = bitpack.pack(v, bits, backend="torch")
        assert torch.equal(a, b)
        assert torch.equal(bitpack.unpack(a, bits, n, backend="numpy"), bitpack.unpack(a, bits, n, backend="torch"))


def test_known_bytes():
    u8 = lambda xs: torch.tensor(xs, dtype=torch.uint8)  # noqa: E731
    for backend in BACKENDS:
        assert bitpack.pack(u8([1, 0, 1, 1]), 1, backend=backend).tolist() == [0b1101]
        assert bitpack.pack(u8([1, 2, 3]), 2, backend=backend).tolist() == [1 | 2 << 2 | 3 << 4]
        assert bitpack.pack(u8([3, 1]), 4, backend=backend).tolist() == [0x13]
        # 5 = 101b, 7 = 111b, 1 = 001b -> stream 1,0,1, 1,1,1, 1,0,0 (LSB first)
        assert bitpack.pack(u8([5, 7, 1]), 3, backend=backend).tolist() == [0b01111101, 0]
        assert bitpack.pack(u8([200, 7]), 8, backend=backend).tolist() == [200, 7]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", range(1, 8))
def test_padding_bits_are_zero(bits, backend):
    for n in (1, 3, 5, 9, 13):
        if n * bits % 8 == 0:
            continue
        packed = bitpack.pack(torch.full((n,), (1 << bits) - 1, dtype=torch.uint8), bits, backend=backend)
        assert packed[-1].item() == (1 << (n * bits % 8)) - 1


def test_use_backend_switches_default_and_restores(monkeypatch):
    v = random_values(1001, 3)
    calls = []
    original = bitpack._pack_numpy
    monkeypatch.setattr(bitpack, "_pack_numpy", lambda *args: calls.append(1) or original(*args))
    with bitpack.use_backend("torch"):
        bitpack.pack(v, 3)
        assert not bitpack.numpy_enabled(torch.device("cpu"))
    assert calls == []
    bitpack.pack(v, 3)
    assert calls == [1]
    assert bitpack.numpy_enabled(torch.device("cpu"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_parameter_writes_only_its_slice(backend):
    v = random_values(21, 4)
    buf = torch.full((20,), 0xAA, dtype=torch.uint8)
    out = bitpack.pack(v, 4, out=buf[3:14], backend=backend)
    assert out.data_ptr() == buf[3:].data_ptr()
    assert buf[:3].tolist() == [0xAA] * 3 and buf[14:].tolist() == [0xAA] * 6
    dst = torch.empty(21, dtype=torch.uint8)
    assert bitpack.unpack(buf[3:14], 4, 21, out=dst, backend=backend) is dst
    assert torch.equal(dst, v)


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpack_lookup_is_table_of_codes(bits):
    table = torch.randn(1 << bits, generator=torch.Generator().manual_seed(bits))
    for n in LENGTHS:
        v = random_values(n, bits, seed=n + 7)
        out = torch.full((n,), float("nan"))
        assert bitpack.unpack_lookup(bitpack.pack(v, bits), bits, n, table, out) is out
        assert torch.equal(out, table[v.long()])


def test_unpack_lookup_errors():
    packed = bitpack.pack(torch.zeros(10, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="table"):
        bitpack.unpack_lookup(packed, 2, 10, torch.zeros(8), torch.empty(10))
    with pytest.raises(ValueError, match="table"):
        bitpack.unpack_lookup(packed, 2, 10, torch.zeros(4, dtype=torch.float64), torch.empty(10))
    with pytest.raises(ValueError, match="out"):
        bitpack.unpack_lookup(packed, 2, 10, torch.zeros(4), torch.empty(11))
    with pytest.raises(ValueError, match="bytes"):
        bitpack.unpack_lookup(packed, 2, 13, torch.zeros(4), torch.empty(13))


@pytest.mark.parametrize("bits", [0, 9, -1, 2.0, True, None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        bitpack.pack(torch.zeros(4, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        bitpack.packed_bytes(4, bits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_values(backend):
    with pytest.raises(TypeError, match="uint8"):
        bitpack.pack(torch.zeros(4), 2, backend=backend)
    with pytest.raises(TypeError, match="uint8"):
        bitpack.pack([0, 1], 1, backend=backend)
    with pytest.raises(ValueError, match="1-D"):
        bitpack.pack(torch.zeros(2, 2, dtype=torch.uint8), 2, backend=backend)
    for bits in range(1, 8):
        with pytest.raises(ValueError, match=r"< 2\*\*bits"):
            bitpack.pack(torch.tensor([0, 1 << bits], dtype=torch.uint8), bits, backend=backend)
    bitpack.pack(torch.tensor([7], dtype=torch.uint8), 2, check=False, backend=backend)  # check can be skipped


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_packed_and_out(backend):
    with pytest.raises(ValueError, match="packed must hold"):
        bitpack.unpack(torch.zeros(3, dtype=torch.uint8), 4, 7, backend=backend)
    with pytest.raises(TypeError, match="uint8"):
        bitpack.unpack(torch.zeros(4, dtype=torch.int32), 4, 7, backend=backend)
    with pytest.raises(ValueError, match="n must be"):
        bitpack.unpack(torch.zeros(0, dtype=torch.uint8), 4, -1, backend=backend)
    with pytest.raises(ValueError, match="out must hold"):
        bitpack.pack(torch.zeros(8, dtype=torch.uint8), 1, out=torch.zeros(2, dtype=torch.uint8), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        bitpack.pack(torch.zeros(8, dtype=torch.uint8), 1, backend="cupy")
    with pytest.raises(ValueError, match="backend"), bitpack.use_backend("gpu"):
        pass


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), data=st.data())
def test_property_roundtrip_both_backends(bits, data):
    values = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=300))
    v = torch.tensor(values, dtype=torch.uint8)
    a = bitpack.pack(v, bits, backend="numpy")
    assert torch.equal(a, bitpack.pack(v, bits, backend="torch"))
    np.testing.assert_array_equal(a.numpy(), reference_pack(v.numpy(), bits))
    for backend in BACKENDS:
        assert torch.equal(bitpack.unpack(a, bits, len(values), backend=backend), v)
