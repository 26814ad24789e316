"""The checkpoint store against a really full disk: HDF5's failed writes become one OSError naming the file.

The store refuses a save that cannot fit before writing (tested through the app in test_app_failures);
here that check is switched off, or another writer fills the disk after it, so that a write inside an
HDF5 file hits ENOSPC, as it does when another process fills the disk during a save. HDF5 itself never
sees the failure (the store's file object keeps it), so the process goes on and exits cleanly: each case
runs in a child process whose exit status must be 0 (HDF5 crashed at exit with SIGSEGV before).
"""

import errno
import os
import subprocess
import sys

import pytest

from mpicomm.checkpoint import durable

from .conftest import tmpfs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELUDE = """
import os, sys, torch
from mpicomm.checkpoint import durable, latest_checkpoint, load_checkpoint, save_checkpoint, store

class One:  # a one-process stand-in for a communicator (the store needs only these three)
    rank, size = 0, 1
    def allgather_object(self, obj, what): return [obj]

def fill(directory):  # another writer takes every byte left
    fd = os.open(os.path.join(directory, "other-writer"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:
        os.close(fd)

root = sys.argv[1]
save_checkpoint(root, One(), {"w": torch.arange(1000.0)}, step=1)  # fits
"""
LOADS = """
state, meta = load_checkpoint(root, One())
print(f"latest={latest_checkpoint(root).name} intact={torch.equal(state['w'], torch.arange(1000.0))}", flush=True)
"""
NO_SPACE_CHECK = PRELUDE + """
durable.check_space = lambda directory, need: None
try:
    save_checkpoint(root, One(), {"w": torch.ones(1 << 22)}, step=2)  # 16 MiB into 4 MiB
except OSError as exc:
    print(f"errno={exc.errno} message={exc}", flush=True)
""" + LOADS
FILLED_BEFORE_COMMIT = PRELUDE + """
write_rank_file = store._write_rank_file
def then_fill(path, state, identity):
    write_rank_file(path, state, identity)
    fill(root)
store._write_rank_file = then_fill
try:
    save_checkpoint(root, One(), {"w": torch.ones(1 << 16)}, step=2)
except OSError as exc:
    print(f"errno={exc.errno} message={exc}", flush=True)
os.unlink(os.path.join(root, "other-writer"))
""" + LOADS


@pytest.fixture
def disk(tmp_path):
    """A 4 MiB tmpfs."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        yield disk


def _child(code: str, disk) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, str(disk)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_enospc_inside_hdf5_is_one_error_naming_the_file_and_the_process_exits_cleanly(disk):
    child = _child(NO_SPACE_CHECK, disk)
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-2000:])
    assert "errno=28 message=" in child.stdout, (child.stdout, child.stderr[-2000:])
    assert "rank-00000.h5" in child.stdout and "No space left on device" in child.stdout
    assert "latest=step-000000001 intact=True" in child.stdout  # the earlier checkpoint, untouched
    assert child.stderr == "", child.stderr[-2000:]
    assert sorted(p.name for p in disk.iterdir()) == ["latest", "step-000000001"]  # the temporary directory is gone


def test_a_disk_filled_before_the_commit_fails_the_index_cleanly(disk):
    """The rank file is written; then another writer fills the disk, and checkpoint.h5 cannot be."""
    child = _child(FILLED_BEFORE_COMMIT, disk)
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-2000:])
    assert "errno=28 message=" in child.stdout and "checkpoint.h5" in child.stdout, child.stdout
    assert "latest=step-000000001 intact=True" in child.stdout
    assert child.stderr == "", child.stderr[-2000:]
    assert sorted(p.name for p in disk.iterdir()) == ["latest", "step-000000001"]


def test_the_sink_reads_back_what_it_kept_after_a_failed_write(disk):
    """Past the first failed write, HDF5 still reads back exactly what it wrote (kept in memory)."""
    sink = durable.Sink(disk / "f")
    try:
        chunk = bytes(range(256)) * 1024  # 256 KiB
        for i in range(24):  # 6 MiB into 4 MiB
            sink.seek(i * len(chunk))
            assert sink.write(memoryview(chunk)) == len(chunk)
        assert sink.error is not None and sink.error.errno == errno.ENOSPC
        sink.seek(0)
        buffer = bytearray(24 * len(chunk))
        assert sink.readinto(buffer) == len(buffer) and bytes(buffer) == chunk * 24
        sink.seek(100, os.SEEK_SET)
        sink.write(b"xyz")
        sink.seek(-len(buffer) + 99, os.SEEK_END)
        assert sink.read(5) == bytes([99]) + b"xyz" + bytes([103])
    finally:
        os.close(sink.fd)


def test_the_sink_keeps_at_most_its_bound_in_memory(disk, monkeypatch):
    monkeypatch.setattr(durable, "_HELD_BYTES", 1 << 20)
    sink = durable.Sink(disk / "f")
    try:
        for _ in range(32):  # 8 MiB into 4 MiB
            sink.write(bytes(1 << 18))
        assert sink.error is not None and sink.pos == sink.size == 8 << 20
        assert sum(len(data) for _, data in sink._held) <= 1 << 20
    finally:
        os.close(sink.fd)
