"""Save, load, list and prune checkpoints: one HDF5 file per rank joined by ``checkpoint.h5``, committed atomically.

Layout under a root directory (see docs/checkpoints.md)::

    ROOT/latest                      "step-000000123": the last committed checkpoint
    ROOT/step-000000123/checkpoint.h5   rank 0: /meta (world size, step, time, versions, caller's meta),
                                     /ranks/00000 -> ExternalLink("rank-00000.h5", "/ranks/00000"), ...
    ROOT/step-000000123/rank-00000.h5   rank 0's state under /ranks/00000, written by rank 0

Commit protocol of :func:`save_checkpoint`: every rank writes and fsyncs its file in
``ROOT/.tmp-step-...``; the ranks agree that all writes succeeded; rank 0 writes and fsyncs
``checkpoint.h5``, renames the directory to ``step-...`` (atomic on POSIX) and only then replaces
``latest`` (write ``latest.tmp``, rename). A save that fails on any rank raises the same error on every
rank and removes its temporary directory; one that dies leaves a ``.tmp-`` directory that readers
ignore and the next save removes. All ranks must see the same file system at ``ROOT``.

Collective calls use the communicator only for ``allgather`` of small Python objects: ``comm`` is a
:class:`~mpicomm.comm.Communicator` or anything with ``Get_rank``, ``Get_size`` and ``allgather``.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import errno
import importlib.metadata
import json
import os
import platform
import re
import shutil
import uuid
import warnings
from pathlib import Path

import h5py
import numpy as np
import torch

from .. import __version__
from ..errors import mark_agreed
from .model_record import model_record
from .tree import LIBVER, CheckpointError, link_name, read_tree, write_tree

__all__ = ["latest_checkpoint", "list_checkpoints", "load_checkpoint", "optimizer_settings", "read_index",
           "read_rank_entry", "run_meta", "save_checkpoint", "set_aside_after"]

INDEX = "checkpoint.h5"
LATEST = "latest"
FORMAT = "mpicomm-checkpoint/1"
_STEP_DIR = re.compile(r"step-(\d{9,})")
_RESERVED = ("world_size", "step", "time", "versions")
_IDENTITY = ("rank", "world_size", "step", "save_id")
_HELD_BYTES = 64 << 20  # what a failed HDF5 file keeps in memory after its failed write, at most
LAZY_BYTES = 64 << 10
"""A checkpoint of another world size leaves tensors of this many bytes or more in its files until a rule reads
them (parameters, optimizer state, residuals); smaller ones (generators, counters) are read at once."""


def _step_name(step: int) -> str:
    return f"step-{step:09d}"


def _rank_name(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def _rank_group(rank: int) -> str:
    """Where a rank's state lives, the same path in its own file and in checkpoint.h5."""
    return f"/ranks/{rank:05d}"


class _Agreement:
    """A Communicator's rank, size and guarded ``allgather_object``, under the names mpi4py uses."""

    def __init__(self, comm):
        self._comm = comm

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's spelling
        return self._comm.rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's spelling
        return self._comm.size

    def allgather(self, obj):
        return self._comm.allgather_object(obj, "the checkpoint's agreement")


def _raw(comm):
    """What the store gathers with: a Communicator's guarded control plane, or an mpi4py communicator."""
    if hasattr(comm, "allgather_object"):
        return _Agreement(comm)
    if not all(hasattr(comm, a) for a in ("Get_rank", "Get_size", "allgather")):
        raise TypeError(f"comm must be a Communicator or an mpi4py communicator, got {type(comm).__name__}")
    return comm


def _error_class(error: BaseException) -> type:
    """The nearest class of ``error`` every rank can rebuild: CheckpointError or a builtin exception."""
    return next(c for c in type(error).__mro__ if c is CheckpointError or getattr(builtins, c.__name__, None) is c)


