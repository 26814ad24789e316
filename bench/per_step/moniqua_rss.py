"""Peak resident memory per rank: ResNet-20 on the digits for one epoch, D-PSGD or Moniqua's default.

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/per_step/moniqua_rss.py dpsgd'
    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/per_step/moniqua_rss.py moniqua'

Each rank trains one epoch (32 images a step, lr 0.1, momentum 0.9, ring) and reports
``resource.getrusage(RUSAGE_SELF).ru_maxrss``; run the two algorithms as separate jobs (peak RSS only grows).
"""

from __future__ import annotations

import os
import resource
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "apps")]

import torch  # noqa: E402
from data.image_task import ImageTask  # noqa: E402
from data.images import load_digits32  # noqa: E402
from models.resnet import build_model  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpicomm import topology  # noqa: E402
from mpicomm.algorithms import make_algorithm  # noqa: E402
from mpicomm.comm import Communicator  # noqa: E402


def main() -> None:
    """Train one epoch with the algorithm named on the command line; rank 0 prints every rank's peak RSS."""
    name = sys.argv[1] if len(sys.argv) > 1 else "moniqua"
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    data = load_digits32(seed=0)
    model = build_model("resnet20", data.num_classes, "batch", seed=0)
    task = ImageTask(model, data, rank=comm.rank, size=comm.size, batch_size=32, seed=0)
    algo = make_algorithm(name, model, Communicator(comm, topology.ring(comm.size)), lr=0.1, momentum=0.9)
    for batch in task.train_batches(0):
        algo.zero_grad()
        loss, _ = task.loss(model, batch)
        loss.backward()
        algo.step()
    algo.close()
    peaks = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, root=0)
    if comm.rank == 0:
        print(f"{name}: peak RSS per rank (MB) {peaks}, max {max(peaks)}")


if __name__ == "__main__":
    main()
