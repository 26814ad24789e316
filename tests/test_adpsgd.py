"""AD-PSGD and Moniqua-AD-PSGD: a real asynchronous 4-rank job with one slow rank, and the Mailbox transports.

The serial test launches ``tests/adpsgd_job.py`` under ``mpiexec -n 4 python -m mpi4py`` (which aborts the
whole job if a rank fails) with ``MPIR_CVAR_ASYNC_PROGRESS=1``, as any run of these algorithms should; the
job's own transport is shared memory (all ranks on one node), which needs no MPI progress at all. The last
rank is held until each other rank has taken 25 steps (the guard row: 8), then sleeps 100 ms after each of
its own 25 steps, about 2.5 s; the other ranks step until it is done. How many steps the fast ranks take
meanwhile is the OS scheduler's (a busy machine once gave [65, 294, 295, 25]), so no ratio is asserted.

Rows: ``adpsgd``; Moniqua-AD-PSGD at 8 bits on every coordinate (``8bit``), at its defaults (4 bits on a
rotating quarter, dither, theta per tensor: ``default``), in the paper's form (1 bit, one theta, nearest:
``paper``), and with a theta far too small (``guard``).
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from mpicomm.comm import Communicator
from mpicomm.comm.rma import Mailbox

from . import lsq_problem as lsq
from .algo_common import topologies_for
from .app_runs import mpiexec
from .conftest import run_all

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Run the 4-rank asynchronous job once; its JSON results."""
    out = tmp_path_factory.mktemp("adpsgd") / "results.json"
    env = dict(os.environ, MPIR_CVAR_ASYNC_PROGRESS="1", OMP_NUM_THREADS="1")
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "mpi4py", os.path.join(HERE, "adpsgd_job.py"), str(out), "2.5",
           "0.1"]
    # a bound only to catch a hang: the job took 56-93 s at a load average of 20 on 2 cores
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def results(job, label):
    """The result row ``label`` (see the module docstring)."""
    return next(r for r in job["results"] if r["label"] == label)


ROWS = ["adpsgd", "8bit", "default", "paper"]


@pytest.mark.parametrize("label", ROWS)
def test_fast_ranks_are_not_held_back_by_the_slow_one(job, label):
    """(a) While the slow rank takes no step at all, every fast rank takes as many steps as the slow one will take
    in all: a step that waited for the slow rank (a lockstep or bounded-staleness implementation) would never
    get there, and the held rank's wait ends after 60 s with ``ahead_while_held`` false."""
    row = results(job, label)
    assert row["ahead_while_held"] is True, row
    assert min(row["steps"][:-1]) >= row["steps"][-1], row["steps"]


ALONE_PAPER = ("the 1-bit paper form ends exactly where ranks that never communicate end (own models' gap equal to "
               "4 digits in every run measured): nearest rounding at 1 bit leaves a dead zone of a grid cell, and "
               "its theta keeps the cell wider than the ranks' spread, so no pull moves a model")


@pytest.mark.parametrize("label,max_gap,max_spread,alone_factor", [
    # 2.5 s on a loaded 2-core machine: gap 4.7e-4 / 9.0e-4 / 6.0e-3 / 9.1e-3, spread 0.082 / 0.084 / 0.40 / 0.64
    # (the default mixes each coordinate on 1/4 of the pulls: spread ~5x). Own models against the same steps
    # taken alone: 27-32x / 37-44x / 2.3-3.8x / 1.0x closer to the optimum (8-bit Moniqua once 5.3x, with the whole
    # suite's tiers running beside the job: its bound is 4x, still far from the 1.0x of ranks that do not mix)
    ("adpsgd", 1e-2, 0.5, 10.0),
    ("8bit", 2e-2, 0.5, 4.0),
    ("default", 5e-2, 1.0, 1.5),
    pytest.param("paper", 0.1, 2.0, 2.0, marks=pytest.mark.xfail(strict=True, reason=ALONE_PAPER)),
])
def test_models_converge_despite_the_slow_rank(job, label, max_gap, max_spread, alone_factor):
    """(b) (F(x̄) - F*) / (F(x_0) - F*) (1 at the start) and sqrt(mean_i |x_i - x̄|^2) at the end, lr 0.1; and the
    ranks' own models, each scored the same way, ``alone_factor`` times closer to the optimum on average than the
    models of ranks that take the same number of steps alone (no communication: each heads for the optimum of its
    own data, planted around a different point on every rank)."""
    row = results(job, label)
    assert row["gap"] < max_gap, row
    assert row["consensus_distance"] < max_spread, row
    n = len(row["steps"])
    alone = sum(lsq.relative_gap(lsq.alone(r, steps, 0.1), n) for r, steps in enumerate(row["steps"])) / n
    own = sum(row["own_gaps"]) / n
    assert own * alone_factor <= alone, (own, alone, row)


@pytest.mark.parametrize("label,bits,parts", [("adpsgd", None, None), ("8bit", 8, 1), ("default", 4, 4),
                                              ("paper", 1, 1)])
def test_one_message_read_per_step(job, label, bits, parts):
    """Bytes read = steps x message: 4d for AD-PSGD; for Moniqua (T = 1 tensor, d = 12) the 8 + 4T byte prefix,
    then 4T fingerprint bytes and ceil(ceil(d / P) b / 8) code bytes rounded up to a multiple of 4."""
    row = results(job, label)
    message = 4 * 12 if bits is None else 8 + 4 + 4 * math.ceil((4 + math.ceil(math.ceil(12 / parts) * bits / 8)) / 4)
    assert row["message_bytes"] == message
    assert row["bytes_read"] == [s * message for s in row["steps"]], row


@pytest.mark.parametrize("label", ROWS + ["guard"])
def test_each_ranks_state_round_trips(job, label):
    """state_dict -> fresh algorithm -> load_state_dict gives the same state and the same next peers on every rank."""
    assert results(job, label)["round_trip"] == [True] * 4


def test_async_guard_detects_every_wrap_and_skips(job):
    """theta = 1e-5 (scale capped at 4): every pull after the first messages wraps; each is detected and the
    tensor left unmixed on every rank, so no garbage is averaged in and the models stay finite (local GD only)."""
    row = results(job, "guard")
    assert row["pulls"] == row["steps"], row
    assert all(w >= max(steps - 3, 1) for w, steps in zip(row["wrapped_parts"], row["steps"])), row
    assert row["params_finite"] == [True] * 4 and row["gap"] < 1.0, row


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["shared", "rma"])
@pytest.mark.parametrize("stage", ["auto", "always"])
def test_mailbox_publish_and_read(comm, transport, stage):
    """Every rank reads every other rank's latest slot, byte for byte, on both transports; ``stage="always"``
    goes through the host staging buffer that device tensors take (and must have used it)."""
    def body():
        c = Communicator(comm, topologies_for(comm.Get_size())[0], stage=stage)
        box = Mailbox(c, 13, transport)
        wrong = []
        for version in range(3):
            box.publish(torch.arange(13, dtype=torch.uint8) + 10 * c.rank + version)
            comm.Barrier()
            out = torch.empty(13, dtype=torch.uint8)
            for peer in range(c.size):
                if not torch.equal(box.read(peer, out), torch.arange(13, dtype=torch.uint8) + 10 * peer + version):
                    wrong.append((version, peer))
            comm.Barrier()
        used, received, staged = box.transport, c.ledger.bytes_received("rma_get"), box._host is not None
        box.close()
        assert not wrong and used == transport and received == 3 * c.size * 13, (wrong, used, received)
        assert staged == (stage == "always")

    run_all(comm, body)
