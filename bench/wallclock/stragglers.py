"""Time to accuracy with one slow rank (a straggler) beside the same runs with none, per method.

    python bench/wallclock/stragglers.py [--factors 1,2,4] [--methods "D-PSGD,AD-PSGD"] [--seeds 0]
        [--epochs 6] [--target 0.70] [--ranks 4] [--model resnet20] [--no-probe] [--fresh] [--out stragglers]

Every case is a real ``mpiexec`` job of ``apps/train_resnet.py`` (``--model``, ResNet-20 by default; embedded
digits data, 32 images per rank per step, lr 0.1 cosine, momentum 0.9, ring, one evaluation of the averaged
model per epoch, a metrics line every step) with ``--slow-ranks R:F``: the last rank R sleeps (F - 1) x its
forward and backward time every step.
Methods: AllReduce-SGD, D-PSGD, Moniqua (default), AD-PSGD, Moniqua on AD-PSGD, CPD-SGDM (4-bit QSGD, period 4,
as in ``time_to_accuracy.py``) and DiLoCo with H = 4 inner steps between syncs (its outer Nesterov 0.7/0.9 as by
default; the default H = 10 leaves only 6 outer steps in a 6-epoch run of 66 steps).

Two clocks, both rank 0's (the metrics are rank 0's; rank 0 is never the slow rank in the main grid):

* ``train_s`` at the first evaluation reaching the target, as ``time_to_accuracy.py`` measures it: rank 0's
  time inside its training steps (forward, backward, the method's step). It does not contain the loop's
  per-step agreement (``mpicomm/training/health.py``: an allgather after every step), so time rank 0 spends
  waiting there for a slower rank is not in it.
* wall time to the target less the evaluations: rank 0's ``wall_s`` at that evaluation minus the time spent in
  this and the earlier evaluations (each evaluation's ``wall_s`` less the ``wall_s`` of the train record of the
  same step, written just before it). This is the time a user waits for the training to get there, and it
  contains every wait for the slow rank wherever it happens.

Steps per second of a fast rank: rank 0's steps over that wall time. For the asynchronous methods
(``--no-probe`` turns it off) one more run per method at the largest factor makes rank 0 itself the slow
one (``--slow-ranks 0:F``), so its records give the slow rank's own steps per second.

The ranks share the machine's cores (4 ranks on 2 cores here, OMP_NUM_THREADS=1): while the slow rank sleeps
it lends its share of a core to the others, whose compute then runs faster than with no slow rank. A slow rank
therefore costs less here than it would on dedicated hardware, for every method alike; and for a method whose
fast ranks do not wait, their steps would get faster, not just stay as fast.

Writes docs/results/NAME.{md,json} (default NAME: stragglers); runs under bench/results/runs/stragglers/.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import AppRun, launch, time_to_target  # noqa: E402
from bench.common import RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402

BASE = ["--batch-size", "32", "--lr", "0.1", "--momentum", "0.9", "--topology", "ring",
        "--log-every", "1"]
QSGD4 = ["--codec", "qsgd", "--codec-options", "bits=4"]
METHODS = {  # label: (arguments, asynchronous)
    "AllReduce-SGD": (["--algorithm", "allreduce_sgd"], False),
    "D-PSGD": (["--algorithm", "dpsgd"], False),
    "Moniqua": (["--algorithm", "moniqua"], False),
    "AD-PSGD": (["--algorithm", "adpsgd"], True),
    "Moniqua on AD-PSGD": (["--algorithm", "moniqua_adpsgd"], True),
    "CPD-SGDM qsgd 4-bit p=4": (["--algorithm", "cpdsgdm", *QSGD4, "--period", "4", "--gamma", "0.6"], False),
    "DiLoCo H=4": (["--algorithm", "diloco", "--period", "4"], False),
}


def eval_times(run: AppRun) -> list[tuple[int, float, float, float]]:
    """``(step, accuracy, train_s, wall_s less the evaluations so far)`` at every evaluation."""
    out, spent, last_wall = [], 0.0, 0.0
    for r in run.records:
        if r["event"] == "train":
            last_wall = r["wall_s"]
        elif r["event"] == "eval":
            spent += r["wall_s"] - last_wall
            out.append((r["step"], r["test_accuracy"], r["train_s"], r["wall_s"] - spent))
            last_wall = r["wall_s"]
    return out


def measure(run: AppRun, target: float) -> dict:
    """One run's figures: times to target on both clocks, rank 0's steps per second, final accuracy."""
    points = eval_times(run)
    tta_train = time_to_target([(t, a, s) for s, a, t, _ in points], target)
    tta_wall = time_to_target([(w, a, s) for s, a, _, w in points], target)
    training_wall = points[-1][3] if points else None
    split = run.per_step()
    return {"time_to_target_train_s": tta_train, "time_to_target_wall_s": tta_wall,
            "final_test_accuracy": run.end["test_accuracy"], "steps": run.end["step"],
            "train_s": run.end["train_s"], "training_wall_s": training_wall,
            "rank0_steps_per_s": run.end["step"] / training_wall if training_wall else None,
            "rank0_train_steps_per_s": run.end["step"] / run.end["train_s"],
            "per_step_s_mean_over_ranks": split, "curve": points}


def mean_of(values: list) -> float | None:
    """The mean, or None if any is None (a seed that never reached the target)."""
    return None if any(v is None for v in values) else statistics.fmean(values)


def notes(payload: list[dict], args, slow: int) -> str:
    """The table's notes: what was measured and what not, the biases, and the verdict from the rows."""
    top = max(r["factor"] for r in payload)
    at_top = [r for r in payload if r["factor"] == top and top > 1]
    lines = [
        "Notes",
        "",
        f"* Setting: {args.ranks} ranks, {args.model} on the embedded digits (1,438 training images), {args.epochs} "
        f"epochs, seed(s) {args.seeds}, target {100 * args.target:.0f} % test accuracy of the averaged model. "
        "The setting first asked for (8 ranks, full MNIST, ResNet-8, two seeds) does not fit this 2-core "
        "machine: one 8-rank MNIST run takes 3-18 minutes here (docs/results/scale.md), and this grid is "
        f"{len(payload)} runs plus probes. The target is set below every method's final accuracy in this "
        "setting (--target).",
        "* `train_s`: rank 0's time inside its training steps (the clock of time_to_accuracy.md). It leaves out "
        "the loop's per-step agreement (an allgather of a few bytes after every step, "
        "mpicomm/training/health.py), so a rank that waits for the slow one *there* shows no slowdown on this "
        "clock. `wall less evals`: rank 0's wall clock to the target less the evaluations, which holds every wait.",
        f"* Fast rank = rank 0 (rank {slow} is the slow one); its steps/s is over the wall clock less evaluations. "
        "The slow rank's own steps/s comes from a second run in which rank 0 is the slow one (asynchronous "
        "methods, largest factor only); not measured for the other methods, whose ranks wait for each other "
        "in the method's own exchange (every step, or every period for CPD-SGDM and DiLoCo).",
        "* Oversubscription: the ranks share 2 cores, so the slow rank's sleep lends its share of a core to the "
        "others, whose compute gets faster. A slow rank can therefore cost less here than on dedicated hardware "
        "(the ratios may understate the slowdown, for every method alike), and rank 0's `train_s` per step "
        "shrinks when it waits outside its steps. With other work on the machine (next note) the sleeping "
        "rank's share goes partly to that work instead.",
    ]
    loads = [run["loadavg_at_end"][0] for r in payload for run in r["runs"]]
    lines.append(f"* Machine load: the 1-minute load average at the end of the runs was {min(loads):.1f}-"
                 f"{max(loads):.1f} on 2 cores (above about 4, the ranks shared the cores with other work: "
                 "every time here is then longer, and noisier, than on an idle machine).")
    lines.append("* Time to the target is read at one evaluation per epoch (11 steps at 4 ranks), so a run that "
                 "crosses it an epoch earlier or later (the asynchronous methods' curves differ from run to run with "
                 "the ranks' timing) moves it by a whole epoch's time; rank 0's steps per second is the steadier "
                 "measure of what the slow rank costs.")
    asyn = [r for r in at_top if r["asynchronous"]]
    sync = [r for r in at_top if not r["asynchronous"]]

    def ratios(rows: list[dict]) -> str:
        return "; ".join(f"{r['method']}: steps/s {r['fast_rank_steps_per_s_vs_none']:.2f}x of none, time to target "
                         + (f"{r['ratio_wall_s_vs_none']:.2f}x" if r["ratio_wall_s_vs_none"] else "-")
                         for r in rows) or "none measured"

    if asyn:
        slow_rates = ", ".join(f"{r['method']} {r['slow_rank_steps_per_s']:.2f} steps/s against its fast rank's "
                               f"{r['fast_rank_steps_per_s']:.2f}" for r in asyn if r["slow_rank_steps_per_s"])
        held = all(r["fast_rank_steps_per_s_vs_none"] >= 0.8 for r in asyn)
        lines += ["", f"Verdict at {top:g}x (rank 0's wall clock, evaluations left out; slow / none). Asynchronous: "
                  f"{ratios(asyn)}. Synchronous and periodic: {ratios(sync)}."
                  + (f" The slow rank itself (rank 0 slowed, own run): {slow_rates}." if slow_rates else "")
                  + " The claim that a slow rank does not slow the asynchronous methods' other ranks (taken as: a "
                  "fast rank keeps at least 0.8x of its steps per second) is "
                  + ("confirmed" if held else "refuted") + " in these runs"
                  + ("." if held else
                     ": their fast ranks do not keep going. Every rank of the app's training loop joins the "
                     "per-step agreement (mpicomm/training/health.py), which holds the fast ranks to the slow "
                     "rank's pace whatever the method's own exchange does; on rank 0's `train_s` clock, which "
                     "leaves that wait out, the asynchronous methods look unaffected.")]
    return "\n".join(lines)


