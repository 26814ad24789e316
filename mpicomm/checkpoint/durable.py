"""Crash-safe HDF5 files: written through a file object that survives a full disk, fsynced, space checked first.

A failed write (a full disk) becomes one ``OSError`` naming the file, raised after HDF5 has closed it
cleanly, and the half-written file is removed (:func:`write_h5`); :func:`check_space` refuses a save that
cannot fit before any byte is written.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import h5py
import torch

from .tree import LIBVER

__all__ = ["Sink", "check_space", "fsync", "state_nbytes", "write_h5"]

_HELD_BYTES = 64 << 20  # what a failed HDF5 file keeps in memory after its failed write, at most


def fsync(path: Path) -> None:
    """fsync the file or directory ``path`` (a directory: the names it holds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Sink:
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


def write_h5(path: Path, fill) -> None:
    """Create the HDF5 file ``path`` with ``fill(file)``, then fsync it.

    A write that fails (a full disk) raises one ``OSError`` naming ``path``, with its errno, after HDF5
    has closed the file cleanly (:class:`Sink`); the half-written file is removed.
    """
    sink = Sink(path)
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


def state_nbytes(state) -> int:
    """Bytes of the tensors and arrays in ``state`` (a nested dict/list): what its rank file will hold."""
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    return int(getattr(state, "nbytes", 64))


def check_space(directory: Path, need: int) -> None:
    """Refuse a save that cannot fit, before any byte is written (HDF5 adds a little beyond the raw data)."""
    free = shutil.disk_usage(directory).free
    want = int(need * 1.05) + (1 << 20)
    if free < want:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the checkpoint needs about "
                      f"{want / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free", str(directory))