def _agree(raw, error: Exception | None, what: str, payload=None) -> list:
    """Collective: every rank raises if any rank failed (first failure's type and message); else all payloads."""
    mine = None if error is None else (_error_class(error).__name__, type(error).__name__, str(error),
                                         getattr(error, "errno", None))
    gathered = raw.allgather((mine, payload))
    failed = [(rank, report) for rank, (report, _) in enumerate(gathered) if report is not None]
    if failed:
        rank, (name, kind, message, code) = failed[0]
        more = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        text = f"{what} failed on rank {rank}{more}: {kind}: {message}"
        cls = CheckpointError if name == "CheckpointError" else getattr(builtins, name)
        try:
            exc = cls(text)
        except TypeError:  # a builtin needing more arguments (UnicodeEncodeError)
            exc = RuntimeError(text)
        if isinstance(exc, OSError):
            exc.errno = code
        raise mark_agreed(exc, message, [r for r, _ in failed], len(gathered)) from error
    return [p for _, p in gathered]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _versions() -> dict:
    try:
        mpi4py = importlib.metadata.version("mpi4py")
    except importlib.metadata.PackageNotFoundError:
        mpi4py = None
    return {"mpicomm": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version, "mpi4py": mpi4py}


def run_meta(comm, algorithm=None) -> dict:
    """Standard meta/expect entries: the Communicator's topology (name, W) and the algorithm's name, config, model.

    With an algorithm, ``model_signature`` (its flat parameters' names and shapes, compared on resume)
    and ``model`` (:func:`~.model_record.model_record`: the ``state_dict`` keys and, for a transformers
    model, its class and config; what ``mpicomm export`` rebuilds the model's files from).
    """
    out = {}
    schedule = getattr(comm, "schedule", None)
    if schedule is not None:
        mats = [np.array(schedule.at(t).W) for t in range(schedule.period)]
        out["topology"] = {"name": schedule.name, "W": mats[0] if len(mats) == 1 else np.stack(mats)}
    if algorithm is not None:
        out["algorithm"] = {"name": algorithm.name, "config": dataclasses.asdict(algorithm.config)}
        out["optimizer"] = optimizer_settings(getattr(algorithm, "optimizer", None))
        out["model_signature"] = repr(algorithm.flat.signature())
        out["model"] = model_record(algorithm.model)
    return out


def optimizer_settings(optimizer) -> str:
    """JSON of what an optimizer's steps depend on besides its state: its type and each parameter group's
    options (the learning rate aside: the run's schedule sets it). ``"{}"`` without an optimizer."""
    if optimizer is None:
        return "{}"
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
              for g in optimizer.param_groups]
    return json.dumps({"type": type(optimizer).__name__, "groups": groups}, sort_keys=True, default=repr)


