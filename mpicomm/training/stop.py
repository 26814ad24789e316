"""Graceful stop on the signals a scheduler sends before a time limit or on preemption.

SLURM sends ``SIGTERM`` on preemption/cancel and, with ``--signal=USR1@N``, ``SIGUSR1`` N seconds before
the time limit. The handler only sets a flag; after each step the training loop has every rank agree on
it (see :mod:`mpicomm.training.health`), so every rank finishes the same step, commits a checkpoint and
exits together.
"""

from __future__ import annotations

import signal

__all__ = ["StopFlag"]


class StopFlag:
    """Set by SIGUSR1/SIGTERM (or by hand): ``signum`` is the signal this rank received, or None."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, install: bool = True):
        self.signum: int | None = None
        self._previous = {}
        if install:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def uninstall(self) -> None:
        """Restore the previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

