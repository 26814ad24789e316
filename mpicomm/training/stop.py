"""Graceful stop on the signals a scheduler sends before a time limit or on preemption.

SLURM sends ``SIGTERM`` on preemption/cancel and, with ``--signal=USR1@N``, ``SIGUSR1`` N seconds before
the time limit. The handler only sets a flag; after each step the training loop has every rank agree on
it (see :mod:`mpicomm.training.health`), so every rank finishes the same step, commits a checkpoint and
exits together. A signal that arrives while a rank is blocked in a collective it cannot leave reaches the
hang guard instead (:mod:`mpicomm.comm.guard`), which ends the rank within seconds.

A repeated signal changes nothing: the stop is already under way (the checkpoint is being written), and
once the run has stopped the handlers stay in place, ignoring further signals, until the process exits
with 128 + the signal number — a second ``scancel`` or Ctrl-C does not turn a clean stop into a kill.
"""

from __future__ import annotations

import signal

__all__ = ["StopFlag"]


class StopFlag:
    """Set by SIGUSR1/SIGTERM (or by hand): ``signum`` is the first signal this rank received, or None.

    ``guard``: a :class:`~mpicomm.comm.guard.WaitGuard` that should also learn of the signals (so that a rank
    blocked in a collective can still end).
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, install: bool = True, guard=None):
        self.signum: int | None = None
        self._previous = {}
        self._guard = guard if install else None
        if install:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            if guard is not None:
                guard.watch_signals()

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def uninstall(self, keep_ignoring: bool = False) -> None:
        """Restore the previous handlers; ``keep_ignoring``: ignore these signals from now on instead (a run
        that stopped on one and is about to exit)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if keep_ignoring else handler)
        self._previous.clear()
        if self._guard is not None:
            self._guard.unwatch_signals()
            self._guard = None
