"""Resume is exact for every registered algorithm: 2N straight == N, stop, checkpoint, resume, N more.

Runs the real training loop (``run_training``) with real HDF5 checkpoints on a tiny MLP task, under
pytest-mpi at 1, 2 and 4 ranks; parameters, BatchNorm-free buffers, optimizer and algorithm state, RNG
and data position all go through the checkpoint.
"""

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import ALGORITHMS, make_algorithm
from mpicomm.comm import Communicator
from mpicomm.training.loop import TrainConfig, run_training

from .algo_common import batch, make_model
from .conftest import run_all

pytestmark = pytest.mark.mpi

STEPS = 8
# Options some algorithms need for a short run (the rest use their defaults).
OPTIONS = {
    "apmsqueeze": {"warmup_steps": 3, "total_steps": STEPS},
    "moniqua": {"bits": 2},
    "moniqua_d2": {"bits": 2},
    "hsq": {"min_compress": 10, "d": 4, "K": 16},
    "cpdsgdm": {"period": 2},
    "pdsgdm": {"period": 2},
    "powersgd": {"warmup_steps": 2, "min_compression_rate": 1.0},
    "powergossip": {"min_compression_rate": 1.0},
    "zeroone_adam": {"var_freeze_step": 3, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4},
    "onebit_lamb": {"freeze_step": 3},
}
ASYNC = {"adpsgd", "moniqua_adpsgd"}  # timing-dependent: state round trip in adpsgd_job.py, N + N in turns in
# test_moniqua_adpsgd_mpi.py


class TinyTask:
    """The tiny MLP on per-rank random batches, with dropout so the torch RNG matters on resume."""

    def __init__(self, rank):
        self.rank = rank
        self.model = torch.nn.Sequential(make_model(0), torch.nn.Dropout(0.1))
        self.steps_per_epoch = 3

    def train_batches(self, epoch, start=0):
        for b in range(start, self.steps_per_epoch):
            yield batch(self.rank, 100 * epoch + b)

    def loss(self, model, data):
        x, y = data
        return torch.nn.functional.cross_entropy(model(x), y), {"count": len(y)}

    def evaluate(self, model):
        x, y = batch(self.rank, 10_000)
        return {"test_loss": float(torch.nn.functional.cross_entropy(model(x), y))}


def _run(comm, name, out_dir, **cfg):
    task = TinyTask(comm.Get_rank())
    schedule = topology.ring(comm.Get_size())
    algo = make_algorithm(name, task.model, Communicator(comm, schedule), **OPTIONS.get(name, {}))
    config = TrainConfig(epochs=3, max_steps=STEPS, lr=0.05, log_every=2, out_dir=out_dir, progress=False,
                         handle_signals=False, **cfg)
    summary = run_training(task, algo, config)
    return algo, summary


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - ASYNC))
def test_resume_is_bit_exact(comm, name, tmp_path_factory):
    root = comm.bcast(str(tmp_path_factory.mktemp("resume")) if comm.Get_rank() == 0 else None)

    def body():
        straight, _ = _run(comm, name, f"{root}/straight")
        _, first = _run(comm, name, f"{root}/split", stop_at_step=STEPS // 2)
        assert first["step"] == STEPS // 2 and first["stopped_by_signal"]
        resumed, last = _run(comm, name, f"{root}/split", resume="latest")
        assert last["step"] == STEPS
        assert torch.equal(resumed.flat.data, straight.flat.data), (
            f"{name}: max diff {float((resumed.flat.data - straight.flat.data).abs().max())}")
        assert resumed.step_count == straight.step_count

    run_all(comm, body)
