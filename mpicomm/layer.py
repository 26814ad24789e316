"""Where one parameter tensor lives in a flat buffer: a name, an offset and a shape (no torch needed).

:class:`~mpicomm.flat.FlatParameters` lays a model's parameters out as these; the planner describes models it
never builds with them, so ``mpicomm plan``, ``mpicomm slurm`` and the other commands start without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layer"]


@dataclass(frozen=True)
class Layer:
    """Where one parameter tensor lives in the flat buffer."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements of this parameter."""
        n = 1
        for s in self.shape:
            n *= s
        return n
