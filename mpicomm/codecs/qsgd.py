"""QSGD (Alistarh et al., NeurIPS 2017) and TernGrad (Wen et al., NeurIPS 2017): unbiased stochastic
quantization with a max-norm scale per bucket.

For a bucket v with scale m = max|v| and s = 2**(bits-1) - 1 magnitude levels:

    q_i = floor(v_i * s/m + u_i),  u_i ~ U(0,1)    (stochastic rounding: E[q_i] = v_i * s/m)
    decode: v_hat_i = q_i * m / s                   (unbiased; a zero bucket decodes to exactly 0)

so q_i is an integer in [-s, s]: one sign and bits-1 magnitude bits, stored as a ``bits``-bit two's
complement code (u has 16-bit resolution, see ``_rng``: E[q_i] is exact to within 2**-17). TernGrad is
bits=2 with one bucket: q in {-1, 0, +1}, P(|q_i| = 1) = |v_i|/max|v|.

Payload: one float32 scale per bucket (ceil(n/bucket_size) of them; one for bucket_size=None; none for
n = 0), then ceil(n*bits/8) bytes of codes in the ``bitpack`` layout.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import bitpack, kernels
from ._layout import check_numel, chunk_elems, chunk_ranges, decoded_chunks, prepare_out, read_field, write_field
from ._rng import SeededGenerator
from .base import Codec, check_flat_float, check_payload

__all__ = ["QSGDCodec", "TernGradCodec"]


class QSGDCodec(Codec):
    """QSGD with ``bits`` bits per element (1 sign + bits-1 magnitude) and a scale per bucket."""

    name = "qsgd"

    def __init__(self, bits: int, bucket_size: int | None = 512, seed: int = 0):
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
            raise ValueError(f"bits must be an int in 2..8 (1 sign bit + magnitude bits), got {bits!r}")
        if bucket_size is not None and (
            isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1
        ):
            raise ValueError(f"bucket_size must be a positive int or None, got {bucket_size!r}")
        self.bits, self.bucket_size = bits, bucket_size
        self.s = (1 << (bits - 1)) - 1
        self._rng = SeededGenerator(seed)

    def num_buckets(self, numel: int) -> int:
        """Number of buckets (= float32 scales in the header) for ``numel`` elements."""
        if numel == 0:
            return 0
        return 1 if self.bucket_size is None else -(-numel // self.bucket_size)

    def payload_bytes(self, numel: int) -> int:
        """``4*num_buckets(numel) + ceil(numel*bits/8)``."""
        numel = check_numel(numel, "QSGDCodec.payload_bytes")
        return 4 * self.num_buckets(numel) + bitpack.packed_bytes(numel, self.bits)

    def _chunk(self, device: torch.device) -> int:
        b = self.bucket_size
        return chunk_elems(device) if b is None else chunk_elems(device, b * 8 // math.gcd(b, 8))

    def _bucket_rows(self, t: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
        """Split a chunk (starting on a bucket boundary) into a (rows, bucket) view and a tail row."""
        b, m = self.bucket_size, t.numel()
        if b is None:
            return [(t.view(1, m), slice(0, 1))]
        full = m // b
        parts = [(t[: full * b].view(full, b), slice(0, full))] if full else []
        if full * b < m:
            parts.append((t[full * b :].view(1, m - full * b), slice(full, full + 1)))
        return parts

    def split_alignment(self) -> int | None:
        """``bucket_size``: each bucket has its own scale (None for one scale over the whole tensor)."""
        return self.bucket_size

    def draw_uniforms(self, numel: int, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``numel`` uniforms ``encode`` of a ``numel``-element tensor on ``device`` would draw, drawn now.

        The generator advances exactly as that encode's would (same chunks, same calls), so encoding
        pieces ``x[lo:hi]`` with ``uniforms=u[lo:hi]``, in any order, gives the codes the single encode
        would give.
        """
        out = prepare_out(out, check_numel(numel, "QSGDCodec.draw_uniforms"), device, "QSGDCodec.draw_uniforms")
        for start, stop in chunk_ranges(numel, self._chunk(device)):
            self._rng.uniform_(out[start:stop])
        return out

    def encode(self, x: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """Per-bucket scales followed by the packed two's-complement codes of q.

        ``uniforms``: x.numel() values from :meth:`draw_uniforms` to round with instead of drawing.
        """
        check_flat_float(x, "QSGDCodec.encode")
        if uniforms is not None and uniforms.shape != x.shape:
            raise ValueError(f"QSGDCodec.encode: uniforms must have shape {tuple(x.shape)}, "
                             f"got {tuple(uniforms.shape)}")
        x, n, bits, dev = x.detach(), x.numel(), self.bits, x.device
        nb = self.num_buckets(n)
        payload = torch.empty(self.payload_bytes(n), dtype=torch.uint8, device=dev)
        body = payload[4 * nb :]
        if self.bucket_size is None and n:
            lo, hi = torch.aminmax(x)
            write_field(payload, 0, torch.maximum(-lo, hi).float().reshape(1))
            whole = read_field(payload, 0, 1, torch.float32).item()
            inv_whole = self.s / whole if whole > 0 else 0.0
        step, kernel = self._chunk(dev), self._kernel(dev)
        x32 = torch.empty(min(step, n), dtype=torch.float32, device=dev) if x.dtype != torch.float32 else None
        if kernel is None:  # the torch path's working buffers
            y = torch.empty(min(step, n), dtype=torch.float32, device=dev)
            q = torch.empty(y.numel(), dtype=torch.int8, device=dev)
        for start, stop in chunk_ranges(n, step):
            m = stop - start
            xc = x[start:stop] if x32 is None else x32[:m].copy_(x[start:stop])
            if kernel is not None:
                out = body[start * bits // 8 : start * bits // 8 + bitpack.packed_bytes(m, bits)].numpy()
                if self.bucket_size is None:
                    bucket, invs = m, np.full(1, inv_whole, np.float32)
                else:
                    first, bucket = start // self.bucket_size, self.bucket_size
                    # a view into the fresh payload's header (4-byte aligned): the kernel writes the scales there
                    scales = read_field(payload, 4 * first, -(-m // bucket), torch.float32).numpy()
                    invs = np.empty(scales.size, np.float32)
                    kernel.bucket_scales(xc.numpy(), bucket, np.float32(self.s), scales, invs)
                if uniforms is None:
                    kernel.encode(xc.numpy(), self._rng.draw16(m, dev).numpy(), invs, bucket, bits, out)
                else:
                    kernel.encode_with_uniforms(xc.numpy(), uniforms[start:stop].numpy(), invs, bucket, bits, out)
                continue
            yc, qc = y[:m], q[:m]
            if self.bucket_size is None:
                self._uniform(yc, uniforms, start).add_(xc, alpha=inv_whole)
            else:
                torch.abs(xc, out=yc)
                first = start // self.bucket_size
                invs = []
                for yrows, idx in self._bucket_rows(yc):
                    scale = yrows.amax(dim=1)
                    write_field(payload, 4 * (first + idx.start), scale)
                    invs.append(torch.where(scale > 0, self.s / scale, torch.zeros_like(scale)))
                self._uniform(yc, uniforms, start)
                for (rows, _), (yrows, _), inv in zip(self._bucket_rows(xc), self._bucket_rows(yc), invs):
                    yrows.addcmul_(rows, inv[:, None])
            yc.floor_().clamp_(-self.s, self.s)
            qc.copy_(yc)
            codes = qc.view(torch.uint8)
            if bits < 8:
                codes.bitwise_and_((1 << bits) - 1)
            out = body[start * bits // 8 : start * bits // 8 + bitpack.packed_bytes(m, bits)]
            bitpack.pack(codes, bits, out=out, check=False)
        return payload

    def _kernel(self, device: torch.device):
        """The fused kernels' module (:mod:`.kernels.qsgd`) when they handle this codec on ``device``, else None:
        a CPU, a whole number of bytes of codes per bucket."""
        if not bitpack.kernels_enabled(device) or self.bits not in kernels.WIDTHS:
            return None
        if self.bucket_size is not None and self.bucket_size * self.bits % 8:
            return None
        from .kernels import qsgd
        return qsgd

    def _uniform(self, yc: torch.Tensor, uniforms: torch.Tensor | None, start: int) -> torch.Tensor:
        """Fill the chunk ``yc`` (at ``start``) with fresh draws, or with the given ``uniforms``."""
        if uniforms is None:
            return self._rng.uniform_(yc)
        return yc.copy_(uniforms[start:start + yc.numel()])

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``q * scale / s`` per element, with ``q`` sign-extended from its ``bits``-bit code."""
        check_payload(payload, self.payload_bytes(numel), "QSGDCodec.decode")
        dev, bits = payload.device, self.bits
        out = prepare_out(out, numel, dev, "QSGDCodec.decode")
        nb = self.num_buckets(numel)
        factors = read_field(payload, 0, nb, torch.float32) / self.s
        body = payload[4 * nb :]
        kernel = self._kernel(dev)
        if kernel is not None:
            bucket = numel if self.bucket_size is None else self.bucket_size
            kernel.decode(body.numpy(), factors.numpy(), bucket, bits, out.numpy())
            return out
        table = None
        if bits in (2, 4):  # one gather per byte beats unpack + sign-extend + convert
            table = torch.arange(1 << bits, dtype=torch.float32, device=dev)
            table[1 << (bits - 1) :] -= 1 << bits  # two's complement code -> q
        for start, oc in decoded_chunks(body, bits, numel, out, self._chunk(dev), table, _signed_codes(bits)):
            first = 0 if self.bucket_size is None else start // self.bucket_size
            for rows, idx in self._bucket_rows(oc):
                rows.mul_(factors[first + idx.start : first + idx.stop, None])
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bits={self.bits}, bucket_size={self.bucket_size})"


def _signed_codes(bits: int):
    """Write ``bits``-bit two's complement codes (uint8) into a float32 chunk as the integers q they hold."""
    def convert(chunk: torch.Tensor, codes: torch.Tensor) -> None:
        if bits < 8:  # sign-extend the bits-bit two's complement code to int8
            codes.bitwise_left_shift_(8 - bits)
            codes.view(torch.int8).bitwise_right_shift_(8 - bits)
        chunk.copy_(codes.view(torch.int8))
    return convert


class TernGradCodec(QSGDCodec):
    """TernGrad: ``QSGDCodec(bits=2, bucket_size=None)``, values in max|x| * {-1, 0, +1}."""

    name = "terngrad"

    def __init__(self, seed: int = 0):
        super().__init__(bits=2, bucket_size=None, seed=seed)

    def __repr__(self) -> str:
        return "TernGradCodec()"
