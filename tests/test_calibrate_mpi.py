"""Calibrating the transport on the ranks of the tier: the same calibration on every rank, every MPI call under the
hang guard, nothing booked; ``mpicomm plan --calibrate`` writes the cache that ``--net measured`` then reads, and
refuses job options in one line; the automatic choice without a network prices a quick calibration; on one rank
calibrating is one line. No time is asserted (a loaded machine makes any transport slow), only the calibration's
shape."""

import contextlib
import math

import pytest

from mpicomm import topology
from mpicomm.cli import main
from mpicomm.comm import Communicator
from mpicomm.comm.calibrate import calibrate

from .conftest import assert_all

pytestmark = pytest.mark.mpi


def _ranks(comm, n):
    if comm.Get_size() != n:
        pytest.skip(f"runs once, in the {n}-rank tier")


def test_calibration_agrees_waits_under_the_hang_guard_and_books_nothing(comm):
    """Every raw MPI call is made inside a hang-guard wait, nothing lands in the Ledger, every rank returns the same
    calibration: ascending sizes, finite positive seconds, a hidden fraction in [0, 1]."""
    _ranks(comm, 2)
    c = Communicator(comm, topology.ring(2))
    waits, calls = [], []
    original = c.guard.waiting

    @contextlib.contextmanager
    def waiting(what):
        waits.append(what)
        try:
            with original(what):
                yield
        finally:
            waits.pop()

    class Watched:  # the raw communicator, each call noted with whether a guarded wait was open
        def __init__(self, raw):
            self.raw = raw

        def __getattr__(self, name):
            def call(*args, **kwargs):
                calls.append((name, bool(waits)))
                return getattr(self.raw, name)(*args, **kwargs)
            return call

    raw, c.comm, c.guard.waiting = c.comm, Watched(c.comm), waiting
    try:
        cal = calibrate(c, "loopback", quick=True)
    finally:
        c.comm = raw
        del c.guard.waiting  # the process's guard: its own method again
    unguarded = [name for name, guarded in calls  # (the ring's graph is made as every Communicator makes its own)
                 if not guarded and not name.startswith(("Get_", "I")) and name != "Create_dist_graph_adjacent"]
    # (a non-blocking post returns at once; its wait is the Handle's, under the guard)
    names = {name for name, _ in calls}
    texts = comm.allgather(cal.to_json())
    sizes = {op: [b for b, _ in rows] for op, rows in cal.tables.items()}
    ok = (not unguarded and {"Send", "Recv", "Allreduce", "Barrier"} <= names and c.ledger.bytes_sent() == 0
          and len(set(texts)) == 1 and cal.ranks == 2 and cal.transport == "loopback"
          and all(len(s) >= 2 and s == sorted(s) for s in sizes.values())
          and all(math.isfinite(t) and t > 0 for rows in cal.tables.values() for _, t in rows)
          and 0 < cal.latency_s < math.inf and 0 <= cal.hidden_fraction <= 1 and 0 <= cal.bucket_hidden_fraction <= 1)
    assert_all(comm, ok, f"unguarded {unguarded}; calls {sorted(names)}; sent {c.ledger.bytes_sent()}; {texts[0]}")


def test_plan_calibrate_writes_the_cache_net_measured_reads(comm, tmp_path_factory, monkeypatch, capsys):
    _ranks(comm, 2)
    cache = comm.bcast(str(tmp_path_factory.mktemp("cache")) if comm.Get_rank() == 0 else None)
    monkeypatch.setenv("MPICOMM_PLAN_CACHE", f"{cache}/costs.json")
    refused = main(["plan", "--calibrate", "--ranks", "2"])
    said = capsys.readouterr()
    code = main(["plan", "--calibrate", "--transport", "lo", "--budget", "1"])  # a cheap test
    out = capsys.readouterr().out
    problems = []
    if refused != 2 or said.out or said.err != ("mpicomm plan: error: --calibrate measures the transport and takes "
                                                "no job options; leave out --ranks\n" if comm.Get_rank() == 0 else ""):
        problems.append(f"refusal {refused}: {said}")
    if code != 0 or (comm.Get_rank() == 0) != out.startswith("measured: lo on ") \
            or (comm.Get_rank() == 0 and not out.rstrip().endswith("-lo-2.json")):
        problems.append(f"calibrate {code}: {out!r}")
    if comm.Get_rank() == 0:
        job = ["plan", "--params", "1000", "--step-time", "0.1", "--no-codec-work", "--net", "measured",
               "--transport", "lo"]
        if main([*job, "--ranks", "2"]) != 0 or "--net measured: lo on " not in capsys.readouterr().out:
            problems.append("--net measured did not price with the calibration just written")
        if main([*job, "--ranks", "3"]) != 2 or not capsys.readouterr().err.endswith(
                "; run mpiexec -n 3 python -m mpicomm plan --calibrate --transport lo first\n"):
            problems.append("--net measured at 3 ranks found a calibration")
    assert_all(comm, not problems, "; ".join(problems))


def test_one_rank_has_no_transport_to_calibrate(comm):
    _ranks(comm, 1)
    with pytest.raises(ValueError, match="^calibrating a transport needs at least 2 ranks, got 1$"):
        calibrate(Communicator(comm, topology.ring(1)))


def test_the_automatic_choice_without_a_network_prices_a_quick_calibration(comm):
    """``plan_choice`` with no network calibrates the transport: its record names the measured summary, the source
    and the calibration, the same on every rank."""
    _ranks(comm, 2)
    import torch

    from mpicomm.plan.choose import plan_choice

    c = Communicator(comm, topology.ring(2))
    record = plan_choice(torch.nn.Linear(8, 4), c, 0.01, "", 100.0)
    records = comm.allgather(record)
    ok = (all(r == records[0] for r in records) and record["net_source"] == "calibrated"
          and record["net"].startswith("measured: default on ") and record["calibration"]["ranks"] == 2
          and c.ledger.bytes_sent() == 0)
    assert_all(comm, ok, f"{record}")