# ---------------------------------------------------------------------------------------------- listing
def list_checkpoints(root) -> list[Path]:
    """Complete checkpoints (``step-*`` directories holding ``checkpoint.h5``) under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and (p / INDEX).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def set_aside_after(root, step: int) -> list[Path]:
    """Rename the complete checkpoints of ``root`` past ``step`` to ``superseded-step-…`` (never deleted); return them.

    A run resumed from an earlier checkpoint re-trains the steps after it: its own later checkpoints would
    collide with those names. Renamed, they stay on disk (``list_checkpoints`` no longer sees them).
    """
    moved = []
    for path in list_checkpoints(root):
        if int(path.name[5:]) > step:
            target = path.with_name(f"superseded-{path.name}")
            suffix = 1
            while target.exists():
                target, suffix = path.with_name(f"superseded-{path.name}.{suffix}"), suffix + 1
            os.rename(path, target)
            moved.append(target)
    return moved


def latest_checkpoint(root) -> Path | None:
    """The checkpoint ``root/latest`` names (else the newest complete one), or None if there is none."""
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        name = ""
    if _STEP_DIR.fullmatch(name) and (root / name / INDEX).is_file():
        return root / name
    found = list_checkpoints(root)
    return found[-1] if found else None


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
    return root / _step_name(step), root / f".tmp-{_step_name(step)}"


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


class _Sink:
    """A file for h5py's file-object driver that never reports a failed write to HDF5.

    HDF5 does not survive an I/O error in the middle of a file: the dataset whose flush failed stays
    half-closed in the library's table of open objects, and the library's own clean-up at process exit
    (``H5_term_library``) then crashes on it (SIGSEGV, after the run's last line). So this object writes
    ``path`` itself; once a write fails it keeps the error in ``error``, and what HDF5 writes after it in
    memory (read back from there), so that HDF5 completes and closes the file as if nothing had happened.
    The caller then raises ``error`` and removes the file. Memory is bounded: past ``_HELD_BYTES`` kept,
    later writes are dropped (read back as zeros). HDF5 reads back nothing of a file it writes front to
    back as the store does, unless its metadata cache overflows, so that is a margin, not a need.
    """

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = self.size = 0
        self.error: OSError | None = None
        self._held: list[tuple[int, bytes]] = []  # (offset, data) written after the error, in order
        self._held_bytes = 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move to ``offset`` (from the start, the current position or the end)."""
        self.pos = offset + {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        return self.pos

    def tell(self) -> int:
        """The current position."""
        return self.pos

    def write(self, data) -> int:
        """Write ``data`` at the current position: to the file, or to memory once a write has failed."""
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += os.pwrite(self.fd, view[done:], self.pos + done)
            except OSError as exc:
                self.error = exc
        if self.error is not None and self._held_bytes + len(view) <= _HELD_BYTES:
            self._held.append((self.pos, bytes(view)))
            self._held_bytes += len(view)
        self.pos += len(view)
        self.size = max(self.size, self.pos)
        return len(view)

    def readinto(self, buffer) -> int:
        """Read at the current position what was written there (zeros where nothing was)."""
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self.pos))
        got = os.pread(self.fd, n, self.pos) if n else b""
        view[:len(got)] = got
        view[len(got):n] = bytes(n - len(got))
        for offset, data in self._held:
            lo, hi = max(offset, self.pos), min(offset + len(data), self.pos + n)
            if lo < hi:
                view[lo - self.pos:hi - self.pos] = data[lo - offset:hi - offset]
        self.pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes from the current position (all of the rest with -1)."""
        buffer = bytearray(max(0, self.size - self.pos) if size < 0 else size)
        return bytes(buffer[:self.readinto(buffer)])

    def truncate(self, size: int) -> int:
        """Set the file's size (HDF5's end of allocated space)."""
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self.error = exc
        self.size = size
        return size

    def flush(self) -> None:
        """Nothing to do: writes go straight to the file (fsynced when complete)."""


def _write_h5(path: Path, fill) -> None:
    """Create the HDF5 file ``path`` with ``fill(file)``, then fsync it.

    A write that fails (a full disk) raises one ``OSError`` naming ``path``, with its errno, after HDF5
    has closed the file cleanly (:class:`_Sink`); the half-written file is removed.
    """
    sink = _Sink(path)
    try:
        with h5py.File(sink, "w", libver=LIBVER) as f:
            fill(f)
        if sink.error is None:
            try:
                os.fsync(sink.fd)
            except OSError as exc:
                sink.error = exc
    finally:
        os.close(sink.fd)
    if sink.error is not None:
        path.unlink(missing_ok=True)
        code = sink.error.errno
        raise OSError(code, os.strerror(code) if code else str(sink.error), str(path)) from sink.error


def _write_rank_file(path: Path, state: dict, identity: dict) -> None:
    """Write and fsync one rank's file; a failed write raises one ``OSError`` naming ``path`` and the cause."""
    def fill(f: h5py.File) -> None:
        write_tree(f.create_group(_rank_group(identity["rank"])), state)
        for key, value in identity.items():
            f.attrs[f"mpicomm_{key}"] = value

    _write_h5(path, fill)


def _state_nbytes(state) -> int:
    """Bytes of the tensors and arrays in ``state`` (a nested dict/list): what its rank file will hold."""
    if isinstance(state, dict):
        return sum(_state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_nbytes(v) for v in state)
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    return int(getattr(state, "nbytes", 64))


def _check_space(directory: Path, need: int) -> None:
    """Refuse a save that cannot fit, before any byte is written (HDF5 adds a little beyond the raw data)."""
    free = shutil.disk_usage(directory).free
    want = int(need * 1.05) + (1 << 20)
    if free < want:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the checkpoint needs about "
                      f"{want / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free", str(directory))


