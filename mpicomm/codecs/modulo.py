"""Moniqua's modulo codec (Lu & De Sa, "Moniqua: Modulo Quantized Communication in Decentralized SGD",
ICML 2020): send x modulo B at b bits per coordinate; the receiver recovers x from its own model.

    cmod(a, B) = a - B*floor(a/B + 1/2)                        centred modulo, in [-B/2, B/2)
    z = cmod(x/B, 1) in [-1/2, 1/2),  t = (z + 1/2)*2^b = frac(x/B + 1/2)*2^b in [0, 2^b)
      nearest:    k = floor(t),             v = -1/2 + (k + 1/2)/2^b    delta = 2^-(b+1)
      stochastic: k = floor(t + u) mod 2^b, v = -1/2 + k/2^b            delta = 2^-b   (u ~ U(0,1))
    receiver with reference r (its own model):  x_hat = cmod(v*B - r, B) + r
    B = b_theta(theta) = 2*theta / (1 - 2*delta)

Guarantee: if |x - r|_inf < theta then |x_hat - x|_inf <= delta*B. Why: v*B = x + e (mod B) with
|e| <= delta*B, and |x - r + e| < theta + delta*B = B/2, so the centred modulo returns x - r + e
exactly. Once |x - r| exceeds B/2 + delta*B the residue wraps and x_hat is off by about a multiple of
B -- silently, which is why algorithms must guard theta. In float32 (the encoder scales x by 2^b/B,
the decoder r by 1/B) every computed position is off by at most eps = 2^-21 * (|x|_inf + |r|_inf + B)
(eight unit roundoffs), so the implemented guarantee reads: |x - r|_inf < theta - eps implies
|x_hat - x|_inf <= delta*B + eps. Keep theta well above eps: float32 cannot resolve a modulus B
that is tiny next to the magnitude of the model.
Stochastic rounding at 1 bit has delta = 1/2 and makes B infinite, so it is refused.

The payload is exactly ceil(n*b/8) bytes (no header; B is known to both sides). Memory: encode and
decode stream in chunks of C = ``chunk_elems(device)`` elements (2**18 on a CPU, 2**22 on a GPU) and,
besides the payload and the output, allocate only chunk-sized temporaries, independent of the model
size: two float32 buffers of C, a uint8 buffer of C, the bit packer's temporaries (at most 8 bytes per
element of one chunk, for the 3/5/6/7-bit word route), an int64 buffer of C/4 for stochastic rounding,
and in decode an int32 index per packed byte of a chunk. ``out`` may be the ``reference`` tensor itself
(each chunk reads r before writing x_hat).
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np
import torch

from . import bitpack, kernels
from ._layout import check_numel, chunk_elems, chunk_ranges, f32_chunk, prepare_out, store_codes
from ._rng import SeededGenerator
from .base import check_flat_float, check_payload
from .uniform import ROUNDINGS

__all__ = ["ModuloCodec", "cmod"]

_EMPTY16 = np.empty(0, dtype=np.int16)  # no draws: nearest rounding, for the kernel


def cmod(a, B):
    """Centred modulo ``a - B*floor(a/B + 1/2)``: in [-B/2, B/2) up to rounding (tensor or float ``a``, B > 0)."""
    if isinstance(a, torch.Tensor):
        return a - B * torch.floor(a / B + 0.5)
    return a - B * math.floor(a / B + 0.5)


def _check_positive(value: float, name: str, who: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (Real, torch.Tensor)):
        raise TypeError(f"{who}: {name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{who}: {name} must be finite and > 0, got {value}")
    return value


class ModuloCodec:
    """Moniqua's b-bit modulo quantizer: ``encode(x, B)``; ``decode(payload, reference, B)``."""

    name = "moniqua"
    lossless = False

    def __init__(self, bits: int, rounding: str = "nearest", seed: int = 0):
        bitpack.packed_bytes(0, bits)  # validates bits
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if rounding == "stochastic" and bits == 1:
            raise ValueError(
                "ModuloCodec: stochastic rounding needs bits >= 2; at 1 bit its error is a whole grid "
                "step (delta = 1/2), so B_theta = 2*theta/(1 - 2*delta) is infinite. Use rounding='nearest'."
            )
        self.bits, self.rounding = bits, rounding
        self.delta = 2.0 ** -(bits + 1) if rounding == "nearest" else 2.0**-bits
        self._rng = SeededGenerator(seed) if rounding == "stochastic" else None

    def b_theta(self, theta: float) -> float:
        """Modulus ``2*theta/(1 - 2*delta)`` that makes recovery exact up to delta*B for |x - r| < theta."""
        theta = _check_positive(theta, "theta", "ModuloCodec.b_theta")
        return 2.0 * theta / (1.0 - 2.0 * self.delta)

    def payload_bytes(self, numel: int) -> int:
        """``ceil(numel*bits/8)``: no header."""
        return bitpack.packed_bytes(check_numel(numel, "ModuloCodec.payload_bytes"), self.bits)

    def bits_per_element(self, numel: int) -> float:
        """Bits on the wire per element."""
        return 8.0 * self.payload_bytes(numel) / max(numel, 1)

    def encode(self, x: torch.Tensor, B: float) -> torch.Tensor:
        """Packed b-bit grid indices of ``cmod(x/B, 1)``."""
        check_flat_float(x, "ModuloCodec.encode")
        B = _check_positive(B, "B", "ModuloCodec.encode")
        x, n, bits, dev = x.detach(), x.numel(), self.bits, x.device
        levels = float(1 << bits)
        payload = torch.empty(self.payload_bytes(n), dtype=torch.uint8, device=dev)
        step = chunk_elems(dev)
        kernel = bitpack.kernels_enabled(dev) and bits in kernels.WIDTHS
        # a float32 chunk buffer: the kernel needs it only to convert a half-precision input, the torch path always
        t = torch.empty(min(step, n) if not kernel or x.dtype != torch.float32 else 0, dtype=torch.float32,
                        device=dev)
        if kernel:
            from .kernels import modulo
        else:
            f = torch.empty_like(t)
            codes = torch.empty(t.numel(), dtype=torch.uint8, device=dev)
        for start, stop in chunk_ranges(n, step):
            m = stop - start
            out = payload[start * bits // 8 : start * bits // 8 + bitpack.packed_bytes(m, bits)]
            if kernel:
                draws = _EMPTY16 if self._rng is None else self._rng.draw16(m, dev).numpy()
                modulo.encode(f32_chunk(x[start:stop], t[:m]).numpy(), draws, np.float32(levels / B), bits, out.numpy())
                continue
            tc, fc, cc = t[:m], f[:m], codes[:m]
            torch.mul(f32_chunk(x[start:stop], tc), levels / B, out=tc)  # t = x*2^b/B + 2^(b-1) [+ u]
            tc.add_(levels / 2)
            if self._rng is not None:
                tc.add_(self._rng.uniform_(fc))
            tc.floor_()
            torch.mul(tc, 1.0 / levels, out=fc).floor_()
            tc.sub_(fc, alpha=levels)  # k = floor(t) mod 2^b, exact on integer-valued floats
            store_codes(cc, tc, bits)
            bitpack.pack(cc, bits, out=out, check=False)
        return payload

    def decode(
        self,
        payload: torch.Tensor,
        reference: torch.Tensor,
        B: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x_hat = cmod(v*B - reference, B) + reference`` (float32, into ``out`` if given)."""
        check_flat_float(reference, "ModuloCodec.decode (reference)")
        B = _check_positive(B, "B", "ModuloCodec.decode")
        n, bits, dev = reference.numel(), self.bits, reference.device
        check_payload(payload, self.payload_bytes(n), "ModuloCodec.decode")
        if payload.device != dev:
            raise ValueError(f"ModuloCodec.decode: payload is on {payload.device}, reference on {dev}")
        out = prepare_out(out, n, dev, "ModuloCodec.decode")
        reference = reference.detach()
        levels = float(1 << bits)
        centre = 0.5 if self.rounding == "nearest" else 0.0
        if bitpack.kernels_enabled(dev) and bits in kernels.WIDTHS and reference.dtype == torch.float32:
            from .kernels import modulo

            modulo.decode(payload.numpy(), reference.numpy(), np.float32(1.0 / B), np.float32(B), np.float32(centre),
                          bits, out.numpy())
            return out
        step = chunk_elems(dev)
        t = torch.empty(min(step, n), dtype=torch.float32, device=dev)
        f = torch.empty_like(t)
        lookup = bits in (1, 2, 4)  # one gather per byte beats unpack + convert + affine
        if lookup:
            table = torch.arange(1 << bits, dtype=torch.float32, device=dev).add_(centre).mul_(1.0 / levels)
        else:
            codes = torch.empty(t.numel(), dtype=torch.uint8, device=dev)
        for start, stop in chunk_ranges(n, step):
            m = stop - start
            tc, fc, rc = t[:m], f[:m], reference[start:stop]
            packed = payload[start * bits // 8 : start * bits // 8 + bitpack.packed_bytes(m, bits)]
            if lookup:  # a = v + 1/2 = (k + centre)/2^b, exact
                bitpack.unpack_lookup(packed, bits, m, table, tc)
            else:
                tc.copy_(bitpack.unpack(packed, bits, m, out=codes[:m]))
                tc.add_(centre).mul_(1.0 / levels)
            tc.sub_(rc, alpha=1.0 / B)  # a = v + 1/2 - r/B = w + 1/2
            torch.floor(tc, out=fc)
            tc.sub_(fc).sub_(0.5)  # cmod(w, 1) = w - floor(w + 1/2)
            torch.add(rc, tc, alpha=B, out=out[start:stop])
        return out

    def state_dict(self) -> dict:
        """Generator state (stochastic rounding only)."""
        return self._rng.state_dict() if self._rng is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore the generator state saved by ``state_dict``."""
        if self._rng is not None:
            self._rng.load_state_dict(state)

    def __repr__(self) -> str:
        return f"ModuloCodec(bits={self.bits}, rounding={self.rounding!r})"
