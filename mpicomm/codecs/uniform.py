"""b-bit uniform (min-max) quantizer with nearest or stochastic rounding.

With L = 2**bits - 1 and step = (hi - lo) / L, the grid is lo + k*step for k = 0..L (both ends
included). An element is clamped to [lo, hi], mapped to y = (x - lo)/step and coded as

    nearest:     k = floor(y + 1/2)           |x - x_hat| <= step/2 = (hi - lo) / (2L)
    stochastic:  k = floor(y + u), u ~ U(0,1)  E[x_hat] = x for x in [lo, hi] (unbiased)

then packed at ``bits`` bits per element. With ``lo``/``hi`` left as None the tensor's own min and
max are used and written first in the payload as two float32 (an 8-byte header), so the payload is
``8*[lo is None] + ceil(n*bits/8)`` bytes.

u has 16-bit resolution (see ``_rng``), so the stochastic mean is exact to within 2**-17 of a step.
Inputs of other float dtypes are quantized from their float32 values; non-finite inputs are not checked.
The maths runs in float32 on chunk-sized buffers: the nearest-rounding bound holds up to float32
rounding of (x - lo)/step and lo + k*step, i.e. a few ulps of max(|lo|, |hi|).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import bitpack, kernels
from ._layout import (
    check_numel,
    chunk_elems,
    chunk_ranges,
    decoded_chunks,
    f32_chunk,
    prepare_out,
    read_field,
    store_codes,
    write_field,
)
from ._rng import SeededGenerator, uniforms_from_draws
from .base import Codec, check_flat_float, check_payload

__all__ = ["ROUNDINGS", "UniformCodec"]

ROUNDINGS = ("nearest", "stochastic")


class UniformCodec(Codec):
    """``bits``-bit uniform quantizer on [lo, hi] (per-tensor min/max header when they are None)."""

    name = "uniform"

    def __init__(
        self,
        bits: int,
        lo: float | None = None,
        hi: float | None = None,
        rounding: str = "nearest",
        seed: int = 0,
    ):
        bitpack.packed_bytes(0, bits)  # validates bits
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if (lo is None) != (hi is None):
            raise ValueError("lo and hi must both be given or both be None")
        if lo is not None:
            lo, hi = float(lo), float(hi)
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ValueError(f"need finite lo < hi, got lo={lo}, hi={hi}")
        self.bits, self.lo, self.hi, self.rounding = bits, lo, hi, rounding
        self.levels = (1 << bits) - 1
        self._header = 8 if lo is None else 0
        self._rng = SeededGenerator(seed) if rounding == "stochastic" else None

    def payload_bytes(self, numel: int) -> int:
        """``8`` header bytes (when lo/hi are per tensor) plus ``ceil(numel*bits/8)``."""
        return self._header + bitpack.packed_bytes(check_numel(numel, "UniformCodec.payload_bytes"), self.bits)

    def _range(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) as float64 scalars on the payload's device: no host round trip for the header."""
        if self._header:
            lo, hi = read_field(payload, 0, 2, torch.float32).double().unbind()
            return lo, hi
        bounds = torch.tensor([self.lo, self.hi], dtype=torch.float64, device=payload.device)
        return bounds[0], bounds[1]

    def draw_segments(self, counts: list[int], device: torch.device) -> torch.Tensor:
        """The draws (int16, one per element) that encoding pieces of ``counts`` elements in turn would take from the
        stochastic rounding generator, taken now in the same calls; pass slices of them to :meth:`encode` or
        :meth:`encode_segments` as ``draws`` to encode the pieces later, in any order, with the same codes."""
        if self._rng is None:
            raise ValueError("draw_segments: only stochastic rounding draws")
        out = torch.empty(int(sum(counts)), dtype=torch.int16, device=device)
        at, step = 0, chunk_elems(device)
        for count in counts:
            for start, stop in chunk_ranges(count, step):
                out[at + start:at + stop].copy_(self._rng.draw16(stop - start, device))
            at += count
        return out

    def encode(self, x: torch.Tensor, draws: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize ``x`` to ``bits``-bit grid indices, packed after the optional [lo, hi] header.

        ``draws``: stochastic rounding only, ``x.numel()`` values from :meth:`draw_segments` to round with
        instead of drawing from the generator."""
        check_flat_float(x, "UniformCodec.encode")
        x, n, bits = x.detach(), x.numel(), self.bits
        if draws is not None and (self._rng is None or draws.shape != (n,)):
            raise ValueError(f"UniformCodec.encode: draws need stochastic rounding and shape ({n},), got "
                             f"{tuple(draws.shape)} with rounding {self.rounding!r}")
        payload = torch.empty(self.payload_bytes(n), dtype=torch.uint8, device=x.device)
        if self._header:
            bounds = torch.stack(torch.aminmax(x)).float() if n else torch.zeros(2, device=x.device)
            write_field(payload, 0, bounds)
        lo, hi = self._range(payload)
        # levels / (hi - lo) in float64, then float32: what a Python scalar gives, kept on the device
        scale = torch.where(hi > lo, self.levels / (hi - lo), 0.0).float()
        lo = lo.float()
        rng = self._rng
        body = payload[self._header :]
        step = chunk_elems(x.device)
        kernel = bitpack.kernels_enabled(x.device) and bits in kernels.WIDTHS
        # a float32 chunk buffer: the kernels need it only to convert a half-precision input, the torch path always
        y = torch.empty(min(step, n) if not kernel or x.dtype != torch.float32 else 0, dtype=torch.float32,
                        device=x.device)
        if kernel:
            from .kernels import uniform as kuniform
            args = (np.float32(lo.item()), np.float32(scale.item()), np.float32(self.levels), bits)
        else:
            u = torch.empty_like(y) if rng is not None else None
            codes = torch.empty(y.numel(), dtype=torch.uint8, device=x.device)
        for start, stop in chunk_ranges(n, step):
            m = stop - start
            out = body[start * bits // 8 : start * bits // 8 + bitpack.packed_bytes(m, bits)]
            if kernel:
                xc = f32_chunk(x[start:stop], y[:m]).numpy()
                if rng is None:
                    kuniform.encode_nearest(xc, *args, out.numpy())
                else:
                    drawn = rng.draw16(m, x.device) if draws is None else draws[start:stop]
                    kuniform.encode_stochastic(xc, drawn.numpy(), *args, out.numpy())
                continue
            yc, cc = y[:m], codes[:m]
            torch.sub(f32_chunk(x[start:stop], yc), lo, out=yc)
            yc.mul_(scale)
            if rng is None:
                yc.add_(0.5)
            elif draws is None:
                yc.add_(rng.uniform_(u[:m]))
            else:
                yc.add_(uniforms_from_draws(draws[start:stop], u[:m]))
            yc.clamp_(0.0, self.levels)
            store_codes(cc, yc, bits)  # truncation == floor on non-negative values
            bitpack.pack(cc, bits, out=out, check=False)
        return payload

    def encode_segments(self, x: torch.Tensor, counts: list[int], payload: torch.Tensor, at: list[int],
                        draws: torch.Tensor | None = None) -> None:
        """Encode each of the consecutive pieces of ``counts`` elements of the float32 CPU tensor ``x`` into
        ``payload`` from byte ``at[i]`` (``payload_bytes(counts[i])`` bytes each): bit for bit ``encode`` of
        every piece in turn, the generator drawn piece by piece as those calls draw it, in one kernel call
        (``draws``: the pieces' draws from :meth:`draw_segments`, taken earlier).

        For stochastic rounding with a per-tensor range, pieces of at most one chunk, on the ``kernels``
        backend (HSQ's per-layer norms, any width); anything else, or a piece holding a NaN, encodes piece by
        piece.
        """
        starts = np.cumsum([0, *counts])
        fused = (bitpack.kernels_enabled(x.device) and self._rng is not None and self._header
                 and x.dtype == torch.float32 and all(counts)
                 and max(counts, default=0) <= chunk_elems(x.device))
        if fused:
            values, first = x.numpy(), starts[:-1]
            bounds = np.stack([np.minimum.reduceat(values, first), np.maximum.reduceat(values, first)], axis=1)
            fused = not np.isnan(bounds).any()  # a NaN header carries the input NaN's bits: torch's aminmax keeps them
        if not fused:
            for a, b, pos in zip(starts[:-1], starts[1:], at):
                piece = None if draws is None else draws[a:b]
                payload[pos:pos + self.payload_bytes(int(b - a))].copy_(self.encode(x[a:b], draws=piece))
            return
        from .kernels import uniform as kuniform

        raw = payload.numpy()
        for head, pos in zip(bounds, at):  # the [lo, hi] headers, float32 at byte offsets
            raw[pos:pos + 8] = head.view(np.uint8)
        lo, hi = bounds[:, 0].astype(np.float64), bounds[:, 1].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(hi > lo, self.levels / (hi - lo), 0.0).astype(np.float32)  # as in encode: float64
        if draws is None:
            draws = self.draw_segments(counts, x.device)
        kuniform.encode_stochastic_segments(values, draws.numpy(), starts, bounds[:, 0].copy(), scale,
                                            np.float32(self.levels), self.bits, np.asarray(at, dtype=np.int64) + 8, raw)

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``lo + k*step`` for every packed index ``k``."""
        check_payload(payload, self.payload_bytes(numel), "UniformCodec.decode")
        out = prepare_out(out, numel, payload.device, "UniformCodec.decode")
        lo, hi = self._range(payload)
        delta, lo = ((hi - lo) / self.levels).float(), lo.float()
        body, bits, dev = payload[self._header :], self.bits, payload.device
        step = chunk_elems(dev)
        if bitpack.kernels_enabled(dev) and bits in kernels.WIDTHS:
            from .kernels import uniform as kuniform
            kuniform.decode(body.numpy(), np.float32(lo.item()), np.float32(delta.item()), bits, out.numpy())
            return out
        table = None
        if bits in (1, 2, 4):  # one gather per byte beats unpack + convert + affine
            table = torch.arange(self.levels + 1, dtype=torch.float32, device=dev).mul_(delta).add_(lo)
        for _, chunk in decoded_chunks(body, bits, numel, out, step, table, torch.Tensor.copy_):
            if table is None:  # the codes k were written: lo + k*step
                chunk.mul_(delta).add_(lo)
        return out

    def __repr__(self) -> str:
        return f"UniformCodec(bits={self.bits}, lo={self.lo}, hi={self.hi}, rounding={self.rounding!r})"
