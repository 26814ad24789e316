"""Moniqua's lattice codec exactly as the algorithm runs it, for the codec benchmarks.

The tensor is one run cut into frames of the synchronous algorithm's size (``ModuloGossip.chunk``:
:func:`~mpicomm.codecs._layout.chunk_elems` positions), the last padded to whole bytes by a gap as the
algorithm's messages are. ``encode`` builds every frame and encodes it (:meth:`Frame.encode`: the step's
shared dither, t = x s + u, the codes, the fingerprints and -x̂ for the mixing increment); ``decode``
zeroes ``out`` and recovers the payload into it (:meth:`Frame.recover_into`: L' against the encoder's t,
so against the input itself as the receiver's model, the fingerprints, + x̂). On a CPU both are the fused
kernels; with ``bitpack.use_backend("numpy")`` the torch path they replaced.
"""

from __future__ import annotations

import torch

from mpicomm.algorithms.moniqua_frame import Frame, per_run
from mpicomm.algorithms.moniqua_parts import Chunk
from mpicomm.codecs import lattice
from mpicomm.codecs._layout import chunk_elems, chunk_ranges

__all__ = ["LatticeCodec"]


class LatticeCodec:
    """``bits``-bit lattice codec with ``rounding`` "dither" or "nearest" at theta ``theta`` (one tensor)."""

    def __init__(self, bits: int, rounding: str = "dither", theta: float = 0.01):
        self.bits, self.dithered = bits, rounding == "dither"
        s = (1 << bits) * (1.0 - 2.0 * lattice.delta(bits, rounding)) / (2.0 * theta)
        self.scale, self.inverse = torch.tensor([s]), torch.tensor([1.0 / s])
        self.frames: list[Frame] = []
        self.mixing: torch.Tensor | None = None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The packed codes of ``x`` (keeps the frames for :meth:`decode`)."""
        n, dev, bits = x.numel(), x.device, self.bits
        positions = -(-n // 8) * 8  # the algorithm's messages hold whole bytes: a gap pads the last frame
        key = lattice.stream_key(0, 1) if self.dithered else None
        scale, inverse = per_run(self.scale, dev), per_run(self.inverse, dev)
        payload = torch.empty(lattice.packed_bytes(positions, bits), dtype=torch.uint8, device=dev)
        own = torch.zeros(2, dtype=torch.int64, device=dev)
        if self.mixing is None or self.mixing.numel() != positions or self.mixing.device != dev:
            self.mixing = torch.empty(positions, dtype=torch.float32, device=dev)  # the algorithm's increment, kept
        self.frames = []
        for lo, hi in chunk_ranges(positions, chunk_elems(dev)):
            runs = [(m, 0, lo, 0) for m in [min(hi, n) - lo] if m > 0] + [(hi - max(lo, n), 1, None, 0)] * (hi > n)
            lengths, tensors, starts, shifts = zip(*runs)
            ends = tuple(sum(lengths[:r + 1]) - 1 for r in range(len(runs)))
            frame = Frame(Chunk(lo, hi, lengths, tensors, starts, shifts, ends), dev, key)
            frame.encode(x, scale, inverse, None, bits, payload, own, -1.0, self.mixing[lo:hi])
            self.frames.append(frame)
        return payload

    def decode(self, payload: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x̂ of the last encoded tensor from ``payload``, into ``out``."""
        dev = payload.device
        out = torch.empty(n, dtype=torch.float32, device=dev) if out is None else out
        fingerprints = torch.zeros(2, dtype=torch.int64, device=dev)
        inverse = per_run(self.inverse, dev)
        for frame in self.frames:
            lo, hi = frame.chunk.lo, frame.chunk.hi
            into = out[lo:hi].zero_() if hi <= n else torch.zeros(hi - lo, device=dev)  # the padded last frame
            frame.recover_into(payload, self.bits, inverse, 1.0, fingerprints, None, into)
            if hi > n:
                out[lo:].copy_(into[:n - lo])
        return out

    def bits_per_element(self, n: int) -> float:
        """Bits on the wire per element."""
        return 8.0 * lattice.packed_bytes(-(-n // 8) * 8, self.bits) / max(n, 1)
