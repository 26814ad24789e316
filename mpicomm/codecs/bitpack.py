"""Pack b-bit unsigned integers (1 <= b <= 8) densely into bytes, and unpack them again.

Layout (identical, byte for byte, on every backend and device): the values form one little-endian bit
stream. Bit ``j`` (``j = 0`` the least significant) of value ``i`` is stream bit ``i*bits + j``, and
stream bit ``s`` is bit ``s % 8`` (LSB first) of byte ``s // 8`` -- numpy's ``bitorder="little"``. For
``bits`` in {1, 2, 4, 8} value ``i`` therefore sits in byte ``i*bits // 8`` at shift ``(i*bits) % 8``.
The padding bits of the last byte are zero. ``n`` values take ``packed_bytes(n, bits) =
ceil(n*bits/8)`` bytes.

Backends: ``"numpy"`` works on zero-copy numpy views of CPU tensors (``np.packbits``/``np.unpackbits``
for 1 bit, in-place ufuncs and byte lookup tables otherwise; single-threaded, so it is also what one MPI
rank per core wants); ``"torch"`` is pure torch and is what CUDA tensors use. ``"kernels"`` is numpy plus
the codecs' fused single-pass CPU kernels (:mod:`mpicomm.codecs.kernels`, compiled by numba), which the
codecs use where they have one, and which pack and unpack widths 1, 2, 4 and 8 here. ``"auto"`` (the
default) means kernels on a CPU and torch elsewhere. All give identical bytes; the module default can be
switched with ``use_backend("numpy")`` or ``use_backend("torch")`` so that tests compare the kernels with
the op-at-a-time paths they replace and exercise the device code path on a CPU.
Widths 3, 5, 6 and 7 go through 64-bit words: 8 values of ``b`` bits are ``b`` whole bytes, assembled
in a little-endian uint64 (the host and CUDA devices are little-endian).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import numpy as np
import torch

__all__ = [
    "BACKENDS",
    "kernels_enabled",
    "numpy_enabled",
    "pack",
    "packed_bytes",
    "unpack",
    "unpack_lookup",
    "use_backend",
]

BACKENDS = ("auto", "kernels", "numpy", "torch")
_default_backend = "auto"
_BYTE_CODES: dict = {}  # (bits, device, "numpy"|"torch") -> (256, 8 // bits) codes held by each byte value
# unpack_lookup moves the 8 // bits float32 values of one byte as whole 8- or 16-byte words (a 1-D gather of
# words is several times faster than a gather of short float rows); (word dtype, float32 values per word)
_WIDE_ROWS = {1: (torch.complex128, 4), 2: (torch.complex128, 4), 4: (torch.int64, 2)}

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("mpicomm.codecs.bitpack assumes a little-endian host")


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def _resolve_backend(backend: str | None, device: torch.device) -> str:
    backend = _default_backend if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if device.type != "cpu":
        return "torch"
    return "kernels" if backend == "auto" else backend


def numpy_enabled(device: torch.device, backend: str | None = None) -> bool:
    """Whether numpy fast paths may be used for tensors on ``device`` (CPU and backend not ``"torch"``)."""
    return _resolve_backend(backend, device) != "torch"


def kernels_enabled(device: torch.device, backend: str | None = None) -> bool:
    """Whether the fused CPU kernels of :mod:`mpicomm.codecs.kernels` are used for tensors on ``device``."""
    return _resolve_backend(backend, device) == "kernels"


def _byte_codes(bits: int, device: torch.device, kind: str):
    """The ``8 // bits`` codes stored in each of the 256 byte values, as a (256, 8 // bits) table."""
    key = (bits, device, kind)
    if key not in _BYTE_CODES:
        codes = (torch.arange(256)[:, None] >> torch.arange(0, 8, bits)) & ((1 << bits) - 1)
        _BYTE_CODES[key] = codes.to(torch.uint8).numpy() if kind == "numpy" else codes.to(device)
    return _BYTE_CODES[key]


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Context manager that sets the module default backend (one of :data:`BACKENDS`)."""
    global _default_backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    previous, _default_backend = _default_backend, backend
    try:
        yield
    finally:
        _default_backend = previous


def packed_bytes(n: int, bits: int) -> int:
    """Bytes that ``n`` values of ``bits`` bits take once packed: ``ceil(n*bits/8)``."""
    _check_bits(bits)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    return (n * bits + 7) // 8


def _check_uint8(t: torch.Tensor, who: str, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{who}: {what} must be a torch.uint8 tensor, got {got}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{who}: {what} must be a 1-D contiguous tensor, got shape {tuple(t.shape)}")


def _prepare_out(out: torch.Tensor | None, size: int, device: torch.device, who: str) -> torch.Tensor:
    if out is None:
        return torch.empty(size, dtype=torch.uint8, device=device)
    _check_uint8(out, who, "out")
    if out.numel() != size or out.device != device:
        raise ValueError(f"{who}: out must hold {size} bytes on {device}, got {out.numel()} on {out.device}")
    return out


def pack(
    values: torch.Tensor,
    bits: int,
    *,
    out: torch.Tensor | None = None,
    check: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of values < 2**bits into ``packed_bytes(n, bits)`` bytes (into ``out``)."""
    _check_bits(bits)
    _check_uint8(values, "pack", "values")
    n = values.numel()
    out = _prepare_out(out, packed_bytes(n, bits), values.device, "pack")
    if check and bits < 8 and n and int(values.max()) >= 1 << bits:
        raise ValueError(f"pack: values must be < 2**bits = {1 << bits}, got max {int(values.max())}")
    if kernels_enabled(values.device, backend) and 8 % bits == 0:
        from .kernels import packing

        packing.pack(values.numpy(), bits, out.numpy())
    elif numpy_enabled(values.device, backend):
        _pack_numpy(values.numpy(), bits, out.numpy())
    else:
        _pack_torch(values, bits, out)
    return out


