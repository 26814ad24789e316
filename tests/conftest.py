"""Shared fixtures. MPI is imported lazily so the serial tier never needs a launcher."""

import contextlib
import os
import subprocess
import threading
import traceback

import pytest
from hypothesis import settings

# Same examples on every run and on every MPI rank: a property test must not pass or fail by luck,
# and ranks drawing different examples would enter different collectives.
settings.register_profile("mpicomm", derandomize=True, deadline=None, database=None)
settings.load_profile("mpicomm")


# The serial tier's longest files and their rough cost in seconds on 2 idle cores (module fixtures that start
# several MPI jobs, a cold kernel compile). pytest-xdist's worksteal scheduler hands each worker one contiguous
# share of the collected list (the first len // workers tests to the first worker, and so on) and lets an idle
# worker steal from the end of another's; so each share starts with long files, dealt to the least loaded share,
# and the short tests follow and balance the rest. Only the order of files changes; a file's tests stay together.
LONG_FILES = {"test_resize.py": 64, "test_user_script.py": 62, "test_slurm_presets.py": 60, "test_kernel_warmup.py": 55,
              "test_apps.py": 48, "test_app_failures.py": 48, "test_adpsgd.py": 42, "test_export.py": 35}


def pytest_collection_modifyitems(config, items):
    """Order the tests for the workers of pytest-xdist (see :data:`LONG_FILES`); without workers, long files first."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    files = {}
    for item in items:
        files.setdefault(item.path.name, []).append(item)
    shares = [[] for _ in range(workers)]
    load = [0] * workers
    for name in sorted((n for n in LONG_FILES if n in files), key=LONG_FILES.get, reverse=True):
        least = load.index(min(load))
        shares[least] += files[name]
        load[least] += LONG_FILES[name]
    rest = [item for item in items if item.path.name not in LONG_FILES]
    ordered, left = [], len(items)
    for i, share in enumerate(shares):
        size = left // (workers - i)  # what the scheduler sends this worker
        take = max(0, size - len(share)) if i < workers - 1 else len(rest)
        ordered += share + rest[:take]
        rest = rest[take:]
        left -= len(share) + take
    items[:] = ordered


_HUNG_LINE = pytest.StashKey[threading.Timer]()


def _say_hung(nodeid: str, limit: float) -> None:
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    line = (f"HUNG: {nodeid} is still running after {limit - 1:g} s{f' on rank {rank}' if rank else ''}; "
            f"pytest-timeout ends it at {limit:g} s (the timeout in setup.cfg, or -o timeout=SECONDS)\n")
    fd = int(os.environ.get("MPICOMM_TEST_CONSOLE_FD", "2"))  # tests/mpi_run.py: the rank's real stderr
    try:
        os.write(fd, line.encode())
    except OSError:
        os.write(2, line.encode())


def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's hook, beside its own timer: one line naming a test about to be ended (its own report is
    a stack dump, and under MPI only the ranks' stacks), a second before the limit, on the console."""
    if settings.timeout > 2:
        timer = threading.Timer(settings.timeout - 1, _say_hung, (item.nodeid, settings.timeout))
        timer.daemon = True
        timer.start()
        item.stash[_HUNG_LINE] = timer
    # None: pytest-timeout's own implementation still sets its timer


def pytest_timeout_cancel_timer(item):
    """pytest-timeout's hook: the test ended in time, no line."""
    timer = item.stash.get(_HUNG_LINE, None)
    if timer is not None:
        timer.cancel()


@pytest.fixture
def comm():
    """``MPI.COMM_WORLD`` for tests marked ``mpi`` (run under mpiexec with --with-mpi)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def free_communicators(request):
    """After each test run under MPI: free the communicators mpicomm created during it (every Communicator holds a
    graph communicator, and MPICH holds at most 2048 a process: a 4-rank tier creates more). Every rank runs the same
    tests and creates them in the same order, so the collective frees match."""
    if request.node.get_closest_marker("mpi") is None:
        yield
        return
    from mpicomm.comm.faults import free_tracked, tracked

    before = {id(raw) for raw in tracked()}
    yield
    free_tracked([raw for raw in tracked() if id(raw) not in before])


def assert_all(comm, ok: bool, detail: str = "") -> None:
    """Collective assertion: every rank reaches it, and every rank fails if any rank's ``ok`` is false."""
    results = comm.allgather((bool(ok), str(detail)))
    bad = [(rank, d) for rank, (good, d) in enumerate(results) if not good]
    assert not bad, "failed on rank(s): " + "; ".join(f"{r}: {d}" for r, d in bad)


def run_all(comm, body) -> None:
    """Run ``body()`` on every rank, then fail on every rank if it raised on any (with the traceback)."""
    try:
        body()
        ok, detail = True, ""
    except Exception:  # noqa: BLE001 - reported collectively below
        ok, detail = False, traceback.format_exc(limit=6)
    assert_all(comm, ok, detail)


def mount_tmpfs(where, size: str) -> None:
    """Mount a tmpfs of ``size`` (e.g. ``"4m"``) at the new folder ``where``; skip the test without root."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")


@contextlib.contextmanager
def tmpfs(where, size: str):
    """:func:`mount_tmpfs` for the block, unmounted (lazily) after it; yields ``where``."""
    mount_tmpfs(where, size)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
