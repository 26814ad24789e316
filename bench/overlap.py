"""AllReduce-SGD with and without overlap, and DDP-like buckets against one large bucket, under ``--net gbit``.

    python bench/overlap.py [--models resnet20,resnet18] [--ranks 2] [--steps 12] [--rounds 3] [--setting gbit]

Each case is a real ``mpiexec`` job of ``apps/train_resnet.py --algorithm allreduce_sgd`` with ``--net
SETTING`` (the modelled transfer of each collective completes at its deadline, so an allreduce started
during backward is credited with the compute it overlapped). Cases, interleaved round by round:

* ``no overlap``: one allreduce of the whole gradient after backward;
* ``overlap, 1 bucket of 1M``: the old default (``--bucket-numel 1048576``, first bucket as large), which
  on ResNet-20 (0.27 M parameters) is a single bucket launched when backward ends;
* ``overlap, DDP buckets``: the default, a 1 MiB first bucket then 25 MiB buckets.

Reported: the median over rounds of the mean seconds per step (steps 2..``--steps``, from each job's
``metrics.jsonl``), and its ratio to ``no overlap`` in the same round. Writes docs/results/overlap.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.apprun import RUNS, SETTINGS, enter_loopback_namespace, launch, markdown_table, write_table  # noqa: E402

CASES = [
    ("no overlap", ["--no-overlap"]),
    ("overlap, 1 bucket of 1M", ["--overlap", "--bucket-numel", str(2**20), "--first-bucket-numel", str(2**20)]),
    ("overlap, DDP buckets", ["--overlap"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet20,resnet18")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setting", default="gbit", choices=sorted(SETTINGS))
    args = parser.parse_args()
    enter_loopback_namespace()
    base = ["--algorithm", "allreduce_sgd", "--momentum", "0.9", "--batch-size", "32", "--max-steps",
            str(args.steps), "--log-every", "1", "--eval-limit", "32", "--net", SETTINGS[args.setting]]
    rows, payload = [], {}
    for model in args.models.split(","):
        step_s = {label: [] for label, _ in CASES}
        ratio = {label: [] for label, _ in CASES}
        for round_ in range(args.rounds):
            seconds = {}
            for label, extra in CASES:
                run_dir = os.path.join(RUNS, "overlap", model, f"{label.replace(' ', '_').replace(',', '')}-{round_}")
                run = launch(f"{model} {label} #{round_}", "train_resnet.py", args.ranks,
                             [*base, "--model", model, *extra], run_dir, fresh=True)
                seconds[label] = run.per_step(first=1)["step_s"]
            for label in seconds:
                step_s[label].append(seconds[label])
                ratio[label].append(seconds[label] / seconds["no overlap"])
        payload[model] = {"step_s": step_s, "ratio_to_no_overlap": ratio}
        for label, _ in CASES:
            rows.append([model, label, f"{1e3 * statistics.median(step_s[label]):.0f}",
                         f"{statistics.median(ratio[label]):.3f}",
                         " / ".join(f"{r:.3f}" for r in ratio[label])])
    table = markdown_table(["model", "case", "ms per step (median)", "ratio to no overlap (median)",
                            "ratio per round"], rows)
    title = (f"AllReduce-SGD overlap, {args.ranks} ranks, --net {args.setting} ({SETTINGS[args.setting]}), "
             f"batch 32 per rank, steps 2..{args.steps}, {args.rounds} interleaved rounds")
    write_table("overlap", title, table, payload)


if __name__ == "__main__":
    main()
