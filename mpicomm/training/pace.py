"""Free running: the ranks of an asynchronous method step at their own pace and share the run's steps.

In the loop's default lockstep every rank takes the run's ``total`` steps and the ranks agree after each
one (:mod:`.health`), so the slowest rank sets everyone's pace whatever the method exchanges. AD-PSGD's
promise (Lian et al., ICML 2018) is the opposite: a rank never waits for another's computation, so a slow
rank costs only its own share of the work. With ``free_running`` (asynchronous methods only: their step
holds no collective) the run is ``size x total`` steps of all ranks together -- the gradients a lockstep
run computes -- and a fast rank takes more of them than a slow one.

The ranks learn how far the run has come in *rounds*: each rank puts its own step count into a
non-blocking allgather on a private duplicate of the communicator and tests it after each of its steps.
A round completes once every rank has joined it, at the slowest rank's pace, but nobody waits for it.
Every rank then reads the same counts: the run's step is ``start + (sum of the counts) // size``, the
steps each rank would have taken in lockstep. Whatever needs every rank -- a log line, an evaluation, a
checkpoint, a stop signal, the end -- happens after the round whose step crosses it, so on every rank
after the same round; then the rank posts the next round. The learning rate follows the run's step as of
the last round.

A rank never runs further past the last round than the budget left (the steps all ranks still owe): once
its own steps would use it up, it waits for the round under the hang guard, so a stuck or lost rank is
still caught and no rank trains on past the run's end alone. That is the only wait, and it comes at the
end: a rank that waited for round r joins round r + 1 with at least the budget its steps used up, so the
counts of round r + 1 make up the run (no count ever shrinks) and the run ends at round r or r + 1.
:attr:`SharedSteps.waited` lists the rounds a rank waited for. The rounds themselves are
:class:`mpicomm.comm.rounds.CountRounds`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.rounds import CountRounds

__all__ = ["ASYNC_ONLY", "Round", "SharedSteps"]

ASYNC_ONLY = ("--free-running needs an asynchronous method (adpsgd, moniqua_adpsgd), whose step waits for no "
              "other rank; {name} exchanges with the other ranks in its step, so its ranks run in lockstep anyway")
"""The refusal for a method whose step holds a collective (formatted with ``name``)."""


@dataclass(frozen=True)
class Round:
    """What one completed round told every rank: the run's step and the highest stop signal any rank had."""

    step: int
    signal: int


class SharedSteps:
    """Collective at construction: the rounds of one free-running run over the Communicator ``comm``.

    ``start``: the run's step it begins at (a resumed run's); ``total``: the run's last step. Call
    :meth:`took_step` after each of this rank's steps, then :meth:`poll`; after a round that did not end
    the run, :meth:`post` the next one. :meth:`close` (collective) gathers every rank's waits into
    :attr:`waited_by_rank` and frees the private communicator.
    """

    def __init__(self, comm, start: int, total: int):
        self.comm, self.size = comm, comm.size
        self.start, self.owed = start, comm.size * (total - start)
        self.mine = 0  # this rank's steps since this run began
        self.known = 0  # every rank's steps together, as of the last round
        self.by_rank = [0] * self.size  # each rank's steps since this run began, as of the last round
        self.rounds = 0  # rounds completed (the first is posted here, with every count 0)
        self.waited: list[int] = []  # the rounds (1, 2, ...) this rank waited for: its budget was used up
        self.waited_by_rank: list[list[int]] = []  # every rank's ``waited``, gathered by close()
        self._rounds = CountRounds(comm, 2)
        self.post(0)

    def took_step(self) -> None:
        """Count one step (update) of this rank."""
        self.mine += 1

    def post(self, signum: int | None) -> None:
        """Join the next round with this rank's count and its pending stop signal (0 or None: none)."""
        self._rounds.post((self.mine, signum or 0))

    def poll(self) -> Round | None:
        """The round that completed since the last call, or None while it is still open (no wait, unless
        this rank's steps since it joined would use up the budget left: then it waits for the others)."""
        rounds = self._rounds
        if not rounds.open:
            return None
        ahead = self.mine - int(rounds.sent[0])
        if ahead >= self.owed - self.known:
            self.waited.append(self.rounds + 1)
            rounds.wait("the free-running ranks' step count (a rank is far behind)")
        elif not rounds.test():
            return None
        self.rounds += 1
        self.by_rank = [int(c) for c in rounds.received[:, 0]]
        self.known = sum(self.by_rank)
        return Round(self.start + self.known // self.size, int(rounds.received[:, 1].max()))

    def close(self) -> None:
        """Collective, after the last round has completed on every rank: gather every rank's waits, free the
        private communicator."""
        self.waited_by_rank = self.comm.allgather_object(self.waited, "the free-running ranks' waits")
        self._rounds.free()
