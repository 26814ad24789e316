"""Scaling with the number of workers: throughput and time to accuracy at 1, 2, 4 and 8 ranks.

    python bench/wallclock/scaling.py [--settings gbit] [--ranks 1,2,4,8] [--epochs-per-rank 4] \
        [--target 0.70] [--fresh]

Two cores cannot host 8 ranks without distorting their compute time, so this states exactly what is
measured and what is modelled:

* measured, for real, on ``n`` ranks (one ``mpiexec -n n`` job of ``apps/train_resnet.py``, ResNet-20,
  digits, 32 images per rank per step, lr 0.1 cosine, momentum 0.9, ring, ``--epochs`` epochs, with
  ``--net SETTING``): the accuracy reached after each epoch, the steps it took and the bytes sent per
  step, i.e. the statistical side of scaling. Every n trains about the same number of steps (n times
  ``--epochs-per-rank`` epochs: the digits data has only 1,437 training images, so a fixed epoch budget
  would give 8 ranks 40 steps); linear speed-up means the steps to the target fall as 1/n;
* measured on 1 rank with the machine to itself: compute time per step, ``c1`` (what each worker of a
  real cluster spends on its own core);
* modelled: communication time per step ``m(n)``, the alpha-beta cost of the run's own traffic under
  SETTING with no overlap credit (the Communicator clock's ``modelled_s`` / steps).

Then time per step ``t(n) = c1 + m(n)``, throughput ``n * 32 / t(n)`` images/s, and time to accuracy
``steps to target(n) * t(n)``. The oversubscription factor (compute per step measured inside the
n-rank job over ``c1``) is reported so the distortion that was avoided is visible.

Writes docs/results/scaling.{md,json,png}.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import SETTINGS, bench_parser, describe, launch  # noqa: E402
from bench.common import RUNS, enter_loopback_namespace, markdown_table, write_outputs  # noqa: E402

BATCH = 32
BASE = ["--model", "resnet20", "--batch-size", str(BATCH), "--lr", "0.1", "--momentum", "0.9", "--topology", "ring"]
CASES = [  # label, arguments
    ("AllReduce-SGD", ["--algorithm", "allreduce_sgd"]),
    ("CPD-SGDM qsgd 4-bit p=4", ["--algorithm", "cpdsgdm", "--codec", "qsgd", "--codec-options", "bits=4",
                                 "--period", "4", "--gamma", "0.6"]),
]


def main() -> None:
    """Run every (setting, case, ranks), compose the modelled times, write table, JSON and plot."""
    parser = bench_parser(__doc__.splitlines()[0], default_settings="gbit")
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--epochs-per-rank", type=int, default=4, help="n ranks train n times this many epochs")
    parser.add_argument("--target", type=float, default=0.70)
    args = parser.parse_args()
    counts = [int(n) for n in args.ranks.split(",")]
    settings = args.settings.split(",")
    if any(s not in SETTINGS for s in settings):
        raise SystemExit(f"--settings: choose from {', '.join(SETTINGS)}")
    enter_loopback_namespace()
    rows, payload, panels = [], [], []
    for setting in settings:
        throughput, tta_series = {}, {}
        for label, extra in CASES:
            runs = {n: launch(f"{label} n={n}", "train_resnet.py", n,
                              [*BASE, *extra, "--epochs", str(n * args.epochs_per_rank), "--net", SETTINGS[setting]],
                              os.path.join(RUNS, "scaling", setting, label.replace(" ", "_"), str(n)),
                              fresh=args.fresh) for n in counts}
            c1 = runs[min(counts)].per_step()["compute_s"] if min(counts) == 1 else None
            xs, ys, ts = [], [], []
            for n, run in runs.items():
                steps = run.end["step"]
                modelled = run.end["net_modelled_s"] / steps
                measured = run.per_step()
                compute = c1 if c1 is not None else measured["compute_s"]
                t_step = compute + modelled
                reach = next((step for _, acc, step in run.evals("test_accuracy") if acc >= args.target), None)
                tta = reach * t_step if reach else None
                xs.append(n)
                ys.append(n * BATCH / t_step)
                ts.append(tta)
                rows.append([setting, label, n, f"{100 * run.end['test_accuracy']:.1f}", reach or "never",
                             f"{compute:.3f}", f"{modelled:.4f}", f"{n * BATCH / t_step:.0f}",
                             f"{tta:.1f}" if tta else "never", f"{measured['compute_s'] / compute:.2f}"])
                payload.append({"setting": setting, "case": label, "ranks": n, "command": run.command,
                                "final_test_accuracy": run.end["test_accuracy"], "steps": steps,
                                "steps_to_target": reach, "compute_s_per_step": compute,
                                "modelled_comm_s_per_step": modelled, "time_per_step_s": t_step,
                                "throughput_images_per_s": n * BATCH / t_step, "time_to_target_s": tta,
                                "measured_compute_s_per_step_in_job": measured["compute_s"],
                                "bytes_sent_per_step": run.traffic_per_step()})
            throughput[label] = (xs, ys)
            tta_series[label] = ([x for x, t in zip(xs, ts) if t], [t for t in ts if t])
        throughput["linear (from 1 rank)"] = (counts, [n * throughput[CASES[0][0]][1][0] / counts[0] for n in counts])
        panels += [{"title": f"throughput, {setting}: {SETTINGS[setting]}", "xlabel": "ranks",
                    "ylabel": "images / s (modelled)", "series": throughput, "legend": True},
                   {"title": f"time to {100 * args.target:.0f}% accuracy, {setting}", "xlabel": "ranks",
                    "ylabel": "seconds (c1 + modelled comm)", "series": tta_series}]
    header = ["net", "case", "ranks", "final acc %", f"steps to {100 * args.target:.0f}%", "compute s/step (c1)",
              "modelled comm s/step", "images/s", "time to target (s)", "oversubscription factor"]
    title = (f"Scaling, ResNet-20 / digits, {BATCH} images per rank per step, {args.epochs_per_rank} x n epochs; "
             f"settings {describe(args.settings)}")
    write_outputs("scaling", title, markdown_table(header, rows),
                  {"target": args.target, "batch_per_rank": BATCH, "rows": payload}, panels)


if __name__ == "__main__":
    main()
