"""Resume is exact for every registered algorithm: 2N straight == N, stop, checkpoint, resume, N more.

A restart from step 0 is bit-identical to the straight run for the methods whose runs draw no random numbers
of their own, so the split run must also show that it resumed: the ``resume`` event at the split step, naming
the checkpoint it saved there, and the algorithm's step counter restored before its first step.

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
from mpicomm.training.metrics import read_metrics

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
    "diloco": {"period": 3, "codec": "uniform", "codec_options": {"bits": 4}},
    "sparseloco": {"period": 3, "chunk": 32, "density": 0.25},
    "decentralized_diloco": {"period": 3},
    "streaming_diloco": {"period": 4, "fragments": 2, "delay": 1},  # fragment 0's exchange in flight at the stop
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
    """Train; the algorithm, the end summary, and the algorithm's step counter at each of its steps."""
    task = TinyTask(comm.Get_rank())
    schedule = topology.ring(comm.Get_size())
    algo = make_algorithm(name, task.model, Communicator(comm, schedule), **OPTIONS.get(name, {}))
    config = TrainConfig(epochs=3, max_steps=STEPS, lr=0.05, log_every=2, out_dir=out_dir, progress=False,
                         handle_signals=False, **cfg)
    counters, step = [], algo.step

    def counted_step():
        counters.append(algo.step_count)
        step()

    algo.step = counted_step
    summary = run_training(task, algo, config)
    return algo, summary, counters


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - ASYNC))
def test_resume_is_bit_exact(comm, name, tmp_path_factory):
    """Straight 2N steps and N, stop, resume, N more end bit for bit alike, and the second half really resumed:
    its metrics carry a ``resume`` event at step N from the checkpoint saved there, and the algorithm's step
    counter was N at its first step."""
    root = comm.bcast(str(tmp_path_factory.mktemp("resume")) if comm.Get_rank() == 0 else None)

    def body():
        straight, _, _ = _run(comm, name, f"{root}/straight")
        _, first, _ = _run(comm, name, f"{root}/split", stop_at_step=STEPS // 2)
        assert first["step"] == STEPS // 2 and first["stopped_by_signal"]
        resumed, last, counters = _run(comm, name, f"{root}/split", resume="latest")
        assert last["step"] == STEPS
        records = read_metrics(f"{root}/split/metrics.jsonl")
        saved = [r["path"] for r in records if r["event"] == "checkpoint" and r["step"] == STEPS // 2]
        resumes = [(r["step"], r["path"]) for r in records if r["event"] == "resume"]
        assert len(saved) == 1 and resumes == [(STEPS // 2, saved[0])], (saved, resumes)
        starts = [(r["step"], r["resumed_from"]) for r in records if r["event"] == "start"]
        assert starts == [(0, ""), (STEPS // 2, saved[0])], starts
        assert counters == list(range(STEPS // 2, STEPS)), counters
        assert torch.equal(resumed.flat.data, straight.flat.data), (
            f"{name}: max diff {float((resumed.flat.data - straight.flat.data).abs().max())}")
        assert resumed.step_count == straight.step_count

    run_all(comm, body)
