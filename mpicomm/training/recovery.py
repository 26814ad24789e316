"""``--on-rank-loss continue``: a lost rank costs the survivors the step it interrupted, not the job.

Under the fault-tolerant stack (:mod:`mpicomm.comm.faults`: Open MPI 5 with ULFM, ``scripts/ft_run.sh``) the
training loop ends every step with :meth:`Recovery.commit`, a uniform agreement of all ranks, and keeps a copy
of the rank's state as it stands after it (the same tree a checkpoint holds, :meth:`~.run.Run.state`). When a
rank dies, every survivor meets an MPI error — in the step's exchange, in an evaluation, in a checkpoint's
save, or at the latest in the next commit — and :meth:`Recovery.recover`:

1. revokes every communicator, so that nobody stays blocked, and joins the pending commit with a failed vote
   (every survivor has then made as many agreements, and none has kept the interrupted step);
2. shrinks the world to the survivors (``MPI_Comm_shrink``) and ends the run with one line if fewer than
   ``min_ranks`` are left;
3. gathers the survivors' committed states on every survivor and rebuilds the run at the new size (the
   topology, the communicator, this rank's share of the data and the algorithm: ``rebuild(world)``);
4. hands them to the new run, which loads them by the same family rules as a checkpoint resumed at another
   size (:func:`~mpicomm.checkpoint.resize.load_resized`): the centralized methods' state is identical on the
   survivors and carried, decentralized replicas re-form consensus, error-feedback residuals keep their
   mean, the DiLoCo family keeps its outer state, each survivor keeps its own generators.

The interrupted step is trained again; the data position continues where the committed step left it, as the
same share of the epoch over the survivors' shards. Cost: one agreement and one copy of the rank's state per
step (``bench/recovery``). Checkpoints go on at the new size; a save that a failure interrupted is never
committed (the checkpoint protocol's staging directory), and the next save writes a complete one.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..comm import faults
from ..comm.nodes import RANKS_PER_NODE_ENV, ranks_per_node_setting
from ..errors import TrainingStopped, mark_agreed

__all__ = ["ON_RANK_LOSS", "LostRanks", "Recovery", "check_on_rank_loss", "state_digest"]

ON_RANK_LOSS = ("stop", "continue", "replace")


def check_on_rank_loss(on_rank_loss: str, min_ranks: int, size: int) -> None:
    """Refuse (``ValueError``, one line) a policy this job cannot keep: ``continue`` needs the fault-tolerant stack."""
    if on_rank_loss not in ON_RANK_LOSS:
        raise ValueError(f"--on-rank-loss must be one of {', '.join(ON_RANK_LOSS)}, got {on_rank_loss!r}")
    if not 1 <= min_ranks <= max(size, 1):
        raise ValueError(f"--min-ranks must be between 1 and the job's {size} ranks, got {min_ranks}")
    if on_rank_loss != "stop" and not faults.available():
        raise ValueError(f"--on-rank-loss {on_rank_loss} needs an MPI that survives a lost rank, and this job's does "
                         "not (MPICH, or Open MPI launched without --with-ft ulfm): set up the fault-tolerant stack "
                         "once with scripts/setup_env.sh --ft and launch with scripts/ft_run.sh -n N python ...")


def _tensors(tree, path: tuple = ()):
    """``(path, tensor)`` for every tensor leaf of ``tree`` (dicts, lists and tuples)."""
    if torch.is_tensor(tree):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _tensors(value, (*path, index))


def _replaced(tree, swap, leaf=torch.is_tensor, path: tuple = ()):
    """``tree`` with each leaf ``v`` at ``path`` (``leaf(v)``: a tensor by default) replaced by ``swap(path, v)``."""
    if leaf(tree):
        return swap(path, tree)
    if isinstance(tree, dict):
        return {key: _replaced(value, swap, leaf, (*path, key)) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replaced(value, swap, leaf, (*path, index)) for index, value in enumerate(tree))
    return tree


def state_digest(tensor: torch.Tensor) -> str:
    """A digest of ``tensor``'s dtype, shape and bytes."""
    data = tensor.detach().cpu().contiguous().reshape(-1)
    raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return hashlib.blake2b(f"{tensor.dtype}{tuple(tensor.shape)}".encode() + raw, digest_size=16).hexdigest()


