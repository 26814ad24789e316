"""The collective save and load: every rank's state committed atomically as one checkpoint, and read back.

Commit protocol of :func:`save_checkpoint`: every rank writes and fsyncs its file in
``ROOT/.tmp-step-...``; the ranks agree that all writes succeeded; rank 0 writes and fsyncs
``checkpoint.h5``, renames the directory to ``step-...`` (atomic on POSIX) and only then replaces
``latest`` (write ``latest.tmp``, rename). A save that fails on any rank raises the same error on every
rank and removes its temporary directory; one that dies leaves a ``.tmp-`` directory that readers
ignore and the next save removes. All ranks must see the same file system at ``ROOT``.

The files' layout is :mod:`.layout`'s, their crash-safe writing :mod:`.durable`'s, the serial reading
:mod:`.reading`'s and the meta's comparison :mod:`.meta`'s. The ranks agree through
``comm.allgather_object`` only (:mod:`.agreement`): ``comm`` is a :class:`~mpicomm.comm.Communicator` or
any object with ``rank``, ``size`` and ``allgather_object``.
"""

from __future__ import annotations

import datetime
import os
import shutil
import uuid
import warnings
from pathlib import Path

import h5py

from . import durable
from .agreement import WHAT, agree, control
from .layout import (
    FORMAT,
    IDENTITY,
    INDEX,
    LATEST,
    latest_checkpoint,
    list_checkpoints,
    prune,
    rank_group,
    rank_name,
    set_aside_after,
    step_name,
)
from .meta import at_another_size, mismatch, optimizer_settings, run_meta, versions
from .reading import open_h5, read_index, read_index_file, read_rank, read_rank_entry, resolve
from .tree import write_tree

# Besides its own two functions, the names its importers (the training loop, export) have long taken from here.
__all__ = ["LAZY_BYTES", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "optimizer_settings",
           "read_index", "read_rank_entry", "run_meta", "save_checkpoint", "set_aside_after"]

_RESERVED = ("world_size", "step", "time", "versions")
LAZY_BYTES = 64 << 10
"""A checkpoint of another world size leaves tensors of this many bytes or more in its files until a rule reads
them (parameters, optimizer state, residuals); smaller ones (generators, counters) are read at once."""


# ---------------------------------------------------------------------------------------------- saving
def _check_save_args(step, meta, keep_last) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    reserved = sorted(set(meta) & set(_RESERVED))
    if reserved:
        raise ValueError(f"meta keys {reserved} are reserved: save_checkpoint records {list(_RESERVED)} itself")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")


def _paths(root: Path, step: int) -> tuple[Path, Path]:
    """(the committed directory, the temporary directory) of a save at ``step``."""
    return root / step_name(step), root / f".tmp-{step_name(step)}"


def _prepare(root: Path, final: Path, tmp: Path) -> str:
    """Rank 0: create ``root``, remove leftovers of crashed saves/prunes, create ``tmp``; return a save id."""
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():
        raise FileExistsError(f"{final} already exists; checkpoints are never overwritten")
    for stale in root.iterdir():
        if stale.name.startswith((".tmp-step-", ".trash-step-")):
            shutil.rmtree(stale)
    tmp.mkdir()
    return uuid.uuid4().hex


def _write_rank_file(path: Path, state: dict, identity: dict) -> None:
    """Write and fsync one rank's file; a failed write raises one ``OSError`` naming ``path`` and the cause."""
    def fill(f: h5py.File) -> None:
        write_tree(f.create_group(rank_group(identity["rank"])), state)
        for key, value in identity.items():
            f.attrs[f"mpicomm_{key}"] = value

    durable.write_h5(path, fill)


