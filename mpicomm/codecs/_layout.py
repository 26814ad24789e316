"""Shared plumbing for the codecs: typed header fields inside a uint8 payload, output checks, chunking.

Codecs stream through their input in chunks of ``chunk_elems(device)`` elements so that every
temporary is chunk-sized (a few MiB, cache resident on a CPU) instead of model-sized.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from . import bitpack

__all__ = [
    "CHUNK_CPU",
    "CHUNK_DEVICE",
    "check_numel",
    "chunk_elems",
    "chunk_ranges",
    "decoded_chunks",
    "f32_chunk",
    "prepare_out",
    "read_field",
    "store_codes",
    "write_field",
]

CHUNK_CPU = 1 << 18
"""Elements per chunk on a CPU: 1 MiB of float32 temporaries stays in a core's L2 cache."""
CHUNK_DEVICE = 1 << 22
"""Elements per chunk on an accelerator: large enough that kernel launches do not dominate."""


def check_numel(numel: int, who: str) -> int:
    """Return ``numel`` after checking it is a non-negative int."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"{who}: numel must be a non-negative int, got {numel!r}")
    return numel


def chunk_elems(device: torch.device, multiple: int = 8) -> int:
    """Chunk length for ``device``, rounded down to a multiple of ``multiple`` (at least ``multiple``)."""
    base = CHUNK_CPU if device.type == "cpu" else CHUNK_DEVICE
    return max(multiple, base // multiple * multiple)


def chunk_ranges(n: int, step: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, stop)`` covering ``range(n)`` in steps of ``step``."""
    for start in range(0, n, step):
        yield start, min(n, start + step)


def decoded_chunks(body: torch.Tensor, bits: int, numel: int, out: torch.Tensor, step: int,
                   table: torch.Tensor | None, convert=None) -> Iterator[tuple[int, torch.Tensor]]:
    """Decode the ``numel`` packed ``bits``-bit codes of ``body`` into the float32 ``out``, ``step`` elements
    at a time, yielding each chunk's start and its slice of ``out`` once written.

    With a ``table`` (the value of every code) one gather per byte writes the values; otherwise the codes
    are unpacked into a uint8 buffer and ``convert(chunk, codes)`` writes their values into the chunk.
    """
    codes = None if table is not None else torch.empty(min(step, numel), dtype=torch.uint8, device=body.device)
    for start, stop in chunk_ranges(numel, step):
        m = stop - start
        chunk = out[start:stop]
        packed = body[start * bits // 8 : start * bits // 8 + bitpack.packed_bytes(m, bits)]
        if table is not None:
            bitpack.unpack_lookup(packed, bits, m, table, chunk)
        else:
            convert(chunk, bitpack.unpack(packed, bits, m, out=codes[:m]))
        yield start, chunk


def f32_chunk(src: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``src`` itself when float32, else ``src`` copied into the float32 buffer ``buf`` (so maths runs in fp32)."""
    return src if src.dtype == torch.float32 else buf.copy_(src)


def store_codes(codes: torch.Tensor, y: torch.Tensor, bits: int) -> None:
    """Copy integer-valued floats ``y`` in [0, 2**bits) into the uint8 ``codes``.

    Below 8 bits the values fit int8, whose float conversion is several times faster than uint8's on a CPU.
    """
    (codes.view(torch.int8) if bits < 8 else codes).copy_(y)


def read_field(payload: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` values of ``dtype`` stored at byte ``offset`` of ``payload`` (a view when aligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = payload[offset : offset + count * size]
    if (raw.storage_offset() % size) != 0:
        raw = raw.clone()
    return raw.view(dtype)


def write_field(payload: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """Store the bytes of the contiguous tensor ``values`` at byte ``offset`` of ``payload``."""
    raw = values.contiguous().reshape(-1).view(torch.uint8)
    payload[offset : offset + raw.numel()].copy_(raw)


def prepare_out(out: torch.Tensor | None, numel: int, device: torch.device, who: str) -> torch.Tensor:
    """Return ``out`` after checking it is a flat float32 tensor of ``numel`` on ``device``, else a new one."""
    if out is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"{who}: out must be a float32 tensor, got {got}")
    if out.dim() != 1 or out.numel() != numel or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"{who}: out must be a contiguous 1-D tensor of {numel} elements on {device}, "
            f"got shape {tuple(out.shape)} on {out.device}"
        )
    return out
