"""Loading a checkpoint of N ranks into a job of M ranks: the algorithm, buffers, generators, data position.

:func:`~mpicomm.checkpoint.store.load_checkpoint` with ``any_size=True`` gives every rank the N saved states;
:func:`load_resized` builds this rank's from them (the algorithm by its
:meth:`~mpicomm.algorithms.base.Algorithm.reshard_state`, the rules of :mod:`mpicomm.checkpoint.resize_rules`) and
loads it. What each part becomes (docs/checkpoints.md, Another world size):

* the algorithm's state: its family's rule;
* the model's buffers (BatchNorm statistics): carried when identical on every saved rank, floating-point
  ones averaged otherwise, others (the batch counter) rank 0's for new ranks past N;
* the global random generators (torch, CUDA, numpy, Python): new rank r < N continues old rank r's; a new
  rank r >= N seeds them from (the algorithm's seed, r, the step) (:func:`derived_seed`), so it draws a
  stream of its own, the same every time the same resize is resumed;
* the data position (:func:`resized_position`): the step continues; the epoch continues at the same share of
  its samples.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .placement import map_location
from .rng import restore_rng_state
from .tree import LazyTensor

__all__ = ["derived_seed", "load_resized", "resized_counters", "resized_position", "seed_generators"]


def derived_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for new rank ``rank`` of a run with ``seed`` resized at ``step`` (numpy's SeedSequence)."""
    words = np.random.SeedSequence([int(seed) & (2**63 - 1), int(rank), int(step)]).generate_state(2, np.uint32)
    return (int(words[0]) << 31 | int(words[1]) >> 1) & (2**63 - 1)


def seed_generators(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), numpy's global generator and Python's ``random`` with ``seed``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _buffers(saved: list[dict], model: torch.nn.Module, rank: int, size: int):
    """The model's buffers from every saved rank's by :func:`~mpicomm.checkpoint.resize_rules.agreed_or_merged`."""
    from .resize_rules import Resize, agreed_or_merged, reshard_tree

    built = {name: b.detach().clone() for name, b in model.named_buffers()}
    if not built:
        return {}
    return reshard_tree(saved, built, Resize(saved, built, rank, size, "buffers"), {"": agreed_or_merged})


def _read_whole(tree):
    """``tree`` with its :class:`~mpicomm.checkpoint.tree.LazyTensor` leaves read."""
    if isinstance(tree, LazyTensor):
        return tree.read()
    if isinstance(tree, dict):
        return {k: _read_whole(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_read_whole(v) for v in tree)
    return tree


def _parameters_in_place(new: dict, algo) -> dict:
    """``new`` (a state built by :meth:`reshard_state`) with its parameters, and its frozen ones, copied into the
    algorithm's own tensors and replaced by them.

    The tensors the rules assembled are freed before ``load_state_dict`` loads the optimizer state, which the
    optimizers copy again as they load it: without this the assembled parameters stay alive beside both copies
    of that state, one more tensor of the model's size at the restore's peak. ``load_state_dict`` then copies
    each of these tensors onto itself, which torch skips. Entries of another size (refused by
    ``load_state_dict``) are left as they are, and the algorithm's are not touched."""
    params, flat = new.get("params"), algo.flat.data
    if not torch.is_tensor(params) or params.numel() != flat.numel() or params is flat:
        return new
    frozen, own = new.get("frozen") or {}, algo.flat.frozen
    if frozen and (set(frozen) != set(own) or any(
            not torch.is_tensor(v) or v.numel() != own[k].numel() for k, v in frozen.items())):
        return new
    with torch.no_grad():
        flat.copy_(params.reshape(flat.shape))
        for name, value in frozen.items():
            own[name].copy_(value.reshape(own[name].shape))
    return {**new, "params": flat, **({"frozen": {name: own[name] for name in frozen}} if frozen else {})}


def load_resized(states: list[dict], algo, step: int, places: list[int] | None = None) -> dict:
    """Build this rank's state from the N saved ``states`` (each with ``algorithm``, ``buffers``, ``rng``; large
    tensors may be lazy, read a slice at a time) and load the algorithm, the buffers and the generators
    (``places``: each state's rank in the world that saved it, when some of its states are missing); returns
    old rank r's state for the rest (r < N; rank 0's otherwise) without its ``algorithm`` and ``buffers``, on
    this run's device. Raises ``ValueError`` where the method cannot continue (not collective: the caller
    agrees).

    Memory: the rules hold this rank's new state, the algorithm's own as built (its ``state_dict()``) and one
    slice of one saved entry; the new parameters then go straight into the algorithm's flat buffer, so that
    loading the rest (an optimizer copies its state as it loads it) holds the new optimizer state twice at most,
    as a restore at the saved size does."""
    device = algo.flat.data.device
    rank, size = algo.comm.rank, algo.comm.size
    new = _parameters_in_place(algo.reshard_state([s["algorithm"] for s in states], places), algo)
    new = map_location(new, device)
    buffers = _buffers([s["buffers"] for s in states], algo.model, rank, size)
    algo.load_state_dict(new)
    del new
    current = dict(algo.model.named_buffers())
    with torch.no_grad():
        for name, value in buffers.items():
            current[name].copy_(value)
    if rank < len(states):
        restore_rng_state(states[rank]["rng"], device)
    else:
        seed_generators(derived_seed(algo.config.seed, rank, step))
    mine = states[rank] if rank < len(states) else states[0]
    return map_location(_read_whole({k: v for k, v in mine.items() if k not in ("algorithm", "buffers")}), device)


def resized_counters(states: list[dict], rank: int) -> dict:
    """The run's counters for new rank ``rank``: old rank r's (bytes per operation and peer, times) for r < N; for
    r >= N rank 0's times with no bytes counted yet."""
    if rank < len(states):
        return states[rank].get("counters", {})
    counters = dict(states[0].get("counters", {}))
    if counters:
        counters["ledger"] = {"contributed": {}, "sent": {}, "received": {}, "links": {"sent": {}, "received": {}}}
    return counters


def resized_position(position: dict, old_size: int, new_size: int, steps_per_epoch: int) -> tuple[int, int, int]:
    """(step, epoch, batch) at ``new_size`` ranks for a position saved at ``old_size``: the step continues; within
    the epoch, the batches already taken (each of ``old_size`` ranks' batches) become the same share of the new
    ``steps_per_epoch`` (rounded down: a few samples of the epoch are seen again rather than skipped); past
    the epoch's end the next epoch begins."""
    step, epoch, batch = (int(position[k]) for k in ("step", "epoch", "batch"))
    old_per_epoch = int(position.get("steps_per_epoch", 0) or 0)
    if old_per_epoch > 0:
        batch = batch * steps_per_epoch // old_per_epoch
    else:  # a checkpoint that did not record it: the epoch's samples split over the ranks
        batch = batch * old_size // new_size
    if batch >= steps_per_epoch:
        epoch, batch = epoch + 1, 0
    return step, epoch, batch