def unpack(
    packed: torch.Tensor,
    bits: int,
    n: int,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Unpack ``n`` values of ``bits`` bits from ``packed`` into a uint8 tensor (into ``out``)."""
    size = packed_bytes(n, bits)
    _check_uint8(packed, "unpack", "packed")
    if packed.numel() != size:
        raise ValueError(f"unpack: packed must hold packed_bytes({n}, {bits}) = {size} bytes, got {packed.numel()}")
    out = _prepare_out(out, n, packed.device, "unpack")
    if kernels_enabled(packed.device, backend) and 8 % bits == 0:
        from .kernels import packing

        packing.unpack(packed.numpy(), bits, out.numpy())
    elif numpy_enabled(packed.device, backend):
        _unpack_numpy(packed.numpy(), bits, n, out.numpy())
    else:
        _unpack_torch(packed, bits, n, out)
    return out


def unpack_lookup(packed: torch.Tensor, bits: int, n: int, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``table[code_i]`` for the ``n`` codes in ``packed`` into the float32 tensor ``out``.

    ``table`` holds ``2**bits`` float32 values on ``packed``'s device. For 1, 2 and 4 bits each byte is
    expanded through a (256, 8 // bits) table in one gather (an int32 temporary of one index per byte),
    moving each byte's floats as 8- or 16-byte words when ``out`` is aligned for it (bytes are copied,
    never computed on, so the result is the same); other widths unpack first. Pure torch, so identical
    on every device.
    """
    size = packed_bytes(n, bits)
    _check_uint8(packed, "unpack_lookup", "packed")
    if packed.numel() != size:
        raise ValueError(f"unpack_lookup: packed must hold {size} bytes, got {packed.numel()}")
    dev = packed.device
    if table.shape != (1 << bits,) or table.dtype != torch.float32 or table.device != dev:
        raise ValueError(f"unpack_lookup: table must be float32 of shape ({1 << bits},) on {dev}")
    if out.shape != (n,) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"unpack_lookup: out must be a contiguous float32 tensor of {n} elements on {dev}")
    if 8 % bits == 0 and bits < 8:
        per = 8 // bits
        full = n // per
        byte_table = table[_byte_codes(bits, dev, "torch")]
        index = torch.empty(full, dtype=torch.int32, device=dev).copy_(packed[:full])
        head = out[: full * per].view(full, per)
        wide, ratio = _WIDE_ROWS[bits]
        if head.storage_offset() % ratio == 0:  # a byte's floats gathered as whole wider words
            rows = byte_table.view(wide)
            dst = head.view(wide)
            if rows.shape[1] == 1:
                rows, dst = rows.view(-1), dst.view(-1)
            torch.index_select(rows, 0, index, out=dst)
        else:
            torch.index_select(byte_table, 0, index, out=head)
        if full * per < n:
            out[full * per :].copy_(byte_table[packed[full].long()][: n - full * per])
    else:
        codes = unpack(packed, bits, n)
        torch.index_select(table, 0, codes.to(torch.int32), out=out)
    return out


# ---- numpy backend ---------------------------------------------------------------------------------


