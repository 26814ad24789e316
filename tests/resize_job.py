"""An MPI job for tests/test_resize.py: every algorithm saved at one size and resumed at others, in one job.

usage: mpiexec -n 6 python -m mpi4py tests/resize_job.py DIR

The job's ranks form a new world of each size in turn (``MPI.Comm.Split``: the first N ranks; a real
communicator of N ranks, as a job of N ranks would have): at 4 each algorithm of :data:`ALGOS` (every
registered one, with options under which the state its resize rule is about exists at the save) trains
:data:`STEPS` steps on the tiny MLP of ``algo_common`` and is saved with ``mpicomm.save`` under
``DIR/saved4/<name>``; then the 4-rank checkpoints are resumed at 2 (and saved again under ``DIR/saved2``
after training on), at 3 and at 6, and the 2-rank ones at 4. For each (saved size, new size) rank 0 writes
``DIR/report<old>to<new>.pt`` (``torch.save``): for each algorithm every new rank's state as built at the new
size (before the restore) and as restored, and the loss of the averaged model before and after :data:`MORE`
further steps; or, where the restore raised, its message. The saved states are not in the report: the test
reads them from the checkpoints itself. Ranks outside the world of the moment wait asleep (they would
otherwise spin on the cores the others train on).
"""

import copy
import functools
import os
import sys
import time

import torch
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mpicomm  # noqa: E402
from mpicomm import topology  # noqa: E402
from mpicomm.algorithms import make_algorithm  # noqa: E402
from mpicomm.comm import Communicator  # noqa: E402
from tests.algo_common import batch, make_model  # noqa: E402

STEPS, MORE, LR = 4, 6, 0.1
ALGOS = {
    # centralized: momentum or Adam state, codec generators, error feedback past its warm-up
    "allreduce_sgd": {"momentum": 0.9},
    "allreduce_adam": {"lr": 0.01},
    "compressed_sgd": {"codec": "randomk", "codec_options": {"ratio": 0.25}, "error_feedback": True,
                       "momentum": 0.9, "lr": 0.05},
    "qsgd": {"bits": 2, "bucket_size": 16},
    "terngrad": {},
    "signsgd": {"momentum": 0.9, "lr": 0.003},
    "ef_signsgd": {},
    "hsq": {"min_compress": 4},
    "lamb": {"lr": 0.01},
    "powersgd": {"rank": 1, "warmup_steps": 2, "min_compression_rate": 1.0, "momentum": 0.9},  # rank 1: a residual
    # the 1-bit family past its warm-up / variance freeze: worker and server errors in use
    "apmsqueeze": {"warmup_steps": 2, "total_steps": 40, "lr": 0.01},
    "zeroone_adam": {"var_freeze_step": 2, "lr": 0.001},
    "onebit_lamb": {"freeze_step": 2, "lr": 0.03},
    # decentralized: replicas and momenta apart, per-neighbour state in use
    "dpsgd": {"momentum": 0.9},
    "d2": {},
    "adpsgd": {},
    "choco": {"codec": "sign", "momentum": 0.9},
    "dcd": {},
    "moniqua": {"bits": 2},
    "moniqua_d2": {"bits": 2},
    "moniqua_adpsgd": {},
    "pdsgdm": {"period": 3},
    "cpdsgdm": {"period": 3},
    "powergossip": {"min_compression_rate": 1.0},
    "decentralized_diloco": {"period": 3},
    # DiLoCo family: saved between outer steps (inner models apart), residuals and a fragment in flight
    "diloco": {"period": 3, "codec": "uniform", "codec_options": {"bits": 4}, "momentum": 0.9, "lr": 0.03},
    "sparseloco": {"period": 3, "density": 0.1, "chunk": 16},
    "streaming_diloco": {"period": 4, "fragments": 2, "delay": 1, "error_feedback": True},
}


def build(name: str, world) -> object:
    """The algorithm ``name`` around the tiny MLP on a ring of this job's ranks."""
    options = dict(ALGOS[name])
    options.setdefault("lr", LR)
    return make_algorithm(name, make_model(0), Communicator(world, topology.ring(world.Get_size())), **options)


