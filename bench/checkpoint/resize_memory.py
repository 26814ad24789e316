"""Memory of a restore at another world size against a restore at the saved size: the restore's own growth.

    python bench/checkpoint/resize_memory.py [--params 50] [--algorithm allreduce_adam] [--pairs 4:2,2:4]
        [--repo PATH] [--out resize_memory]

For each pair N:M, real ``mpiexec`` jobs (``resize_memory_job.py``) build ``--algorithm`` around an MLP of
``--params`` million parameters, take one step and save at N ranks; then the checkpoint is restored at N ranks
(the same-size baseline) and at M ranks (the resize), each in fresh processes. Each restoring process records its
resident memory once built (before the restore) and the peak of it during the restore (the kernel's peak, reset
just before the restore: the building's own temporaries do not count). The headline is the restore's own growth,
peak - built, the largest over the ranks, and its ratio resized / same size: the process's total peak is mostly
the model and optimizer it built, which both restores share, so a ratio of totals would hide a restore that
doubles its own memory. Also reported: the growth in states (the bytes of the tensors of one restored
``state_dict()``: parameters and optimizer state), the total peaks and the restore's time. A 4:2 pair saves at 4
and restores at 4 and at 2.

``--repo`` runs the jobs against another checkout of mpicomm (e.g. an older commit, for a before/after); the
jobs and this script are this checkout's.
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
    increase = max(r["peak_rss_mib"] - r["rss_built_mib"] for r in rows)
    state = max(r["state_mib"] for r in rows)
    return {"ranks": n, "peak_rss_mib": max(r["peak_rss_mib"] for r in rows),
            "rss_built_mib": max(r["rss_built_mib"] for r in rows), "increase_mib": increase,
            "state_mib": state, "increase_states": increase / state,
            "peak_since_reset": all(r.get("peak_since_reset", False) for r in rows),
            "restore_s": max(r["restore_s"] for r in rows), "params": rows[0]["params"], "per_rank": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50.0, help="model size, millions of parameters")
    parser.add_argument("--algorithm", default="allreduce_adam")
    parser.add_argument("--pairs", default="4:2,2:4", help="saved:resumed world sizes, comma separated (4:2,2:4)")
    parser.add_argument("--repo", default=REPO, help="the mpicomm checkout the jobs import")
    parser.add_argument("--out", default="resize_memory")
    args = parser.parse_args()
    enter_loopback_namespace()
    runs = os.path.join(RUNS, args.out)
    shutil.rmtree(runs, ignore_errors=True)
    os.makedirs(runs)
    results = []
    for pair in args.pairs.split(","):
        try:
            old, new = (int(v) for v in pair.strip().split(":"))
        except ValueError:
            parser.error(f"--pairs: {pair!r} is not SAVED:RESUMED (e.g. 4:2)")
        where = os.path.join(runs, f"{old}to{new}")
        saved = os.path.join(where, "saved")
        os.makedirs(where)
        run(old, args.repo, "save", saved, args.params, args.algorithm)
        same = restore(old, saved, where, args)
        resized = restore(new, saved, where, args)
        shutil.rmtree(saved)
        results.append({"saved": old, "resumed": new, "same_size": same, "resized": resized,
                        "increase_ratio": resized["increase_mib"] / max(same["increase_mib"], 1.0),
                        "peak_ratio": resized["peak_rss_mib"] / same["peak_rss_mib"]})
        print(f"{old} -> {new}: the restore grows {resized['increase_mib']:.0f} MiB against "
              f"{same['increase_mib']:.0f} MiB at the same size ({results[-1]['increase_ratio']:.2f}x); peak "
              f"{resized['peak_rss_mib']:.0f} / {same['peak_rss_mib']:.0f} MiB", flush=True)
    rows = [[f"{r['saved']} → {r['resumed']}",
             f"{r['same_size']['increase_mib']:.0f} / {r['resized']['increase_mib']:.0f}",
             f"**{r['increase_ratio']:.2f}×**",
             f"{r['same_size']['increase_states']:.2f} / {r['resized']['increase_states']:.2f}",
             f"{r['same_size']['peak_rss_mib']:.0f} / {r['resized']['peak_rss_mib']:.0f}", f"{r['peak_ratio']:.2f}×",
             f"{r['same_size']['restore_s']:.1f} / {r['resized']['restore_s']:.1f}"] for r in results]
    table = markdown_table(["saved → resumed", "restore's growth (peak − before), same / resized (MiB)",
                            "growth ratio", "growth in states, same / resized",
                            "peak RSS per rank, same / resized (MiB)", "peak ratio",
                            "restore time, same / resized (s)"], rows)
    state = results[0]["same_size"]["state_mib"]
    table += (f"\n\nOne state (parameters and optimizer state, per rank) is {state:.0f} MiB at the saved size; "
              "growth is the largest over the ranks of the peak resident memory during the restore less that "
              "before it" + ("" if all(r[k]["peak_since_reset"] for r in results for k in ("same_size", "resized"))
                             else " (the peak is the process's: this kernel refused to reset it)") + ".")
    commit = subprocess.run(["git", "-C", args.repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    payload = {"algorithm": args.algorithm, "params": results[0]["same_size"]["params"], "repo_commit": commit,
               "results": results, "machine": machine(),
               "command": f"python bench/checkpoint/resize_memory.py --params {args.params:g} --algorithm "
                          f"{args.algorithm} --pairs {args.pairs}"}
    write_table(args.out, f"Memory of a restore at another world size ({args.algorithm}, "
                f"{payload['params'] / 1e6:.1f}M parameters, commit {commit})", table, payload)


if __name__ == "__main__":
    main()