def _pack_numpy(v: np.ndarray, bits: int, o: np.ndarray) -> None:
    n = v.shape[0]
    if bits == 8:
        o[:] = v
    elif bits == 1:
        o[:] = np.packbits(v, bitorder="little")
    elif 8 % bits == 0:
        # The values of one output byte, read as one little-endian word, fold together with shifts
        # (4 bits: w | w >> 4; 2 bits: t = w | w >> 6, then t | t >> 12); the low byte is the result.
        per = 8 // bits
        full = n // per
        w = v[: full * per].view(np.uint16 if bits == 4 else np.uint32)
        t = np.right_shift(w, 8 - bits)
        np.bitwise_or(t, w, out=t)
        if bits == 2:
            np.bitwise_or(t, np.right_shift(t, 12), out=t)
        np.copyto(o[:full], t, casting="unsafe")  # unsigned narrowing keeps the low byte
        if full * per < n:
            shifts = np.arange(0, (n - full * per) * bits, bits, dtype=np.uint8)
            o[full] = np.bitwise_or.reduce(np.left_shift(v[full * per :], shifts))
    else:
        groups = -(-n // 8)
        a = np.zeros((groups, 8), dtype=np.uint8)
        a.reshape(-1)[:n] = v
        words = a[:, 0].astype(np.uint64)
        for j in range(1, 8):
            np.bitwise_or(words, np.left_shift(a[:, j].astype(np.uint64), np.uint64(j * bits)), out=words)
        o[:] = words.view(np.uint8).reshape(groups, 8)[:, :bits].reshape(-1)[: o.shape[0]]


def _unpack_numpy(p: np.ndarray, bits: int, n: int, o: np.ndarray) -> None:
    if bits == 8:
        o[:] = p
    elif bits == 1:
        o[:] = np.unpackbits(p, count=n, bitorder="little")
    elif 8 % bits == 0:
        per, table = 8 // bits, _byte_codes(bits, torch.device("cpu"), "numpy")
        full = n // per
        np.take(table, p[:full], axis=0, out=o[: full * per].reshape(full, per))
        if full * per < n:
            o[full * per :] = table[p[full]][: n - full * per]
    else:
        groups, mask = -(-n // 8), np.uint64((1 << bits) - 1)
        b = np.zeros((groups, 8), dtype=np.uint8)
        padded = np.zeros(groups * bits, dtype=np.uint8)
        padded[: p.shape[0]] = p
        b[:, :bits] = padded.reshape(groups, bits)
        words = b.view(np.uint64).reshape(groups)
        vals = np.empty((groups, 8), dtype=np.uint8)
        for j in range(8):
            np.copyto(vals[:, j], np.bitwise_and(np.right_shift(words, np.uint64(j * bits)), mask), casting="unsafe")
        o[:] = vals.reshape(-1)[:n]


# ---- torch backend ---------------------------------------------------------------------------------


def _pack_torch(v: torch.Tensor, bits: int, o: torch.Tensor) -> None:
    n = v.numel()
    if bits == 8:
        o.copy_(v)
    elif 8 % bits == 0:
        per = 8 // bits
        full = n // per
        a, of = v[: full * per].view(full, per), o[:full]
        of.copy_(a[:, 0])
        for j in range(1, per):
            of.bitwise_or_(a[:, j] << (j * bits))
        rem = n - full * per
        if rem:
            shifts = torch.arange(0, rem * bits, bits, dtype=torch.uint8, device=v.device)
            o[full:].copy_((v[full * per :] << shifts).sum(dtype=torch.uint8))
    else:
        groups = -(-n // 8)
        a = torch.zeros((groups, 8), dtype=torch.uint8, device=v.device)
        a.view(-1)[:n].copy_(v)
        words = torch.empty(groups, dtype=torch.int64, device=v.device).copy_(a[:, 0])
        for j in range(1, 8):
            words.bitwise_or_(a[:, j].to(torch.int64) << (j * bits))
        o.copy_(words.view(torch.uint8).view(groups, 8)[:, :bits].reshape(-1)[: o.numel()])


def _unpack_torch(p: torch.Tensor, bits: int, n: int, o: torch.Tensor) -> None:
    if bits == 8:
        o.copy_(p)
    elif 8 % bits == 0:
        per, mask = 8 // bits, (1 << bits) - 1
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)
        full = n // per
        o2 = o[: full * per].view(full, per)
        torch.bitwise_right_shift(p[:full, None], shifts, out=o2)
        o2.bitwise_and_(mask)
        if full * per < n:
            o[full * per :].copy_(((p[full] >> shifts) & mask)[: n - full * per])
    else:
        groups, mask = -(-n // 8), (1 << bits) - 1
        b = torch.zeros((groups, 8), dtype=torch.uint8, device=p.device)
        padded = torch.zeros(groups * bits, dtype=torch.uint8, device=p.device)
        padded[: p.numel()].copy_(p)
        b[:, :bits].copy_(padded.view(groups, bits))
        words = b.view(torch.int64).view(groups)
        vals = torch.empty((groups, 8), dtype=torch.uint8, device=p.device)
        for j in range(8):
            vals[:, j].copy_((words >> (j * bits)) & mask)
        o.copy_(vals.view(-1)[:n])
