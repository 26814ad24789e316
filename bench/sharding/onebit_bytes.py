"""Bytes a compression-phase step of APMSqueeze sends per rank, unsharded against ``shard=True`` with each
``gather_bits`` (the parameter gather's precision), by the Ledger, at each world size.

    python bench/sharding/onebit_bytes.py [--ranks 2,4,8] [--params 4]

One ``mpiexec`` job per world size (entered in a loopback-only namespace when root) builds every configuration
around an MLP of about ``--params`` million parameters, runs one warm-up step and two compression steps, and
prints the last step's bytes sent per rank (the largest rank's): what the 1-bit average sends
(``alltoall`` + ``allgather`` of its payloads) and what the parameter gather adds (``allgatherv`` exact, or an
``allgather`` of quantized updates). Bytes do not depend on the machine's load, so one step is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = {"unsharded": {}, "shard, gather_bits=32": {"shard": True},
           "shard, gather_bits=8": {"shard": True, "gather_bits": 8},
           "shard, gather_bits=4": {"shard": True, "gather_bits": 4}}


def job(params_m: float) -> None:
    """Every rank: each configuration's last-step bytes by operation; rank 0 prints them as one JSON line."""
    import torch

    import mpicomm

    world = mpicomm.init()
    width = 1024
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    out = {}
    for label, options in CONFIGS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
        algo = mpicomm.wrap(model, None, "apmsqueeze", lr=1e-3, warmup_steps=1, **options)
        for _ in range(3):
            before = {op: algo.comm.ledger.bytes_sent(op) for op in ("alltoall", "allgather", "allgatherv")}
            algo.zero_grad()
            model(torch.randn(8, width)).pow(2).mean().backward()
            algo.step()
        sent = {op: algo.comm.ledger.bytes_sent(op) - before[op] for op in before}
        out[label] = max(world.world.allgather_object(sent), key=lambda s: sum(s.values()))
        out["d"] = algo.flat.numel
    if world.rank == 0:
        print(json.dumps(out), flush=True)


def main() -> None:
    """Launch one job per world size and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--params", type=float, default=4.0, help="model size, millions of parameters")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.params)
        return
    here = os.path.abspath(__file__)
    prefix = ["unshare", "-n", "bash", "-c", 'ip link set lo up && exec "$0" "$@"'] if os.geteuid() == 0 else []
    print("| ranks | d | " + " | ".join(f"{label} (KiB; × unsharded)" for label in CONFIGS) + " |")
    print("|---" * (2 + len(CONFIGS)) + "|")
    for n in (int(v) for v in args.ranks.split(",")):
        done = subprocess.run([*prefix, "mpiexec", "-n", str(n), sys.executable, here, "--job", "--params",
                               str(args.params)], capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        base = sum(result["unsharded"].values())
        cells = [f"{sum(result[label].values()) / 1024:.0f}; {sum(result[label].values()) / base:.2f}×"
                 for label in CONFIGS]
        print(f"| {n} | {result['d']:,} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