def _commit(root: Path, tmp: Path, final: Path, meta: dict, size: int, step: int, save_id: str) -> None:
    """Rank 0: write and fsync ``checkpoint.h5``, rename ``tmp`` to ``final``, then point ``latest`` at it."""
    index = tmp / INDEX
    full = {"world_size": size, "step": step, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": _versions(), **meta}

    def fill(f: h5py.File) -> None:
        f.attrs["format"] = FORMAT
        f.attrs["save_id"] = save_id
        write_tree(f.create_group("meta"), full)
        ranks = f.create_group("ranks")
        for rank in range(size):
            ranks[f"{rank:05d}"] = h5py.ExternalLink(_rank_name(rank), _rank_group(rank))

    _write_h5(index, fill)
    _fsync(tmp)
    os.rename(tmp, final)
    _fsync(root)
    pointer = root / (LATEST + ".tmp")
    with open(pointer, "w") as fh:
        fh.write(final.name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(pointer, root / LATEST)
    _fsync(root)


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    """Rank 0: remove all but the newest ``keep_last`` complete checkpoints, never ``keep`` (renamed away first)."""
    others = [p for p in list_checkpoints(root) if p != keep]
    for old in others[: max(0, len(others) - (keep_last - 1))]:
        trash = root / f".trash-{old.name}"
        os.rename(old, trash)
        shutil.rmtree(trash)


def save_checkpoint(root, comm, state: dict, *, step: int, meta: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Collective: commit every rank's ``state`` as ``root/step-<step>``; returns that directory on every rank.

    ``meta`` (same on every rank; e.g. :func:`run_meta`) is stored in ``checkpoint.h5`` beside the
    world size, step, time and library versions. With ``keep_last``, older complete checkpoints beyond
    the newest ``keep_last`` are removed after the commit (a failure there only warns).
    """
    raw = _raw(comm)
    rank, size = raw.Get_rank(), raw.Get_size()
    meta, root = ({} if meta is None else meta), Path(root)
    error, save_id = None, None
    try:
        _check_save_args(step, meta, keep_last)
        if rank == 0:
            save_id = _prepare(root, *_paths(root, step))
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    gathered = _agree(raw, error, "save_checkpoint", (save_id, _state_nbytes(state)))
    save_id = gathered[0][0]
    final, tmp = _paths(root, step)

    error = None
    if rank == 0:
        try:
            _check_space(tmp, sum(n for _, n in gathered))
        except OSError as exc:
            error = exc
    try:
        _agree(raw, error, f"save_checkpoint(step={step})")  # nothing is written if it cannot fit
        error = None
        try:
            _write_rank_file(tmp / _rank_name(rank), state,
                             {"rank": rank, "world_size": size, "step": step, "save_id": save_id})
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
        _agree(raw, error, f"save_checkpoint(step={step})")
    except Exception:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raw.allgather(None)  # no rank returns before the temporary directory is gone
        raise

    error = None
    if rank == 0:
        try:
            _commit(root, tmp, final, meta, size, step, save_id)
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None and keep_last is not None:
            try:
                _prune(root, keep_last, final)
            except OSError as exc:
                warnings.warn(f"checkpoint {final} is committed, but pruning old ones failed: {exc}", stacklevel=2)
    _agree(raw, error, f"save_checkpoint(step={step}) commit")
    return final


# ---------------------------------------------------------------------------------------------- loading
def _resolve(path: Path) -> Path:
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


def _open(path: Path, read):
    """``read(file)`` on the HDF5 file ``path``; unreadable or corrupted content raises CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        with h5py.File(path, "r") as f:
            return read(f)
    except (OSError, CheckpointError) as exc:
        raise CheckpointError(f"{path} is unreadable or corrupted: {exc}") from exc


def _read_index(f: h5py.File, size: int | None) -> tuple[dict, str]:
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


def _show(value) -> str:
    if isinstance(value, (np.ndarray, torch.Tensor)):
        text = np.array2string(np.asarray(value.detach().cpu().double() if torch.is_tensor(value) else value),
                               threshold=16, separator=", ").replace("\n", "")
        return f"{type(value).__name__} of shape {tuple(value.shape)} {text}"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _mismatch(label: str, have, want) -> str | None:
    """How ``have`` (stored) differs from ``want`` (expected), or None; dicts are compared on want's keys."""
    if isinstance(want, dict) and isinstance(have, dict):
        for key, sub in want.items():
            name = f"{label}.{key}" if label else str(key)
            if key not in have:
                return f"checkpoint has no {name!r} (it has {sorted(map(str, have))})"
            found = _mismatch(name, have[key], sub)
            if found:
                return found
        return None
    if isinstance(want, (np.ndarray, torch.Tensor)) or isinstance(have, (np.ndarray, torch.Tensor)):
        a, b = (np.asarray(v.detach().cpu().double() if torch.is_tensor(v) else v) for v in (have, want))
        same = a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(want, (list, tuple)) and isinstance(have, (list, tuple)) and len(want) == len(have):
        return next((m for i, (h, w) in enumerate(zip(have, want)) if (m := _mismatch(f"{label}[{i}]", h, w))), None)
    else:
        same = type(have) is type(want) and have == want
    return None if same else f"checkpoint has {label} {_show(have)}, this job has {_show(want)}"


def _read_rank(path: Path, rank: int, size: int, step: int, save_id: str, keys: tuple = (), missing_ok: bool = False,
               lazy_bytes: int | None = None):
    """Rank ``rank``'s state from its file (identity checked), or only the entry at ``keys`` (dict keys; None when
    it is absent and ``missing_ok``); tensors of ``lazy_bytes`` or more as :class:`~.tree.LazyTensor`."""
    def read(f):
        found = tuple(str(f.attrs.get(f"mpicomm_{key}")) for key in _IDENTITY)
        want = tuple(str(v) for v in (rank, size, step, save_id))
        if found != want:
            raise CheckpointError(f"belongs to another save: its (rank, world size, step, save id) is {found}, "
                                  f"expected {want}")
        node = f[_rank_group(rank)]
        for depth, key in enumerate(keys):
            if link_name(key) not in node:
                if missing_ok:
                    return None
                raise CheckpointError(f"rank {rank}'s state has no entry {list(keys[:depth + 1])}")
            node = node[link_name(key)]
        return read_tree(node, lazy_bytes)

    return _open(path, read)


def read_index(path_or_root) -> tuple[Path, dict, str]:
    """Serial (no MPI): (checkpoint directory, meta, save id) of a checkpoint dir, its checkpoint.h5, or a root.

    A missing, incomplete or corrupted index raises :class:`CheckpointError` naming the file.
    """
    directory = _resolve(Path(path_or_root))
    meta, save_id = _open(directory / INDEX, lambda f: _read_index(f, None))
    return directory, meta, save_id


def read_rank_entry(directory, rank: int, meta: dict, save_id: str, keys: tuple = (), missing_ok: bool = False):
    """Serial (no MPI): rank ``rank``'s state, or its entry at ``keys`` (``("algorithm", "params")``).

    ``directory``, ``meta`` and ``save_id`` come from :func:`read_index`; the rank file must belong to
    that save (its identity is checked) and be intact, else :class:`CheckpointError` names it. An absent
    entry is an error too, or None with ``missing_ok``.
    """
    path = Path(directory) / _rank_name(rank)
    return _read_rank(path, rank, meta["world_size"], meta["step"], save_id, tuple(keys), missing_ok)


def topology_kind(name) -> str:
    """A topology's name without its size (``ring(4)`` -> ``ring``): what stays the same at another world size."""
    return re.sub(r"\(.*\)$", "", str(name))


def _at_another_size(expect: dict, meta: dict) -> dict:
    """``expect`` for a checkpoint of another world size: the topology compared by its kind only (the graph's
    size and its matrix ``W`` are the new size's)."""
    topology = expect.get("topology")
    if not isinstance(topology, dict):
        return expect
    kept = {k: v for k, v in topology.items() if k not in ("W", "name")}
    stored = meta.get("topology", {}).get("name")
    if "name" in topology and (stored is None or topology_kind(stored) != topology_kind(topology["name"])):
        kept["name"] = topology["name"]
    return {**expect, "topology": kept}


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
    raw = _raw(comm)
    rank, size = raw.Get_rank(), raw.Get_size()
    error, found = None, None
    if rank == 0:
        try:
            directory = _resolve(Path(path_or_root))
            found = (directory, *_open(directory / INDEX, lambda f: _read_index(f, None if any_size else size)))
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
    directory, meta, save_id = _agree(raw, error, "load_checkpoint", found)[0]
    saved_size = int(meta["world_size"])
    if saved_size != size:
        expect = _at_another_size(expect or {}, meta)

    error = None
    try:
        problem = _mismatch("", meta, {} if expect is None else expect)
        if problem:
            raise ValueError(f"{problem} ({directory})")
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    _agree(raw, error, "load_checkpoint")

    error, state = None, None
    try:
        if saved_size == size:
            state = _read_rank(directory / _rank_name(rank), rank, size, meta["step"], save_id)
        else:
            state = [_read_rank(directory / _rank_name(r), r, saved_size, meta["step"], save_id,
                                lazy_bytes=LAZY_BYTES) for r in range(saved_size)]
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    _agree(raw, error, "load_checkpoint")
    return state, meta
