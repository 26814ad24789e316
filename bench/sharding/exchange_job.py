"""One configuration of bench/sharding/exchange.py, run by every rank of an ``mpiexec``.

    mpiexec -n N python exchange_job.py ORDER STEPS PARAMS_M OUT.json

AllReduce-Adam with ``shard=True`` (and ``shard_order=ORDER``; ORDER ``before`` passes none, for a checkout that
predates the option) around the MLP of memory_job.py (about PARAMS_M million parameters), STEPS steps on random
inputs. Rank 0 writes every rank's figures of the last step to OUT.json: the Ledger's messages and bytes sent by
operation (``alltoallv``: the fp32 reduce-scatter; ``allgather``: the parameter gather) and its calls (the
reduce-scatter's rounds), the landing buffer's bytes (``exchange.received``), and the seconds of the
reduce-scatter and of the whole step.
"""

import json
import sys
import time

import torch
from mpi4py import MPI

import mpicomm

WIDTH = 2048
BATCH = 16


def main() -> None:
    order, steps, params_m, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks[:-1])
    options = {"lr": 1e-3, "shard": True, **({} if order == "before" else {"shard_order": order})}
    algo = mpicomm.wrap(model, None, "allreduce_adam", **options)
    world = MPI.COMM_WORLD
    exchange = algo.sharding.exchange
    timed = []
    reduce_scatter = exchange.reduce_scatter

    def timed_reduce_scatter(grad, shard):
        t0 = time.perf_counter()
        result = reduce_scatter(grad, shard)
        timed.append(time.perf_counter() - t0)
        return result

    exchange.reduce_scatter = timed_reduce_scatter
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))
    ledger = algo.comm.ledger
    step_s, row = [], {}
    for i in range(steps):
        world.Barrier()
        before = {op: (ledger.messages_sent(op), ledger.bytes_sent(op),
                       ledger.contributed[op].messages if op in ledger.contributed else 0)
                  for op in ("alltoallv", "allgather", "allreduce")}
        t0 = time.perf_counter()
        algo.zero_grad()
        model(x).square().mean().backward()
        algo.step()
        step_s.append(time.perf_counter() - t0)
        if i == steps - 1:
            row = {op: {"messages": ledger.messages_sent(op) - m, "bytes": ledger.bytes_sent(op) - b,
                        "calls": (ledger.contributed[op].messages if op in ledger.contributed else 0) - c}
                   for op, (m, b, c) in before.items()}
    row.update(rank=world.rank, params=algo.flat.numel, shard=algo.sharding.hi - algo.sharding.lo,
               landing_bytes=exchange.received.numel() * exchange.received.element_size(),
               reduce_scatter_s=timed, step_s=step_s)
    algo.close()
    rows = world.gather(row, root=0)
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
