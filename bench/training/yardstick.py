"""Methods x seeds on MNIST-1D at N ranks: final test accuracy, mean ± std over the seeds, and traffic per step.

    python bench/training/yardstick.py --ranks 8 --seeds 0,1,2 --epochs 10 \\
        --methods allreduce_sgd,dpsgd,moniqua,moniqua+bits=2
    python bench/training/yardstick.py --ranks 4 --seeds 0 --epochs 2 --methods allreduce_sgd,dpsgd,moniqua \\
        --name mnist1d_pilot

Each run is ``apps/train_resnet.py --dataset mnist1d --algorithm A --seed S --epochs E`` on ``--ranks`` ranks (the
paper's 1-D CNN, 40,000 training sequences, batch 32 per rank, every other option the app's default); a method
entry ``A+flag=value+...`` adds ``--flag value`` for each pair (``moniqua+bits=2``), a bare ``+switch`` adds
``--switch`` (``allreduce_adam+shard+shard-bits=4``), and the entry is its row's label. The
set is the same in every run (MNIST-1D's fixed seed); ``--seed`` moves the initial weights, the shards'
order and the methods' own draws. The table gives each row's final test accuracy of the averaged model as the
mean ± sample standard deviation over the seeds, every seed's value, the bytes per parameter per step that
rank 0 handed to MPI (its ``bytes_contributed`` over the run, initial broadcast excluded, per step, over the
parameter count: one copy of what it sends), the bytes it sent over its links per parameter per step (its
``bytes_sent``: each copy to each peer counted), the final consensus distance (at the app's last evaluation,
``sqrt(mean_i ||x_i - x̄||^2)``: how far apart the ranks' models are; 0 for the centralized methods; small at
the end of a schedule that decays the lr to 0) and its mean over the run's evaluations, each the mean over the
seeds, and the app's wall seconds per run. A finished run of the same command is reused (``--fresh``
reruns it); a run that exits with an error is listed as failed. Writes ``docs/results/<name>.{md,json}`` with
the command that produced it; the runs go to ``bench/results/runs/yardstick/``. Run it niced; it enters a
loopback namespace when root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.apprun import launch  # noqa: E402
from bench.common import RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402
from mpicomm.algorithms import ALGORITHMS  # noqa: E402


def method_args(entry: str) -> list[str]:
    """The app arguments of a method entry ``A+flag=value+switch+...``: ``--algorithm A --flag value --switch ...``."""
    algorithm, *pairs = entry.split("+")
    if algorithm not in ALGORITHMS:
        raise SystemExit(f"--methods: unknown algorithm {algorithm!r} in {entry!r}; choose from {sorted(ALGORITHMS)}")
    args = ["--algorithm", algorithm]
    for pair in pairs:
        flag, sep, value = pair.partition("=")
        if not flag or (sep and not value):
            raise SystemExit(f"--methods: {pair!r} in {entry!r} is not flag=value or a switch")
        args += [f"--{flag}", value] if sep else [f"--{flag}"]
    return args


def run_one(entry: str, seed: int, ranks: int, epochs: int, fresh: bool) -> dict:
    """Run (or reuse) one method entry at one seed; its final accuracy, traffic and seconds."""
    args = ["--dataset", "mnist1d", *method_args(entry), "--seed", str(seed), "--epochs", str(epochs)]
    run_dir = os.path.join(RUNS, "yardstick", f"{ranks}r-{epochs}e", entry.replace("=", "-"), f"seed{seed}")
    t0 = time.perf_counter()
    try:
        run = launch(f"{entry} seed {seed}", "train_resnet.py", ranks, args, run_dir, fresh=fresh, timeout=7200)
    except RuntimeError as exc:
        print(str(exc)[-2000:], flush=True)
        return {"seed": seed, "failed": True}
    spread = [r["consensus_distance"] for r in run.records
              if r["event"] == "eval" and r.get("consensus_distance") is not None]
    return {"seed": seed, "failed": False, "test_accuracy": run.end["test_accuracy"], "steps": run.end["step"],
            "bytes_per_parameter_per_step": run.traffic_per_step("bytes_contributed") / run.start["parameters"],
            "bytes_sent_per_parameter_per_step": run.traffic_per_step("bytes_sent") / run.start["parameters"],
            "consensus_distance": run.end.get("consensus_distance"),
            "consensus_distance_mean": statistics.fmean(spread) if spread else None,
            "app_wall_s": run.end["wall_s"], "launch_s": time.perf_counter() - t0}


def summary(runs: list[dict]) -> dict:
    """Mean and sample standard deviation (None below 2 runs) of the finished runs' accuracy, and their traffic and
    consensus distances (None where no finished run recorded one)."""
    done = [r for r in runs if not r["failed"]]
    accuracies = [r["test_accuracy"] for r in done]

    def mean_of(key):
        values = [r[key] for r in done if r.get(key) is not None]
        return statistics.fmean(values) if values else None
    return {"finished": len(done), "failed": len(runs) - len(done),
            "mean": statistics.fmean(accuracies) if done else None,
            "std": statistics.stdev(accuracies) if len(done) > 1 else None,
            "bytes_per_parameter_per_step": statistics.fmean(r["bytes_per_parameter_per_step"] for r in done)
            if done else None,
            "bytes_sent_per_parameter_per_step": statistics.fmean(r["bytes_sent_per_parameter_per_step"]
                                                                  for r in done) if done else None,
            "consensus_distance": mean_of("consensus_distance"),
            "consensus_distance_mean": mean_of("consensus_distance_mean"),
            "app_wall_s": statistics.fmean(r["app_wall_s"] for r in done) if done else None}


def table(results: dict[str, list[dict]]) -> str:
    """The markdown table: one row per method entry."""
    rows = []
    for entry, runs in results.items():
        s = summary(runs)
        mean = "–" if s["mean"] is None else f"{100 * s['mean']:.2f} %"
        spread = "–" if s["std"] is None else f"± {100 * s['std']:.2f}"
        seeds = ", ".join("failed" if r["failed"] else f"{100 * r['test_accuracy']:.2f}" for r in runs)
        traffic, sent, final, over_run = (
            "–" if s[key] is None else f"{s[key]:.3g}"
            for key in ("bytes_per_parameter_per_step", "bytes_sent_per_parameter_per_step", "consensus_distance",
                        "consensus_distance_mean"))
        consensus = f"{final} / {over_run}"
        wall = "–" if s["app_wall_s"] is None else f"{s['app_wall_s']:.0f}"
        rows.append([f"`{entry}`", mean, spread, seeds, traffic, sent, consensus, wall])
    return markdown_table(["method", "test accuracy (mean)", "std over seeds", "per seed", "bytes / parameter / step",
                           "bytes sent / parameter / step", "consensus distance: final / mean over evaluations",
                           "wall s per run"], rows)


def add_table_options(p: argparse.ArgumentParser, methods: str, name: str) -> None:
    """The options every yardstick table takes: seeds, method entries, the table's name, --fresh."""
    p.add_argument("--seeds", default="0,1,2", help="comma list of --seed values")
    p.add_argument("--methods", default=methods, help="comma list of A or A+flag=value+...")
    p.add_argument("--name", default=name, help="docs/results/<name>.{md,json}")
    p.add_argument("--fresh", action="store_true", help="rerun finished runs")


