"""The clock that applies a :class:`~mpicomm.net.model.CostModel` to real MPI calls, and times them.

With a model, each operation's modelled network time is added on top of the real transfer by
sleeping, so a run on one machine takes the wall-clock time it would take on the modelled network:

* blocking operation: the real call returns, then the rank waits until its link has carried the
  modelled cost (``start = max(now, link free)``, ``end = start + cost``);
* non-blocking operation: the modelled transfer is queued on the link when the operation is posted,
  so compute between post and ``wait()`` hides it; ``wait()`` returns once both the real request and
  the modelled transfer are done. Operations posted back to back queue behind each other on the link.

Without a model nothing is slept; the clock still measures the time the rank spends blocked in
communication. Counters (seconds, cumulative): ``blocked_s`` (inside communication calls and waits),
``slept_s`` (modelled transfer time the rank actually waited for, i.e. not hidden by compute),
``modelled_s`` (modelled cost of every operation, hidden or not).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..pausable import Pausable
from .model import CostModel

__all__ = ["NetClock"]


class NetClock(Pausable):
    """Applies ``model`` (or nothing, when None) to communication calls and accumulates their timing.

    Inside ``with clock.paused():`` calls are neither modelled nor timed (monitoring traffic).
    """

    def __init__(self, model: CostModel | None = None, *, now: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.model = model
        self._now, self._sleep = now, sleep
        self._link_free = 0.0
        self.blocked_s = 0.0
        self.slept_s = 0.0
        self.modelled_s = 0.0

    @property
    def active(self) -> bool:
        """Whether a model is applied right now (not paused)."""
        return self.model is not None and not self.is_paused

    def _queue(self, cost: float, ready: float) -> float:
        """Book ``cost`` seconds on the link, starting no earlier than ``ready``; return the end time."""
        start = max(ready, self._link_free)
        self._link_free = start + cost
        self.modelled_s += cost
        return self._link_free

    def _sleep_until(self, deadline: float, now: float) -> None:
        """Wait until ``deadline``; book ``deadline - now`` as slept (``now`` is when the wait began).

        Booking from the same ``now`` the deadline was computed against makes ``slept_s`` of a blocking
        call its modelled cost (to the float resolution of the clock's reading), however late this process
        is scheduled.
        """
        left = deadline - now
        if left > 0:
            self.slept_s += left
            remaining = deadline - self._now()
            if remaining > 0:
                self._sleep(remaining)

    def run(self, cost: Callable[[CostModel], float], call: Callable[[], object]):
        """A blocking operation: ``call()``, then wait out the modelled ``cost(model)`` on top."""
        if self.is_paused:
            return call()
        t0 = self._now()
        result = call()
        if self.model is not None:
            now = self._now()
            self._sleep_until(self._queue(cost(self.model), now), now)
        self.blocked_s += self._now() - t0
        return result

    def post(self, cost: Callable[[CostModel], float]) -> float:
        """A non-blocking operation is posted now: queue its modelled transfer; return its end time."""
        if not self.active:
            return 0.0
        return self._queue(cost(self.model), self._now())

    def complete(self, deadline: float, wait: Callable[[], object]):
        """``wait()`` for a posted operation, then until its modelled transfer (``deadline``) is done."""
        if self.is_paused:
            return wait()
        t0 = self._now()
        result = wait()
        self._sleep_until(deadline, self._now())
        self.blocked_s += self._now() - t0
        return result

    def passed(self, deadline: float) -> bool:
        """Whether the modelled transfer ending at ``deadline`` is over."""
        return self._now() >= deadline

    def totals(self) -> dict[str, float]:
        """The cumulative counters, for metrics (and checkpoints: :meth:`load_totals` continues them)."""
        return {"blocked_s": self.blocked_s, "slept_s": self.slept_s, "modelled_s": self.modelled_s}

    def load_totals(self, totals: dict[str, float]) -> None:
        """Set the cumulative counters to ``totals`` (a resumed run's)."""
        self.blocked_s, self.slept_s, self.modelled_s = (float(totals[k]) for k in
                                                         ("blocked_s", "slept_s", "modelled_s"))
