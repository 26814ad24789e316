"""One phase of bench/checkpoint/resize_memory.py, run by every rank of an ``mpiexec``.

    mpiexec -n N python resize_memory_job.py save DIR PARAMS_M ALGORITHM
    mpiexec -n M python resize_memory_job.py restore DIR PARAMS_M ALGORITHM OUT.json

``save``: builds ALGORITHM around an MLP of PARAMS_M million parameters, takes one step (so Adam's state
exists) and saves it to DIR. ``restore``: builds the same, records this process's resident memory, resets the
kernel's peak of it (``/proc/self/clear_refs``), restores DIR (at this job's size, whatever size saved it) and
records the peak resident memory since (``VmHWM``): the restore's own peak, not the building's, whose
temporaries (the model's parameters before they move into the flat buffer) would otherwise set a floor under a
small restore. Where the reset is refused the peak is the process's (``ru_maxrss``) and ``peak_since_reset`` is
false. Also recorded: the bytes of the tensors of the restored ``state_dict()`` (the state's size, what a
restore must hold at least once), per rank. Rank 0 writes every rank's figures to OUT.json. The repository
imported is the one on ``PYTHONPATH`` (the benchmark can point it at another checkout).
"""

import json
import resource
import sys
import time

import torch
from mpi4py import MPI

import mpicomm
from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

WIDTH = 4096


def status_mib(field: str = "VmRSS") -> float:
    """``field`` of /proc/self/status (VmRSS: resident memory now; VmHWM: its peak), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> bool:
    """Reset the kernel's peak resident memory of this process to its current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def layer_widths(params_m: float) -> list[int]:
    """Output widths of Linear layers from WIDTH inputs whose parameters sum to ``params_m`` million (to one row):
    WIDTH x WIDTH layers, then one narrower layer for the rest."""
    target, per_row = round(params_m * 1e6), WIDTH + 1
    full = target // (WIDTH * per_row)
    rest = round((target - full * WIDTH * per_row) / per_row)
    return [WIDTH] * full + ([rest] if rest else []) or [1]


def tensor_bytes(tree) -> int:
    """Bytes of the tensors of a nested state."""
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def build(params_m: float, algorithm: str):
    """ALGORITHM around Linear layers of ``params_m`` million parameters in all (:func:`layer_widths`)."""
    torch.random.default_generator.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, width) for width in layer_widths(params_m)])
    world = MPI.COMM_WORLD
    return make_algorithm(algorithm, model, Communicator(world, topology.ring(world.Get_size())), lr=1e-3)


def main() -> None:
    phase, directory, params_m, algorithm = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    algo = build(params_m, algorithm)
    if phase == "save":
        algo.zero_grad()
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(algo.comm.rank))
        algo.model(x).square().mean().backward()
        algo.step()
        mpicomm.save(directory, algo, step=1)
        return
    MPI.COMM_WORLD.Barrier()
    built = status_mib()
    since_reset = reset_peak()
    t0 = time.perf_counter()
    mpicomm.restore(directory, algo)
    seconds = time.perf_counter() - t0
    peak = status_mib("VmHWM") if since_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    after = status_mib()
    numel = sum(p.numel() for p in algo.model.parameters())
    state_mib = tensor_bytes(algo.state_dict()) / 2**20
    rows = MPI.COMM_WORLD.gather({"rank": algo.comm.rank, "rss_built_mib": built, "peak_rss_mib": peak,
                                  "rss_after_mib": after, "peak_since_reset": since_reset, "state_mib": state_mib,
                                  "restore_s": seconds, "params": numel}, root=0)
    if algo.comm.rank == 0:
        with open(sys.argv[5], "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