def main() -> None:
    """Run every (method, factor, seed), then write the table and the JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", default="1,2,4", help="slowdowns of the last rank (1: no slow rank)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--model", default="resnet20", help="resnet8, resnet20, ...")
    parser.add_argument("--target", type=float, default=0.70, help="test accuracy of the averaged model")
    parser.add_argument("--no-probe", action="store_true", help="no slow-rank-0 runs for the asynchronous methods")
    parser.add_argument("--fresh", action="store_true", help="rerun cases that already finished")
    parser.add_argument("--out", default="stragglers", help="output name under docs/results/")
    args = parser.parse_args()
    enter_loopback_namespace()
    factors = [float(f) for f in args.factors.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    slow = args.ranks - 1
    base = [*BASE, "--model", args.model, "--epochs", str(args.epochs)]

    def run(label: str, extra: list[str], factor: float, seed: int, slow_rank: int) -> dict:
        slowing = ["--slow-ranks", f"{slow_rank}:{factor:g}"] if factor > 1 else []
        name = f"{label.replace(' ', '_')}_x{factor:g}" + (f"_slow{slow_rank}" if slow_rank != slow else "")
        run_dir = os.path.join(RUNS, "stragglers", f"{args.model}_r{args.ranks}_e{args.epochs}_seed{seed}", name)
        done = launch(f"{label} x{factor:g} seed {seed}", "train_resnet.py", args.ranks,
                      [*base, *extra, "--seed", str(seed), *slowing], run_dir, fresh=args.fresh, timeout=1200)
        stamp = os.path.join(run_dir, "loadavg.json")  # the machine's load when the run ended (other work too)
        if not os.path.exists(stamp):
            with open(stamp, "w") as f:
                json.dump(os.getloadavg(), f)
        with open(stamp) as f:
            load = json.load(f)
        return {"command": done.command, "loadavg_at_end": load, **measure(done, args.target)}

    rows, payload = [], []
    for label in methods:
        extra, asynchronous = METHODS[label]
        by_factor = {f: [run(label, extra, f, s, slow) for s in seeds] for f in factors}
        probe = None
        if asynchronous and not args.no_probe and max(factors) > 1:
            probe = [run(label, extra, max(factors), s, 0) for s in seeds]
        none = by_factor.get(1.0)
        base_train = mean_of([r["time_to_target_train_s"] for r in none]) if none else None
        base_wall = mean_of([r["time_to_target_wall_s"] for r in none]) if none else None
        base_rate = statistics.fmean(r["rank0_steps_per_s"] for r in none) if none else None
        for f in factors:
            runs = by_factor[f]
            tta_train = mean_of([r["time_to_target_train_s"] for r in runs])
            tta_wall = mean_of([r["time_to_target_wall_s"] for r in runs])
            fast_rate = statistics.fmean(r["rank0_steps_per_s"] for r in runs)
            slow_rate = None
            if probe is not None and f == max(factors):
                slow_rate = statistics.fmean(r["rank0_steps_per_s"] for r in probe)
            ratio_train = tta_train / base_train if (tta_train and base_train) else None
            ratio_wall = tta_wall / base_wall if (tta_wall and base_wall) else None
            rate_ratio = fast_rate / base_rate if base_rate else None
            acc = statistics.fmean(r["final_test_accuracy"] for r in runs)
            rows.append([label, "async" if asynchronous else "sync", f"{f:g}x",
                         f"{tta_train:.1f}" if tta_train else "never",
                         f"{ratio_train:.2f}" if ratio_train else "-",
                         f"{tta_wall:.1f}" if tta_wall else "never",
                         f"{ratio_wall:.2f}" if ratio_wall else "-",
                         f"{100 * acc:.1f}", f"{fast_rate:.2f}", f"{rate_ratio:.2f}" if rate_ratio else "-",
                         f"{slow_rate:.2f}" if slow_rate else ("-" if f > 1 else "")])
            payload.append({"method": label, "asynchronous": asynchronous, "factor": f,
                            "slow_rank": slow if f > 1 else None, "seeds": seeds,
                            "time_to_target_train_s": tta_train, "ratio_train_s_vs_none": ratio_train,
                            "time_to_target_wall_s": tta_wall, "ratio_wall_s_vs_none": ratio_wall,
                            "final_test_accuracy": acc, "fast_rank_steps_per_s": fast_rate,
                            "fast_rank_steps_per_s_vs_none": rate_ratio,
                            "slow_rank_steps_per_s": slow_rate, "runs": runs,
                            "slow_rank0_runs": probe if (probe is not None and f == max(factors)) else None})
    header = ["method", "kind", "slow rank", f"time to {100 * args.target:.0f}% train_s (s)", "ratio vs none",
              f"time to {100 * args.target:.0f}% wall less evals (s)", "ratio vs none", "final acc %",
              "fast rank (rank 0) steps/s", "ratio vs none", "slow rank steps/s (rank 0 slowed, own run)"]
    title = (f"Stragglers: {args.model} on digits, {args.ranks} ranks (2 cores), ring, {args.epochs} epochs, "
             f"seeds {args.seeds}; rank {slow} slowed {', '.join(f'{f:g}x' for f in factors if f > 1)} "
             "(not the 8 ranks, full MNIST, 2 seeds first asked for: see the notes)")
    write_table(args.out, title, markdown_table(header, rows) + "\n\n" + notes(payload, args, slow),
                {"target": args.target, "ranks": args.ranks, "epochs": args.epochs, "slow_rank": slow,
                 "factors": factors, "seeds": seeds, "rows": payload})


if __name__ == "__main__":
    main()