def train(algo, steps: int, start: int) -> None:
    """``steps`` steps of every rank on its own batches (the step number is the batch index)."""
    rank = algo.comm.rank
    for step in range(start, start + steps):
        algo.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.cross_entropy(algo.model(x), y).backward()
        algo.step()


def averaged_loss(algo) -> float:
    """Collective: the cross-entropy of the averaged model over every rank's fixed evaluation batch."""
    with algo.averaged_model() as model, torch.no_grad():
        x, y = batch(algo.comm.rank, 10_000)
        local = torch.tensor([float(torch.nn.functional.cross_entropy(model(x), y))], dtype=torch.float64)
    return float(algo.comm.allreduce(local)[0]) / algo.comm.size


def load_one(name: str, root: str, world, save_root: str | None) -> dict:
    """Restore ``name`` at this size, train on (and save to ``save_root``); rank 0 gets every rank's state as
    built and as restored, and the losses (or the restore's error)."""
    algo = build(name, world)
    fresh = copy.deepcopy(algo.state_dict())
    try:
        step, _ = mpicomm.restore(os.path.join(root, name), algo)
    except ValueError as exc:  # raised alike on every rank
        algo.close()
        if save_root:  # a method that cannot resize: a checkpoint of its own at this size for the next phase
            save_fresh(name, save_root, world)
        return {"error": str(exc)}
    restored = copy.deepcopy(algo.state_dict())
    before = averaged_loss(algo)
    train(algo, MORE, step)
    after = averaged_loss(algo)
    if save_root:
        mpicomm.save(os.path.join(save_root, name), algo, step=step + MORE)
    algo.close()
    states = world.gather((fresh, restored), root=0)
    if world.Get_rank() != 0:
        return {}
    return {"fresh": [s[0] for s in states], "restored": [s[1] for s in states], "step": step,
            "before": before, "after": after}


# (saved at, resumed at), in order: the 2-rank checkpoint is the one saved after 4 -> 2
SIZES = [(4, 2), (4, 3), (4, 6), (2, 4)]


def wait_asleep(comm) -> None:
    """A barrier of ``comm`` that sleeps between polls (ranks idle during another world's phase)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def in_world(size: int, phase):
    """Run ``phase(world)`` on a world of the first ``size`` ranks; every rank leaves together."""
    everyone = MPI.COMM_WORLD
    world = everyone.Split(0 if everyone.Get_rank() < size else MPI.UNDEFINED, everyone.Get_rank())
    if world != MPI.COMM_NULL:
        phase(world)
        world.Free()
    wait_asleep(everyone)


def save_fresh(name: str, root: str, world) -> None:
    """``name`` trained :data:`STEPS` steps from the start and saved under ``root/<name>``."""
    algo = build(name, world)
    train(algo, STEPS, 0)
    mpicomm.save(os.path.join(root, name), algo, step=STEPS)
    algo.close()


def save_all(root: str, world) -> None:
    """Every algorithm trained :data:`STEPS` steps and saved under ``root/<name>``."""
    for name in ALGOS:
        save_fresh(name, root, world)


def load_all(root: str, report: str, save_root: str | None, world) -> None:
    """Every algorithm resumed from ``root/<name>`` at this world's size; rank 0 writes ``report``."""
    results = {name: load_one(name, root, world, save_root) for name in ALGOS}
    if world.Get_rank() == 0:
        torch.save({"size": world.Get_size(), "results": results}, report)


def main() -> None:
    root = sys.argv[1]
    in_world(4, functools.partial(save_all, os.path.join(root, "saved4")))
    for old, new in SIZES:
        again = os.path.join(root, "saved2") if (old, new) == (4, 2) else None
        report = os.path.join(root, f"report{old}to{new}.pt")
        in_world(new, functools.partial(load_all, os.path.join(root, f"saved{old}"), report, again))


if __name__ == "__main__":
    main()
