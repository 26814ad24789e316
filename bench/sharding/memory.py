"""Sharded data parallel (``shard=True``) against the replicated method: state, peak memory, bytes and step time.

    python bench/sharding/memory.py [--params 25] [--ranks 1,2,4,8]
        [--algorithms allreduce_adam,allreduce_sgd,apmsqueeze] [--bits-ranks 2,4,8] [--time-ranks 2,4]
        [--steps 3] [--rounds 8] [--warmup 2] [--time-env VAR=VALUE] [--repo PATH] [--out sharding]

Memory and bytes: every configuration is its own ``mpiexec`` job (``memory_job.py``: fresh processes, so a peak
is that job's) on an MLP of ``--params`` million parameters, random inputs, 16 a rank, ``--steps`` steps. For
each algorithm (AllReduce-Adam, lr 1e-3; AllReduce-SGD with momentum 0.9; APMSqueeze with one warm-up step, so
the rest run its 1-bit phase) and each size of ``--ranks``: the replicated method, then ``shard=True`` (exact,
32-bit); for AllReduce-Adam at each size of ``--bits-ranks`` also ``shard_bits=8`` and 4. Reported, the largest
rank's figure: the optimizer-state bytes (tensors in ``algo.optimizer.state``); the process's peak resident
memory (``ru_maxrss``) and the peak while stepping (VmHWM reset once built), with the drop predicted from the
bytes the job counted (state given up, less the reduced shard and the exchange's buffers); the Ledger's bytes
sent in the last step, by operation.

Step time: at each size of ``--time-ranks`` one ``time_job.py`` per algorithm, in which the replicated and the
sharded configurations wrap copies of the model in the same processes and step in turn for ``--rounds`` rounds
(the same load for all on a shared machine); the median after ``--warmup`` rounds, with the sharded exchange's
reduce-scatter and allgather timed. AllReduce-Adam's job runs once more with ``--time-env`` set (an MPICH
setting; '' for none). Every ratio is against the replicated configuration measured in the same invocation.

``--repo`` runs the jobs against another copy of mpicomm (e.g. a ``git archive`` of a commit, while the working
tree changes). Writes docs/results/<out>.json (the results and the three markdown tables, which
docs/results/<out>.md quotes); the jobs' files under bench/results/runs/<out>/. Run it niced; it enters a
loopback namespace when root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.common import REPO, RESULTS, RUNS, enter_loopback_namespace, machine, markdown_table, write_json  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_job.py")
TIME_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "time_job.py")
MIB = 1 << 20
TEMPORARIES = {"allreduce_adam": 8, "apmsqueeze": 8}
"""Bytes per stepped element the optimizer's step allocates for a moment: torch's AdamW on the CPU (its single-tensor
path) computes ``denom = (v.sqrt() / c).add_(eps)``, two fp32 temporaries of the stepped length alive together;
SGD with momentum steps in place."""
ALLREDUCE_TEMPORARY = 2
"""Bytes per element MPICH 5.0.2's in-place fp32 allreduce allocates while it runs (measured: +48 MiB of peak for a
96 MiB vector at 2, 4 and 8 ranks; its in-place allgatherv and the exchange's alltoallv add under 3 MiB)."""


def mpiexec(ranks: int, script: str, args, *job_args, env: dict | None = None) -> None:
    """``mpiexec -n ranks python script job_args...`` importing ``args.repo``; raises on failure."""
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, script, *map(str, job_args)]
    job_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=args.repo, **(env or {}))
    proc = subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def memory_job(algorithm: str, ranks: int, bits: int, args, where: str) -> dict:
    """One memory job; the ranks' rows summed up (the largest rank's figures)."""
    out = os.path.join(where, f"{algorithm}-{ranks}r-{bits}b.json")
    mpiexec(ranks, JOB, args, algorithm, bits, args.steps, args.params, out)
    with open(out) as f:
        rows = json.load(f)
    ops = sorted({op for r in rows for op in r["sent_by_op"]})
    result = {"algorithm": algorithm, "ranks": ranks, "bits": bits, "params": rows[0]["params"],
              "state_bytes": max(r["state_bytes"] for r in rows),
              "peak_mib": max(r["peak_mib"] for r in rows),
              "step_peak_mib": max(r["step_peak_mib"] or float("nan") for r in rows),
              "built_mib": max(r["rss_built_mib"] for r in rows),
              "imports_mib": max(r["rss_imports_mib"] for r in rows),
              "exchange_extra_bytes": max(r["exchange_extra_bytes"] for r in rows),
              "sent_by_op": {op: max(r["sent_by_op"].get(op, 0) for r in rows) for op in ops}, "per_rank": rows}
    print(f"{algorithm} {ranks} ranks {'replicated' if not bits else f'shard {bits}-bit'}: state "
          f"{result['state_bytes'] / MIB:.1f} MiB, peak {result['peak_mib']:.0f} MiB, sent {result['sent_by_op']}",
          flush=True)
    return result


