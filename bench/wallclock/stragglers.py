"""What one slow rank (a straggler) costs the other ranks, per method: each slowed run paired with its unslowed
baseline run back to back, so both share the machine's load.

    python bench/wallclock/stragglers.py [--factor 4] [--methods "AD-PSGD,D-PSGD"] [--repeats 3]
        [--free-repeats 8]
        [--epochs 6] [--target 0.55] [--ranks 4] [--model resnet8] [--fresh] [--out stragglers]

Every run is a real ``mpiexec`` job of ``apps/train_resnet.py`` (``--model``; embedded digits data, 32 images
per rank per step, lr 0.1 cosine, momentum 0.9, ring, one evaluation of the averaged model and a metrics line
per epoch); the slowed one adds ``--slow-ranks R:F``: the last rank R sleeps (F - 1) x its forward and backward
time every step.
Methods: AllReduce-SGD, D-PSGD, Moniqua (default), AD-PSGD and Moniqua on AD-PSGD free running
(``--free-running``: each rank steps at its own pace, the ranks share the run's steps), AD-PSGD in the loop's
default lockstep (every rank takes every step, the ranks agree after each one), CPD-SGDM (4-bit QSGD, period 4,
as in ``time_to_accuracy.py``) and DiLoCo with H = 4 inner steps between syncs.

Pairs: repeat i (seed i) runs every method's pair in turn, the slowed run and its baseline back to back with the
same seed, in alternating order (baseline first for every other pair of a method), so a load that rises or falls
over the pair favours neither side on average. Each pair gives ratios slowed / baseline; the table gives their
mean, standard deviation and the smallest difference from the mean the repeats can detect: the half-width of
the 95 % confidence interval of the mean, t(0.975, R - 1) x std / sqrt(R). A pair whose halves did not both
finish in one invocation is rerun whole.

Measures, both from rank 0's wall clock less the evaluations (the time a user waits; it holds every wait for
the slow rank wherever it happens):

* fast ranks' steps per second: the mean of every rank's own steps but the slow rank's, over that wall time
  (free running, each rank's count is in the end record's ``steps_by_rank``; in lockstep every rank takes the
  run's steps);
* time to the target: that wall time at the first evaluation reaching ``--target``.

The ranks share the machine's cores (4 ranks on 2 cores here, OMP_NUM_THREADS=1): while the slow rank sleeps
it lends its share of a core to the others, whose compute then runs faster than with no slow rank. A slow rank
therefore costs less here than it would on dedicated hardware, for every method alike.

Writes docs/results/NAME.{md,json} (default NAME: stragglers); runs under bench/results/runs/stragglers_paired/.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import AppRun, finished, launch, time_to_target  # noqa: E402
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
DEFAULT_METHODS = ["AD-PSGD", "Moniqua on AD-PSGD", "AD-PSGD lockstep", "AllReduce-SGD", "D-PSGD"]
KEEP = 0.8  # the claim: a free-running method's fast ranks keep at least this share of their steps per second
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20}


def eval_times(run: AppRun) -> list[tuple[int, float, float]]:
    """``(step, accuracy, wall_s less the evaluations so far)`` at every evaluation."""
    out, spent, last_wall = [], 0.0, 0.0
    for r in run.records:
        if r["event"] == "train":
            last_wall = r["wall_s"]
        elif r["event"] == "eval":
            spent += r["wall_s"] - last_wall
            out.append((r["step"], r["test_accuracy"], r["wall_s"] - spent))
            last_wall = r["wall_s"]
    return out


def measure(run: AppRun, target: float, slow: int) -> dict:
    """One run's figures: time to target, the fast ranks' and the slow rank's steps per second, final accuracy."""
    points = eval_times(run)
    wall = points[-1][2] if points else None
    own = run.end.get("steps_by_rank") or [run.end["step"]] * (slow + 1)  # lockstep: every rank takes every step
    return {"time_to_target_wall_s": time_to_target([(w, a, s) for s, a, w in points], target),
            "final_test_accuracy": run.end["test_accuracy"], "steps": run.end["step"], "training_wall_s": wall,
            "steps_by_rank": own,
            "fast_ranks_steps_per_s": statistics.fmean(c for r, c in enumerate(own) if r != slow) / wall,
            "slow_rank_steps_per_s": own[slow] / wall, "curve": points}


