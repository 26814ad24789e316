"""The ranks' average model: what decentralized methods evaluate and save, and how far the ranks' models
are from it.

Part of :class:`~mpicomm.algorithms.base.Algorithm` (a base class of it), kept apart so each file has one job.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["AveragedModel"]


class AveragedModel:
    """The evaluation part of :class:`~mpicomm.algorithms.base.Algorithm` (see :meth:`averaged_model`)."""

    def consensus_model(self) -> torch.Tensor:
        """Collective: the average of all ranks' flat parameters (what decentralized methods evaluate)."""
        avg = self.flat.data.detach().clone()
        self.comm.allreduce(avg)
        return avg.div_(self.comm.size)

    @contextlib.contextmanager
    def averaged_model(self, buffers: str = "average"):
        """Collective: within the block ``self.model`` holds the average of every rank's parameters; restored after.

        What decentralized methods evaluate and save (their ranks' models differ); for centralized ones it is
        the model every rank already holds. ``buffers``: ``"average"`` (BatchNorm running statistics and other
        floating-point buffers averaged over the ranks too) or ``"own"`` (this rank's). Yields the model::

            with algo.averaged_model() as model:
                torch.save(model.state_dict(), "model.pt")   # on rank 0, say
        """
        if buffers not in ("average", "own"):
            raise ValueError(f"averaged_model: buffers must be 'average' or 'own', got {buffers!r}")
        self.check_model("averaged_model()")
        self._refuse_in_flight("averaged_model() was entered")
        saved = self.flat.data.clone()
        floating = [b for b in self.model.buffers() if b.is_floating_point()] if buffers == "average" else []
        kept = [b.clone() for b in floating]
        self.flat.data.copy_(self.consensus_model())
        for b in floating:  # summed in float64 whatever the buffer's dtype (MPI reduces no half precision)
            b.copy_(self.comm.allreduce(b.detach().to(torch.float64)).div_(self.comm.size))
        try:
            yield self.model
        finally:
            self.flat.data.copy_(saved)
            for b, value in zip(floating, kept):
                b.copy_(value)

    def consensus_distance(self) -> float:
        """Collective: sqrt(mean_i ||x_i - x_bar||^2), the spread of the ranks' models."""
        avg = self.consensus_model()
        local = torch.tensor([float((self.flat.data - avg).pow(2).sum())], dtype=torch.float64)
        self.comm.allreduce(local)
        return float(local.item() / self.comm.size) ** 0.5