class _Same:
    """Stands for a tensor that every survivor holds alike (each puts its own copy back in)."""


def _gather_states(world, state: dict | None) -> list[dict]:
    """Collective: every survivor's ``state``, in rank order (a replacement that just joined passes None and gets
    them too). A tensor that every survivor holds alike (the centralized methods' parameters and optimizer state,
    the DiLoCo family's outer state) is not gathered: only a digest of it is, each survivor puts its own copy back,
    and rank 0 (a survivor) sends one copy to the replacements; what differs (replicas, residuals, generators) is."""
    digests = None if state is None else {path: state_digest(t) for path, t in _tensors(state)}
    every = world.allgather_object(digests, "the digests of the survivors' states")
    present = [d for d in every if d is not None]
    alike = {path for path, digest in present[0].items() if all(d.get(path) == digest for d in present)}
    mine = {} if state is None else dict(_tensors(state))
    sent = None if state is None else _replaced(state, lambda path, t: _Same() if path in alike else t)
    gathered = [other for other in world.allgather_object(sent, "the survivors' committed states") if other is not None]
    if len(present) < world.size:  # replacements: one copy of what the survivors hold alike, from rank 0
        shared = world.bcast_object({path: mine[path] for path in alike} if world.rank == 0 else None,
                                    what="the survivors' shared state")
        mine = mine or shared
    # every _Same put back as this rank's own tensor at its path
    return [_replaced(other, lambda path, _: mine[path], lambda v: isinstance(v, _Same)) for other in gathered]


@dataclass
class LostRanks:
    """What :meth:`Recovery.recover` (and :meth:`Recovery.join`) hand to the run that continues on the survivors."""

    lost: list[int]
    """The ranks, in the world before, that are gone."""
    old_size: int
    states: list[dict]
    """Every survivor's state after the last committed step, in the new rank order."""
    places: list[int]
    """Each survivor's rank before the loss."""
    task: object
    algo: object
    rank0_survived: bool
    """Whether the process that was rank 0 (which holds ``--out-dir``'s lock and writes the metrics) still is."""
    started: float
    """``time.perf_counter()`` when this rank began recovering (joining)."""
    joined: list[int]
    """The ranks of the replacements that joined (``--on-rank-loss replace``), the last ones; empty otherwise."""


