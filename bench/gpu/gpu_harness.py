"""Pieces of ``bench/gpu/gpu_check.py``: ResNet-20 steps on a device, codec lists, device timing.

``train(...)`` runs the training step the apps run (autocast, scaled backward, agreed overflow
check, ``algo.step``) on the embedded digits, for a few steps, without the loop's logging and
checkpoints, and returns this rank's losses and step times.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "apps"))

from data.image_task import ImageTask  # noqa: E402
from data.images import load_digits32  # noqa: E402
from models.resnet import build_model  # noqa: E402

from mpicomm import topology  # noqa: E402
from mpicomm.algorithms import make_algorithm  # noqa: E402
from mpicomm.codecs import bitpack  # noqa: E402
from mpicomm.comm import Communicator  # noqa: E402
from mpicomm.training.device import place_task, to_device  # noqa: E402
from mpicomm.training.precision import Precision  # noqa: E402

# Every synchronous algorithm with options that make it train ResNet-20 in a few steps; "stochastic"
# marks those whose random streams differ between devices (CPU and CUDA generators draw differently).
ALGORITHMS = {
    "dpsgd": ({"momentum": 0.9}, False),
    "dpsgd_overlap": ({"momentum": 0.9, "overlap": True}, False),
    "dpsgd_hier": ({"momentum": 0.9, "hierarchical": True}, False),  # node average, then gossip between nodes
    "moniqua": ({"bits": 8}, False),
    "moniqua_overlap": ({"bits": 8, "overlap": True}, False),
    "moniqua_1bit": ({"bits": 1}, False),
    "moniqua_hier": ({"bits": 8, "hierarchical": True}, False),
    "d2": ({}, False),
    "d2_hier": ({"hierarchical": True}, False),
    "moniqua_d2": ({"bits": 8}, False),
    "moniqua_d2_hier": ({"bits": 8, "hierarchical": True}, False),
    "choco": ({"codec": "qsgd", "codec_options": {"bits": 4}}, True),
    "choco_hier": ({"codec": "qsgd", "codec_options": {"bits": 4}, "hierarchical": True}, True),
    "choco_overlap": ({"codec": "qsgd", "codec_options": {"bits": 4}, "order": "cta", "overlap": True}, True),
    "dcd": ({"codec": "sign"}, False),
    "dcd_hier": ({"codec": "sign", "hierarchical": True}, False),
    "pdsgdm": ({"period": 2, "momentum": 0.9}, False),
    "cpdsgdm": ({"period": 2, "codec": "sign"}, False),
    "pdsgdm_overlap": ({"period": 2, "momentum": 0.9, "order": "cta", "overlap": True}, False),
    "cpdsgdm_overlap": ({"period": 2, "codec": "sign", "order": "cta", "overlap": True}, False),
    "adpsgd": ({"momentum": 0.9}, True),  # asynchronous (ASYNCHRONOUS below)
    "moniqua_adpsgd": ({"momentum": 0.9}, True),
    "allreduce_sgd": ({"momentum": 0.9}, False),
    "allreduce_sgd_hier": ({"momentum": 0.9, "hierarchical": True}, False),  # two levels on the node layout
    "qsgd": ({"bits": 4}, True),
    "qsgd_hier": ({"bits": 4, "hierarchical": True}, True),
    "qsgd_overlap": ({"bits": 4, "overlap": True, "first_bucket_numel": 4096, "bucket_numel": 65536}, True),
    "terngrad": ({}, True),
    "signsgd": ({"lr": 1e-3}, False),
    "signsgd_overlap": ({"lr": 1e-3, "overlap": True, "first_bucket_numel": 4096, "bucket_numel": 65536}, False),
    "ef_signsgd": ({}, False),
    "compressed_sgd": ({"codec": "topk", "codec_options": {"ratio": 0.01}, "error_feedback": True}, False),
    "hsq": ({"d": 8}, False),
    "hsq_hier": ({"d": 8, "hierarchical": True}, False),
    "hsq_overlap": ({"d": 8, "overlap": True, "first_bucket_numel": 4096, "bucket_numel": 65536}, False),
    "powersgd": ({"rank": 2, "warmup_steps": 1}, False),
    "powersgd_overlap": ({"rank": 2, "warmup_steps": 1, "overlap": True, "first_bucket_numel": 4096,
                          "bucket_numel": 65536}, False),
    "powersgd_hier": ({"rank": 2, "warmup_steps": 1, "hierarchical": True}, False),
    "allreduce_adam": ({"lr": 1e-3}, False),
    "allreduce_adam_hier": ({"lr": 1e-3, "hierarchical": True}, False),
    "allreduce_adam_shard": ({"lr": 1e-3, "shard": True, "shard_bits": 4, "gather_bits": 8}, True),  # QSGD rounding
    "lamb_hier": ({"lr": 1e-3, "hierarchical": True}, False),
    "zeroone_adam": ({"lr": 1e-3}, False),
    "onebit_lamb": ({"lr": 1e-3, "freeze_step": 1}, False),
    "apmsqueeze": ({"lr": 1e-3, "warmup_steps": 5}, False),
    "apmsqueeze_hier": ({"lr": 1e-3, "warmup_steps": 5, "hierarchical": True}, False),
    "apmsqueeze_shard": ({"lr": 1e-3, "warmup_steps": 5, "shard": True}, False),
    "apmsqueeze_overlap": ({"lr": 1e-3, "warmup_steps": 5, "overlap": True, "first_bucket_numel": 4096,
                            "bucket_numel": 65536}, False),
    "diloco": ({"period": 2, "codec": "uniform", "codec_options": {"bits": 4}}, False),
    "diloco_hier": ({"period": 2, "codec": "uniform", "codec_options": {"bits": 4}, "hierarchical": True}, False),
    "sparseloco": ({"period": 2, "inner_optimizer": "adamw", "lr": 1e-3}, False),  # the inner AdamW path
    "sparseloco_hier": ({"period": 2, "hierarchical": True}, False),
    "powergossip": ({"momentum": 0.9}, False),
    "powergossip_overlap": ({"momentum": 0.9, "order": "cta", "overlap": True}, False),
    "decentralized_diloco": ({"period": 2}, False),
    "decentralized_diloco_hier": ({"period": 2, "hierarchical": True}, False),
    "streaming_diloco": ({"period": 4, "fragments": 2, "delay": 1}, False),
    "streaming_diloco_hier": ({"period": 4, "fragments": 2, "delay": 1, "hierarchical": True}, False),
}
ASYNCHRONOUS = {"adpsgd", "moniqua_adpsgd"}
"""Which peer state a pull sees depends on timing: free-running, a device run and a CPU run interleaved
differently about one pair in five, and their last losses then differed by 10-11 %. Untimed, these take their
steps in turns (rank 0's step, a barrier, rank 1's, ...), so each pull sees one fixed state and the two runs
must agree like the synchronous methods; timed runs stay free-running."""


def in_turns(mpi_comm, step) -> None:
    """Collective: ``step()`` on one rank at a time, in rank order, a barrier after each."""
    for turn in range(mpi_comm.Get_size()):
        if mpi_comm.Get_rank() == turn:
            step()
        mpi_comm.Barrier()


def algorithm_name(key: str) -> str:
    """The registry name behind an ``ALGORITHMS`` key (``moniqua_1bit`` is ``moniqua``, ``qsgd_overlap``,
    ``qsgd_hier`` are ``qsgd``, ``apmsqueeze_shard`` is ``apmsqueeze``)."""
    return ("moniqua" if key == "moniqua_1bit"
            else key.removesuffix("_overlap").removesuffix("_hier").removesuffix("_shard"))


def bench_codecs(x_ref: dict) -> list:
    """``(label, codec, target)`` from ``bench/codecs/codecs.py`` (loaded by path: its name shadows the stdlib's)."""
    spec = importlib.util.spec_from_file_location("bench_codecs", os.path.join(ROOT, "bench", "codecs", "codecs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.codecs(x_ref)


@contextlib.contextmanager
def torch_path(enabled: bool):
    """Force the codecs' torch path (what CUDA tensors take) on the CPU when ``enabled``."""
    with bitpack.use_backend("torch" if enabled else "auto"):
        yield


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeat: int) -> float:
    """Median wall time of ``fn()`` in ms over ``repeat`` runs after one warm-up, synchronised."""
    fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


_DATA: list = []


def _digits():
    """The embedded digits, loaded once per process (a fresh copy of the tensors for every run)."""
    if not _DATA:
        _DATA.append(load_digits32())
    d = _DATA[0]
    return type(d)(d.x_train.clone(), d.y_train.clone(), d.x_test.clone(), d.y_test.clone(), d.name, d.flip)


def train(mpi_comm, key: str, device: torch.device, steps: int, *, batch: int = 32, precision: str = "fp32",
          stage: str = "auto", seed: int = 0, timed: bool = False) -> dict:
    """Collective: ``steps`` steps of ResNet-20 with algorithm ``key``; this rank's losses (and step ms)."""
    options, _ = ALGORITHMS[key]
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    torch.manual_seed(1_000_003 * seed + rank)
    data = _digits()
    task = ImageTask(build_model("resnet20", data.num_classes, seed=seed), data, rank=rank, size=size,
                     batch_size=batch, seed=seed, augment_images=False, eval_limit=64)
    place_task(task, device)
    comm = Communicator(mpi_comm, topology.build("ring", size), stage=stage)
    algo = make_algorithm(algorithm_name(key), task.model, comm, **{"lr": 0.05, **options})
    prec = Precision(precision, device, comm)
    losses, step_ms, epoch = [], [], 0
    while len(losses) < steps:
        for x in task.train_batches(epoch):
            sync(device)
            t0 = time.perf_counter()
            if precision != "fp16":  # fp16 may skip the step after backward: its exchange is not begun early
                algo.begin_step()  # the *_overlap methods post their exchange here, before the forward pass
            algo.zero_grad()
            with prec.autocast():
                loss, _ = task.loss(algo.model, to_device(x, device))
            prec.backward(loss)
            if prec.ready(algo.flat):
                in_turns(mpi_comm, algo.step) if key in ASYNCHRONOUS and not timed else algo.step()
            if timed:
                sync(device)
                step_ms.append(1e3 * (time.perf_counter() - t0))
            losses.append(loss.detach())
            if len(losses) == steps:
                break
        epoch += 1
    algo.close()
    out = {"losses": [float(v) for v in losses], "finite": bool(torch.isfinite(torch.stack(losses)).all())}
    if timed:
        out["step_ms"] = statistics.median(step_ms[min(5, len(step_ms) - 1):])
    if precision == "fp16":
        out.update(loss_scale=prec.scale, skipped=prec.skipped)
    return out