def _commit(root: Path, tmp: Path, final: Path, meta: dict, size: int, step: int, save_id: str) -> None:
    """Rank 0: write and fsync ``checkpoint.h5``, rename ``tmp`` to ``final``, then point ``latest`` at it."""
    index = tmp / INDEX
    full = {"world_size": size, "step": step, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": versions(), **meta}

    def fill(f: h5py.File) -> None:
        f.attrs["format"] = FORMAT
        f.attrs["save_id"] = save_id
        write_tree(f.create_group("meta"), full)
        ranks = f.create_group("ranks")
        for rank in range(size):
            ranks[f"{rank:05d}"] = h5py.ExternalLink(rank_name(rank), rank_group(rank))

    durable.write_h5(index, fill)
    durable.fsync(tmp)
    os.rename(tmp, final)
    durable.fsync(root)
    pointer = root / (LATEST + ".tmp")
    with open(pointer, "w") as fh:
        fh.write(final.name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(pointer, root / LATEST)
    durable.fsync(root)


def save_checkpoint(root, comm, state: dict, *, step: int, meta: dict | None = None,
                    keep_last: int | None = None, confirm=None) -> Path:
    """Collective: commit every rank's ``state`` as ``root/step-<step>``; returns that directory on every rank.

    ``meta`` (same on every rank; e.g. :func:`run_meta`) is stored in ``checkpoint.h5`` beside the
    world size, step, time and library versions. With ``keep_last``, older complete checkpoints beyond
    the newest ``keep_last`` are removed after the commit (a failure there only warns). ``confirm``: called on
    every rank once every rank has written, before the commit; it raises on every rank when one of them may
    not have (a lost rank, :meth:`mpicomm.training.recovery.Recovery.confirm`), and nothing is committed.
    """
    comm = control(comm)
    rank, size = comm.rank, comm.size
    meta, root = ({} if meta is None else meta), Path(root)
    error, save_id = None, None
    try:
        _check_save_args(step, meta, keep_last)
        if rank == 0:
            save_id = _prepare(root, *_paths(root, step))
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    gathered = agree(comm, error, "save_checkpoint", (save_id, durable.state_nbytes(state)))
    save_id = gathered[0][0]
    final, tmp = _paths(root, step)

    error = None
    if rank == 0:
        try:
            durable.check_space(tmp, sum(n for _, n in gathered))
        except OSError as exc:
            error = exc
    try:
        agree(comm, error, f"save_checkpoint(step={step})")  # nothing is written if it cannot fit
        error = None
        try:
            _write_rank_file(tmp / rank_name(rank), state, dict(zip(IDENTITY, (rank, size, step, save_id))))
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
        agree(comm, error, f"save_checkpoint(step={step})")
    except Exception:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.allgather_object(None, WHAT)  # no rank returns before the temporary directory is gone
        raise
    if confirm is not None:
        confirm()  # a lost rank: the staging directory stays uncommitted (the next save removes it)

    error = None
    if rank == 0:
        try:
            _commit(root, tmp, final, meta, size, step, save_id)
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None and keep_last is not None:
            try:
                prune(root, keep_last, final)
            except OSError as exc:
                warnings.warn(f"checkpoint {final} is committed, but pruning old ones failed: {exc}", stacklevel=2)
    agree(comm, error, f"save_checkpoint(step={step}) commit")
    return final


# ---------------------------------------------------------------------------------------------- loading
def load_checkpoint(path_or_root, comm, *, expect: dict | None = None, any_size: bool = False) -> tuple:
    """Collective: (this rank's state, the checkpoint's meta) from a checkpoint dir, its checkpoint.h5, or a root.

    Every rank raises the same error if the checkpoint is missing, incomplete or corrupted (naming the
    file), written by another world size, or if any entry of ``expect`` (compared with the stored meta;
    nested dicts on ``expect``'s keys, arrays and tensors exactly) differs.

    ``any_size``: a checkpoint of another world size N is not refused; then ``state`` is the list of all N
    saved ranks' states (old rank order) with every tensor of :data:`LAZY_BYTES` or more left in its file as a
    :class:`~.tree.LazyTensor` (read a slice at a time by the resize rules, so no rank holds N states at
    once), ``meta["world_size"]`` is N, and ``expect``'s
    topology is compared by its kind (``ring``), not its size or matrix ``W``. At the same size nothing changes.
    """
    comm = control(comm)
    rank, size = comm.rank, comm.size
    error, found = None, None
    if rank == 0:
        try:
            directory = resolve(Path(path_or_root))
            found = (directory, *open_h5(directory / INDEX, lambda f: read_index_file(f, None if any_size else size)))
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
    directory, meta, save_id = agree(comm, error, "load_checkpoint", found)[0]
    saved_size = int(meta["world_size"])
    if saved_size != size:
        expect = at_another_size(expect or {}, meta)

    error = None
    try:
        problem = mismatch("", meta, {} if expect is None else expect)
        if problem:
            raise ValueError(f"{problem} ({directory})")
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    agree(comm, error, "load_checkpoint")

    error, state = None, None
    try:
        if saved_size == size:
            state = read_rank(directory / rank_name(rank), rank, size, meta["step"], save_id)
        else:
            state = [read_rank(directory / rank_name(r), r, saved_size, meta["step"], save_id,
                               lazy_bytes=LAZY_BYTES) for r in range(saved_size)]
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    agree(comm, error, "load_checkpoint")
    return state, meta
