"""A user's own loop that outlives a lost rank: :class:`Elastic`, the library's ``--on-rank-loss continue``.

    job = mpicomm.init()
    algo = mpicomm.wrap(model, optimizer, "dpsgd", topology="ring")
    elastic = mpicomm.Elastic(algo, topology="ring", on_resize=lambda rank, size: loader.reshard(rank, size))
    while elastic.steps < total:
        x, y = batch(elastic.steps)                 # what this rank trains on at this step (its shard)
        with elastic.step():
            elastic.algo.zero_grad()
            loss_fn(model(x), y).backward()
            elastic.algo.step()

Each ``with elastic.step()`` ends with a commit, a uniform agreement of every rank, and a copy of the rank's state
(the algorithm's, the model's buffers, the random generators). When a rank dies, the block's MPI error (or the
commit's) is caught on every survivor: they shrink to the survivors, rebuild the algorithm around the same
model and optimizer at the new size, load the last committed state by the family rules of a resize
(:mod:`mpicomm.training.recovery`, docs/fault_tolerance.md), call ``on_resize(rank, size)`` for the data, and
the ``with`` block ends normally with :attr:`Elastic.steps` unchanged: the loop redoes that step. Only under
the fault-tolerant stack (``scripts/ft_run.sh``); elsewhere building one is refused in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
from typing import Callable

from . import topology as topologies
from .algorithms import make_algorithm
from .checkpoint.resize import load_resized
from .checkpoint.rng import capture_rng_state
from .comm import Communicator, raise_together, world
from .comm.faults import leave
from .training.recovery import Recovery, check_on_rank_loss

__all__ = ["Elastic"]


class Elastic:
    """Collective to build: keeps ``algo`` (from :func:`mpicomm.wrap`) training over lost ranks.

    ``topology``: the graph ``algo`` was wrapped with (rebuilt at each new size). ``on_resize(rank, size)``: called
    after a recovery with this rank's new place, to re-shard the user's data. ``min_ranks``: below this many
    survivors the job ends (``TrainingStopped`` on every rank).
    """

    def __init__(self, algo, *, topology: str = "ring", on_resize: Callable[[int, int], None] | None = None,
                 min_ranks: int = 1):
        error = None
        try:
            check_on_rank_loss("continue", min_ranks, algo.comm.size)
            topologies.build(topology, algo.comm.size)
        except ValueError as exc:
            error = exc
        raise_together(algo.comm, error)
        self.algo = algo
        self.steps = 0
        """Steps committed on every rank so far (a step a lost rank interrupted is not counted: redo it)."""
        self.recoveries: list[dict] = []
        """One record per recovery: ``step``, ``lost`` (ranks in the world before), ``old_size``, ``new_size``."""
        self._topology, self._on_resize = topology, on_resize
        self._optimizer = algo.optimizer if algo.user_optimizer else None
        self._options = {f.name: getattr(algo.config, f.name) for f in dataclasses.fields(algo.config)}
        self._recovery = Recovery(world(), self._rebuild, min_ranks)
        self._recovery.commit(self, (0, 0))

    @property
    def rank(self) -> int:
        """This rank's place in the job now."""
        return self.algo.comm.rank

    @property
    def size(self) -> int:
        """How many ranks the job has now."""
        return self.algo.comm.size

    def state(self, position) -> dict:
        """This rank's state between steps (what a commit keeps); ``position`` is unused (the step is :attr:`steps`)."""
        device = self.algo.flat.data.device
        return {"algorithm": self.algo.state_dict(), "rng": capture_rng_state(device),
                "buffers": {name: b.detach().clone() for name, b in self.algo.model.named_buffers()},
                "position": {"step": self.steps}}

    @contextlib.contextmanager
    def step(self):
        """One training step: commit it on every rank at the end, or recover from a lost rank (see the module)."""
        try:
            yield
            self.steps += 1
            self._recovery.commit(self, (0, 0))
        except Exception as exc:
            if not self._recovery.handles(exc):
                raise
            self._recover()

    def _rebuild(self, survivors):
        """The algorithm around the same model and optimizer on the survivors' world (collective)."""
        comm = Communicator(survivors, topologies.build(self._topology, survivors.size), net=self.algo.comm.net)
        return None, make_algorithm(self.algo.name, self.algo.model, comm, optimizer=self._optimizer, **self._options)

    def _recover(self) -> None:
        """Collective over the survivors: shrink, rebuild, load the committed state, re-shard, commit again."""
        while True:
            try:
                lost = self._recovery.recover()
                step = int(lost.states[0]["position"]["step"])
                load_resized(lost.states, lost.algo, step, lost.places)
                self.algo, self.steps = lost.algo, step
                self.recoveries.append({"step": step, "lost": lost.lost, "old_size": lost.old_size,
                                        "new_size": self.size})
                if not self.recoveries[:-1]:  # the first recovery: MPI_Finalize may hang after one (faults.leave)
                    atexit.register(leave, self._recovery.membership, 0)
                if self._on_resize is not None:
                    self._on_resize(self.rank, self.size)
                self._recovery.commit(self, (0, 0))
                return
            except Exception as exc:
                if not self._recovery.handles(exc):
                    raise
