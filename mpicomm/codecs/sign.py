"""1-bit sign compression with an optional scale: the project's single copy of sign maths.

    C(x) = s * sign(x),  sign(0) = +1 (also for -0.0),  one bit per element (1 = +, 0 = -)

    scale="l2":   s = ||x||_2 / sqrt(n)   APMSqueeze / 1-bit Adam (Tang et al. 2020; Tang et al. 2021)
    scale="l1":   s = ||x||_1 / n         EF-SignSGD (Karimireddy et al., ICML 2019)
    scale="none": s = 1, no header        SignSGD with majority vote (Bernstein et al., ICML 2018)

Payload: the scale as one float32 (absent for "none"), then ceil(n/8) bytes of sign bits in the
``bitpack`` layout. For n = 0 the scale is written as 0. The scale is combined from per-chunk norms
taken while each chunk is in cache, so its last bit may depend on the chunk size (i.e. the device);
float64 inputs are converted to float32 first.
"""

from __future__ import annotations

import numpy as np
import torch

from . import bitpack
from ._layout import check_numel, chunk_elems, chunk_ranges, prepare_out, read_field, write_field
from .base import Codec, check_flat_float, check_payload

__all__ = ["SCALES", "SignCodec"]

SCALES = ("l2", "l1", "none")


class SignCodec(Codec):
    """Sign bits times one scale (``"l2"``: RMS, ``"l1"``: mean absolute value, ``"none"``: +-1)."""

    name = "sign"

    def __init__(self, scale: str = "l2"):
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
        self.scale = scale
        self._header = 0 if scale == "none" else 4

    def payload_bytes(self, numel: int) -> int:
        """``4`` scale bytes (unless scale="none") plus ``ceil(numel/8)``."""
        return self._header + bitpack.packed_bytes(check_numel(numel, "SignCodec.payload_bytes"), 1)

    def split_alignment(self) -> int | None:
        """1 for scale="none" (elementwise signs); None otherwise (one scale over the whole tensor)."""
        return 1 if self.scale == "none" else None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Scale header (if any) followed by the packed bits of ``x >= 0``."""
        check_flat_float(x, "SignCodec.encode")
        x, n, dev = x.detach(), x.numel(), x.device
        if x.element_size() > 4:  # float64: work on its float32 values, as for every other codec
            x = x.float()
        payload = torch.empty(self.payload_bytes(n), dtype=torch.uint8, device=dev)
        body = payload[self._header :]
        step = chunk_elems(dev)
        order = {"l2": 2, "l1": 1}.get(self.scale)
        # per-chunk norms, taken while the chunk is in cache, combined after the loop
        partial = torch.zeros(-(-n // step), dtype=torch.float32, device=dev)
        mask = torch.empty(min(step, n), dtype=torch.bool, device=dev)
        fast = bitpack.numpy_enabled(dev) and x.dtype == torch.float32
        xn, mn = (x.numpy(), mask.numpy()) if fast else (None, None)
        for i, (start, stop) in enumerate(chunk_ranges(n, step)):
            m = stop - start
            if fast:  # numpy's SIMD comparison is ~4x faster than torch.ge on a CPU
                np.greater_equal(xn[start:stop], 0.0, out=mn[:m])
            else:
                torch.ge(x[start:stop], 0, out=mask[:m])
            if order is not None:
                torch.linalg.vector_norm(x[start:stop], order, dtype=torch.float32, out=partial[i])
            packed = body[start // 8 : start // 8 + (m + 7) // 8]
            bitpack.pack(mask[:m].view(torch.uint8), 1, out=packed, check=False)
        if order == 2:  # ||x||_2 / sqrt(n)
            write_field(payload, 0, (torch.linalg.vector_norm(partial) / max(n, 1) ** 0.5).reshape(1))
        elif order == 1:  # ||x||_1 / n
            write_field(payload, 0, (partial.sum() / max(n, 1)).reshape(1))
        return payload

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``+s`` where the bit is set, ``-s`` where it is clear."""
        check_payload(payload, self.payload_bytes(numel), "SignCodec.decode")
        out = prepare_out(out, numel, payload.device, "SignCodec.decode")
        dev = payload.device
        s = read_field(payload, 0, 1, torch.float32) if self._header else torch.ones(1, device=dev)
        table = torch.cat([-s, s])  # bit 0 -> -s, bit 1 -> +s
        body = payload[self._header :]
        step = chunk_elems(dev)
        for start, stop in chunk_ranges(numel, step):
            m = stop - start
            bitpack.unpack_lookup(body[start // 8 : start // 8 + (m + 7) // 8], 1, m, table, out[start:stop])
        return out

    def __repr__(self) -> str:
        return f"SignCodec(scale={self.scale!r})"
