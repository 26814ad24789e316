"""The codec interface: pure tensor maths that turns a flat float tensor into a packed uint8 payload.

Every codec's payload is *self-contained*: scales, norms and other metadata are written into the
same ``uint8`` tensor as a fixed header, so what the communicator moves is exactly one buffer and
``payload_bytes(numel)`` is the exact number of bytes on the wire for a tensor of ``numel`` elements.
Payload sizes depend only on ``numel`` (never on the values), so ranks can exchange payloads with
equal-size collectives.
"""

from __future__ import annotations

import abc

import torch

__all__ = ["Codec", "check_flat_float", "check_float32", "check_payload"]


def check_flat_float(x: torch.Tensor, who: str) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``x`` is a 1-D contiguous floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{who}: expected a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{who}: expected a 1-D (flat) tensor, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{who}: expected a contiguous tensor; call .contiguous() first")


def check_float32(algorithm: str, params: torch.Tensor, why: str = "its codec decodes to float32") -> None:
    """Raise ``TypeError`` naming ``algorithm`` unless ``params`` are float32: every codec decodes to float32, so a
    method that exchanges codec payloads needs float32 parameters (refused when built, not at the first step)."""
    if params.dtype != torch.float32:
        raise TypeError(f"{algorithm} needs float32 parameters ({why}), got {params.dtype}")


def check_payload(payload: torch.Tensor, expected_bytes: int, who: str) -> None:
    """Raise unless ``payload`` is a 1-D uint8 tensor of exactly ``expected_bytes`` bytes."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        got = payload.dtype if isinstance(payload, torch.Tensor) else type(payload).__name__
        raise TypeError(f"{who}: payload must be a torch.uint8 tensor, got {got}")
    if payload.dim() != 1 or payload.numel() != expected_bytes:
        raise ValueError(
            f"{who}: payload has {payload.numel()} bytes (shape {tuple(payload.shape)}), "
            f"expected a flat payload of {expected_bytes} bytes"
        )


class Codec(abc.ABC):
    """Compression operator C(x): ``encode`` a flat float tensor, ``decode`` it back.

    Subclasses set ``name`` and ``lossless`` and implement the three abstract methods. Stochastic
    codecs own a seeded ``torch.Generator`` and expose it through ``state_dict``/``load_state_dict``
    so that checkpoints resume bit-exactly.
    """

    name: str = "codec"
    lossless: bool = False

    @abc.abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Exact size in bytes of ``encode(x)`` for a tensor of ``numel`` elements (header included)."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Return the packed ``uint8`` payload of the flat float tensor ``x`` (on ``x``'s device)."""

    @abc.abstractmethod
    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Return the float32 tensor of ``numel`` elements that ``payload`` encodes (into ``out`` if given)."""

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: what a receiver reconstructs; error-feedback algorithms use it."""
        return self.decode(self.encode(x), x.numel())

    def split_alignment(self) -> int | None:
        """Where the encoding can be cut: an ``a`` such that encoding and decoding the pieces of x cut at
        multiples of ``a`` gives, bit for bit, the pieces of ``decode(encode(x))`` (given the same random
        draws); None when the encoding is global (one scale over the whole tensor). None here."""
        return None

    def bits_per_element(self, numel: int) -> float:
        """Bits on the wire per element for a tensor of ``numel`` elements."""
        return 8.0 * self.payload_bytes(numel) / max(numel, 1)

    _rng = None
    """A stochastic codec's :class:`~mpicomm.codecs._rng.SeededGenerator` (None: deterministic)."""

    def state_dict(self) -> dict:
        """Random-generator state of a stochastic codec (empty for deterministic codecs)."""
        return self._rng.state_dict() if self._rng is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        if self._rng is not None:
            self._rng.load_state_dict(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