class Recovery:
    """Collective to build (on every rank of ``world``): commits steps and rebuilds the run after a lost rank.

    ``rebuild(world)``: collective over the survivors' :class:`~mpicomm.comm.World`; returns ``(task, algo)`` built
    at its size, this rank's data shard included. ``min_ranks``: below this many survivors the run ends.
    ``replace``: the command (a list, as ``sys.argv`` with the interpreter first) that the survivors start once per
    lost rank so that the job keeps its size (``--on-rank-loss replace``); None: continue on the survivors.
    """

    def __init__(self, world, rebuild: Callable, min_ranks: int = 1, replace: list[str] | None = None,
                 membership=None):
        self.membership = membership or faults.Membership(world)
        self.rebuild = rebuild
        self.min_ranks = min_ranks
        self.replace = replace
        self.size = self.membership.world.size  # the size a replacing job keeps
        self.snapshot: dict | None = None
        self._committing = False
        self._ranks_per_node = os.environ.get(RANKS_PER_NODE_ENV)  # emulated nodes, as the job was launched
        self._since: tuple[list[str], float] | None = None
        """The processes of the world the snapshot was committed in and when recovering from it began, while a run
        is not yet continued on the survivors (a loss during a recovery restarts it from there)."""

    def commit(self, run, position: tuple[int, int]) -> None:
        """Collective: end this step on every rank (or raise the loss on every survivor) and keep its state."""
        self._committing = True
        self.membership.commit()
        self._committing = False
        self._since = None  # the run goes on: a later loss is recovered from this step
        # every tensor copied: what stays true whatever the next step does to the live ones
        self.snapshot = _replaced(run.state(position), lambda path, t: t.detach().clone())

    def confirm(self) -> None:
        """Collective: raise the loss on every survivor if any rank is gone, before something outlives the step (an
        evaluation's record, a checkpoint's commit): data a collective completed without a dead rank is never kept."""
        self._committing = True
        self.membership.commit()
        self._committing = False

    def handles(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a lost rank this run can continue without (a step has been committed)."""
        return self.snapshot is not None and faults.is_rank_loss(exc)

    def recover(self) -> LostRanks:
        """Collective over the survivors: shrink to them (and start replacements), gather their committed states,
        rebuild the run. A recovery that a further loss interrupted starts again here; the run it then continues
        counts the ranks lost since the last committed step, in the world of that step, and its time since the
        first loss (the snapshot's states are that world's)."""
        if self._since is None:
            self._since = (list(self.membership.origin), time.perf_counter())
        self.membership.revoke()
        if not self._committing:
            self.membership.vote_failed()
        self._committing = False
        before = list(self.membership.origin)
        world, lost = self.membership.shrink()
        first, started = self._since
        if all(process in first for process in self.membership.origin):  # no replacement among the survivors
            before = first
            lost = [rank for rank, process in enumerate(before) if process not in self.membership.origin]
        step = self.snapshot["position"]["step"]
        if world.size < self.min_ranks:
            message = (f"rank(s) {', '.join(map(str, lost))} lost at step {step}: {world.size} left, fewer than "
                       f"--min-ranks {self.min_ranks}; the last checkpoint resumes the run at any size (--resume "
                       "latest)")
            raise mark_agreed(TrainingStopped(message), message, range(world.size), world.size)
        survivors = list(self.membership.origin)
        places = [before.index(process) for process in survivors]
        joined: list[int] = []
        if self.replace is not None and world.size < self.size:
            world = self.membership.grow(self.size - world.size, self.replace)
            joined = list(range(len(survivors), world.size))
            world.bcast_object((lost, len(before), places, survivors[0] == before[0]), what="the loss")
        return self._rebuilt(world, self.snapshot, lost, len(before), places, survivors[0] == before[0], started,
                             joined)

    @classmethod
    def join(cls, membership, rebuild: Callable, min_ranks: int = 1, replace: list[str] | None = None
             ) -> tuple[Recovery, LostRanks]:
        """In a replacement process, collective with the survivors' :meth:`recover`: receive their committed states
        from them (no checkpoint is read) and build this rank's part of the run."""
        started = time.perf_counter()
        recovery = cls(membership.world, rebuild, min_ranks, replace, membership)
        world = membership.world
        lost, old_size, places, rank0_survived = world.bcast_object(None, what="the loss")
        joined = list(range(len(places), world.size))
        return recovery, recovery._rebuilt(world, None, lost, old_size, places, rank0_survived, started, joined)

    def _emulate_nodes(self, size: int) -> None:
        """Emulated nodes (``MPICOMM_RANKS_PER_NODE=k``) at ``size`` ranks: as launched where ``k`` divides them;
        otherwise every rank is a node of its own (the two-level collectives flat under ``hierarchical`` auto), as
        real nodes that no longer hold the same number of ranks run flat, instead of refusing the rebuild."""
        if self._ranks_per_node is None:
            return
        os.environ[RANKS_PER_NODE_ENV] = self._ranks_per_node
        k = ranks_per_node_setting()
        if k is not None and size % k:
            os.environ[RANKS_PER_NODE_ENV] = "1"

    def _rebuilt(self, world, snapshot, lost, old_size, places, rank0_survived, started, joined) -> LostRanks:
        """Collective over the new world: the survivors' states on every rank, and the run rebuilt at its size."""
        states = _gather_states(world, snapshot)
        self._emulate_nodes(world.size)
        task, algo = self.rebuild(world)
        return LostRanks(lost, old_size, states, places, task, algo, rank0_survived, started, joined)