def spread(values: list[float]) -> dict:
    """Mean, standard deviation and the 95 % confidence half-width of the mean (None where too few values)."""
    n = len(values)
    mean = statistics.fmean(values) if values else None
    std = statistics.stdev(values) if n > 1 else None
    half = T975.get(n - 1, 2.0) * std / n ** 0.5 if std is not None else None
    return {"n": n, "mean": mean, "std": std, "half_width_95": half}


def verdict(s: dict) -> str:
    """Whether the fast ranks keep at least KEEP of their pace, as far as the pairs can tell."""
    if s["half_width_95"] is None:
        return "cannot tell (one pair)"
    if s["mean"] - s["half_width_95"] >= KEEP:
        return f"keep >= {KEEP:g}x: confirmed"
    if s["mean"] + s["half_width_95"] < KEEP:
        return f"keep >= {KEEP:g}x: rejected"
    return "cannot tell"


def summarise(label: str, asynchronous: bool, pairs: list[dict]) -> dict:
    """A method's row: the per-pair ratios slowed / baseline and their spread."""
    rate = [p["slowed"]["fast_ranks_steps_per_s"] / p["none"]["fast_ranks_steps_per_s"] for p in pairs]
    tta = [p["slowed"]["time_to_target_wall_s"] / p["none"]["time_to_target_wall_s"] for p in pairs
           if p["slowed"]["time_to_target_wall_s"] and p["none"]["time_to_target_wall_s"]]
    loads = [x for p in pairs for x in (p["loadavg_before"][0], p["loadavg_after"][0])]
    return {"method": label, "asynchronous": asynchronous, "pairs": len(pairs),
            "fast_steps_per_s_none": spread([p["none"]["fast_ranks_steps_per_s"] for p in pairs]),
            "fast_steps_per_s_slowed": spread([p["slowed"]["fast_ranks_steps_per_s"] for p in pairs]),
            "slow_rank_steps_per_s": spread([p["slowed"]["slow_rank_steps_per_s"] for p in pairs]),
            "fast_steps_per_s_ratio": {**spread(rate), "per_pair": rate},
            "time_to_target_ratio": {**spread(tta), "per_pair": tta},
            "time_to_target_none_s": spread([p["none"]["time_to_target_wall_s"] for p in pairs
                                             if p["none"]["time_to_target_wall_s"]]),
            "final_accuracy_none": spread([p["none"]["final_test_accuracy"] for p in pairs]),
            "final_accuracy_slowed": spread([p["slowed"]["final_test_accuracy"] for p in pairs]),
            "loadavg_1min_range": [min(loads), max(loads)], "verdict": verdict(spread(rate)), "runs": pairs}


def fmt(s: dict, digits: int = 2, scale: float = 1.0) -> str:
    """``mean ± std`` (or the mean alone, or '-')."""
    if s["mean"] is None:
        return "-"
    return f"{scale * s['mean']:.{digits}f}" + (f" ± {scale * s['std']:.{digits}f}" if s["std"] is not None else "")


def half(s: dict) -> str:
    """``± the 95 % half-width`` (or '-')."""
    return f"± {s['half_width_95']:.2f}" if s["half_width_95"] is not None else "-"


def row(r: dict) -> list[str]:
    """The table's line for a method."""
    rate, tta = r["fast_steps_per_s_ratio"], r["time_to_target_ratio"]
    return [r["method"], "free running" if r["asynchronous"] else "lockstep", str(r["pairs"]),
            fmt(r["fast_steps_per_s_none"]), fmt(r["fast_steps_per_s_slowed"]), fmt(rate), half(rate),
            " ".join(f"{x:.2f}" for x in rate["per_pair"]), fmt(r["slow_rank_steps_per_s"]),
            fmt(r["time_to_target_none_s"], 1), f"{fmt(tta)} ({tta['n']})", half(tta),
            f"{fmt(r['final_accuracy_none'], 1, 100)} / {fmt(r['final_accuracy_slowed'], 1, 100)}",
            "{:.1f}-{:.1f}".format(*r["loadavg_1min_range"]), r["verdict"]]


