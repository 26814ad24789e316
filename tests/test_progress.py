"""``MPICOMM_PROGRESS``: the three mechanisms, the default, a bad value refused in one line, and ``mpich``
asking MPICH for its asynchronous progress thread."""

import os

import pytest

from mpicomm.comm import progress


@pytest.mark.parametrize("text, mode", [("", "gossip"), ("none", "none"), ("MPICH", "mpich"), (" thread ", "thread"),
                                        ("gossip", "gossip")])
def test_mode_from_environment(monkeypatch, text, mode):
    monkeypatch.setenv("MPICOMM_PROGRESS", text)
    assert progress.progress_mode() == mode


def test_bad_mode_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv("MPICOMM_PROGRESS", "fast")
    with pytest.raises(ValueError, match=r"^MPICOMM_PROGRESS must be one of none, mpich, gossip, thread, got 'fast'$"):
        progress.progress_mode()


@pytest.mark.parametrize("mode, expected", [("mpich", "1"), ("gossip", None), ("thread", None), ("none", None)])
def test_mpich_mode_sets_mpichs_variable(monkeypatch, mode, expected):
    monkeypatch.setenv("MPICOMM_PROGRESS", mode)
    monkeypatch.delenv("MPIR_CVAR_ASYNC_PROGRESS", raising=False)
    progress.request_mpich_progress()
    assert os.environ.get("MPIR_CVAR_ASYNC_PROGRESS") == expected


@pytest.mark.parametrize("mode, served", [("gossip", {"ineighbor_allgather", "ineighbor_alltoallv"}),
                                          ("thread", {"ineighbor_allgather", "ineighbor_alltoallv", "iallreduce",
                                                      "iallgather"})])
def test_which_calls_the_thread_serves(monkeypatch, mode, served):
    """``gossip`` (the default): the neighbour exchanges only; ``thread``: every non-blocking call."""
    thread = object()
    monkeypatch.setattr(progress, "_MODE", mode)
    monkeypatch.setattr(progress, "_THREAD", thread)
    ops = ["ineighbor_allgather", "ineighbor_alltoallv", "iallreduce", "iallgather"]
    assert {op for op in ops if progress._thread(op) is thread} == served
