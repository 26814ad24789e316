"""Reading a committed checkpoint, serially (no MPI): its index, and a rank's file checked against it.

:func:`read_index` and :func:`read_rank_entry` serve readers outside a job (``mpicomm export``);
``load_checkpoint`` reads through the same functions on every rank. A missing, incomplete, corrupted or
foreign file raises :class:`~.tree.CheckpointError` naming it.
"""

from __future__ import annotations

from pathlib import Path

import h5py

from .layout import FORMAT, IDENTITY, INDEX, latest_checkpoint, rank_group, rank_name
from .tree import CheckpointError, link_name, read_tree

__all__ = ["open_h5", "read_index", "read_index_file", "read_rank", "read_rank_entry", "resolve"]


def resolve(path: Path) -> Path:
    """The checkpoint directory meant by a ``checkpoint.h5`` path, a checkpoint directory or a root."""
    if path.is_file():
        return path.parent
    if (path / INDEX).is_file():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: expected a checkpoint.h5, a step-* directory holding "
                              "one, or a root directory holding step-* checkpoints")
    return found


def open_h5(path: Path, read):
    """``read(file)`` on the HDF5 file ``path``; unreadable or corrupted content raises CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        with h5py.File(path, "r") as f:
            return read(f)
    except (OSError, CheckpointError) as exc:
        raise CheckpointError(f"{path} is unreadable or corrupted: {exc}") from exc


def read_index_file(f: h5py.File, size: int | None) -> tuple[dict, str]:
    """(meta, save id) of an open ``checkpoint.h5``; ``size`` (None: any) is the world size it must have."""
    if f.attrs.get("format") != FORMAT:
        raise CheckpointError(f"not an mpicomm checkpoint index (format {f.attrs.get('format')!r})")
    meta = read_tree(f["meta"])
    size = meta["world_size"] if size is None else size
    if meta["world_size"] != size:
        raise ValueError(f"checkpoint has world size {meta['world_size']}, this job has {size}")
    if len(f["ranks"]) != size:
        raise CheckpointError(f"links {len(f['ranks'])} rank files, its world size is {size}")
    return meta, str(f.attrs["save_id"])


def read_rank(path: Path, rank: int, size: int, step: int, save_id: str, keys: tuple = (), missing_ok: bool = False,
              lazy_bytes: int | None = None):
    """Rank ``rank``'s state from its file (identity checked), or only the entry at ``keys`` (dict keys; None when
    it is absent and ``missing_ok``); tensors of ``lazy_bytes`` or more as :class:`~.tree.LazyTensor`."""
    def read(f):
        found = tuple(str(f.attrs.get(f"mpicomm_{key}")) for key in IDENTITY)
        want = tuple(str(v) for v in (rank, size, step, save_id))
        if found != want:
            raise CheckpointError(f"belongs to another save: its (rank, world size, step, save id) is {found}, "
                                  f"expected {want}")
        node = f[rank_group(rank)]
        for depth, key in enumerate(keys):
            if link_name(key) not in node:
                if missing_ok:
                    return None
                raise CheckpointError(f"rank {rank}'s state has no entry {list(keys[:depth + 1])}")
            node = node[link_name(key)]
        return read_tree(node, lazy_bytes)

    return open_h5(path, read)


def read_index(path_or_root) -> tuple[Path, dict, str]:
    """Serial (no MPI): (checkpoint directory, meta, save id) of a checkpoint dir, its checkpoint.h5, or a root.

    A missing, incomplete or corrupted index raises :class:`CheckpointError` naming the file.
    """
    directory = resolve(Path(path_or_root))
    meta, save_id = open_h5(directory / INDEX, lambda f: read_index_file(f, None))
    return directory, meta, save_id


def read_rank_entry(directory, rank: int, meta: dict, save_id: str, keys: tuple = (), missing_ok: bool = False):
    """Serial (no MPI): rank ``rank``'s state, or its entry at ``keys`` (``("algorithm", "params")``).

    ``directory``, ``meta`` and ``save_id`` come from :func:`read_index`; the rank file must belong to
    that save (its identity is checked) and be intact, else :class:`CheckpointError` names it. An absent
    entry is an error too, or None with ``missing_ok``.
    """
    path = Path(directory) / rank_name(rank)
    return read_rank(path, rank, meta["world_size"], meta["step"], save_id, tuple(keys), missing_ok)