def time_job(algorithm: str, ranks: int, configs: list[int], args, where: str, env: str) -> dict:
    """One interleaved step-time job (``time_job.py``); medians after the warm-up rounds, by configuration."""
    label = "-env" if env else ""
    out = os.path.join(where, f"time-{algorithm}-{ranks}r{label}.json")
    extra = dict([env.split("=", 1)]) if env else None
    mpiexec(ranks, TIME_JOB, args, algorithm, ",".join(map(str, configs)), args.rounds, args.params, out, env=extra)
    with open(out) as f:
        raw = json.load(f)
    result = {"algorithm": algorithm, "ranks": ranks, "env": env, "raw": raw, "median_s": {}}
    for bits, record in raw.items():
        # a phase some steps skip (APMSqueeze's reduce-scatter, after its warm-up) is left out
        result["median_s"][bits] = {k: statistics.median(v[args.warmup:]) for k, v in record.items()
                                    if len(v) == args.rounds}
    print(f"time {algorithm} {ranks} ranks {env}: {result['median_s']}", flush=True)
    return result


def predicted_drop_mib(rep: dict, sh: dict) -> float:
    """What sharding should save per rank: the state given up and the step's largest temporary (the optimizer's,
    TEMPORARIES bytes per element stepped, or the replicated allreduce's, ALLREDUCE_TEMPORARY), less what the
    sharded job holds instead (the reduced shard's gradient, 4 d / N bytes, and the exchange's buffers)."""
    d, n = rep["params"], sh["ranks"]
    shard = 8 * -(-d // (8 * n))
    per_element = TEMPORARIES.get(sh["algorithm"], 0)
    allreduce = ALLREDUCE_TEMPORARY if "allreduce" in rep["sent_by_op"] else 0
    temporaries = max(per_element, allreduce) * d - per_element * shard
    return (rep["state_bytes"] - sh["state_bytes"] + temporaries - 4 * shard - sh["exchange_extra_bytes"]) / MIB


def memory_table(results: list[dict]) -> str:
    """State and peak RSS, sharded against replicated, per algorithm, size and shard_bits."""
    rows = []
    for sh in (r for r in results if r["bits"]):
        rep = find(results, sh["algorithm"], sh["ranks"], 0)
        ratio = sh["state_bytes"] / rep["state_bytes"]
        rows.append([sh["algorithm"], sh["ranks"], sh["bits"], f"{rep['state_bytes'] / MIB:.1f}",
                     f"{sh['state_bytes'] / MIB:.1f}",
                     f"{ratio:.4f} (1/N = {1 / sh['ranks']:.4f}, {100 * (ratio * sh['ranks'] - 1):+.2f} %)",
                     f"{rep['peak_mib']:.0f} → {sh['peak_mib']:.0f}", f"{rep['peak_mib'] - sh['peak_mib']:.0f}",
                     f"{rep['step_peak_mib'] - sh['step_peak_mib']:.0f}", f"{predicted_drop_mib(rep, sh):.0f}",
                     f"{sh['exchange_extra_bytes'] / MIB:.0f}"])
    return markdown_table(["algorithm", "ranks", "shard_bits", "state replicated (MiB)", "state sharded (MiB)",
                           "state ratio", "peak RSS per rank, replicated → sharded (MiB)", "peak drop (MiB)",
                           "drop of the stepping peak (MiB)", "predicted drop (MiB)",
                           "exchange buffers (MiB)"], rows)


def bytes_table(results: list[dict]) -> str:
    """Bytes sent per rank in one step by operation, against the replicated method's step (an fp32 allreduce; for
    APMSqueeze, its 1-bit average). The fp32 reduce-scatter it is compared with sends half an allreduce."""
    rows = []
    for r in results:
        if r["bits"] == 0 or r["ranks"] == 1:
            continue
        rep = find(results, r["algorithm"], r["ranks"], 0)
        allreduce = rep["sent_by_op"].get("allreduce", 0) or sum(rep["sent_by_op"].values())
        scatter = sum(v for op, v in r["sent_by_op"].items() if "alltoall" in op)
        gather = sum(v for op, v in r["sent_by_op"].items() if "allgather" in op)
        other = sum(r["sent_by_op"].values()) - scatter - gather
        versus = f"{scatter / (allreduce / 2):.3f}×" if "allreduce" in rep["sent_by_op"] else "–"
        rows.append([r["algorithm"], r["ranks"], r["bits"], f"{allreduce / MIB:.2f}", f"{scatter / MIB:.2f}", versus,
                     f"{gather / MIB:.2f}", f"{other / MIB:.2f}", f"{(scatter + gather + other) / allreduce:.3f}×"])
    return markdown_table(["algorithm", "ranks", "shard_bits", "replicated step (MiB)", "reduce-scatter (MiB)",
                           "reduce-scatter / fp32 reduce-scatter", "parameter allgather (MiB)", "other (MiB)",
                           "step total / replicated"], rows)


def time_table(timings: list[dict]) -> str:
    """Median step time, each sharded configuration against the replicated one of the same interleaved job."""
    rows = []
    for t in timings:
        rep = t["median_s"]["0"]["step_s"]
        for bits, med in t["median_s"].items():
            if bits == "0":
                continue
            rows.append([t["algorithm"], t["ranks"], bits, f"`{t['env']}`" if t["env"] else "default",
                         f"{rep:.3f}", f"{med['step_s']:.3f}", f"{med['step_s'] / rep:.2f}×",
                         *(f"{med[k]:.3f}" if k in med else "–" for k in ("reduce_scatter_s", "allgather_s"))])
    return markdown_table(["algorithm", "ranks", "shard_bits", "MPICH setting", "replicated step (s)",
                           "sharded step (s)", "ratio", "of which reduce-scatter (s)", "of which allgather (s)"],
                          rows)


def find(results: list[dict], algorithm: str, ranks: int, bits: int) -> dict:
    """The result of one configuration."""
    return next(r for r in results if (r["algorithm"], r["ranks"], r["bits"]) == (algorithm, ranks, bits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=25.0, help="model size, millions of parameters")
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--algorithms", default="allreduce_adam,allreduce_sgd,apmsqueeze")
    parser.add_argument("--bits-ranks", default="2,4,8", help="sizes at which AllReduce-Adam runs shard_bits 8 and 4")
    parser.add_argument("--time-ranks", default="2,4", help="sizes whose step times are reported")
    parser.add_argument("--steps", type=int, default=3, help="steps of each memory job")
    parser.add_argument("--rounds", type=int, default=8, help="steps of each configuration in a time job")
    parser.add_argument("--warmup", type=int, default=2, help="rounds left out of a time job's median")
    parser.add_argument("--time-env", default="MPIR_CVAR_ALLGATHERV_INTRA_ALGORITHM=recursive_doubling",
                        help="VAR=VALUE: AllReduce-Adam's time jobs once more with it set ('' for none)")
    parser.add_argument("--repo", default=REPO, help="the mpicomm checkout the jobs import")
    parser.add_argument("--out", default="sharding")
    parser.add_argument("--from-json", action="store_true",
                        help="run nothing: rewrite the tables of docs/results/<out>.json from its results")
    args = parser.parse_args()
    if args.from_json:
        return render(args.out)
    enter_loopback_namespace()
    where = os.path.join(RUNS, args.out)
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    sizes = [int(v) for v in args.ranks.split(",")]
    bits_sizes = [int(v) for v in args.bits_ranks.split(",") if v]
    time_sizes = [int(v) for v in args.time_ranks.split(",") if v]
    algorithms = args.algorithms.split(",")
    results = []
    for algorithm in algorithms:
        for n in sizes:
            for bits in (0, 32, *((8, 4) if algorithm == "allreduce_adam" and n in bits_sizes else ())):
                results.append(memory_job(algorithm, n, bits, args, where))
    timings = []
    for n in time_sizes:
        for algorithm in algorithms:
            configs = [0, 32, 8, 4] if algorithm == "allreduce_adam" else [0, 32]
            timings.append(time_job(algorithm, n, configs, args, where, ""))
            if algorithm == "allreduce_adam" and args.time_env:
                timings.append(time_job(algorithm, n, configs, args, where, args.time_env))
    command = "python bench/sharding/memory.py " + " ".join(sys.argv[1:])
    tables = {"memory": memory_table(results), "bytes": bytes_table(results),
              "time": time_table(timings)}
    commit = subprocess.run(["git", "-C", args.repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    payload = {"command": command.strip(), "commit": commit, "repo": args.repo, "params": results[0]["params"],
               "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
               "results": results, "timings": timings, "tables": tables, "machine": machine()}
    write_json(os.path.join(RESULTS, f"{args.out}.json"), payload)
    for name, table in tables.items():
        print(f"\n{name}\n{table}")
    print(f"wrote {RESULTS}/{args.out}.json")


def render(out: str) -> None:
    """Rewrite the tables of docs/results/<out>.json from the results it holds."""
    path = os.path.join(RESULTS, f"{out}.json")
    with open(path) as f:
        payload = json.load(f)
    payload["tables"] = {"memory": memory_table(payload["results"]), "bytes": bytes_table(payload["results"]),
                         "time": time_table(payload["timings"])}
    write_json(path, payload)
    for name, table in payload["tables"].items():
        print(f"\n{name}\n{table}")


if __name__ == "__main__":
    main()
