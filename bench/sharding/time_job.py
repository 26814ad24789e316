"""The step-time part of bench/sharding/memory.py, run by every rank of an ``mpiexec``.

    mpiexec -n N python time_job.py ALGORITHM BITS ROUNDS PARAMS_M OUT.json

BITS is a comma list of configurations, 0 for the replicated method and 32, 8 or 4 for ``shard=True`` with that
``shard_bits``. Each configuration wraps its own copy of the same MLP (memory_job.py's, the same options) in this
one process, and the configurations step in turn, one step each per round, for ROUNDS rounds: on a shared machine
whose load drifts, each configuration's steps are taken under the same load as the others'. A step's time is the
slowest rank's (a barrier before each). For a sharded configuration the reduce-scatter and the parameter
allgather are timed as well (the exchange's methods wrapped here). Rank 0 writes ``{bits: {"step_s": [...],
"reduce_scatter_s": [...], "allgather_s": [...]}}`` to OUT.json.
"""

import json
import sys
import time

import torch
from memory_job import BATCH, OPTIONS, WIDTH
from mpi4py import MPI

import mpicomm


def timed(record: list, call):
    """``call`` that appends its seconds to ``record``."""
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - t0)
    return run


def main() -> None:
    algorithm, configs, rounds, params_m, out = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], \
        int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))
    runs = {}
    for bits in configs:
        torch.manual_seed(0)
        blocks = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
        model = torch.nn.Sequential(*blocks[:-1])
        options = dict(OPTIONS[algorithm], **({"shard": True, "shard_bits": bits} if bits else {}))
        algo = mpicomm.wrap(model, None, algorithm, **options)
        record = {"step_s": [], "reduce_scatter_s": [], "allgather_s": []}
        if bits:
            exchange = algo.sharding.exchange
            exchange.reduce_scatter = timed(record["reduce_scatter_s"], exchange.reduce_scatter)
            gather = getattr(algo.sharding, "gather", None)  # the parameter allgather's own object, where it has one
            if gather is not None:
                gather.gather = timed(record["allgather_s"], gather.gather)
            else:
                exchange.allgather = timed(record["allgather_s"], exchange.allgather)
        runs[bits] = (model, algo, record)
    for _ in range(rounds):
        for model, algo, record in runs.values():
            world.Barrier()
            t0 = time.perf_counter()
            algo.zero_grad()
            model(x).square().mean().backward()
            algo.step()
            record["step_s"].append(time.perf_counter() - t0)
    result = {}
    for bits, (_, algo, record) in runs.items():
        algo.close()
        result[bits] = {k: [max(values) for values in zip(*world.allgather(v))] for k, v in record.items()}
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
