"""PowerSGD against torch's ``powerSGD_hook`` on DDP (gloo): step time, same ranks, same model, same run.

    unshare -n bash -c 'ip link set lo up && mpiexec -n 2 python bench/wallclock/powersgd_hook.py'
                                             [--steps 20] [--rank 2] [--rounds 3] [--batch 32]

One MPI job. Every rank trains ResNet-20 on its shard of the embedded digits (batch ``--batch``, lr 0.05,
momentum 0.9) three ways, interleaved round by round so the machine's load falls on all three alike:

* ``hook``: ``DistributedDataParallel`` (gloo process group over the same ranks, loopback; BatchNorm
  statistics kept per rank, as mpicomm keeps them: ``broadcast_buffers=False``) with ``powerSGD_hook`` (rank
  ``--rank``, warm start, error feedback, ``start_powerSGD_iter`` 2) on one bucket: with DDP's default two
  buckets of ResNet-20, gloo aborted at the first compressed step here ("Received data size doesn't match
  expected size": the two buckets' chained P and Q allreduces reached the ranks in different orders), so
  the hook runs once backward has ended, as mpicomm's blocking case does;
* ``blocking``: mpicomm's ``powersgd`` (the same options) exchanging after backward;
* ``overlap``: mpicomm's ``powersgd --overlap`` (DDP's bucket sizes), both allreduces per bucket during backward.

Both libraries move real bytes on loopback (no modelled network: gloo has none). Reported: each round's median
step time over steps 3..``--steps`` (after the warm-up), the median over rounds, and each mpicomm case's
ratio to the hook in the same round, against the target overlap <= 1.05 x hook. Writes
docs/results/powersgd_hook.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))

from data.image_task import ImageTask  # noqa: E402
from data.images import load_digits32  # noqa: E402
from models.resnet import build_model  # noqa: E402

from bench.common import markdown_table, write_table  # noqa: E402
from mpicomm import topology  # noqa: E402
from mpicomm.algorithms import make_algorithm  # noqa: E402
from mpicomm.comm import Communicator  # noqa: E402

TARGET = 1.05
WARMUP = 2
CASES = ("hook", "blocking", "overlap")


def init_gloo(comm) -> None:
    """A gloo process group over the MPI ranks through a TCPStore on a free loopback port of rank 0."""
    store = dist.TCPStore("127.0.0.1", 0, comm.Get_size(), True, wait_for_workers=False) if comm.Get_rank() == 0 \
        else None
    port = comm.bcast(store.port if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, comm.Get_size(), False)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=store, rank=comm.Get_rank(), world_size=comm.Get_size())


def step_times(comm, case: str, args, task: ImageTask) -> list[float]:
    """Seconds of each of ``args.steps`` training steps of ``case`` (this rank's clock, after a barrier)."""
    model = build_model("resnet20", task.data.num_classes, seed=0)
    if case == "hook":
        with warnings.catch_warnings():  # the flag's newer name still syncs buffers at start-up
            warnings.simplefilter("ignore", FutureWarning)
            net = DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=1024)
        state = PowerSGDState(None, matrix_approximation_rank=args.rank, start_powerSGD_iter=WARMUP,
                              use_error_feedback=True, warm_start=True)
        net.register_comm_hook(state, powerSGD_hook)
        sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

        def zero_grad():
            sgd.zero_grad()

        step = sgd.step
    else:
        net = model
        algo = make_algorithm("powersgd", model, Communicator(comm, topology.complete(comm.Get_size())), lr=0.05,
                              momentum=0.9, rank=args.rank, warmup_steps=WARMUP, overlap=case == "overlap")
        zero_grad, step = algo.zero_grad, algo.step
    times = []
    comm.Barrier()
    for x, y in task.train_batches(0):
        t0 = time.perf_counter()
        zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        step()
        times.append(time.perf_counter() - t0)
        if len(times) == args.steps:
            break
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    init_gloo(comm)
    task = ImageTask(build_model("resnet20", 10, seed=0), load_digits32(), rank=comm.Get_rank(),
                     size=comm.Get_size(), batch_size=args.batch, seed=0, augment_images=False, eval_limit=32)
    medians = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            times = step_times(comm, case, args, task)[WARMUP:]
            slowest = comm.allreduce(statistics.median(times), op=MPI.MAX)  # a step lasts as long as its slowest rank
            medians[case].append(slowest)
    dist.destroy_process_group()
    if comm.Get_rank() != 0:
        return
    ratios = {case: [m / h for m, h in zip(medians[case], medians["hook"])] for case in ("blocking", "overlap")}
    rows = [[case, " / ".join(f"{1e3 * m:.1f}" for m in medians[case]), f"{1e3 * statistics.median(medians[case]):.1f}",
             "1" if case == "hook" else f"{statistics.median(ratios[case]):.3f}",
             "" if case != "overlap" else ("met" if statistics.median(ratios[case]) <= TARGET else "missed")]
            for case in CASES]
    table = markdown_table(["case", "median step ms per round", "median ms", "ratio to hook",
                            f"target overlap <= {TARGET} x hook"], rows)
    title = (f"PowerSGD (rank {args.rank}) against torch's powerSGD_hook on DDP (gloo), ResNet-20, digits, "
             f"{comm.Get_size()} ranks, batch {args.batch}, steps {WARMUP + 1}..{args.steps}, {args.rounds} rounds")
    write_table("powersgd_hook", title, table, {"ranks": comm.Get_size(), "rank": args.rank, "steps": args.steps,
                                                "medians_s": medians, "ratios_to_hook": ratios, "target": TARGET})


if __name__ == "__main__":
    main()
