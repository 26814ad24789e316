"""A nestable pause switch, shared by the Ledger and the network clock (for monitoring traffic)."""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["Pausable"]


class Pausable:
    """Mixin: ``with obj.paused(): ...`` sets ``obj.is_paused`` for the block; pauses nest."""

    _pause_depth = 0

    @property
    def is_paused(self) -> bool:
        """Whether a :meth:`paused` block is open."""
        return self._pause_depth > 0

    @contextmanager
    def paused(self):
        """Pause for the duration of the ``with`` block."""
        self._pause_depth += 1
        try:
            yield
        finally:
            self._pause_depth -= 1
