"""A nested state dict <-> an HDF5 group, exactly (pure h5py, no MPI).

Mapping (every object carries a ``kind`` attribute saying how to read it back):

* ``dict`` -> group; its keys (``str`` or ``int``, order kept) are the JSON attribute ``keys``; each
  child's link name is the key with ``%``, ``/``, NUL and a leading ``.`` percent-escaped (``""`` -> ``%``).
* ``list`` / ``tuple`` -> group with children ``0, 1, ...``; a non-empty one whose items are all ``int``
  (within int64), all ``float``, all ``bool`` or all ``str`` (without NUL) -> one 1-D dataset instead.
* ``torch.Tensor`` -> dataset of the same shape (read back on the CPU). A dtype numpy lacks (bfloat16,
  float8, complex32) is stored as the unsigned integer of the same width (bfloat16 -> uint16) with the
  torch dtype in the ``dtype`` attribute. ``numpy.ndarray`` and numpy scalars (bool, int, uint, float,
  complex dtypes) -> dataset.
* ``None`` -> empty (null-dataspace) dataset; ``bool``/``int``/``float``/``complex`` -> 0-d dataset
  (an int beyond int64 as its decimal string); ``str`` -> UTF-8 string (bytes when it holds NUL);
  ``bytes`` -> uint8 dataset.

Integrity: a non-empty numeric dataset of rank >= 1 is chunked with HDF5's fletcher32 filter, which
checksums every stored chunk and is verified by the library on every read. Every other dataset (empty,
0-d, strings, whose bytes live in the global heap) carries a ``crc32`` attribute of its bytes,
checked here on read. Groups, attributes and dataset headers are covered by the metadata checksums of
the HDF5 1.8+ file format (open files with ``libver=LIBVER``). Any mismatch raises
:class:`CheckpointError` naming the key path.
"""

from __future__ import annotations

import json
import zlib

import h5py
import numpy as np
import torch

__all__ = ["LIBVER", "CheckpointError", "LazyTensor", "link_name", "read_tree", "write_tree"]

LIBVER = ("v108", "latest")
_NUMERIC = "biufc"
_INT64 = np.iinfo(np.int64)
_UNSIGNED = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32),
             8: (torch.int64, np.uint64)}
_STR = h5py.string_dtype("utf-8")
_CHUNK_BYTES = 4 << 20  # reads of 4 MiB chunks ran 2.7x faster than h5py's guess (48 KiB) for 100 MB
_MAX_CHUNK_BYTES = 1 << 30  # HDF5 caps a chunk below 4 GiB
_ELEMENTS = {"int": int, "float": float, "bool": bool, "str": str}


class CheckpointError(ValueError):
    """A checkpoint (or one of its files or datasets) is missing, incomplete, corrupted or not from mpicomm."""


def _where(path: str) -> str:
    return path or "the top level"


def link_name(key) -> str:
    """HDF5 link name of a dict key: ``%``, ``/``, NUL and a leading ``.`` escaped; ``""`` becomes ``%``."""
    name = str(key).replace("%", "%25").replace("/", "%2F").replace("\0", "%00")
    if name.startswith("."):
        name = "%2E" + name[1:]
    return name or "%"


