"""The training loop with a user optimizer, accumulation and clipping: exact resume and equivalence.

Real ``run_training`` with real HDF5 checkpoints at 1, 2 and 4 ranks: N + N == 2N bit for bit with the
optimizer's state (two parameter groups, SGD or AdamW) in the checkpoint and the loop's cosine
schedule written into its groups; and ``accumulate=2`` over half batches equals ``accumulate=1`` over
whole batches (parameters and logged losses, to float tolerance).
"""

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator
from mpicomm.training.loop import TrainConfig, run_training
from mpicomm.training.metrics import read_metrics
from mpicomm.training.param_groups import decay_groups

from .algo_common import batch, make_model
from .conftest import run_all
from .test_resume_mpi import TinyTask

pytestmark = pytest.mark.mpi

STEPS = 8
CASES = {
    "dpsgd-sgd": ("dpsgd", {}, lambda m: torch.optim.SGD(decay_groups(m, 0.01), lr=0.05, momentum=0.9), {}),
    "moniqua-adamw": ("moniqua", {"bits": 2}, lambda m: torch.optim.AdamW(decay_groups(m, 0.1), lr=0.01), {}),
    "allreduce_adam-adamw-acc-clip": ("allreduce_adam", {}, lambda m: torch.optim.AdamW(decay_groups(m, 0.1), lr=0.01),
                                      {"accumulate": 2, "clip_grad_norm": 0.5}),
    "allreduce_sgd-overlap-acc": ("allreduce_sgd", {"overlap": True, "bucket_numel": 20},
                                  lambda m: torch.optim.SGD(decay_groups(m, 0.01), lr=0.05, momentum=0.9),
                                  {"accumulate": 3}),
}


def _run(comm, case, out_dir, **cfg):
    name, options, build, extra = CASES[case]
    task = TinyTask(comm.Get_rank())
    algo = make_algorithm(name, task.model, Communicator(comm, topology.ring(comm.Get_size())),
                          optimizer=build(task.model), **options)
    config = TrainConfig(epochs=9, max_steps=STEPS, lr=0.05, log_every=2, out_dir=out_dir, progress=False,
                         handle_signals=False, **extra, **cfg)
    return algo, run_training(task, algo, config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_with_user_optimizer_is_bit_exact(comm, case, tmp_path_factory):
    root = comm.bcast(str(tmp_path_factory.mktemp("resume")) if comm.Get_rank() == 0 else None)

    def body():
        straight, _ = _run(comm, case, f"{root}/straight")
        _, first = _run(comm, case, f"{root}/split", stop_at_step=STEPS // 2)
        assert first["step"] == STEPS // 2 and first["stopped_by_signal"]
        resumed, last = _run(comm, case, f"{root}/split", resume="latest")
        assert last["step"] == STEPS
        assert torch.equal(resumed.flat.data, straight.flat.data), (
            f"{case}: max diff {float((resumed.flat.data - straight.flat.data).abs().max())}")
        assert resumed.optimizer.state_dict()["param_groups"] == straight.optimizer.state_dict()["param_groups"]

    run_all(comm, body)


class HalfTask:
    """TinyTask's MLP without dropout; ``halves``: each batch of 16 comes as two micro-batches of 8."""

    def __init__(self, rank, halves):
        self.rank, self.halves = rank, halves
        self.model = make_model(0)
        self.steps_per_epoch = 6 if halves else 3

    def train_batches(self, epoch, start=0):
        for b in range(start, self.steps_per_epoch):
            x, y = batch(self.rank, 100 * epoch + (b // 2 if self.halves else b))
            if self.halves:
                x, y = x[8 * (b % 2):8 * (b % 2 + 1)], y[8 * (b % 2):8 * (b % 2 + 1)]
            yield x, y

    def loss(self, model, data):
        x, y = data
        return torch.nn.functional.cross_entropy(model(x), y), {"count": len(y)}

    def evaluate(self, model):
        return {}


@pytest.mark.parametrize("name", ["allreduce_sgd", "dpsgd"])
def test_loop_accumulation_equals_whole_batches(comm, name, tmp_path_factory):
    root = comm.bcast(str(tmp_path_factory.mktemp("acc")) if comm.Get_rank() == 0 else None)

    def body():
        runs = {}
        for halves in (False, True):
            task = HalfTask(comm.Get_rank(), halves)
            algo = make_algorithm(name, task.model, Communicator(comm, topology.ring(comm.Get_size())), momentum=0.9)
            out = f"{root}/{halves}"
            summary = run_training(task, algo, TrainConfig(epochs=2, lr=0.1, log_every=1, out_dir=out, progress=False,
                                                           handle_signals=False, accumulate=2 if halves else 1))
            losses = [r["loss"] for r in read_metrics(f"{out}/metrics.jsonl") if r["event"] == "train"]
            runs[halves] = (algo.flat.data, summary, losses, algo.step_count)
        (whole, s1, l1, n1), (micro, s2, l2, n2) = runs[False], runs[True]
        assert s1["step"] == s2["step"] == n1 == n2 == 6
        torch.testing.assert_close(micro, whole, rtol=1e-5, atol=1e-6)
        assert l2 == pytest.approx(l1, rel=1e-5)

    run_all(comm, body)


def test_bad_loop_options_are_refused():
    with pytest.raises(ValueError, match="--accumulate must be >= 1"):
        TrainConfig(accumulate=0)
    with pytest.raises(ValueError, match="--clip-grad-norm must be >= 0"):
        TrainConfig(clip_grad_norm=-1.0)
    with pytest.raises(ValueError, match="--accumulate cannot be combined with --precision fp16"):
        TrainConfig(accumulate=2, precision="fp16")
    assert TrainConfig(epochs=3, accumulate=2).total_steps(5) == 7
