"""A 1-rank run whose evaluations and checkpoint saves each take longer than its hang timeout, with the hang guard
set as under recovery (``--on-rank-loss continue``: a rank that spends the timeout inside a step without reaching MPI
leaves the job). Run by tests/test_recovery_run.py:

    recovery_stall_job.py OUT_DIR HANG_TIMEOUT SLOW_S

Prints the end summary as one JSON line when the run finishes; a rank that took the slow evaluation or save for a
stall kills itself (SIGKILL) instead.
"""

import json
import sys
import time

import torch
from mpi4py import MPI

import mpicomm.training.run as run_module
from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator
from mpicomm.comm.guard import process_guard
from mpicomm.comm.world import abort_world
from mpicomm.training.loop import TrainConfig, run_training

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from tests.algo_common import batch, make_model  # noqa: E402


class SlowEvaluation:
    """The tiny MLP; each evaluation takes ``slow_s``."""

    def __init__(self, slow_s: float):
        self.model, self.steps_per_epoch, self.slow_s = make_model(0), 4, slow_s

    def train_batches(self, epoch, start=0):
        for b in range(start, self.steps_per_epoch):
            yield batch(0, 100 * epoch + b)

    def loss(self, model, data):
        x, y = data
        return torch.nn.functional.cross_entropy(model(x), y), {"count": len(y)}

    def evaluate(self, model):
        time.sleep(self.slow_s)
        x, y = batch(0, 10_000)
        return {"test_loss": float(torch.nn.functional.cross_entropy(model(x), y))}


def main() -> None:
    out, timeout, slow_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    save = run_module.save_checkpoint

    def slow_save(*args, **kwargs):
        time.sleep(slow_s)
        return save(*args, **kwargs)

    run_module.save_checkpoint = slow_save
    task = SlowEvaluation(slow_s)
    algo = make_algorithm("allreduce_sgd", task.model, Communicator(MPI.COMM_WORLD, topology.ring(1)))
    process_guard(abort_world).leave_when_stalled = True  # as under --on-rank-loss continue
    cfg = TrainConfig(max_steps=4, lr=0.05, eval_every=2, save_every=2, out_dir=out, progress=False,
                      handle_signals=False, hang_timeout=timeout)
    summary = run_training(task, algo, cfg)
    print(json.dumps({"step": summary["step"], "total_steps": summary["total_steps"]}), flush=True)


if __name__ == "__main__":
    main()
