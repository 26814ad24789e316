"""HSQ: hyper-sphere (vector) quantization of a layered gradient against a shared codebook of unit vectors.

Dai, Yan, Zhou, Yang, Ng, Cheng, Fan. "Hyper-Sphere Quantization: Communication-Efficient SGD for
Federated Learning." arXiv, November 2019.

Per layer of D numbers (D > ``min_compress``; smaller layers travel as raw float32), the layer is viewed as
N = ceil(D/d) chunks g_m of dimension d (the last one zero-padded). Each chunk travels as the index k of one
row of a (K, d) codebook C of unit rows and one value u, and decodes as ``u * c_k``: ``mode="greedy"``
projects the chunk on its closest codeword (biased), ``mode="unbiased"`` samples a codeword so that the
decode's expectation is g_m.

The N values u of a layer are quantized with stochastic min-max uniform quantization at ``n_bit`` bits
(``UniformCodec``: lo = min u, hi = max u as float32, E[u_hat] = u). Codebooks are built on the CPU in
float64 from ``codebook_seed`` and cast to float32, so every rank holds the same bytes (see
``codebook_digest``); ``seed`` drives only the random draws (norm rounding, index sampling) and should
differ per rank.

Payload (self-contained uint8, layers in layout order, each layer's section starting on a byte boundary):

    raw layer (D <= min_compress):  4*D bytes of float32
    compressed layer:               [lo, hi float32 (8 B)][ceil(N*n_bit/8) B of norm codes]
                                    [ceil(N*b/8) B of indices],  b = ceil(log2 K)

so a compressed layer costs exactly 64 + ceil(N*n_bit/8)*8 + ceil(N*b/8)*8 bits: the only rounding is up
to a whole byte at the end of the norm codes and at the end of the indices. Indices of b <= 8 bits use
``bitpack`` at b bits; for 9 <= b <= 16 the low byte of every index is stored first (N bytes), then the
high b-8 bits packed (``ceil(N*(b-8)/8)`` bytes), which is again ``ceil(N*b/8)`` bytes in total. An
all-zero payload decodes to an all-zero gradient.

The codebooks, the option checks and the choice of a codeword per chunk live in :mod:`.hsq_codebook`
(re-exported here); this module lays the layers out, encodes, decodes and keeps the random draws.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import bitpack
from ._layout import check_numel, chunk_elems, prepare_out
from ._rng import SeededGenerator, check_seed
from .base import Codec, check_flat_float, check_payload
from .hsq_codebook import (
    CODEBOOKS,
    KMEANS_ITERS,
    KMEANS_SAMPLES_PER_CODEWORD,
    MODES,
    _codebook_cpu,
    _coefficient_map,
    _is_int,
    check_hsq_options,
    codebook,
    coefficient_map,
    default_k,
    greedy_select,
    index_bits,
    inverse_cdf_sample,
)
from .uniform import UniformCodec

__all__ = [
    "CODEBOOKS",
    "HSQCodec",
    "HSQDraws",
    "KMEANS_ITERS",
    "KMEANS_SAMPLES_PER_CODEWORD",
    "MODES",
    "check_hsq_options",
    "codebook",
    "coefficient_map",
    "default_k",
    "greedy_select",
    "index_bits",
    "inverse_cdf_sample",
]

_SAMPLER_SALT = 0x5A5A_5A5A_5A5A_5A5A  # the index sampler's seed is seed XOR this (distinct from the norm RNG)


@dataclass
class HSQDraws:
    """The random draws of one :meth:`HSQCodec.encode`, one per compressed chunk, layers in order: ``norms``
    (int16, the norms' stochastic rounding) and ``picks`` (float32 uniforms of the index sampling; None in
    greedy mode)."""

    norms: torch.Tensor
    picks: torch.Tensor | None

    def chunks(self, first: int, last: int) -> HSQDraws:
        """The draws of compressed chunks ``first`` .. ``last - 1`` (see :meth:`HSQCodec.chunks_before`)."""
        return HSQDraws(self.norms[first:last], None if self.picks is None else self.picks[first:last])


def _layer_sizes(layout: Sequence) -> list[int]:
    sizes = [getattr(layer, "numel", layer) for layer in layout]
    if isinstance(layout, (str, bytes)) or not all(_is_int(s) and s >= 0 for s in sizes):
        raise ValueError("layout must be a sequence of non-negative layer sizes (ints or objects with .numel), "
                         f"got {layout!r}")
    return sizes


class HSQCodec(Codec):
    """HSQ of a flat gradient laid out as ``layout`` (layer sizes, in order): per-layer chunk vector quantization."""

    name = "hsq"

    def __init__(
        self,
        layout: Sequence,
        d: int = 16,
        K: int | None = None,
        codebook: str = "gaussian",
        mode: str = "greedy",
        n_bit: int = 6,
        min_compress: int = 1000,
        seed: int = 0,
        codebook_seed: int = 0,
    ):
        self.k = check_hsq_options(d, K, codebook, mode, n_bit, min_compress)
        self.sizes = _layer_sizes(layout)
        self.d, self.kind, self.mode, self.n_bit, self.min_compress = d, codebook, mode, n_bit, min_compress
        self.bits = index_bits(self.k)
        self.codebook_seed = check_seed(codebook_seed)
        kind = "orthonormal" if codebook == "rotation" else codebook
        self._cb_cpu = _codebook_cpu(kind, d, self.k, self.codebook_seed)
        self._pt_cpu = _coefficient_map(kind, d, self.k, self.codebook_seed) if mode == "unbiased" else None
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._work: dict[torch.device, torch.Tensor] = {}  # greedy's products and magnitudes, reused
        self._raw: dict[torch.device, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._norms = UniformCodec(n_bit, rounding="stochastic", seed=check_seed(seed))
        self._sampler = SeededGenerator(seed ^ _SAMPLER_SALT)
        self._plan = []  # per layer: (offset, D, N chunks or 0 for raw, payload offset)
        offset = pos = 0
        for size in self.sizes:
            n = -(-size // d) if size > min_compress else 0
            self._plan.append((offset, size, n, pos))
            offset += size
            pos += self._layer_bytes(size, n)
        self.numel, self._bytes = offset, pos

    # ------------------------------------------------------------------ sizes
    def _layer_bytes(self, size: int, n: int) -> int:
        if n == 0:
            return 4 * size
        return self._norms.payload_bytes(n) + (n * self.bits + 7) // 8

    def payload_bytes(self, numel: int) -> int:
        """Sum over layers of 4*D (raw) or 8 + ceil(N*n_bit/8) + ceil(N*ceil(log2 K)/8) (compressed)."""
        if check_numel(numel, "HSQCodec.payload_bytes") != self.numel:
            raise ValueError(f"HSQCodec: numel must equal the layout total {self.numel}, got {numel}")
        return self._bytes

    def codebook_digest(self) -> str:
        """SHA-256 of the codebook's float32 bytes (equal on two ranks iff they hold the same codebook)."""
        return hashlib.sha256(self._cb_cpu.numpy().tobytes()).hexdigest()

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        if device not in self._tables:
            pt = None if self._pt_cpu is None else self._pt_cpu.to(device)
            self._tables[device] = (self._cb_cpu.to(device), pt)
        return self._tables[device]

    # ------------------------------------------------------------------ encode
    def _chunks(self, x: torch.Tensor, offset: int, size: int, n: int) -> torch.Tensor:
        """The layer as an (n, d) float32 matrix, zero-padded at the end."""
        src = x[offset : offset + size]
        if size == n * self.d and src.dtype == torch.float32:
            return src.view(n, self.d)
        buf = torch.zeros(n * self.d, dtype=torch.float32, device=x.device)
        buf[:size].copy_(src)
        return buf.view(n, self.d)

    def _rows(self, device: torch.device) -> int:
        """Chunks per block of the encoders: about ``chunk_elems`` coefficients."""
        return max(1, chunk_elems(device) // self.k)

    def chunks_before(self, layer: int) -> int:
        """How many compressed chunks the layers before ``layer`` (an index into ``layout``) hold."""
        return sum(n for _, _, n, _ in self._plan[:layer])

    def draw(self, device: torch.device) -> HSQDraws:
        """The draws the next :meth:`encode` on ``device`` would take from the generators, taken now in the same
        calls; ``encode(x, draws=...)`` of any group of layers (by a codec over those layers) then rounds and
        samples exactly as the single encode would."""
        counts = [n for _, _, n, _ in self._plan if n]
        picks = None
        if self.mode == "unbiased":
            picks = torch.empty(sum(counts), dtype=torch.float32, device=device)
            at, rows = 0, self._rows(device)
            for n in counts:
                for start in range(0, n, rows):
                    m = min(rows, n - start)
                    picks[at:at + m] = torch.rand(m, device=device, generator=self._sampler.get(device))
                    at += m
        return HSQDraws(self._norms.draw_segments(counts, device), picks)

    def _select(self, chunks: torch.Tensor, picks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices int64, u float32) for every chunk, in row blocks of about ``chunk_elems`` coefficients
        (``picks``: the layer's sampling uniforms, unbiased mode)."""
        cb, pt = self._on(chunks.device)
        n = chunks.shape[0]
        idx = torch.empty(n, dtype=torch.int64, device=chunks.device)
        u = torch.empty(n, dtype=torch.float32, device=chunks.device)
        rows = self._rows(chunks.device)
        scratch = self._scratch(chunks.device, 2 * min(rows, n) * self.k) if self.mode == "greedy" else None
        for start in range(0, n, rows):
            block = chunks[start : start + rows]
            if self.mode == "greedy":
                i, v = greedy_select(block, cb, scratch)
            else:
                a = block @ pt
                w = a.abs()
                i = inverse_cdf_sample(w, picks[start : start + rows])
                v = torch.sign(a.gather(1, i[:, None]).squeeze(1)).mul_(w.sum(dim=1))
            idx[start : start + rows], u[start : start + rows] = i, v
        return idx, u

    def _raw_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(payload byte of every raw float32 byte, flat coordinate of every raw value) on ``device``; None if no raw
        layer. Built once per device: 40 bytes per raw parameter (raw layers are the small ones)."""
        if device not in self._raw:
            spans = [(offset, size, pos) for offset, size, n, pos in self._plan if n == 0 and size]
            if not spans:
                self._raw[device] = None
            else:
                coords = torch.cat([torch.arange(o, o + size) for o, size, _ in spans])
                octets = torch.cat([torch.arange(p, p + 4 * size) for _, size, p in spans])
                self._raw[device] = (octets.to(device), coords.to(device))
        return self._raw[device]

    def _scratch(self, device: torch.device, numel: int) -> torch.Tensor:
        """A float32 work buffer of at least ``numel`` elements on ``device``, kept between calls (grown when short)."""
        buf = self._work.get(device)
        if buf is None or buf.numel() < numel:
            buf = self._work[device] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf

    def _pack_indices(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        b, n = self.bits, idx.numel()
        if b <= 8:
            bitpack.pack(idx.to(torch.uint8), b, out=out, check=False)
        else:
            out[:n].copy_(idx & 255)
            bitpack.pack((idx >> 8).to(torch.uint8), b - 8, out=out[n:], check=False)

    def encode(self, x: torch.Tensor, draws: HSQDraws | None = None) -> torch.Tensor:
        """Encode every layer of the flat tensor ``x`` (raw float32 or norms + packed indices).

        ``draws``: from :meth:`draw` (of this codec, or the chunks of these layers from a codec over more
        layers) instead of drawing now."""
        check_flat_float(x, "HSQCodec.encode")
        x = x.detach()
        payload = torch.empty(self.payload_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        if draws is None:
            draws = self.draw(x.device)
        raw = self._raw_index(x.device)
        if raw is not None:  # every raw layer's float32 bytes in one scatter
            payload.index_copy_(0, raw[0], x.index_select(0, raw[1]).float().view(torch.uint8))
        norms, counts, at = [], [], []
        done = 0
        for offset, size, n, pos in self._plan:
            if n == 0:
                continue
            picks = None if draws.picks is None else draws.picks[done:done + n]
            idx, u = self._select(self._chunks(x, offset, size, n), picks)
            done += n
            nb = self._norms.payload_bytes(n)
            self._pack_indices(idx, payload[pos + nb : pos + self._layer_bytes(size, n)])
            norms.append(u)
            counts.append(n)
            at.append(pos)
        if norms:  # every layer's norms in one call: the generator draws layer by layer, as one call per layer
            self._norms.encode_segments(torch.cat(norms), counts, payload, at, draws=draws.norms)
        return payload

    # ------------------------------------------------------------------ decode
    def _unpack_indices(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        b = self.bits
        if b <= 8:
            return bitpack.unpack(packed, b, n).to(torch.int64)
        high = bitpack.unpack(packed[n:], b - 8, n).to(torch.int64)
        return high.bitwise_left_shift_(8).bitwise_or_(packed[:n].to(torch.int64))

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``u_hat * c_k`` per chunk (the padding dropped) for compressed layers, the float32 values for raw ones."""
        check_payload(payload, self.payload_bytes(numel), "HSQCodec.decode")
        dev = payload.device
        out = prepare_out(out, numel, dev, "HSQCodec.decode")
        cb, _ = self._on(dev)
        raw = self._raw_index(dev)
        if raw is not None:  # every raw layer's float32 values in one gather
            out.index_copy_(0, raw[1], payload.index_select(0, raw[0]).view(torch.float32))
        if bitpack.kernels_enabled(dev):
            from .kernels import hsq as khsq

            khsq.decode_layers(payload.numpy(), *self._compressed_layers(), self.n_bit, self.bits, cb.numpy(),
                               out.numpy())
            return out
        norms = self._decode_norms(payload)
        at = 0
        for offset, size, n, pos in self._plan:
            dst = out[offset : offset + size]
            if n == 0:
                continue
            nb = self._norms.payload_bytes(n)
            idx = self._unpack_indices(payload[pos + nb : pos + self._layer_bytes(size, n)], n)
            u = norms[at : at + n]
            full = size // self.d  # whole chunks are gathered straight into out, the padded one apart
            rows = dst[: full * self.d].view(full, self.d)
            torch.index_select(cb, 0, idx[:full], out=rows).mul_(u[:full, None])
            if full < n:
                dst[full * self.d :].copy_(cb[idx[full]].mul(u[full])[: size - full * self.d])
            at += n
        return out

    def _compressed_layers(self) -> tuple[np.ndarray, ...]:
        """The compressed layers' flat offsets, sizes, chunk counts and payload offsets (int64), for the decode
        kernel."""
        plan = [(offset, size, n, pos) for offset, size, n, pos in self._plan if n]
        return tuple(np.array(column, dtype=np.int64).reshape(-1) for column in zip(*plan)) if plan else \
            tuple(np.empty(0, dtype=np.int64) for _ in range(4))

    def _decode_norms(self, payload: torch.Tensor) -> torch.Tensor:
        """Every compressed layer's quantized norms, concatenated: ``lo + k (hi - lo) / levels`` per layer.

        The same float32 operations as ``UniformCodec.decode`` (the step in float64 rounded to float32,
        then ``k * step + lo``), applied to all layers at once: one gather of the [lo, hi] headers and one
        affine pass instead of a decoder call per layer.
        """
        layers = [(n, pos) for _, _, n, pos in self._plan if n]
        if not layers:
            return torch.empty(0, dtype=torch.float32, device=payload.device)
        bits, levels = self.n_bit, (1 << self.n_bit) - 1
        counts = torch.tensor([n for n, _ in layers], device=payload.device)
        codes = torch.empty(int(sum(n for n, _ in layers)), dtype=torch.uint8, device=payload.device)
        heads, at = [], 0
        for n, pos in layers:
            heads.append(payload[pos : pos + 8])
            bitpack.unpack(payload[pos + 8 : pos + 8 + bitpack.packed_bytes(n, bits)], bits, n,
                           out=codes[at : at + n])
            at += n
        lo, hi = torch.stack(heads).view(torch.float32).double().unbind(1)  # headers sit at byte offsets
        step, lo = ((hi - lo) / levels).float(), lo.float()
        values = codes.to(torch.float32)
        return values.mul_(step.repeat_interleave(counts)).add_(lo.repeat_interleave(counts))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """States of the norm-rounding and index-sampling generators."""
        return {"norms": self._norms.state_dict(), "sampler": self._sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the generator states saved by ``state_dict``."""
        if set(state) != {"norms", "sampler"}:
            raise ValueError(f"HSQCodec state_dict must have keys 'norms' and 'sampler', got {sorted(state)}")
        self._norms.load_state_dict(state["norms"])
        self._sampler.load_state_dict(state["sampler"])

    def __repr__(self) -> str:
        return (f"HSQCodec(layers={len(self.sizes)}, d={self.d}, K={self.k}, codebook={self.kind!r}, "
                f"mode={self.mode!r}, n_bit={self.n_bit}, min_compress={self.min_compress})")