def notes(summary: list[dict], args, slow: int) -> str:
    """The table's notes: what was measured, the biases, and the verdicts from the rows."""
    loads = [x for r in summary for x in r["loadavg_1min_range"]]
    runs = 2 * sum(r["pairs"] for r in summary)
    lines = [
        "Notes",
        "",
        f"* Setting: {args.ranks} ranks, {args.model} on the embedded digits (1,438 training images), {args.epochs} "
        f"epochs, target {100 * args.target:.0f} % test accuracy of the averaged model (below every method's final "
        f"accuracy here), one evaluation and one metrics line per epoch; {runs} runs. A larger setting (8 ranks, "
        "full MNIST) does not fit this 2-core machine: one 8-rank MNIST run takes 3-18 minutes here "
        "(docs/results/scale.md).",
        "* Pairs: repeat i (seed i) runs each method's slowed run and its baseline back to back with the same seed, "
        "in alternating order, so both halves of a pair share the machine's load; the ratios (slowed / baseline) "
        "are per pair. `± 95 %` is the smallest difference from the mean ratio the pairs can detect: the half-width "
        "of the 95 % confidence interval of the mean, t(0.975, R - 1) x std / sqrt(R) over the R pairs.",
        "* Free running (AD-PSGD, Moniqua on AD-PSGD): each rank steps at its own pace and the ranks share the "
        "run's steps (docs/algorithms/adpsgd.md); a fast rank takes more steps than the slow one, and the run ends "
        "when all ranks together took ranks x steps. `AD-PSGD lockstep` is the same method in the loop's default, "
        "where every rank takes every step and the ranks agree after each one.",
        f"* Steps/s: a rank's own steps over rank 0's wall clock less evaluations; the fast ranks' figure is their "
        f"mean (every rank but rank {slow}, the slow one). Time to target: rank 0's wall clock less evaluations at "
        "the first evaluation reaching it (one per epoch, so it moves by whole epochs); the count in brackets is "
        "the pairs where both halves reached it.",
        "* Oversubscription: the ranks share 2 cores, so the slow rank's sleep lends its share of a core to the "
        "others, whose compute gets faster. A slow rank can therefore cost less here than on dedicated hardware, "
        "and a free-running fast rank can get *faster* than with no slow rank.",
        f"* Machine load: the 1-minute load average before and after the pairs was {min(loads):.1f}-"
        f"{max(loads):.1f} on 2 cores (above about 4 the ranks shared the cores with other work); per method in "
        "the `load` column.",
    ]

    def said(rows: list[dict]) -> str:
        return "; ".join(
            f"{r['method']}: {r['fast_steps_per_s_ratio']['mean']:.2f}x "
            f"(± {r['fast_steps_per_s_ratio']['half_width_95'] or 0:.2f}), {r['verdict'].split(': ')[-1]}"
            for r in rows) or "none measured"

    free = [r for r in summary if r["asynchronous"]]
    held = [r for r in summary if not r["asynchronous"]]
    lines += ["", f"Verdict at {args.factor:g}x (fast ranks' steps per second, slowed / baseline, mean over pairs "
              f"and 95 % half-width; the claim: a slow rank leaves the free-running methods' other ranks at least "
              f"{KEEP:g}x of their pace, and slows every lockstep method's to its own). Free running: {said(free)}. "
              f"Lockstep (keeping {KEEP:g}x rejected is the expected outcome): {said(held)}."]
    return "\n".join(lines)


