"""Identity codec: the payload is the raw bytes of ``x.to(dtype)`` (float32, float16 or bfloat16).

float32 is lossless (a bit-exact round trip), which is how every compressed algorithm is checked
against its full-precision baseline; float16/bfloat16 halve the traffic with plain rounding.
"""

from __future__ import annotations

import torch

from ._layout import check_numel, prepare_out, read_field
from .base import Codec, check_flat_float, check_payload

__all__ = ["IdentityCodec"]

_NAMES = {torch.float32: "identity", torch.float16: "fp16", torch.bfloat16: "bf16"}


class IdentityCodec(Codec):
    """Send ``x`` as ``dtype`` bytes: 4 (float32) or 2 (float16, bfloat16) bytes per element."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        if dtype not in _NAMES:
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype
        self.name = _NAMES[dtype]
        self.lossless = dtype == torch.float32
        self._itemsize = torch.empty((), dtype=dtype).element_size()

    def payload_bytes(self, numel: int) -> int:
        """``numel`` times the item size of ``dtype``."""
        return check_numel(numel, "IdentityCodec.payload_bytes") * self._itemsize

    def split_alignment(self) -> int:
        """1: every element is encoded alone."""
        return 1

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """A fresh copy of ``x`` as ``dtype``, viewed as bytes (never aliases ``x``)."""
        check_flat_float(x, "IdentityCodec.encode")
        buf = torch.empty(x.numel(), dtype=self.dtype, device=x.device)
        buf.copy_(x.detach())
        return buf.view(torch.uint8)

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 values stored in ``payload``."""
        check_payload(payload, self.payload_bytes(numel), "IdentityCodec.decode")
        out = prepare_out(out, numel, payload.device, "IdentityCodec.decode")
        out.copy_(read_field(payload, 0, numel, self.dtype))
        return out

    def __repr__(self) -> str:
        return f"IdentityCodec(dtype={self.dtype})"
