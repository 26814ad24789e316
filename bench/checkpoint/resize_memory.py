"""Peak memory of a restore at another world size against a restore at the saved size.

    python bench/checkpoint/resize_memory.py [--params 50] [--algorithm allreduce_adam] [--pairs 8:4,4:8]
        [--repo PATH] [--out resize_memory]

For each pair N:M, real ``mpiexec`` jobs (``resize_memory_job.py``) build ``--algorithm`` around an MLP of
``--params`` million parameters, take one step and save at N ranks; then the checkpoint is restored at N ranks
(the same-size baseline) and at M ranks (the resize), each in fresh processes so that a process's peak resident
memory (``ru_maxrss``) is that restore's. A 4:8 pair saves at 4 and restores at 4 and at 8. Reported per
restore: the largest peak over the ranks, the memory after building (before the restore) and the restore's
time; the ratio resized / same size of the peaks and of the restore's own increase (peak - built).

``--repo`` runs the jobs against another checkout of mpicomm (e.g. an older commit, for a before/after).
Writes docs/results/NAME.{md,json} (default resize_memory); checkpoints under bench/results/runs/NAME/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.common import REPO, RUNS, enter_loopback_namespace, machine, markdown_table, write_table  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resize_memory_job.py")


def run(n: int, repo: str, *args) -> None:
    """``mpiexec -n n python resize_memory_job.py args...`` with ``repo`` first on the path; raises on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, JOB, *map(str, args)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mpiexec -n {n} {JOB} {' '.join(map(str, args))} failed:\n{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-4000:]}")


def restore(n: int, saved: str, where: str, args) -> dict:
    """Restore ``saved`` at ``n`` ranks in fresh processes; the ranks' figures summed up."""
    out = os.path.join(where, f"restore{n}.json")
    run(n, args.repo, "restore", saved, args.params, args.algorithm, out)
    with open(out) as f:
        rows = json.load(f)
    peak = max(r["peak_rss_mib"] for r in rows)
    built = max(r["rss_built_mib"] for r in rows)
    return {"ranks": n, "peak_rss_mib": peak, "rss_built_mib": built,
            "increase_mib": max(r["peak_rss_mib"] - r["rss_built_mib"] for r in rows),
            "restore_s": max(r["restore_s"] for r in rows), "params": rows[0]["params"], "per_rank": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50.0, help="model size, millions of parameters")
    parser.add_argument("--algorithm", default="allreduce_adam")
    parser.add_argument("--pairs", default="8:4,4:8", help="saved:resumed world sizes, comma separated")
    parser.add_argument("--repo", default=REPO, help="the mpicomm checkout the jobs import")
    parser.add_argument("--out", default="resize_memory")
    args = parser.parse_args()
    enter_loopback_namespace()
    runs = os.path.join(RUNS, args.out)
    shutil.rmtree(runs, ignore_errors=True)
    os.makedirs(runs)
    results = []
    for pair in args.pairs.split(","):
        old, new = (int(v) for v in pair.split(":"))
        where = os.path.join(runs, f"{old}to{new}")
        saved = os.path.join(where, "saved")
        os.makedirs(where)
        run(old, args.repo, "save", saved, args.params, args.algorithm)
        same = restore(old, saved, where, args)
        resized = restore(new, saved, where, args)
        shutil.rmtree(saved)
        results.append({"saved": old, "resumed": new, "same_size": same, "resized": resized,
                        "peak_ratio": resized["peak_rss_mib"] / same["peak_rss_mib"],
                        "increase_ratio": resized["increase_mib"] / max(same["increase_mib"], 1.0)})
        print(f"{old} -> {new}: peak {resized['peak_rss_mib']:.0f} MiB against {same['peak_rss_mib']:.0f} MiB at "
              f"the same size ({results[-1]['peak_ratio']:.2f}x)", flush=True)
    rows = [[f"{r['saved']} → {r['resumed']}", f"{r['same_size']['peak_rss_mib']:.0f}",
             f"{r['resized']['peak_rss_mib']:.0f}", f"{r['peak_ratio']:.2f}×",
             f"{r['same_size']['increase_mib']:.0f} / {r['resized']['increase_mib']:.0f}",
             f"{r['same_size']['restore_s']:.1f} / {r['resized']['restore_s']:.1f}"] for r in results]
    table = markdown_table(["saved → resumed", "same-size restore: peak RSS per rank (MiB)",
                            "resized restore: peak RSS per rank (MiB)", "ratio",
                            "restore's own increase, same / resized (MiB)", "restore time, same / resized (s)"], rows)
    commit = subprocess.run(["git", "-C", args.repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    payload = {"algorithm": args.algorithm, "params": results[0]["same_size"]["params"], "repo_commit": commit,
               "results": results, "machine": machine(),
               "command": f"python bench/checkpoint/resize_memory.py --params {args.params:g} --algorithm "
                          f"{args.algorithm} --pairs {args.pairs}"}
    write_table(args.out, f"Peak memory of a restore at another world size ({args.algorithm}, "
                f"{payload['params'] / 1e6:.1f}M parameters, commit {commit})", table, payload)


if __name__ == "__main__":
    main()
