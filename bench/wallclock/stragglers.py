"""Time to accuracy with one slow rank (a straggler) beside the same runs with none, per method.

    python bench/wallclock/stragglers.py [--factors 1,2,4] [--methods "D-PSGD,AD-PSGD"] [--seeds 0,1]
        [--epochs 6] [--target 0.70] [--ranks 4] [--model resnet20] [--fresh] [--out stragglers]

Every case is a real ``mpiexec`` job of ``apps/train_resnet.py`` (``--model``, ResNet-20 by default; embedded
digits data, 32 images per rank per step, lr 0.1 cosine, momentum 0.9, ring, one evaluation of the averaged
model and a metrics line per epoch) with ``--slow-ranks R:F``: the last rank R sleeps (F - 1) x its forward
and backward time every step.
Methods: AllReduce-SGD, D-PSGD, Moniqua (default), AD-PSGD and Moniqua on AD-PSGD free running
(``--free-running``: each rank steps at its own pace, the ranks share the run's steps), AD-PSGD in the loop's
default lockstep (every rank takes every step, the ranks agree after each one), CPD-SGDM (4-bit QSGD, period 4,
as in ``time_to_accuracy.py``) and DiLoCo with H = 4 inner steps between syncs (its outer Nesterov 0.7/0.9 as by
default; the default H = 10 leaves only 6 outer steps in a 6-epoch run of 66 steps).

Two clocks, both rank 0's (the metrics are rank 0's; rank 0 is never the slow rank in the main grid):

* ``train_s`` at the first evaluation reaching the target, as ``time_to_accuracy.py`` measures it: rank 0's
  time inside its training steps (forward, backward, the method's step). It does not contain the loop's
  agreement between steps (``mpicomm/training/health.py``), so time rank 0 spends waiting there for a slower
  rank is not in it.
* wall time to the target less the evaluations: rank 0's ``wall_s`` at that evaluation minus the time spent in
  this and the earlier evaluations (each evaluation's ``wall_s`` less the ``wall_s`` of the train record of the
  same step, written just before it). This is the time a user waits for the training to get there, and it
  contains every wait for the slow rank wherever it happens.

Steps per second of a rank: its own steps over that wall time (free running, each rank's own count is in
the end record's ``steps_by_rank``; in lockstep every rank takes the run's steps).

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

BATCH, DIGITS_TRAIN = 32, 1438  # images per rank per step; the embedded digits' training images
BASE = ["--batch-size", str(BATCH), "--lr", "0.1", "--momentum", "0.9", "--topology", "ring"]
QSGD4 = ["--codec", "qsgd", "--codec-options", "bits=4"]
METHODS = {  # label: (arguments, free running)
    "AllReduce-SGD": (["--algorithm", "allreduce_sgd"], False),
    "D-PSGD": (["--algorithm", "dpsgd"], False),
    "Moniqua": (["--algorithm", "moniqua"], False),
    "AD-PSGD": (["--algorithm", "adpsgd", "--free-running"], True),
    "Moniqua on AD-PSGD": (["--algorithm", "moniqua_adpsgd", "--free-running"], True),
    "AD-PSGD lockstep": (["--algorithm", "adpsgd"], False),
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


def measure(run: AppRun, target: float, slow: int) -> dict:
    """One run's figures: times to target on both clocks, rank 0's and the slow rank's steps per second, final
    accuracy."""
    points = eval_times(run)
    tta_train = time_to_target([(t, a, s) for s, a, t, _ in points], target)
    tta_wall = time_to_target([(w, a, s) for s, a, _, w in points], target)
    training_wall = points[-1][3] if points else None
    split = run.per_step()
    own = run.end.get("steps_by_rank") or [run.end["step"]] * (slow + 1)  # lockstep: every rank takes every step
    return {"time_to_target_train_s": tta_train, "time_to_target_wall_s": tta_wall,
            "final_test_accuracy": run.end["test_accuracy"], "steps": run.end["step"],
            "train_s": run.end["train_s"], "training_wall_s": training_wall,
            "steps_by_rank": own,
            "fast_ranks_steps_per_s": (statistics.fmean(c for r, c in enumerate(own) if r != slow) / training_wall
                                       if training_wall else None),
            "slow_rank_steps_per_s": own[slow] / training_wall if training_wall else None,
            "rank0_train_steps_per_s": own[0] / run.end["train_s"],
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
        f"epochs, seeds {args.seeds}, target {100 * args.target:.0f} % test accuracy of the averaged model, one "
        "evaluation and one metrics line per epoch. A larger setting (8 ranks, full MNIST) does not fit "
        "this 2-core machine: one 8-rank MNIST run takes 3-18 minutes here (docs/results/scale.md), and this grid "
        f"is {sum(len(r['runs']) for r in payload)} runs. The target is set below every method's final accuracy "
        "in this setting (--target).",
        "* Free running (AD-PSGD, Moniqua on AD-PSGD): each rank steps at its own pace and the ranks share the "
        "run's steps (docs/algorithms/adpsgd.md); a fast rank takes more steps than the slow one, and the run ends "
        "when all ranks together took ranks x steps. `AD-PSGD lockstep` is the same method in the loop's default, "
        "where every rank takes every step and the ranks agree after each one.",
        "* `train_s`: rank 0's time inside its training steps (the clock of time_to_accuracy.md); it leaves out "
        "waits between steps. `wall less evals`: rank 0's wall clock to the target less the evaluations, which "
        "holds every wait.",
        f"* Steps/s: a rank's own steps over rank 0's wall clock less evaluations; the fast ranks' figure is their "
        f"mean (every rank but rank {slow}, the slow one; on 2 shared cores one fast rank can get twice another's "
        "steps, so a single rank's count is noisy). Free running, the counts come from the end record's "
        "`steps_by_rank`; in lockstep every rank takes every step.",
        "* Oversubscription: the ranks share 2 cores, so the slow rank's sleep lends its share of a core to the "
        "others, whose compute gets faster. A slow rank can therefore cost less here than on dedicated hardware "
        "(the ratios may understate the slowdown, for every method alike), and a free-running fast rank can get "
        "*faster* than with no slow rank. With other work on the machine (next note) the sleeping rank's share "
        "goes partly to that work instead.",
    ]
    loads = [run["loadavg_at_end"][0] for r in payload for run in r["runs"]]
    lines.append(f"* Machine load: the 1-minute load average at the end of the runs was {min(loads):.1f}-"
                 f"{max(loads):.1f} on 2 cores (above about 4, the ranks shared the cores with other work: "
                 "every time here is then longer, and noisier, than on an idle machine).")
    lines.append("* Time to the target is read at one evaluation per epoch, so a run that crosses it an epoch "
                 "earlier or later moves it by a whole epoch's time; the fast ranks' steps per second is the steadier "
                 "measure of what the slow rank costs the others.")
    free = [r for r in at_top if r["asynchronous"]]
    held = [r for r in at_top if not r["asynchronous"]]

    def ratios(rows: list[dict]) -> str:
        return "; ".join(f"{r['method']}: steps/s {r['fast_rank_steps_per_s_vs_none']:.2f}x of none, time to target "
                         + (f"{r['ratio_wall_s_vs_none']:.2f}x" if r["ratio_wall_s_vs_none"] else "-")
                         for r in rows) or "none measured"

    if free:
        kept = all(r["fast_rank_steps_per_s_vs_none"] >= 0.8 for r in free)
        lines += ["", f"Verdict at {top:g}x (rank 0's wall clock, evaluations left out; slow / none). Free running: "
                  f"{ratios(free)}. Lockstep: {ratios(held)}. The claim that a slow rank does not slow the "
                  "asynchronous methods' other ranks (taken as: the fast ranks keep at least 0.8x of their steps per "
                  "second) is " + ("confirmed" if kept else "refuted") + " in these runs."]
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
    per_epoch = max(1, DIGITS_TRAIN // args.ranks // BATCH)  # a metrics line with each evaluation, no more often
    base = [*BASE, "--model", args.model, "--epochs", str(args.epochs), "--log-every", str(per_epoch)]

    def run(label: str, extra: list[str], factor: float, seed: int) -> dict:
        slowing = ["--slow-ranks", f"{slow}:{factor:g}"] if factor > 1 else []
        name = f"{label.replace(' ', '_')}_x{factor:g}_log{per_epoch}"
        run_dir = os.path.join(RUNS, "stragglers", f"{args.model}_r{args.ranks}_e{args.epochs}_seed{seed}", name)
        done = launch(f"{label} x{factor:g} seed {seed}", "train_resnet.py", args.ranks,
                      [*base, *extra, "--seed", str(seed), *slowing], run_dir, fresh=args.fresh, timeout=1200)
        stamp = os.path.join(run_dir, "loadavg.json")  # the machine's load when the run ended (other work too)
        if not os.path.exists(stamp):
            with open(stamp, "w") as f:
                json.dump(os.getloadavg(), f)
        with open(stamp) as f:
            load = json.load(f)
        return {"command": done.command, "loadavg_at_end": load, **measure(done, args.target, slow)}

    rows, payload = [], []
    for label in methods:
        extra, asynchronous = METHODS[label]
        by_factor = {f: [run(label, extra, f, s) for s in seeds] for f in factors}
        none = by_factor.get(1.0)
        base_train = mean_of([r["time_to_target_train_s"] for r in none]) if none else None
        base_wall = mean_of([r["time_to_target_wall_s"] for r in none]) if none else None
        base_rate = statistics.fmean(r["fast_ranks_steps_per_s"] for r in none) if none else None
        for f in factors:
            runs = by_factor[f]
            tta_train = mean_of([r["time_to_target_train_s"] for r in runs])
            tta_wall = mean_of([r["time_to_target_wall_s"] for r in runs])
            fast_rate = statistics.fmean(r["fast_ranks_steps_per_s"] for r in runs)
            slow_rate = statistics.fmean(r["slow_rank_steps_per_s"] for r in runs) if f > 1 else None
            ratio_train = tta_train / base_train if (tta_train and base_train) else None
            ratio_wall = tta_wall / base_wall if (tta_wall and base_wall) else None
            rate_ratio = fast_rate / base_rate if base_rate else None
            acc = statistics.fmean(r["final_test_accuracy"] for r in runs)
            rows.append([label, "free running" if asynchronous else "lockstep", f"{f:g}x",
                         f"{tta_train:.1f}" if tta_train else "never",
                         f"{ratio_train:.2f}" if ratio_train else "-",
                         f"{tta_wall:.1f}" if tta_wall else "never",
                         f"{ratio_wall:.2f}" if ratio_wall else "-",
                         f"{100 * acc:.1f}", f"{fast_rate:.2f}", f"{rate_ratio:.2f}" if rate_ratio else "-",
                         f"{slow_rate:.2f}" if slow_rate else ""])
            payload.append({"method": label, "asynchronous": asynchronous, "factor": f,
                            "slow_rank": slow if f > 1 else None, "seeds": seeds,
                            "time_to_target_train_s": tta_train, "ratio_train_s_vs_none": ratio_train,
                            "time_to_target_wall_s": tta_wall, "ratio_wall_s_vs_none": ratio_wall,
                            "final_test_accuracy": acc, "fast_rank_steps_per_s": fast_rate,
                            "fast_rank_steps_per_s_vs_none": rate_ratio,
                            "slow_rank_steps_per_s": slow_rate, "runs": runs})
    header = ["method", "kind", "slow rank", f"time to {100 * args.target:.0f}% train_s (s)", "ratio vs none",
              f"time to {100 * args.target:.0f}% wall less evals (s)", "ratio vs none", "final acc %",
              "fast ranks' steps/s (mean)", "ratio vs none", f"slow rank (rank {slow}) steps/s"]
    title = (f"Stragglers: {args.model} on digits, {args.ranks} ranks (2 cores), ring, {args.epochs} epochs, "
             f"seeds {args.seeds}; rank {slow} slowed {', '.join(f'{f:g}x' for f in factors if f > 1)} "
             "(8 ranks on full MNIST does not fit this machine: see the notes)")
    write_table(args.out, title, markdown_table(header, rows) + "\n\n" + notes(payload, args, slow),
                {"target": args.target, "ranks": args.ranks, "epochs": args.epochs, "slow_rank": slow,
                 "factors": factors, "seeds": seeds, "rows": payload})


if __name__ == "__main__":
    main()
