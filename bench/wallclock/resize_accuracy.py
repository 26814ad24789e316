"""Another world size: does a checkpoint of N ranks, continued at M, reach the uninterrupted run's accuracy?

    python bench/wallclock/resize_accuracy.py [--methods allreduce_sgd,dpsgd,...] [--ranks 4] [--to 2[,3]]
        [--steps 132] [--seed 0] [--noise-methods all] [--smaller] [--model resnet8] [--fresh]
        [--out resize_accuracy]

Per method, real ``mpiexec`` jobs of ``apps/train_resnet.py`` (``--model``, ResNet-8 by default; embedded
digits data, 32 images per rank per step, ``--max-steps`` steps of a cosine schedule, ring, an evaluation of the
averaged model half way and at the end; each method's own options in ``METHODS``):

1. uninterrupted: ``mpiexec -n N`` for ``--steps`` steps, at ``--seed`` and (``--noise-methods``) at
   ``--seed`` + 1: the two seeds' difference is the noise the resize is judged against;
2. stopped: the same run with ``--save-every S/2 --stop-at-step S/2``: it checkpoints at step S/2 and exits;
3. resized: for each M of ``--to``, a copy of that directory continued with ``mpiexec -n M ... --resume latest``
   and the same flags (a resumed run must repeat every setting its trajectory depends on; ``--max-steps`` keeps
   the run's length and its cosine schedule: docs/training.md, "Another world size") to step S.

Read back from each run's ``metrics.jsonl``: the final test accuracy of the averaged model, and the resized
run's ``resize`` record (``old_size``, ``new_size``, ``rule``). A resume the library refuses is a row with its
refusal line, not a failure of the benchmark. ``--smaller`` adds an uninterrupted run at each M (the accuracy of
M ranks from the start, which see fewer samples per step).

Writes docs/results/NAME.{md,json} (default NAME: resize_accuracy); runs under
bench/results/runs/resize_accuracy/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import AppRun, finished, launch, read_complete  # noqa: E402
from bench.common import REPO, RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402

BASE = ["--batch-size", "32", "--topology", "ring", "--log-every", "1", "--epochs", "100"]
SGD = ["--lr", "0.1", "--momentum", "0.9"]
QSGD4 = ["--codec", "qsgd", "--codec-options", "bits=4"]
METHODS = {  # name: (label, family, the method's options)
    "allreduce_sgd": ("AllReduce-SGD", "centralized", SGD),
    "compressed_sgd": ("EF-SGD top-5 %", "centralized",
                       [*SGD, "--codec", "topk", "--codec-options", "ratio=0.05", "--error-feedback"]),
    "ef_signsgd": ("EF-SignSGD", "centralized", SGD),  # not in DEFAULT: it does not learn this ResNet at lr 0.1
    "powersgd": ("PowerSGD r=2", "centralized", [*SGD, "--rank", "2", "--warmup-steps", "10"]),
    "apmsqueeze": ("APMSqueeze", "centralized", ["--lr", "0.002", "--momentum", "0"]),
    "dpsgd": ("D-PSGD", "decentralized", SGD),
    "moniqua": ("Moniqua", "decentralized", SGD),
    "choco": ("CHOCO-SGD qsgd 4-bit", "decentralized", [*SGD, *QSGD4, "--gamma", "0.6"]),
    "cpdsgdm": ("CPD-SGDM qsgd 4-bit p=4", "decentralized", [*SGD, *QSGD4, "--period", "4", "--gamma", "0.6"]),
    "adpsgd": ("AD-PSGD", "decentralized", SGD),
    "diloco": ("DiLoCo H=5", "DiLoCo", [*SGD, "--period", "5"]),
    "streaming_diloco": ("Streaming DiLoCo H=8", "DiLoCo", [*SGD, "--period", "8"]),
}
DEFAULT = ["allreduce_sgd", "compressed_sgd", "powersgd", "apmsqueeze", "dpsgd", "moniqua", "choco", "cpdsgdm",
           "adpsgd", "diloco", "streaming_diloco"]
FAMILIES = ("centralized", "decentralized", "DiLoCo")
STOPPED_EXIT = 128 + signal.SIGUSR1  # a run that --stop-at-step ended (as if SIGUSR1 arrived)
JOBS = {"ran": 0, "reused": 0}  # this invocation's jobs


def command(ranks: int, args: list[str], run_dir: str) -> list[str]:
    """The job's command line."""
    return ["mpiexec", "-n", str(ranks), sys.executable, os.path.join("apps", "train_resnet.py"), *args,
            "--out-dir", run_dir, "--no-progress"]


