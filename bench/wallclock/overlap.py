"""Overlapped communication during backward against none, for AllReduce-SGD and the compressed methods.

    python bench/wallclock/overlap.py [--algorithms allreduce_sgd] [--models resnet20,resnet18] [--ranks 2] [--steps 12]
                            [--rounds 3] [--setting gbit] [--name overlap]

Each case is a real ``mpiexec`` job of ``apps/train_resnet.py --algorithm ALGORITHM`` with ``--net
SETTING`` (the modelled transfer of each collective completes at its deadline, so a collective started
during backward is credited with the compute it overlapped). Cases, interleaved round by round:

* ``no overlap``: one allreduce (or encode + allgather) of the whole gradient after backward;
* ``overlap, 1 bucket of 1M`` (allreduce_sgd only): the old default (``--bucket-numel 1048576``, first
  bucket as large), which on ResNet-20 (0.27 M parameters) is a single bucket launched when backward ends;
* ``overlap, DDP buckets``: the default, a 1 MiB first bucket then 25 MiB buckets.

``--algorithms`` takes ``allreduce_sgd``, ``qsgd`` (4 bits, bucket_size 512) and ``signsgd``. Reported:
the median over rounds of the mean seconds per step (steps 2..``--steps``, from each job's
``metrics.jsonl``), the modelled transfer time the rank waited for (``comm_s_per_step``: what overlap
hides, less noisy than the step on a shared machine), and the step's ratio to ``no overlap`` of the same
algorithm in the same round. Writes
docs/results/NAME.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import SETTINGS, launch  # noqa: E402
from bench.common import RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402

CASES = [
    ("no overlap", ["--no-overlap"]),
    ("overlap, 1 bucket of 1M", ["--overlap", "--bucket-numel", str(2**20), "--first-bucket-numel", str(2**20)]),
    ("overlap, DDP buckets", ["--overlap"]),
]
ALGORITHMS = {  # the algorithm's options, and its cases
    "allreduce_sgd": (["--momentum", "0.9"], CASES),
    "qsgd": (["--momentum", "0.9", "--bits", "4"], [CASES[0], CASES[2]]),
    "signsgd": (["--lr", "0.001", "--momentum", "0.9"], [CASES[0], CASES[2]]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="allreduce_sgd", help=", ".join(ALGORITHMS))
    parser.add_argument("--models", default="resnet20,resnet18")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setting", default="gbit", choices=sorted(SETTINGS))
    parser.add_argument("--name", default="overlap", help="results go to docs/results/NAME.{md,json}")
    args = parser.parse_args()
    algorithms = args.algorithms.split(",")
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown:
        parser.error(f"--algorithms: unknown {unknown}; choose from {', '.join(ALGORITHMS)}")
    enter_loopback_namespace()
    base = ["--batch-size", "32", "--max-steps", str(args.steps), "--log-every", "1", "--eval-limit", "32",
            "--net", SETTINGS[args.setting]]
    rows, payload = [], {}
    for model in args.models.split(","):
        step_s = {(a, label): [] for a in algorithms for label, _ in ALGORITHMS[a][1]}
        comm_s = {key: [] for key in step_s}
        for round_ in range(args.rounds):
            for algorithm in algorithms:
                options, cases = ALGORITHMS[algorithm]
                for label, extra in cases:
                    name = f"{algorithm}-{label.replace(' ', '_').replace(',', '')}-{round_}"
                    run = launch(f"{model} {algorithm} {label} #{round_}", "train_resnet.py", args.ranks,
                                 [*base, "--algorithm", algorithm, *options, "--model", model, *extra],
                                 os.path.join(RUNS, "overlap", model, name), fresh=True)
                    seconds = run.per_step(first=1)
                    step_s[algorithm, label].append(seconds["step_s"])
                    comm_s[algorithm, label].append(seconds["comm_s"])
        ratio = {key: [s / b for s, b in zip(seconds, step_s[key[0], "no overlap"])] for key, seconds in step_s.items()}
        payload[model] = {a: {"step_s": {label: step_s[a, label] for label, _ in ALGORITHMS[a][1]},
                              "comm_s": {label: comm_s[a, label] for label, _ in ALGORITHMS[a][1]},
                              "ratio_to_no_overlap": {label: ratio[a, label] for label, _ in ALGORITHMS[a][1]}}
                          for a in algorithms}
        for (algorithm, label), seconds in step_s.items():
            rows.append([model, algorithm, label, f"{1e3 * statistics.median(seconds):.0f}",
                         f"{1e3 * statistics.median(comm_s[algorithm, label]):.0f}",
                         f"{statistics.median(ratio[algorithm, label]):.3f}",
                         " / ".join(f"{r:.3f}" for r in ratio[algorithm, label])])
    table = markdown_table(["model", "algorithm", "case", "ms per step (median)", "modelled comm waited, ms (median)",
                            "ratio to no overlap (median)", "ratio per round"], rows)
    title = (f"Overlap during backward, {args.ranks} ranks, --net {args.setting} ({SETTINGS[args.setting]}), "
             f"batch 32 per rank, steps 2..{args.steps}, {args.rounds} interleaved rounds")
    write_table(args.name, title, table, payload)


if __name__ == "__main__":
    main()