def _crc(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _str_bytes(values) -> bytes:
    return b"\0".join(v.encode("utf-8") for v in values)


# ---------------------------------------------------------------------------------------------- writing
def write_tree(group: h5py.Group, tree: dict) -> None:
    """Write the nested dict ``tree`` into the (empty) ``group``; unsupported values raise ``TypeError``."""
    if not isinstance(tree, dict):
        raise TypeError(f"the state must be a dict, got {type(tree).__name__}")
    _write_dict(group, tree, "")


def _write_dict(group: h5py.Group, tree: dict, path: str) -> None:
    names: dict[str, object] = {}
    for key in tree:
        if type(key) not in (str, int):
            raise TypeError(f"key {key!r} at {_where(path)}: dict keys must be str or int, got {type(key).__name__}")
        name = link_name(key)
        if name in names:
            raise TypeError(f"keys {names[name]!r} and {key!r} at {_where(path)} map to the same HDF5 name {name!r}")
        names[name] = key
    group.attrs["kind"] = "dict"
    group.attrs["keys"] = json.dumps(list(tree))
    for name, key in names.items():
        _write_value(group, name, tree[key], f"{path}[{key!r}]")


def _homogeneous(items) -> str | None:
    """The element name when ``items`` is non-empty and all of one packable scalar type, else None."""
    kinds = {type(v) for v in items}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind is int and not all(_INT64.min <= v <= _INT64.max for v in items):
        return None
    if kind is str and any("\0" in v for v in items):
        return None
    return next((name for name, t in _ELEMENTS.items() if t is kind), None)


def _write_value(group: h5py.Group, name: str, value, path: str) -> None:
    if isinstance(value, dict):
        _write_dict(group.create_group(name), value, path)
    elif isinstance(value, (list, tuple)):
        _write_sequence(group, name, value, path)
    elif isinstance(value, torch.Tensor):
        _write_tensor(group, name, value, path)
    elif isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype.kind not in _NUMERIC:
            raise TypeError(f"{path}: numpy dtype {array.dtype} is not supported (bool, int, uint, float, complex)")
        _write_array(group, name, array, "ndarray" if isinstance(value, np.ndarray) else "npscalar")
    elif value is None:
        group.create_dataset(name, data=h5py.Empty("u1")).attrs["kind"] = "none"
    elif isinstance(value, (bool, float, complex)) or (isinstance(value, int) and _INT64.min <= value <= _INT64.max):
        kind = next(t for t in (bool, int, float, complex) if isinstance(value, t))
        _write_array(group, name, np.asarray(kind(value)), kind.__name__)
    elif isinstance(value, int):
        _write_str(group, name, str(value), "int")
    elif isinstance(value, str):
        if "\0" in value:
            _write_array(group, name, np.frombuffer(value.encode("utf-8"), np.uint8), "str")
        else:
            _write_str(group, name, value, "str")
    elif isinstance(value, bytes):
        _write_array(group, name, np.frombuffer(value, np.uint8), "bytes")
    else:
        raise TypeError(f"{path}: cannot store a value of type {type(value).__module__}.{type(value).__qualname__}")


def _write_sequence(group: h5py.Group, name: str, value, path: str) -> None:
    kind = "tuple" if isinstance(value, tuple) else "list"
    element = _homogeneous(value)
    if element is None:
        sub = group.create_group(name)
        sub.attrs["kind"] = kind
        sub.attrs["length"] = len(value)
        for i, item in enumerate(value):
            _write_value(sub, str(i), item, f"{path}[{i}]")
        return
    if element == "str":
        ds = group.create_dataset(name, data=np.array(value, dtype=object), dtype=_STR)
        ds.attrs["kind"] = kind
        ds.attrs["crc32"] = _crc(_str_bytes(value))
    else:
        ds = _write_array(group, name, np.asarray(value, dtype=np.int64 if element == "int" else None), kind)
    ds.attrs["element"] = element


def _write_tensor(group: h5py.Group, name: str, value: torch.Tensor, path: str) -> None:
    if value.layout != torch.strided:
        raise TypeError(f"{path}: only dense tensors can be stored, got layout {value.layout}")
    tensor = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
    try:
        array = tensor.numpy()
    except TypeError:  # no numpy dtype (bfloat16, float8, complex32): store the raw bits
        as_torch, as_numpy = _UNSIGNED[tensor.element_size()]
        array = tensor.view(as_torch).numpy().view(as_numpy)
    _write_array(group, name, array, "tensor").attrs["dtype"] = str(value.dtype)


def _chunks(array: np.ndarray) -> tuple | bool:
    """Chunks of whole leading-axis slices, about ``_CHUNK_BYTES`` each (h5py's guess if one slice is huge)."""
    row = array.itemsize * (array.size // array.shape[0])
    if row > _MAX_CHUNK_BYTES:
        return True
    return (min(array.shape[0], max(1, _CHUNK_BYTES // row)), *array.shape[1:])


def _write_array(group: h5py.Group, name: str, array: np.ndarray, kind: str) -> h5py.Dataset:
    """A dataset holding ``array``: fletcher32-chunked when non-empty and rank >= 1, else with a crc32."""
    if array.ndim >= 1 and array.size > 0:
        ds = group.create_dataset(name, data=array, chunks=_chunks(array), fletcher32=True)
    else:
        ds = group.create_dataset(name, data=array)
        ds.attrs["crc32"] = _crc(np.ascontiguousarray(array).tobytes())
    ds.attrs["kind"] = kind
    return ds


def _write_str(group: h5py.Group, name: str, text: str, kind: str) -> None:
    ds = group.create_dataset(name, data=text, dtype=_STR)
    ds.attrs["kind"] = kind
    ds.attrs["crc32"] = _crc(text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------- reading
class LazyTensor:
    """A tensor of a checkpoint file read only when asked for: whole, or a slice of its first axis.

    What :func:`read_tree` gives with ``lazy_bytes`` for a large tensor, so that a reader can fold many
    ranks' entries a slice at a time. Each read opens the file (HDF5 verifies the chunks' checksums)."""

    def __init__(self, filename: str, name: str, dtype: torch.dtype, shape: tuple, path: str):
        self.filename, self.name, self.dtype, self.shape, self.path = filename, name, dtype, tuple(shape), path

    def numel(self) -> int:
        """Its number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    def read(self, rows: slice | None = None) -> torch.Tensor:
        """The tensor (on the CPU), or its rows ``rows`` of the first axis; CheckpointError if corrupted."""
        try:
            with h5py.File(self.filename, "r") as f:
                obj = f[self.name]
                data = obj[()] if rows is None else obj[rows]
                return _decode(obj, "tensor", np.asarray(data), self.path, self.dtype)
        except OSError as exc:
            raise CheckpointError(f"{_where(self.path)} ({self.filename}:{self.name}) is corrupted: {exc}") from exc

    def __repr__(self) -> str:
        return f"LazyTensor({self.filename!r}, {self.name!r}, {self.dtype}, {self.shape})"


def read_tree(group: h5py.Group, lazy_bytes: int | None = None) -> dict:
    """Read back what :func:`write_tree` wrote; checksum failures raise :class:`CheckpointError`.

    ``lazy_bytes``: tensors of at least that many bytes come back as :class:`LazyTensor` (read later)."""
    return _read(group, "", lazy_bytes)


def _kind(obj, path: str) -> str:
    kind = obj.attrs.get("kind")
    if kind is None:
        raise CheckpointError(f"{_where(path)} ({obj.name}) has no 'kind' attribute: not written by mpicomm")
    return kind


def _read(obj, path: str, lazy_bytes: int | None = None):
    kind = _kind(obj, path)
    if isinstance(obj, h5py.Group):
        if kind == "dict":
            keys = json.loads(obj.attrs["keys"])
            return {key: _read(_child(obj, link_name(key), path), f"{path}[{key!r}]", lazy_bytes) for key in keys}
        items = [_read(_child(obj, str(i), path), f"{path}[{i}]", lazy_bytes)
                 for i in range(int(obj.attrs["length"]))]
        return tuple(items) if kind == "tuple" else items
    if kind == "tensor" and lazy_bytes is not None and obj.ndim >= 1 and obj.size * obj.dtype.itemsize >= lazy_bytes:
        return LazyTensor(obj.file.filename, obj.name, _torch_dtype(obj), obj.shape, path)
    try:
        data = obj[()]
    except OSError as exc:
        raise CheckpointError(f"{_where(path)} ({obj.name}) is corrupted: {exc}") from exc
    if kind == "none":
        return None
    if h5py.check_string_dtype(obj.dtype) is not None:
        return _decode_str(obj, kind, data, path)
    if "crc32" in obj.attrs:  # only datasets without fletcher32 (0-d, empty) carry one
        _verify(obj, np.ascontiguousarray(data).tobytes(), path)
    return _decode(obj, kind, np.asarray(data), path)


def _child(group: h5py.Group, name: str, path: str):
    try:
        return group[name]
    except KeyError as exc:
        raise CheckpointError(f"{_where(path)} ({group.name}) lacks its entry {name!r}") from exc


def _verify(obj, data: bytes, path: str) -> None:
    stored = obj.attrs.get("crc32")
    if stored is not None and int(stored) != _crc(data):
        raise CheckpointError(f"{_where(path)} ({obj.name}) is corrupted: crc32 mismatch")


def _decode_str(obj: h5py.Dataset, kind: str, data, path: str):
    raw = [data] if obj.ndim == 0 else list(data)
    _verify(obj, b"\0".join(raw), path)  # before decoding: a flipped byte may not even be UTF-8
    items = [v.decode("utf-8") for v in raw]
    if obj.ndim == 0:
        return int(items[0]) if kind == "int" else items[0]
    return tuple(items) if kind == "tuple" else items


def _torch_dtype(obj: h5py.Dataset) -> torch.dtype:
    """The torch dtype a tensor dataset was written from."""
    return getattr(torch, str(obj.attrs["dtype"]).removeprefix("torch."))


def _decode(obj: h5py.Dataset, kind: str, data: np.ndarray, path: str, dtype: torch.dtype | None = None):
    if kind == "tensor":
        dtype = _torch_dtype(obj) if dtype is None else dtype
        tensor = torch.from_numpy(data)
        return tensor if tensor.dtype == dtype else tensor.view(_UNSIGNED[data.dtype.itemsize][0]).view(dtype)
    if kind in ("list", "tuple"):
        items = [_ELEMENTS[obj.attrs["element"]](v) for v in data.tolist()]
        return tuple(items) if kind == "tuple" else items
    scalars = {"bool": bool, "int": int, "float": float, "complex": complex}
    if kind in scalars:
        return scalars[kind](data[()])
    decoders = {"ndarray": lambda: data, "npscalar": lambda: data[()], "bytes": data.tobytes,
                "str": lambda: data.tobytes().decode("utf-8")}
    if kind not in decoders:
        raise CheckpointError(f"{_where(path)} ({obj.name}) has unknown kind {kind!r}")
    return decoders[kind]()
