"""The memory of a restore at another world size: what it holds beyond the algorithm it loads into is bounded by the
size of one state, never by the saved ranks' states together.

Every rank of the job saves AllReduce-Adam (one step taken: its parameters, m and v, 40 MiB each) around a model of
10.5M parameters; rank 0 alone, a world of 1, builds the same afresh and restores the checkpoint (a resize from the
job's size to 1, every saved rank's entries compared as they are read). The kernel's peak of rank 0's resident memory
is reset just before the restore (``/proc/self/clear_refs``) and read after it (``VmHWM``): the restore's own peak,
in bytes the kernel counts, not a timing. The restore builds the new state (parameters, m, v) beside the algorithm's
own copy of its parameters (its ``state_dict()``), and the optimizer then copies m and v as it loads them: about 4
tensors of the model's size, 1.33 states (160 MiB), plus a slice of a saved entry. The bound, 1.5 states and
16 MiB (196 MiB), fails when the new parameters are kept beside both copies of the optimizer state (5 tensors and
slices of 16 MiB: 210 MiB), when an entry is read whole in float64, or when the saved ranks' states are read whole
(3 tensors each).

    mpiexec -n 2 python tests/mpi_run.py -q -m mpi tests/test_resize_memory_mpi.py

The memory per rank is about 0.6 GiB.
"""

import gc

import pytest
import torch

import mpicomm
from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .conftest import run_all

pytestmark = pytest.mark.mpi

WIDTH, OUT = 4096, 2560  # 10,488,320 parameters: 40 MiB of float32 per tensor, above glibc's largest mmap threshold
STATES, MARGIN_MIB = 1.5, 16


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _build(world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, OUT))
    return make_algorithm("allreduce_adam", model, Communicator(world, topology.ring(world.Get_size())), lr=1e-3)


def _tensor_bytes(tree) -> int:
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def test_a_resized_restore_holds_at_most_one_and_a_half_states_more(comm, mpi_tmp_path):
    from mpi4py import MPI

    if comm.Get_size() < 2:
        pytest.skip("a resize needs a save at 2 ranks or more")
    if not _reset_peak():  # the same kernel on every rank: they skip together
        pytest.skip("the kernel's peak of resident memory cannot be reset here (/proc/self/clear_refs)")
    directory = mpi_tmp_path / "resize_memory"
    algo = _build(comm)
    algo.zero_grad()
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(comm.Get_rank()))
    algo.model(x).square().mean().backward()
    algo.step()
    mpicomm.save(directory, algo, step=1)
    saved = algo.flat.data.clone()
    del algo, x
    gc.collect()
    growth = state = None

    def body():
        nonlocal growth, state
        if comm.Get_rank() != 0:
            return
        alone = _build(MPI.COMM_SELF)
        gc.collect()
        before = _status_mib("VmRSS")
        _reset_peak()
        step, _ = mpicomm.restore(directory, alone)
        growth = _status_mib("VmHWM") - before
        state = _tensor_bytes(alone.state_dict()) / 2**20
        assert step == 1 and torch.equal(alone.flat.data, saved)
        assert set(alone.adam_state()) >= {"exp_avg", "exp_avg_sq"}
        print(f"resized restore: grew {growth:.0f} MiB, one state {state:.0f} MiB")
        assert growth <= STATES * state + MARGIN_MIB, (
            f"the resized restore grew {growth:.0f} MiB, more than {STATES} states of {state:.0f} MiB and "
            f"{MARGIN_MIB} MiB")

    run_all(comm, body)
