"""The sharded fp32 reduce-scatter as it scales: messages per rank and step, and the landing buffer, against n.

    python bench/sharding/exchange.py [--params 25.178112] [--ranks 2,3,4,8] [--steps 3] [--before PATH]
        [--out sharding_exchange]

Measured: for each size of ``--ranks`` one ``mpiexec`` job (``exchange_job.py``) per order of the sum (``fast``,
``exact``; and ``before``: the checkout at ``--before``, whose exact exchange moved each shard in segments of
max(c/n, 2^18) elements by blocking all-to-alls), AllReduce-Adam with ``shard=True`` on an MLP of ``--params``
million parameters: the Ledger's messages sent in the last step by the reduce-scatter (``alltoallv``) and by the
parameter gather (``allgather``), the reduce-scatter's collective calls, and the landing buffer, the largest rank's
figures; with the reduce-scatter's seconds (median of the steps after the first, slowest rank: a shared machine,
so indicative only).

Modelled, for n = 2 .. 64 and for the 1-billion-parameter example: the same figures from the rounds themselves
(:mod:`mpicomm.algorithms.shared.shard_rounds`, every rank's, no MPI), and for ``before`` from its formula,
ceil(c / s) all-to-alls of n - 1 messages each, s = min(c, max(ceil(c / n), 2^18)), landing n s elements.
The model is checked against every measured row. Writes docs/results/<out>.json; prints the markdown tables
that docs/results/sharding.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.common import REPO, RESULTS, RUNS, enter_loopback_namespace, machine, markdown_table, write_json  # noqa: E402
from mpicomm.algorithms.shared.shard_exchange import ShardLayout  # noqa: E402
from mpicomm.algorithms.shared.shard_rounds import rounds  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exchange_job.py")
MIB = 1 << 20
SEGMENT = 1 << 18  # the earlier exact exchange's segment floor
MODEL_RANKS = [2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64]
BILLION = 10**9


def modelled(d: int, n: int, order: str) -> dict:
    """Messages sent per rank and step by the fp32 reduce-scatter (largest rank), its collective calls and its
    landing buffer (bytes), for ``d`` fp32 elements on ``n`` ranks."""
    layout = ShardLayout(d, n)
    c, counts = layout.chunk, layout.counts
    if order == "before":
        seg = max(1, min(c, max(-(-c // n), SEGMENT)))
        calls = -(-max(counts) // seg)
        return {"messages": calls * (n - 1), "calls": calls, "landing_bytes": 4 * n * seg}
    ranks = range(n) if n <= 64 else sorted({0, 1, 2, 3, n - 2, n - 1})
    plans = [rounds(order, n, r, counts) for r in ranks]
    return {"messages": max(sum(1 for step in plan if step.send_to >= 0) for plan in plans),
            "calls": len(plans[0]), "landing_bytes": 4 * max(counts)}


def run_job(n: int, order: str, args, where: str) -> dict:
    """One measured job; the largest rank's figures."""
    out = os.path.join(where, f"{order}-{n}r.json")
    repo = args.before if order == "before" else REPO
    cmd = ["mpiexec", "-n", str(n), sys.executable, JOB, order, str(args.steps), str(args.params), out]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo), capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(out) as f:
        rows = json.load(f)
    later = [statistics.median(r["reduce_scatter_s"][1:] or r["reduce_scatter_s"]) for r in rows]
    result = {"ranks": n, "order": order, "params": rows[0]["params"],
              "messages": max(r["alltoallv"]["messages"] for r in rows),
              "calls": max(r["alltoallv"]["calls"] for r in rows),
              "bytes": max(r["alltoallv"]["bytes"] for r in rows),
              "gather_messages": max(r["allgather"]["messages"] for r in rows),
              "landing_bytes": max(r["landing_bytes"] for r in rows),
              "shard_bytes": 4 * max(r["shard"] for r in rows),
              "reduce_scatter_s": max(later), "per_rank": rows}
    print(f"{order} at {n} ranks: {result['messages']} messages, {result['calls']} calls, landing "
          f"{result['landing_bytes'] / MIB:.1f} MiB, reduce-scatter {result['reduce_scatter_s']:.3f} s", flush=True)
    return result


def mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f}" if nbytes < 100 * MIB else f"{nbytes / MIB:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=25.178112, help="millions of parameters (measured)")
    parser.add_argument("--ranks", default="2,3,4,8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--before", default=None, help="a checkout before shard_order (e.g. a git worktree)")
    parser.add_argument("--out", default="sharding_exchange")
    args = parser.parse_args()
    enter_loopback_namespace()
    where = os.path.join(RUNS, args.out)
    os.makedirs(where, exist_ok=True)
    orders = (["before"] if args.before else []) + ["fast", "exact"]
    measured = [run_job(n, order, args, where) for n in map(int, args.ranks.split(",")) for order in orders]
    for row in measured:  # the model is the measurement where both exist
        model = modelled(row["params"], row["ranks"], row["order"])
        row["modelled"] = model
        row["model_matches"] = (model["messages"], model["calls"], model["landing_bytes"]) == \
            (row["messages"], row["calls"], row["landing_bytes"])
    header = ["ranks", "order", "messages per rank (reduce-scatter)", "collective calls", "+ parameter gather",
              "landing buffer (MiB)", "one shard (MiB)", "reduce-scatter (s)", "model agrees"]
    measured_table = markdown_table(header, [
        [r["ranks"], r["order"], r["messages"], r["calls"], r["gather_messages"], mib(r["landing_bytes"]),
         mib(r["shard_bytes"]), f"{r['reduce_scatter_s']:.3f}", "yes" if r["model_matches"] else "NO"]
        for r in measured])
    tables = {}
    for d in (measured[0]["params"] if measured else int(args.params * 1e6), BILLION):
        rows = []
        for n in MODEL_RANKS:
            got = {order: modelled(d, n, order) for order in ("before", "fast", "exact")}
            rows.append([n, got["before"]["messages"], got["fast"]["messages"], got["exact"]["messages"],
                         mib(got["before"]["landing_bytes"]), mib(got["fast"]["landing_bytes"]),
                         mib(4 * ShardLayout(d, n).chunk)])
        tables[d] = markdown_table(["ranks", "messages before", "messages fast", "messages exact",
                                    "landing before (MiB)", "landing fast / exact (MiB)", "one shard (MiB)"], rows)
    at_1024 = {order: modelled(BILLION, 1024, order) for order in ("before", "fast", "exact")}
    payload = {"machine": machine(), "params_measured": measured[0]["params"] if measured else None,
               "measured": measured, "modelled": {str(d): t for d, t in tables.items()},
               "billion_at_1024": at_1024, "measured_table": measured_table}
    write_json(os.path.join(RESULTS, f"{args.out}.json"), payload)
    print("\nMeasured (Ledger):\n" + measured_table)
    for d, table in tables.items():
        print(f"\nModelled, d = {d:,}:\n{table}")
    print(f"\n1e9 parameters at 1024 ranks: {json.dumps(at_1024)}")


if __name__ == "__main__":
    main()
