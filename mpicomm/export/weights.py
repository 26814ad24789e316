"""A trained model's ``state_dict`` from mpicomm's per-rank checkpoint files: as the run evaluated it, one
rank's, or the average of all.

Every rank's file holds the flat parameter vector (``ranks/R/algorithm/params``, named and shaped by the
meta's ``model_signature``) and the model's buffers by name (``ranks/R/buffers``: BatchNorm's running
mean, variance and batch count, and non-persistent buffers). Serial: h5py only, no MPI.

* the evaluated model (the default, ``buffers="evaluated"``): the training loop's final checkpoint keeps,
  in rank 0's file (``ranks/0/evaluated``), the model its last evaluation scored — the average of the
  ranks' parameters as the run computed it, with the BatchNorm statistics recomputed for those weights
  (``--eval-bn-batches``; rank 0's own with 0). Exported, it scores exactly what ``metrics.jsonl`` reports.
  The checkpoint of a run stopped by a signal (or ``--stop-at-step``) keeps the last evaluation's model too,
  of an earlier step: the one the app's final line scores, exported as that step's (``Weights.step``).
  A checkpoint without it (saved between evaluations, or by an older mpicomm) gives the average below.
* ``rank=R``: rank R's parameters and buffers, exactly as saved.
* the average (``rank=None``, ``buffers="average"`` or a rank): the mean of every rank's parameters
  (accumulated in float64, one rank file in memory at a time, then cast back), with the mean of every
  rank's floating-point buffers (``"average"``; integer buffers such as ``num_batches_tracked`` are rank
  0's) or every buffer of rank R (``buffers="R"``).

The keys are those of the model's own ``state_dict()``, recorded in the meta (``meta["model"]``, see
:mod:`mpicomm.checkpoint.model_record`): tied weights appear under each of their names (one tensor),
non-persistent buffers are left out, and ``model.load_state_dict(...)`` loads it strictly.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.store import read_index, read_rank_entry
from ..checkpoint.tree import CheckpointError

__all__ = ["ExportError", "Weights", "read_weights"]


class ExportError(ValueError):
    """The export cannot be made from this input (the message names the argument and what was expected)."""


@dataclass
class Weights:
    """A model's ``state_dict`` taken from a checkpoint, and where and how it was taken."""

    state_dict: dict[str, torch.Tensor]
    directory: Path
    meta: dict
    ranks: list[int]
    notes: list[str] = field(default_factory=list)
    step: int | None = None
    """The step whose model this is: the checkpoint's (None: ``meta["step"]``), or the step of the last
    evaluation kept in a stopped run's checkpoint."""

    def __post_init__(self):
        if self.step is None:
            self.step = int(self.meta["step"])

    @property
    def what(self) -> str:
        """In words: whose model this is (``"the average of 4 ranks' models"``, ``"rank 1's model"``)."""
        if len(self.ranks) == 1 and self.meta["world_size"] > 1:
            return f"rank {self.ranks[0]}'s model"
        return f"the average of {len(self.ranks)} ranks' models" if len(self.ranks) > 1 else "the model"


def _signature(meta: dict, directory: Path) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) of every flat parameter, from the meta's ``model_signature``."""
    text = meta.get("model_signature")
    if not isinstance(text, str):
        raise ExportError(f"{directory} records no model_signature: it was not written by mpicomm's training loop "
                          "(run_meta(comm, algo) in the checkpoint's meta)")
    return [(name, tuple(shape)) for name, shape in ast.literal_eval(text)[1]]


def _combine(directory: Path, meta: dict, save_id: str, ranks: list[int], buffers_from: int | None):
    """The flat parameters averaged over ``ranks`` (one rank: its own) and the buffers of ``buffers_from``.

    ``buffers_from=None``: floating-point buffers averaged over ``ranks``, the others the first rank's.
    One rank's tensors are in memory at a time, beside the float64 sums.
    """
    total, buffers, sums, dtype = None, {}, {}, None
    for rank in ranks:
        params = read_rank_entry(directory, rank, meta, save_id, ("algorithm", "params"))
        dtype = params.dtype
        total = params.double() if total is None else total.add_(params.double())
        if buffers_from is None or rank == buffers_from:
            own = read_rank_entry(directory, rank, meta, save_id, ("buffers",))
            buffers = own if rank == buffers_from or rank == ranks[0] else buffers
            for name, value in own.items():
                if buffers_from is None and value.is_floating_point():
                    sums[name] = sums[name].add_(value.double()) if name in sums else value.double()
    if buffers_from is None:
        buffers = {name: sums[name].div_(len(ranks)).to(value.dtype) if name in sums else value
                   for name, value in buffers.items()}
    return total.div_(len(ranks)).to(dtype), buffers


