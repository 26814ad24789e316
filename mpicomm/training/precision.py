"""Mixed precision for the training loop: ``--precision fp32|bf16|fp16``.

* ``fp32``: nothing changes (the default; every stored reference is fp32).
* ``bf16``: forward and loss under ``torch.autocast(device, bfloat16)``; parameters, gradients and
  everything the algorithm and its codecs see stay float32 (bf16 has fp32's range: no loss scale).
* ``fp16``: ``torch.autocast(device, float16)`` with a dynamic loss scale S (start 2**16). The loss is
  multiplied by S before ``backward``; afterwards the flat gradient is multiplied by 1/S (exact: S is a
  power of two) and checked for inf/NaN. The overflow decision is **agreed across ranks**: one
  allreduce (max) of a one-element flag through the algorithm's Communicator, booked in the Ledger as
  4 bytes. On overflow every rank skips the algorithm's step (no communication, parameters unchanged)
  and halves S together, so replicas never diverge; after ``growth_interval`` clean steps S doubles.
  The algorithm and its codecs therefore always see unscaled float32 gradients and parameters.

Host synchronisation: fp32 and bf16 add none; fp16 adds one per step (reading the agreed flag).
The scale and its clean-step counter are part of the checkpoint (``state_dict``).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast context, scaled backward and the agreed overflow check for one run.

    ``comm``: the algorithm's :class:`~mpicomm.comm.Communicator` (fp16 allreduces its flag there).
    """

    def __init__(self, mode: str, device: torch.device, comm=None, *, init_scale: float = 2.0**16,
                 growth_interval: int = 2000, min_scale: float = 2.0**-24):
        if mode not in PRECISIONS:
            raise ValueError(f"--precision: expected one of {', '.join(PRECISIONS)}, got {mode!r}")
        if mode == "fp16" and comm is None:
            raise ValueError("--precision fp16 needs the communicator that agrees on overflows")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.mode, self.device, self.comm = mode, torch.device(device), comm
        self.scale = float(init_scale) if mode == "fp16" else 1.0
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0
        self.skipped = 0
        self._flag = None

    def autocast(self):
        """The context the forward pass and loss run in (a no-op for fp32)."""
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.mode])

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, on the scaled loss for fp16."""
        (loss * self.scale if self.mode == "fp16" else loss).backward()

    def ready(self, flat) -> bool:
        """Collective for fp16: unscale the flat gradient in place and agree whether every rank's is finite.

        ``flat``: the algorithm's :class:`~mpicomm.flat.FlatParameters` (its ``gather_grads()`` is the
        gradient the algorithm's step will consume). Returns True when the step should be taken. On an
        overflow anywhere it returns False on every rank and halves the scale; after ``growth_interval``
        clean steps in a row the scale doubles.
        """
        if self.mode != "fp16":
            return True
        grad = flat.gather_grads()
        grad.mul_(1.0 / self.scale)
        if self._flag is None or self._flag.device != grad.device:
            self._flag = torch.zeros(1, dtype=torch.float32, device=grad.device)
        self._flag.copy_(~torch.isfinite(grad).all())
        self.comm.allreduce(self._flag, op="max")
        if bool(self._flag.item()):  # the one host synchronisation per step
            self.scale = max(self.scale * 0.5, self.min_scale)
            self.clean_steps = 0
            self.skipped += 1
            return False
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0
        return True

    def state_dict(self) -> dict:
        """Mode, loss scale, clean-step counter and skipped steps (all plain numbers)."""
        return {"mode": self.mode, "scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the scale only carries over from fp16 to fp16 (a run may resume
        under another precision, and then starts that precision afresh)."""
        if state.get("mode") != self.mode:
            return
        self.scale = float(state["scale"])
        self.clean_steps, self.skipped = int(state["clean_steps"]), int(state["skipped"])