def table_plan(args, script: str) -> tuple[list[str], list[int], str]:
    """The method entries (each checked before anything runs), the seeds, and the command line of the table."""
    entries = args.methods.split(",")
    for entry in entries:
        method_args(entry)
    return entries, [int(s) for s in args.seeds.split(",")], "python " + " ".join([script, *sys.argv[1:]])


def main() -> None:
    """Parse, run every (method, seed), write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--epochs", type=int, default=10)
    add_table_options(p, "allreduce_sgd,dpsgd,moniqua", "mnist1d")
    args = p.parse_args()
    entries, seeds, command = table_plan(args, "bench/training/yardstick.py")
    enter_loopback_namespace()
    results = {entry: [run_one(entry, seed, args.ranks, args.epochs, args.fresh) for seed in seeds]
               for entry in entries}
    intro = (f"`{command}`\n\nEach run: `apps/train_resnet.py --dataset mnist1d --algorithm A --seed S --epochs "
             f"{args.epochs}` on {args.ranks} ranks (the 1-D CNN, batch 32 per rank, the app's defaults otherwise); "
             f"seeds {args.seeds}. Accuracy: the averaged model's final test accuracy on the 10,000 test "
             "sequences; std: the sample standard deviation over the seeds; bytes / parameter / step: what rank 0 "
             "handed to MPI per step over the parameter count; bytes sent: what rank 0 sent over its links per "
             "step over the parameter count (each copy to each peer counted); consensus distance: "
             "sqrt(mean_i ||x_i - x̄||^2) of the ranks' models at the final evaluation (small where the lr decays to "
             "0) / its mean over the run's evaluations, each the mean over the seeds; wall: the app's own seconds "
             f"per run, as loaded as the machine was (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
             "cores when the table was written; a reused run keeps the seconds of its own time).")
    write_table(args.name, f"MNIST-1D at {args.ranks} ranks, {args.epochs} epochs, {len(seeds)} seed(s)",
                f"{intro}\n\n{table(results)}",
                {"command": command, "ranks": args.ranks, "epochs": args.epochs, "seeds": seeds,
                 "results": {entry: {"runs": runs, **summary(runs)} for entry, runs in results.items()}})


if __name__ == "__main__":
    main()
