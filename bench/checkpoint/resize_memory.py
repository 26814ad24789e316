"""Memory of a restore at another world size against a restore at the saved size: the restore's own growth.

    python bench/checkpoint/resize_memory.py [--params 12,50] [--algorithm allreduce_adam] [--pairs 4:2,2:4]
        [--repo PATH] [--before PATH] [--out resize_memory]

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

``--params`` takes several sizes (one table row per size and pair). ``--repo`` runs the jobs against another
checkout of mpicomm; ``--before PATH`` runs every size and pair against the checkout at PATH as well (e.g. an older
commit: ``git worktree add /tmp/before COMMIT``), a row of its own marked with its commit, for a before/after in
one table. The jobs and this script are this checkout's either way.
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

from bench.common import REPO, RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resize_memory_job.py")


def run(n: int, repo: str, *args) -> None:
    """``mpiexec -n n python resize_memory_job.py args...`` with ``repo`` first on the path; raises on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, JOB, *map(str, args)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mpiexec -n {n} {JOB} {' '.join(map(str, args))} failed:\n{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-4000:]}")


def restore(n: int, saved: str, where: str, repo: str, params: float, algorithm: str) -> dict:
    """Restore ``saved`` at ``n`` ranks in fresh processes; the ranks' figures summed up."""
    out = os.path.join(where, f"restore{n}.json")
    run(n, repo, "restore", saved, params, algorithm, out)
    with open(out) as f:
        rows = json.load(f)
    increase = max(r["peak_rss_mib"] - r["rss_built_mib"] for r in rows)
    state = max(r["state_mib"] for r in rows)
    return {"ranks": n, "peak_rss_mib": max(r["peak_rss_mib"] for r in rows),
            "rss_built_mib": max(r["rss_built_mib"] for r in rows), "increase_mib": increase,
            "state_mib": state, "increase_states": increase / state,
            "peak_since_reset": all(r.get("peak_since_reset", False) for r in rows),
            "restore_s": max(r["restore_s"] for r in rows), "params": rows[0]["params"], "per_rank": rows}


def commit_of(repo: str) -> str:
    """The short commit of the checkout at ``repo``."""
    return subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def measure(params: float, old: int, new: int, repo: str, where: str, algorithm: str) -> dict:
    """Save at ``old`` ranks, restore at ``old`` (same size) and at ``new`` (resized) with ``repo``'s mpicomm."""
    saved = os.path.join(where, "saved")
    os.makedirs(where)
    run(old, repo, "save", saved, params, algorithm)
    same = restore(old, saved, where, repo, params, algorithm)
    resized = restore(new, saved, where, repo, params, algorithm)
    shutil.rmtree(saved)
    result = {"params": same["params"], "saved": old, "resumed": new, "commit": commit_of(repo),
              "same_size": same, "resized": resized,
              "increase_ratio": resized["increase_mib"] / max(same["increase_mib"], 1.0),
              "peak_ratio": resized["peak_rss_mib"] / same["peak_rss_mib"]}
    print(f"{same['params'] / 1e6:.1f}M {old} -> {new} ({result['commit']}): the restore grows "
          f"{resized['increase_mib']:.0f} MiB against {same['increase_mib']:.0f} MiB at the same size "
          f"({result['increase_ratio']:.2f}x); peak {resized['peak_rss_mib']:.0f} / {same['peak_rss_mib']:.0f} MiB",
          flush=True)
    return result


def parse_pairs(text: str, parser) -> list[tuple[int, int]]:
    pairs = []
    for pair in text.split(","):
        try:
            old, new = (int(v) for v in pair.strip().split(":"))
        except ValueError:
            parser.error(f"--pairs: {pair!r} is not SAVED:RESUMED (e.g. 4:2)")
        pairs.append((old, new))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="50", help="model sizes, millions of parameters, comma separated")
    parser.add_argument("--algorithm", default="allreduce_adam")
    parser.add_argument("--pairs", default="4:2,2:4", help="saved:resumed world sizes, comma separated (4:2,2:4)")
    parser.add_argument("--repo", default=REPO, help="the mpicomm checkout the jobs import")
    parser.add_argument("--before", default=None, help="another checkout measured as well, row by row")
    parser.add_argument("--out", default="resize_memory")
    args = parser.parse_args()
    sizes = [float(v) for v in args.params.split(",")]
    pairs = parse_pairs(args.pairs, parser)
    enter_loopback_namespace()
    runs = os.path.join(RUNS, args.out)
    shutil.rmtree(runs, ignore_errors=True)
    os.makedirs(runs)
    repos = ([("before", args.before)] if args.before else []) + [("after" if args.before else "", args.repo)]
    results = []
    for params in sizes:
        for old, new in pairs:
            for label, repo in repos:
                where = os.path.join(runs, f"{params:g}M_{old}to{new}_{label or 'this'}")
                results.append({"code": label, **measure(params, old, new, repo, where, args.algorithm)})
    rows = [[f"{r['params'] / 1e6:.1f}M", f"{r['saved']} → {r['resumed']}",
             *([f"{r['code']} ({r['commit']})"] if args.before else []),
             f"{r['same_size']['increase_mib']:.0f} / {r['resized']['increase_mib']:.0f}",
             f"**{r['increase_ratio']:.2f}×**",
             f"{r['same_size']['increase_states']:.2f} / {r['resized']['increase_states']:.2f}",
             f"{r['same_size']['state_mib']:.0f}",
             f"{r['same_size']['peak_rss_mib']:.0f} / {r['resized']['peak_rss_mib']:.0f}", f"{r['peak_ratio']:.2f}×",
             f"{r['same_size']['restore_s']:.1f} / {r['resized']['restore_s']:.1f}"] for r in results]
    table = markdown_table(["parameters", "saved → resumed", *(["code"] if args.before else []),
                            "restore's growth (peak − before), same size / resized (MiB)", "growth ratio",
                            "growth in states, same / resized", "one state (MiB)",
                            "peak RSS per rank, same / resized (MiB)", "peak ratio",
                            "restore time, same / resized (s)"], rows)
    reset = all(r[k]["peak_since_reset"] for r in results for k in ("same_size", "resized"))
    table += ("\n\nGrowth: the largest over the ranks of the peak resident memory during the restore less the "
              "memory before it" + ("" if reset else " (the peak is the process's: this kernel refused to reset it)")
              + "; one state: the bytes of the tensors of one rank's restored state (parameters and optimizer "
              "state) at the saved size; in states: the growth divided by it.")
    command = (f"python bench/checkpoint/resize_memory.py --params {args.params} --algorithm {args.algorithm} "
               f"--pairs {args.pairs}" + (" --before PATH" if args.before else "")
               + (f" --out {args.out}" if args.out != "resize_memory" else ""))
    commits = ", ".join(f"{label or 'this'} {commit_of(repo)}" for label, repo in repos)
    payload = {"algorithm": args.algorithm, "commits": {label or "this": commit_of(repo) for label, repo in repos},
               "results": results, "command": command}
    write_table(args.out, f"Memory of a restore at another world size ({args.algorithm}; {commits})\n\n"
                f"`{command}`", table, payload)


if __name__ == "__main__":
    main()
