"""One configuration of bench/sharding/memory.py, run by every rank of an ``mpiexec``.

    mpiexec -n N python memory_job.py ALGORITHM SHARD_BITS STEPS PARAMS_M OUT.json

Builds ``mpicomm.wrap(model, None, ALGORITHM, ...)`` around an MLP of Linear(WIDTH, WIDTH) layers (about
PARAMS_M million parameters; options as in OPTIONS), replicated when SHARD_BITS is 0, else with
``shard=True, shard_bits=SHARD_BITS``, and trains STEPS steps on random inputs. Rank 0 writes every rank's figures
to OUT.json:

- ``state_bytes``: the sum of the tensor bytes in ``algo.optimizer.state`` after the steps;
- ``rss_imports_mib`` / ``rss_built_mib``: resident memory after the imports and after ``wrap``;
- ``peak_mib``: the process's peak resident memory (``ru_maxrss``) after the steps;
- ``step_peak_mib``: the peak while stepping only (VmHWM, reset through /proc/self/clear_refs once built, so the
  build's transient copies do not count);
- ``step_s``: every step's seconds (zero_grad, forward, backward, step);
- ``sent_by_op``: the Ledger's bytes sent by operation during the last step;
- ``exchange_extra_bytes``: the sharded exchange's own buffers (:func:`exchange_bytes`).
"""

import json
import resource
import sys
import time

import torch
from mpi4py import MPI

import mpicomm

WIDTH = 2048
BATCH = 16
OPTIONS = {"allreduce_adam": {"lr": 1e-3}, "allreduce_sgd": {"lr": 0.01, "momentum": 0.9},
           "apmsqueeze": {"lr": 1e-3, "warmup_steps": 1}}
"""Each algorithm's options (APMSqueeze: one warm-up step, so that the later steps run its 1-bit phase)."""


def status_mib(key: str) -> float:
    """A ``/proc/self/status`` figure (VmRSS, VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def exchange_bytes(sharding) -> int:
    """Bytes the sharded step holds beyond the model, its gradient, the optimizer state and the reduced shard
    (``Sharding.buffer_bytes()`` less the shard, or, in versions without it, ``ShardedSum.extra_bytes()``)."""
    if hasattr(sharding, "buffer_bytes"):
        return sharding.buffer_bytes() - sharding.grad.numel() * sharding.grad.element_size()
    return sharding.exchange.extra_bytes()


def main() -> None:
    algorithm, bits, steps, params_m, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
        sys.argv[5]
    torch.set_num_threads(1)
    rss_imports = status_mib("VmRSS")
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks[:-1])
    options = OPTIONS[algorithm]
    if bits:
        options.update(shard=True, shard_bits=bits)
    algo = mpicomm.wrap(model, None, algorithm, **options)
    rss_built = status_mib("VmRSS")
    world = MPI.COMM_WORLD
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(world.rank))
    reset = reset_peak()
    times, sent = [], {}
    ledger = algo.comm.ledger
    for i in range(steps):
        world.Barrier()
        before = {op: ledger.bytes_sent(op) for op in ledger.contributed}
        t0 = time.perf_counter()
        algo.zero_grad()
        model(x).square().mean().backward()
        algo.step()
        times.append(time.perf_counter() - t0)
        if i == steps - 1:
            sent = {op: ledger.bytes_sent(op) - before.get(op, 0) for op in ledger.contributed}
    state_bytes = sum(v.numel() * v.element_size() for s in algo.optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v))
    row = {"rank": world.rank, "params": algo.flat.numel, "state_bytes": state_bytes,
           "rss_imports_mib": rss_imports, "rss_built_mib": rss_built,
           "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "step_peak_mib": status_mib("VmHWM") if reset else None, "step_s": times,
           "sent_by_op": {op: n for op, n in sent.items() if n},
           "exchange_extra_bytes": exchange_bytes(algo.sharding) if bits else 0}
    algo.close()
    rows = world.gather(row, root=0)
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
