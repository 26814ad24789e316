"""Nested state <-> HDF5 (serial): exact round trips, clear errors, detected corruption, RNG capture."""

import io
import math
import random
import struct

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mpicomm.checkpoint import CheckpointError, capture_rng_state, read_tree, restore_rng_state, write_tree
from mpicomm.checkpoint.tree import LIBVER


def same(a, b, path="state"):
    """Assert ``b`` is an exact copy of ``a``: same types, dtypes, shapes, bits (NaN and -0.0 included)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}"
        assert a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), path
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def roundtrip(state):
    buf = io.BytesIO()
    with h5py.File(buf, "w", libver=LIBVER) as f:
        write_tree(f, state)
    with h5py.File(buf, "r") as f:
        return read_tree(f)


def every_type():
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "bf16_0d": torch.tensor(-2.5, dtype=torch.bfloat16),
        "f32": torch.randn(4, 2, 3, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "f64_nan": torch.tensor([math.nan, -0.0, math.inf]),
        "int64": torch.tensor([-(2**63), 2**63 - 1, 0]),
        "uint8": torch.arange(256, dtype=torch.uint8),
        "bool_t": torch.tensor([True, False]),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "fp8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 4, dtype=torch.int32),
        "scalar_t": torch.tensor(7, dtype=torch.int16),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
        "np": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "np_scalar": np.float32(1.25),
        "np_0d": np.array(3, dtype=np.int8),
        "np_c128": np.array([1 + 2j]),
        "none": None, "t": True, "f": False, "int": -5, "big": 2**80, "float": 0.1, "negzero": -0.0,
        "nan": math.nan, "complex": 1.5 - 2j,
        "str": "héllo wörld ✓ 🎲", "empty_str": "", "nul_str": "a\0b", "bytes": b"\x00\xff", "no_bytes": b"",
        "ints": [1, 2, 3], "floats": (0.5, -1.0), "bools": [True, False], "strs": ["α", "", "b"],
        "mixed": [1, "two", 3.0, None, [4, [5, {"six": 6}]]], "empty_list": [], "empty_tuple": (),
        "size": torch.Size([2, 3]),
        0: {"momentum_buffer": torch.ones(2)}, 17: "int key", "": "empty key", ".": "dot", "a/b%c": "slash",
        "nested": {"deeper": {"deepest": {"x": torch.zeros(1)}}},
    }


def test_every_supported_type_round_trips_exactly():
    state = every_type()
    back = roundtrip(state)
    expected = dict(state, noncontig=state["noncontig"].contiguous(), size=(2, 3))
    same(expected, back)


def test_bf16_stored_as_uint16_with_dtype_attribute_and_fletcher32():
    buf = io.BytesIO()
    with h5py.File(buf, "w", libver=LIBVER) as f:
        write_tree(f, {"w": torch.ones(4, dtype=torch.bfloat16), "s": 1.0})
    with h5py.File(buf, "r") as f:
        assert f["w"].dtype == np.uint16 and f["w"].attrs["dtype"] == "torch.bfloat16"
        assert f["w"][:].tolist() == [0x3F80] * 4  # bfloat16 1.0
        assert f["w"].fletcher32 and not f["s"].fletcher32 and "crc32" in f["s"].attrs


@pytest.mark.parametrize("state, where, what", [
    ({"a": {"b": [1, {"c": {1, 2}}]}}, "['a']['b'][1]['c']", "builtins.set"),
    ({"m": object()}, "['m']", "builtins.object"),
    ({"arr": np.array(["x"])}, "['arr']", "numpy dtype <U1"),
    ({"sp": torch.eye(2).to_sparse()}, "['sp']", "layout torch.sparse_coo"),
    ({"k": {(1, 2): 3}}, "['k']", "dict keys must be str or int"),
    ({"k": {0: 1, "0": 2}}, "['k']", "map to the same HDF5 name"),
])
def test_unsupported_values_raise_type_error_naming_the_key_path(state, where, what):
    with pytest.raises(TypeError) as info:
        roundtrip(state)
    assert where in str(info.value) and what in str(info.value), str(info.value)


def test_top_level_must_be_a_dict():
    with pytest.raises(TypeError, match="must be a dict"):
        roundtrip([1, 2])


def flip_byte(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("key, value", [
    ("tensor", torch.arange(1000, dtype=torch.float32)),  # chunked: fletcher32
    ("scalar", 3.0),                                      # 0-d contiguous: crc32 attribute
    ("text", "a string in the global heap"),              # variable-length: crc32 attribute
])
def test_flipped_data_bytes_are_detected(tmp_path, key, value):
    path = tmp_path / "s.h5"
    with h5py.File(path, "w", libver=LIBVER) as f:
        write_tree(f, {key: value, "other": 1})
        ds = f[key]
        if ds.chunks:
            offset = ds.id.get_chunk_info(0).byte_offset + 8
        elif h5py.check_string_dtype(ds.dtype):
            offset = None
        else:
            offset = ds.id.get_offset()
    if offset is None:  # the string's bytes live in the global heap: find them in the file
        offset = path.read_bytes().index(value.encode()) + 3
    flip_byte(path, offset)
    with h5py.File(path, "r") as f:
        with pytest.raises(CheckpointError, match=rf"\['{key}'\] \(/{key}\) is corrupted"):
            read_tree(f)


def test_truncated_file_fails_to_open(tmp_path):
    path = tmp_path / "s.h5"
    with h5py.File(path, "w", libver=LIBVER) as f:
        write_tree(f, {"x": torch.zeros(10000)})
    path.write_bytes(path.read_bytes()[:20000])
    with pytest.raises(OSError, match="truncated"):
        h5py.File(path, "r")


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(dtype=st.one_of(hnp.integer_dtypes(endianness="="), hnp.unsigned_integer_dtypes(endianness="="),
                                  hnp.floating_dtypes(endianness="="), hnp.complex_number_dtypes(endianness="="),
                                  hnp.boolean_dtypes()),
                  shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))
def test_numpy_arrays_and_their_tensors_round_trip(array):
    state = {"np": array, "t": torch.from_numpy(array.copy())}
    same(state, roundtrip(state))


def draws():
    cuda = [torch.rand(3, device="cuda")] if torch.cuda.is_available() else []
    return torch.rand(3), np.random.rand(3), random.random(), np.random.randn(), cuda


def test_rng_state_round_trips_through_hdf5_and_restores_every_generator():
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    saved = roundtrip({"rng": capture_rng_state()})["rng"]
    first = draws()
    restore_rng_state(saved)
    second = draws()
    assert torch.equal(first[0], second[0]) and np.array_equal(first[1], second[1])
    assert first[2] == second[2] and first[3] == second[3]
    assert all(torch.equal(a, b) for a, b in zip(first[4], second[4]))
    assert not torch.equal(draws()[0], first[0])  # the draws really advance the generator


def test_restore_rng_rejects_a_foreign_dict():
    with pytest.raises(ValueError, match="capture_rng_state"):
        restore_rng_state({"torch": torch.get_rng_state()})
