"""A seeded ``torch.Generator`` that stochastic codecs own, created lazily on their input's device.

Its state round-trips through ``state_dict``/``load_state_dict``, so save -> restore -> encode gives the
same bytes as an uninterrupted run on the same device type. A CPU generator state cannot drive a CUDA
generator (their formats differ), so a run resumed on another device type (a GPU run continued on a
CPU, or the other way round) continues with a fresh stream seeded from a hash of the saved state:
deterministic, reproducible, but not the stream the original device would have drawn.

Stochastic rounding draws ``u = (r + 1/2) / 2**16`` with r uniform on 0..65535: 16 random bits per
element, taken four at a time from full-range 64-bit draws. On a CPU this is 3x cheaper than
``Tensor.uniform_`` (which spends a 32-bit draw per element and dominated encode time). The price is a
rounding probability quantized to 2**-16: E[floor(y + u)] = y to within 2**-17 of one grid step, which
is below float32's own resolution of y for 8-bit grids (y < 256 is resolved to 2**-16).
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["SeededGenerator", "check_seed", "uniforms_from_draws"]


def check_seed(seed: int) -> int:
    """Return ``seed`` after checking it is a non-negative int."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


def _derived_seed(rng_state: torch.Tensor) -> int:
    """A 63-bit seed that is a pure function of a saved generator state (for a change of device type)."""
    digest = hashlib.sha256(rng_state.numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def uniforms_from_draws(draws: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """u = (r + 1/2)/2**16 in (0, 1) into the float32 ``out``, from ``draws`` of r - 32768
    (:meth:`SeededGenerator.draw16`)."""
    out.copy_(draws)  # r - 32768, exact in float32
    return out.add_(32768.5).mul_(2.0**-16)


class SeededGenerator:
    """Lazily created generator seeded with ``seed`` on the device of the first tensor it serves."""

    def __init__(self, seed: int):
        self.seed = check_seed(seed)
        self._gen: torch.Generator | None = None
        self._pending: dict | None = None
        self._scratch: torch.Tensor | None = None

    def get(self, device: torch.device) -> torch.Generator:
        """The generator for tensors on ``device`` (created, seeded or restored on first use)."""
        if self._gen is None:
            gen = torch.Generator(device=device)
            if self._pending is not None and self._pending["rng_state"] is not None:
                saved = torch.device(self._pending["device"])
                if saved.type == device.type:
                    gen.set_state(self._pending["rng_state"])
                else:
                    gen.manual_seed(_derived_seed(self._pending["rng_state"]))
            else:
                gen.manual_seed(self.seed)
            self._gen, self._pending = gen, None
        elif self._gen.device != device:
            raise ValueError(f"codec generator lives on {self._gen.device}; got an input on {device}")
        return self._gen

    def draw16(self, m: int, device: torch.device) -> torch.Tensor:
        """``m`` draws of r - 32768 (int16, r uniform on 0..65535; a view of scratch valid until the next draw).

        :meth:`uniform_` of ``m`` elements advances the generator exactly as this does.
        """
        words = (m + 3) // 4
        if self._scratch is None or self._scratch.device != device or self._scratch.numel() < words:
            self._scratch = torch.empty(words, dtype=torch.int64, device=device)
        draws = self._scratch[:words].random_(-(2**63), None, generator=self.get(device))
        return draws.view(torch.int16)[:m]

    def uniform_(self, out: torch.Tensor) -> torch.Tensor:
        """Fill the float32 tensor ``out`` with u = (r + 1/2)/2**16 in (0, 1), r uniform on 0..65535."""
        return uniforms_from_draws(self.draw16(out.numel(), out.device), out)

    def state_dict(self) -> dict:
        """``{"seed", "device", "rng_state"}``; device and state are None before the first encode."""
        if self._gen is None:
            if self._pending is not None:
                return dict(self._pending)
            return {"seed": self.seed, "device": None, "rng_state": None}
        return {"seed": self.seed, "device": str(self._gen.device), "rng_state": self._gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned; takes effect at the next ``get``."""
        missing = {"seed", "device", "rng_state"} - set(state)
        if missing:
            raise ValueError(f"codec state_dict is missing keys {sorted(missing)}")
        self.seed = check_seed(state["seed"])
        rng_state = state["rng_state"]
        if rng_state is not None:
            if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.uint8:
                raise TypeError("codec state_dict 'rng_state' must be a torch.uint8 tensor or None")
            rng_state = rng_state.detach().cpu().clone()
        self._gen = None
        self._pending = {"seed": self.seed, "device": state["device"], "rng_state": rng_state}