def _named(flat: torch.Tensor, signature, directory: Path) -> dict[str, torch.Tensor]:
    """The flat vector cut into the named parameters (each its own tensor, so a saved file holds no views)."""
    numel = sum(torch.Size(shape).numel() for _, shape in signature)
    if flat.numel() != numel:
        raise CheckpointError(f"{directory}: the saved parameters hold {flat.numel()} values, its model_signature "
                              f"{numel}")
    out, offset = {}, 0
    for name, shape in signature:
        size = torch.Size(shape).numel()
        out[name] = flat[offset:offset + size].view(shape).clone()
        offset += size
    return out


def _keyed(params: dict, buffers: dict, record: dict | None, notes: list[str]) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` from its parameters and buffers, keyed as the meta's record says."""
    if record is None:  # a checkpoint written before the record existed
        notes.append("this checkpoint does not record the model's state_dict keys (written by an older mpicomm): "
                     "the file holds every parameter once and every buffer, non-persistent ones included; "
                     "load it with load_state_dict(..., strict=False) if your model ties weights")
        return {**params, **buffers}
    values = {**buffers, **params}
    missing = [key for key, source in zip(record["state_keys"], record["state_sources"]) if source not in values]
    if missing:
        raise ExportError(f"the checkpoint holds no value for the state_dict entries {', '.join(missing[:5])}"
                          f"{' …' if len(missing) > 5 else ''}: frozen parameters and extra state are not checkpointed")
    return {key: values[source] for key, source in zip(record["state_keys"], record["state_sources"])}


def _evaluated(directory: Path, meta: dict, save_id: str):
    """``(params, buffers, step)`` of the model the run's last evaluation scored (rank 0's ``evaluated`` entry),
    or None. Its step is the checkpoint's, or an earlier one in the checkpoint of a stopped run."""
    entry = read_rank_entry(directory, 0, meta, save_id, ("evaluated",), missing_ok=True)
    if entry is None or int(entry["step"]) > int(meta["step"]):
        return None
    return entry["params"], entry["buffers"], int(entry["step"])


def read_weights(path, *, rank: int | None = None, buffers: str = "evaluated") -> Weights:
    """The ``state_dict`` of the model as the run evaluated it, of rank ``rank``'s, or of all ranks' average.

    ``path`` is a run directory (its ``latest`` checkpoint), a ``step-N`` directory or a ``checkpoint.h5``.
    ``buffers`` (without ``rank``): ``"evaluated"``, ``"average"`` or a rank whose buffers to take with the
    averaged parameters (see the module docstring). Bad input raises :class:`ExportError` or
    :class:`~mpicomm.checkpoint.CheckpointError` (both ``ValueError``).
    """
    directory, meta, save_id = read_index(path)
    size = meta["world_size"]
    signature = _signature(meta, directory)
    if rank is not None and not 0 <= rank < size:
        raise ExportError(f"--rank must be in [0, {size - 1}]: {directory} holds {size} ranks, got {rank}")
    if rank is not None and buffers not in ("evaluated", "average"):
        raise ExportError(f"--buffers applies to the averaged model only (--rank {rank} exports that rank's own)")
    if buffers not in ("evaluated", "average") and not (buffers.isdigit() and int(buffers) < size):
        raise ExportError(f"--buffers must be 'evaluated', 'average' or a rank in [0, {size - 1}], got {buffers!r}")
    notes: list[str] = []
    evaluated = _evaluated(directory, meta, save_id) if rank is None and buffers == "evaluated" else None
    step = int(meta["step"])
    if evaluated is not None:
        flat, kept, step = evaluated
        notes.append(f"the model the run evaluated at step {step}: the ranks' average with the "
                     f"{_buffer_words(kept)} it was scored with")
        if step != int(meta["step"]):
            notes.append(f"the run was stopped at step {meta['step']}, after its last evaluation; --buffers "
                         f"average exports the ranks' average at step {meta['step']} instead (not evaluated)")
        ranks = list(range(size))
    else:
        if rank is None and buffers == "evaluated":
            notes.append("this checkpoint holds no evaluated model (saved between evaluations, or by an older "
                         "mpicomm): the average of the ranks' models")
            buffers = "average"
        ranks = list(range(size)) if rank is None else [rank]
        buffers_from = rank if rank is not None else (None if buffers == "average" else int(buffers))
        flat, kept = _combine(directory, meta, save_id, ranks, buffers_from)
        if rank is None and any(value.is_floating_point() for value in kept.values()):
            words = _buffer_words(kept)
            notes.append(f"floating-point {words} averaged over the ranks too" if buffers_from is None
                         else f"{words} from rank {buffers_from}")
    state = _keyed(_named(flat, signature, directory), kept, meta.get("model"), notes)
    return Weights(state, directory, meta, ranks, notes, step)


def _buffer_words(buffers: dict) -> str:
    """How the notes name a model's buffers: its BatchNorm statistics where it has them, else its buffers."""
    return "BatchNorm statistics" if any(name.endswith("running_mean") for name in buffers) else "buffers"