def main() -> None:
    """Run every repeat's pairs, then write the table and the JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, default=4.0, help="slowdown of the last rank (> 1)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma list of " + ", ".join(METHODS))
    parser.add_argument("--repeats", type=int, default=3, help="pairs per method (seeds 0..R-1)")
    parser.add_argument("--free-repeats", type=int, default=None,
                        help="pairs per free-running method (default: --repeats); their ratios spread the most")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--model", default="resnet8", help="resnet8, resnet20, ...")
    parser.add_argument("--target", type=float, default=0.55, help="test accuracy of the averaged model")
    parser.add_argument("--fresh", action="store_true", help="rerun pairs that already finished")
    parser.add_argument("--out", default="stragglers", help="output name under docs/results/")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    args.free_repeats = args.repeats if args.free_repeats is None else args.free_repeats
    if args.factor <= 1 or min(args.repeats, args.free_repeats) < 1 or args.ranks < 2:
        parser.error("--factor must be > 1, --repeats and --free-repeats >= 1, --ranks >= 2")
    enter_loopback_namespace()
    slow = args.ranks - 1
    per_epoch = max(1, DIGITS_TRAIN // args.ranks // BATCH)  # a metrics line with each evaluation, no more often
    base = [*BASE, "--model", args.model, "--epochs", str(args.epochs), "--log-every", str(per_epoch)]
    root = os.path.join(RUNS, "stragglers_paired", f"{args.model}_r{args.ranks}_e{args.epochs}_x{args.factor:g}")

    def pair(label: str, seed: int, slowed_first: bool) -> dict:
        extra = [*base, *METHODS[label][0], "--seed", str(seed)]
        cases = {"none": extra, "slowed": [*extra, "--slow-ranks", f"{slow}:{args.factor:g}"]}
        pair_dir = os.path.join(root, f"seed{seed}", label.replace(" ", "_"))
        stamp = os.path.join(pair_dir, "pair.json")
        done = {k: finished(label, "train_resnet.py", args.ranks, a, os.path.join(pair_dir, k))
                for k, a in cases.items()}
        if args.fresh or not os.path.exists(stamp) or None in done.values():
            order = ["slowed", "none"] if slowed_first else ["none", "slowed"]
            before = os.getloadavg()
            done = {k: launch(f"{label} {k} seed {seed}", "train_resnet.py", args.ranks, cases[k],
                              os.path.join(pair_dir, k), fresh=True, timeout=1200) for k in order}
            with open(stamp, "w") as f:
                json.dump({"order": order, "loadavg_before": before, "loadavg_after": os.getloadavg()}, f)
        with open(stamp) as f:
            info = json.load(f)
        return {"seed": seed, **info, **{k: {"command": r.command, **measure(r, args.target, slow)}
                                         for k, r in done.items()}}

    pairs: dict[str, list[dict]] = {m: [] for m in methods}
    repeats = {m: args.free_repeats if METHODS[m][1] else args.repeats for m in methods}
    for seed in range(max(repeats.values())):  # every method's pair of a seed before the next seed's
        for i, label in enumerate(methods):
            if seed < repeats[label]:
                pairs[label].append(pair(label, seed, slowed_first=(seed + i) % 2 == 1))
    summary = [summarise(m, METHODS[m][1], pairs[m]) for m in methods]
    header = ["method", "kind", "pairs", "fast ranks' steps/s, none", f"at {args.factor:g}x",
              "ratio (mean ± std)", "± 95 %", "ratio per pair", f"slow rank (rank {slow}) steps/s",
              f"time to {100 * args.target:.0f}% none (s)", "ratio (pairs)", "± 95 %", "final acc % none / slowed",
              "load (1 min)", "verdict"]
    title = (f"Stragglers: {args.model} on digits, {args.ranks} ranks (2 cores), ring, {args.epochs} epochs; rank "
             f"{slow} slowed {args.factor:g}x, each run paired with its baseline at the same load "
             "(8 ranks on full MNIST does not fit this machine: see the notes)")
    command = (f"python bench/wallclock/stragglers.py --methods \"{','.join(methods)}\" --repeats {args.repeats} "
               f"--free-repeats {args.free_repeats} --factor {args.factor:g} --epochs {args.epochs} "
               f"--model {args.model} --target {args.target:g}")
    write_table(args.out, title, f"`{command}`\n\n" + markdown_table(header, [row(r) for r in summary]) + "\n\n"
                + notes(summary, args, slow),
                {"command": command, "target": args.target, "ranks": args.ranks, "epochs": args.epochs,
                 "slow_rank": slow, "factor": args.factor, "repeats": repeats, "rows": summary})


if __name__ == "__main__":
    main()