def job(cmd: list[str]) -> tuple[int, str]:
    """Run one ``mpiexec`` job to its end: its exit status and its output (stdout and stderr together)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1800)
    return proc.returncode, proc.stdout


def refusal(output: str) -> str:
    """The one line a refused job printed (the first naming a refusal or an error, else its last line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for word in ("cannot resume", "refus", "Error"):
        for line in lines:
            if word in line:
                return line
    return lines[-1] if lines else "(no output)"


def cached(stamp: str, cmd: list[str], fresh: bool) -> dict | None:
    """The stamp of a finished stage run with exactly this command, or None."""
    if fresh or not os.path.exists(stamp):
        return None
    with open(stamp) as f:
        done = json.load(f)
    return done if done.get("command") == cmd else None


def stopped(ranks: int, args: list[str], stop: int, run_dir: str, label: str, fresh: bool) -> dict:
    """The run to step ``stop``, checkpointed there (``--stop-at-step``); reused when already done."""
    cmd = command(ranks, [*args, "--save-every", str(stop), "--stop-at-step", str(stop)], run_dir)
    stamp = os.path.join(os.path.dirname(run_dir), "stopped.json")
    done = cached(stamp, cmd, fresh)
    if done is not None and os.path.isdir(run_dir):
        print(f"  reuse  {label:<40} {run_dir}", flush=True)
        JOBS["reused"] += 1
        return done
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    t0 = time.perf_counter()
    rc, out = job(cmd)
    records = read_complete(os.path.join(run_dir, "metrics.jsonl"))
    end = records[-1] if records else {}
    if rc not in (0, STOPPED_EXIT) or end.get("event") != "end" or end.get("step") != stop:
        raise RuntimeError(f"{label}: {' '.join(cmd)} exited {rc}, last record {end}:\n{out[-3000:]}")
    done = {"command": cmd, "exit": rc, "step": end["step"], "stopped_by_signal": end.get("stopped_by_signal"),
            "checkpoints": [r["step"] for r in records if r["event"] == "checkpoint"],
            "test_accuracy_at_stop": next((r["test_accuracy"] for r in records
                                           if r["event"] == "eval" and r["step"] == stop), None)}
    with open(stamp, "w") as f:
        json.dump(done, f, indent=1)
    print(f"  ran    {label:<40} {time.perf_counter() - t0:6.1f} s", flush=True)
    JOBS["ran"] += 1
    return done


def resized(ranks: int, args: list[str], stopped_dir: str, run_dir: str, label: str, fresh: bool) -> dict:
    """A copy of the stopped run continued at ``ranks`` ranks with ``--resume latest`` to the end."""
    cmd = command(ranks, [*args, "--resume", "latest"], run_dir)
    stamp = os.path.join(os.path.dirname(run_dir), f"{os.path.basename(run_dir)}.json")
    done = cached(stamp, cmd, fresh)
    if done is not None:
        print(f"  reuse  {label:<40} {run_dir}", flush=True)
        JOBS["reused"] += 1
        return done
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(stopped_dir, run_dir, symlinks=True)
    before = len(read_complete(os.path.join(run_dir, "metrics.jsonl")))
    t0 = time.perf_counter()
    rc, out = job(cmd)
    seconds = time.perf_counter() - t0
    after = read_complete(os.path.join(run_dir, "metrics.jsonl"))[before:]
    end = after[-1] if after else {}
    done = {"command": cmd, "exit": rc, "job_s": seconds, "output_tail": out[-1500:]}
    if rc != 0 or end.get("event") != "end":
        done["refused"] = refusal(out)
        print(f"  ended  {label:<40} exit {rc}: {done['refused']}", flush=True)
    else:
        resume = next((r for r in after if r["event"] == "resume"), {})
        done.update({"resumed_from_step": resume.get("step"),
                     "resize": next((r for r in after if r["event"] == "resize"), None),
                     "final_step": end["step"], "final_test_accuracy": end["test_accuracy"],
                     "final_test_loss": end["test_loss"],
                     "consensus_distance": end.get("consensus_distance"),
                     "evals_after_resume": [(r["step"], r["test_accuracy"]) for r in after if r["event"] == "eval"]})
        print(f"  ran    {label:<40} {seconds:6.1f} s", flush=True)
    with open(stamp, "w") as f:
        json.dump(done, f, indent=1)
    JOBS["ran"] += 1
    return done


def run(label: str, ranks: int, args: list[str], run_dir: str, fresh: bool) -> AppRun:
    """:func:`bench.apprun.launch` of ``apps/train_resnet.py``, counted in ``JOBS``."""
    JOBS["reused" if not fresh and finished(label, "train_resnet.py", ranks, args, run_dir) else "ran"] += 1
    return launch(label, "train_resnet.py", ranks, args, run_dir, fresh=fresh)


def rule_text(record: dict | None) -> str:
    """The resize record as one table cell: ``old -> new: rule (data position it continues at, lr factor)``."""
    if record is None:
        return "(no resize record)"
    where = ", ".join(f"{k} {record[k]}" for k in ("epoch", "batch", "lr_factor") if k in record)
    text = f"{record.get('old_size')} -> {record.get('new_size')}: {record.get('rule')}"
    return f"{text} ({where})" if where else text


def points(x: float) -> str:
    """Accuracy as a percentage with one decimal."""
    return f"{100 * x:.1f}"


def verdicts(rows: list[dict], targets: list[int]) -> list[str]:
    """One line per family and size M: each method's difference (resized - uninterrupted) against the noise.

    The noise is sigma, the root mean square of the family's two-seed differences (each the difference of two
    runs, as the resize's is): a method is within it when its difference is at most 2 sigma in size, and the
    family when every method is and the mean difference is at most 2 sigma / sqrt(k) for its k methods.
    """
    lines = []
    for family in FAMILIES:
        for m in targets:
            members = [r for r in rows if r["family"] == family and r["to"] == m]
            if not members:
                continue
            spreads = [r["seed_spread"] for r in members if r["seed_spread"] is not None]
            refused = [r["label"] for r in members if r["refused"] is not None]
            judged = [r for r in members if r["refused"] is None]
            refused_text = f"; refused: {', '.join(refused)}" if refused else ""
            if not spreads or not judged:
                lines.append(f"* **{family}, {m} ranks: not judged** (no two-seed spread or no finished resize)"
                             f"{refused_text}.")
                continue
            sigma = math.sqrt(statistics.fmean(s * s for s in spreads))
            diffs = [r["difference"] for r in judged]
            mean, band = statistics.fmean(diffs), 2 * sigma / math.sqrt(len(diffs))
            outside = [r["label"] for r in judged if abs(r["difference"]) > 2 * sigma]
            within = not outside and abs(mean) <= band
            head = "within the noise" if within else "not within the noise"
            each = ", ".join(f"{r['label']} {100 * r['difference']:+.2f}" for r in judged)
            small = [r["resized"] - r["smaller"] for r in judged if r.get("smaller") is not None]
            small_text = (f"; resized − {m} ranks from the start: mean {100 * statistics.fmean(small):+.2f}"
                          if small else "")
            lines.append(
                f"* **{family}, continued at {m} ranks: {head}**: differences {each} points; mean "
                f"{100 * mean:+.2f} against ±{100 * band:.2f} (2σ/√{len(diffs)}); each against "
                f"±{100 * 2 * sigma:.2f} (2σ, σ = {100 * sigma:.2f}, the RMS of {len(spreads)} two-seed differences)"
                + (f"; outside: {', '.join(outside)}" if outside else "") + small_text + refused_text + ".")
    return lines


def main() -> None:
    """Run every method's jobs, then write the table and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(DEFAULT), help="comma list of " + ", ".join(METHODS))
    parser.add_argument("--ranks", type=int, default=4, help="N, the size the checkpoint is saved at")
    parser.add_argument("--to", default="2", help="comma list of sizes M to continue at")
    parser.add_argument("--model", default="resnet8", help="resnet8, resnet20, ...")
    parser.add_argument("--steps", type=int, default=132, help="S, the run's length (--max-steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-methods", default="all",
                        help="methods that also get an uninterrupted run at --seed + 1 (comma list, all, none)")
    parser.add_argument("--smaller", action="store_true", help="also an uninterrupted run at each M")
    parser.add_argument("--fresh", action="store_true", help="rerun cases that already finished")
    parser.add_argument("--out", default="resize_accuracy", help="output name under docs/results/")
    args = parser.parse_args()
    enter_loopback_namespace()
    t_start = time.perf_counter()
    n, steps, stop = args.ranks, args.steps, args.steps // 2
    targets = [int(m) for m in args.to.split(",")]
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    noisy = set(methods if args.noise_methods == "all" else
                [] if args.noise_methods == "none" else args.noise_methods.split(","))
    rows, table, payload = [], [], []
    for method in methods:
        label, family, options = METHODS[method]
        print(f"{label}", flush=True)

        def common(seed: int, method=method, options=options) -> list[str]:
            return [*BASE, "--model", args.model, "--algorithm", method, *options, "--max-steps", str(steps),
                    "--eval-every", str(stop), "--seed", str(seed)]

        where = os.path.join(RUNS, "resize_accuracy", f"{method}_{args.model}_r{n}_s{steps}")
        full = run(f"{label} {n} ranks seed {args.seed}", n, common(args.seed),
                      os.path.join(where, f"uninterrupted_seed{args.seed}"), args.fresh)
        other = None
        if method in noisy:
            other = run(f"{label} {n} ranks seed {args.seed + 1}", n, common(args.seed + 1),
                           os.path.join(where, f"uninterrupted_seed{args.seed + 1}"), args.fresh)
        acc_full = full.end["test_accuracy"]
        spread = abs(other.end["test_accuracy"] - acc_full) if other else None
        stop_dir = os.path.join(where, f"stopped_seed{args.seed}")
        first = stopped(n, common(args.seed), stop, stop_dir, f"{label} {n} ranks to step {stop}", args.fresh)
        entry = {"method": method, "label": label, "family": family, "options": options,
                 "uninterrupted": {"command": full.command, "final_test_accuracy": acc_full,
                                   "final_test_loss": full.end["test_loss"], "wall_s": full.end["wall_s"],
                                   "evals": full.evals("test_accuracy")},
                 "uninterrupted_other_seed": ({"command": other.command, "seed": args.seed + 1,
                                               "final_test_accuracy": other.end["test_accuracy"]}
                                              if other else None),
                 "seed_spread": spread, "stopped": first, "resized": {}, "smaller": {}}
        for m in targets:
            res = resized(m, common(args.seed), stop_dir, os.path.join(where, f"resized_to{m}_seed{args.seed}"),
                          f"{label} {n} -> {m} ranks from step {stop}", args.fresh)
            small = None
            if args.smaller:
                small = run(f"{label} {m} ranks seed {args.seed}", m, common(args.seed),
                               os.path.join(where, f"uninterrupted_r{m}_seed{args.seed}"), args.fresh)
                entry["smaller"][m] = {"command": small.command, "final_test_accuracy": small.end["test_accuracy"]}
            entry["resized"][m] = res
            refused = res.get("refused")
            acc = res.get("final_test_accuracy")
            row = {"method": method, "label": label, "family": family, "to": m, "refused": refused,
                   "difference": None if refused else acc - acc_full, "seed_spread": spread, "resized": acc,
                   "smaller": small.end["test_accuracy"] if small else None}
            rows.append(row)
            cells = [label, family, f"{n} -> {m}"]
            if refused:
                cells += [f"refused: `{refused}`", "-", points(acc_full), "-", "-"]
            else:
                ended = "" if res["final_step"] == steps else f" (ended at step {res['final_step']})"
                cells += [rule_text(res["resize"]), res["resumed_from_step"], points(acc_full), points(acc) + ended,
                          f"{100 * row['difference']:+.1f}"]
            cells.append(f"{100 * spread:.1f}" if spread is not None else "-")
            if args.smaller:
                cells.append(points(small.end["test_accuracy"]))
            table.append(cells)
        payload.append(entry)
    header = ["method", "family", "ranks", "resize record: old -> new size: rule (epoch, batch, lr_factor)",
              "resumed from step",
              f"final acc % ({n} ranks, uninterrupted, seed {args.seed})", "final acc % (resized)",
              "difference (points)", f"seed spread (points): abs(seed {args.seed} − seed {args.seed + 1}), "
              f"{n} ranks uninterrupted"]
    if args.smaller:
        header.append("final acc % (M ranks from the start)")
    load = os.getloadavg()[0]
    minutes = (time.perf_counter() - t_start) / 60
    reproduce = " ".join(["python bench/wallclock/resize_accuracy.py", "--methods", args.methods, "--ranks", str(n),
                          "--to", args.to, "--steps", str(steps), "--seed", str(args.seed), "--model", args.model,
                          *(["--noise-methods", args.noise_methods] if args.noise_methods != "all" else []),
                          *(["--smaller"] if args.smaller else []), "--out", args.out])
    title = (f"Resized mid-run: {args.model} on digits, saved at {n} ranks at step {stop} of {steps} "
             f"(--stop-at-step), continued at {args.to} ranks with --resume latest, against the uninterrupted "
             f"{n}-rank run; ring, 32 images per rank per step, cosine over {steps} steps, seed {args.seed}, "
             f"2 cores")
    notes = "\n".join([
        "Notes", "",
        f"* Every run is a real `mpiexec` job of `apps/train_resnet.py`; the resized run is a copy of the stopped "
        f"run's directory continued by `mpiexec -n M ... --resume latest` with the same flags (`--max-steps "
        f"{steps}` keeps the length and the cosine schedule). The rule column is the resumed run's `resize` "
        "record in metrics.jsonl. Accuracies are the averaged model's on the 359 test digits (one image is "
        "0.28 points), read from each run's last record.",
        f"* After the resize a step takes M x 32 images instead of {n} x 32, so the resized run has seen fewer "
        "samples than the uninterrupted one; a drop can come from that as well as from the resize rule"
        + (" (the last column: M ranks from the start)." if args.smaller else "."),
        f"* Noise: the seed spread is one pair of uninterrupted {n}-rank runs per method (seeds {args.seed} and "
        f"{args.seed + 1}); like the resize's difference it is the difference of two runs. Per family, σ is the "
        "root mean square of its methods' seed spreads; a method is within the noise when its difference is at "
        "most 2σ in size, a family when all its methods are and their mean difference is at most 2σ/√k "
        "(k methods). Two seeds per method make σ a rough scale, not a confidence interval.",
        f"* Machine load: 1-minute load average {load:.2f} at the end, on {os.cpu_count()} cores shared with other "
        f"work (wall seconds in the JSON are indicative only); this invocation took {minutes:.0f} min and ran "
        f"{JOBS['ran']} of its {JOBS['ran'] + JOBS['reused']} jobs (the others: finished runs of the same command "
        "reused).",
        f"* Reproduce: `{reproduce}` (finished runs under bench/results/runs/resize_accuracy/ are reused; "
        "`--fresh` reruns them).",
        "",
        "Verdicts", "",
        *verdicts(rows, targets),
    ])
    write_table(args.out, title, markdown_table(header, table) + "\n\n" + notes,
                {"ranks": n, "to": targets, "steps": steps, "stop_at_step": stop, "seed": args.seed,
                 "model": args.model, "load_average_1min": load, "minutes": minutes, "jobs": JOBS, "command": reproduce,
                 "rows": payload})


if __name__ == "__main__":
    main()
