"""HSQ against the gradient-compression baselines: accuracy vs bits per parameter and vs wall time.

    python bench/wallclock/hsq_wallclock.py [--settings gbit,slow] [--epochs 6] [--fresh]

Every case is a real 4-rank ``mpiexec`` job of ``apps/train_resnet.py`` (ResNet-20, embedded digits
data, 32 images per rank per step, lr 0.1 cosine, momentum 0.9; SignSGD's majority vote takes lr 1e-3
as its paper does) with ``--net SETTING``. The compressed methods allgather their payloads (an
allreduce cannot sum codes); AllReduce-SGD allreduces float32 gradients. HSQ: d-dimensional chunks
against a 256-word Gaussian codebook (greedy), 6-bit norms; layers under 1000 elements (BatchNorm,
biases) go uncompressed.

"Bits/param" is what a rank hands to MPI per parameter per step (the papers' measure), read from
the Ledger. Writes docs/results/hsq_wallclock.{md,json,png}.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import SETTINGS, bench_parser, describe, run_grid  # noqa: E402
from bench.common import markdown_table, write_outputs  # noqa: E402

RANKS = 4
BASE = ["--model", "resnet20", "--batch-size", "32", "--momentum", "0.9"]
SGD = ["--lr", "0.1"]
CASES = [  # label, arguments
    ("AllReduce-SGD", ["--algorithm", "allreduce_sgd", *SGD]),
    ("QSGD 8-bit", ["--algorithm", "qsgd", "--bits", "8", *SGD]),
    ("QSGD 2-bit", ["--algorithm", "qsgd", "--bits", "2", *SGD]),
    ("TernGrad", ["--algorithm", "terngrad", *SGD]),
    ("SignSGD (majority)", ["--algorithm", "signsgd", "--lr", "1e-3"]),
    ("EF-SignSGD", ["--algorithm", "ef_signsgd", *SGD]),
    ("HSQ d=8", ["--algorithm", "hsq", "--d", "8", *SGD]),
    ("HSQ d=16", ["--algorithm", "hsq", "--d", "16", *SGD]),
]


def main() -> None:
    """Run every (setting, case), then write the table, JSON and plot."""
    parser = bench_parser(__doc__.splitlines()[0], default_settings="gbit,slow")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    results = run_grid("hsq_wallclock", "train_resnet.py", RANKS, [*BASE, "--epochs", str(args.epochs)],
                       CASES, args.settings, fresh=args.fresh)
    settings = args.settings.split(",")
    rows, payload = [], []
    panels = [{"title": "final accuracy vs bits per parameter", "xlabel": "bits per parameter per step",
               "ylabel": "final test accuracy (%)", "logx": True, "series": {}}]
    for label, _ in CASES:
        run = results[(settings[0], label)]
        panels[0]["series"][label] = ([run.bits_per_parameter()], [100 * run.end["test_accuracy"]])
    for setting in settings:
        series = {}
        base = results[(setting, "AllReduce-SGD")]
        for label, _ in CASES:
            run = results[(setting, label)]
            curve = run.evals("test_accuracy")
            series[label] = ([t for t, _, _ in curve], [100 * a for _, a, _ in curve])
            split = run.per_step()
            rows.append([setting, label, f"{run.bits_per_parameter():.3f}", f"{100 * run.end['test_accuracy']:.1f}",
                         f"{split['step_s']:.3f}", f"{split['comm_s']:.3f}",
                         f"{base.end['train_s'] / run.end['train_s']:.2f}x", f"{run.end['train_s']:.1f}"])
            payload.append({"setting": setting, "net": SETTINGS[setting], "case": label, "command": run.command,
                            "bits_per_parameter": run.bits_per_parameter(),
                            "final_test_accuracy": run.end["test_accuracy"], "per_step_s": split,
                            "train_s": run.end["train_s"], "curve": curve})
        panels.append({"title": f"{setting}: {SETTINGS[setting]}", "xlabel": "training time (s)",
                       "ylabel": "test accuracy (%)", "series": series})
    header = ["net", "case", "bits/param/step", "final acc %", "s/step", "comm s/step",
              "speed-up vs AllReduce-SGD", "train s"]
    title = (f"Gradient compression on ResNet-20 / digits, {RANKS} ranks (2 cores), {args.epochs} epochs; "
             f"settings {describe(args.settings)}")
    write_outputs("hsq_wallclock", title, markdown_table(header, rows), {"ranks": RANKS, "rows": payload}, panels)


if __name__ == "__main__":
    main()
