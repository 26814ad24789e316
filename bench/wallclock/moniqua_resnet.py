"""Moniqua on ResNet: the new default (~1 bit/param), ~2 bits/param and the paper's form next to D-PSGD.

    python bench/wallclock/moniqua_resnet.py [--epochs 10] [--seeds 0,1] [--cases D-PSGD,...] [--extra] [--fresh]

Every case is a real ``mpiexec`` job of ``apps/train_resnet.py`` (embedded digits 32x32, 32 images per
rank per step, lr 0.1 cosine, momentum 0.9, ring), one per seed; finished runs are reused (see
``bench/apprun.py``). Reported per case: the averaged model's final test accuracy (mean and spread =
max - min over the seeds), accuracy difference to D-PSGD (same seeds), bytes handed to MPI per rank
(ratio to D-PSGD's, same seeds), bits per parameter per step (everything rank 0 sent: payload, headers,
the theta collective), and the guard's wrapped/skipped parts. ``--extra`` adds the ResNet-32 and 8-rank
ring rows (D-PSGD, the default, theta_c 0.1 and the observed theta, first two seeds). The averaged model is
evaluated with BatchNorm statistics recomputed for it (the apps' default, ``--eval-bn-batches 8``).

Writes docs/results/moniqua_resnet.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import launch  # noqa: E402
from bench.common import RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402

BASE = ["--batch-size", "32", "--lr", "0.1", "--momentum", "0.9", "--topology", "ring", "--log-every", "10"]
DEFAULT = ["--algorithm", "moniqua"]  # bits 4 on a rotating quarter of each tensor, theta per tensor, dither
PAPER = ["--algorithm", "moniqua", "--bits", "1", "--parts", "1", "--theta-per", "model", "--theta", "adaptive",
         "--rounding", "nearest",
         "--gamma", "0.5"]
CASES = [  # label, extra arguments, most seeds to run (None: all of --seeds)
    ("D-PSGD", ["--algorithm", "dpsgd"], None),
    ("Moniqua default (4 bits 1/4 parts)", DEFAULT, None),
    ("Moniqua 4 bits 1/2 parts", [*DEFAULT, "--parts", "2"], None),
    ("Moniqua paper form (1 bit one theta)", PAPER, 2),  # fails clearly on both seeds: two are enough
    ("Moniqua theta_c 0.1", [*DEFAULT, "--theta-c", "0.1"], None),  # a tenth of the bound rule's theta
    ("Moniqua observed theta", [*DEFAULT, "--theta", "observed"], None),  # theta from the recovered distances
]
EXTRA = [  # (group label, model, ranks), run with EXTRA_CASES on the first two seeds
    ("ResNet-32, 4-ring", "resnet32", 4),
    ("ResNet-20, 8-ring", "resnet20", 8),
]
EXTRA_CASES = ("D-PSGD", "Moniqua default (4 bits 1/4 parts)", "Moniqua theta_c 0.1", "Moniqua observed theta")


def run_case(label, extra, model, ranks, seed, epochs, fresh):
    """One job (or its cached result)."""
    name = f"{model}_n{ranks}_e{epochs}_s{seed}_{label}".replace(" ", "_").replace("/", "of")
    for ch in "(),~":
        name = name.replace(ch, "")
    args = [*BASE, "--model", model, "--epochs", str(epochs), "--seed", str(seed), *extra]
    return launch(label, "train_resnet.py", ranks, args, os.path.join(RUNS, "moniqua_resnet", name), fresh=fresh,
                  timeout=7200)


def summarise(runs, base_runs):
    """Mean/spread of accuracy, difference to D-PSGD, bytes ratio, bits/param, guard counts."""
    acc = [100 * r.end["test_accuracy"] for r in runs]
    base_acc = [100 * r.end["test_accuracy"] for r in base_runs]
    ratio = statistics.mean(b.end["bytes_sent"] for b in base_runs) / statistics.mean(r.end["bytes_sent"] for r in runs)
    wrapped = [r.end.get("moniqua_wrapped_parts", 0) for r in runs]
    return {"accuracy": acc, "mean": statistics.mean(acc), "spread": max(acc) - min(acc),
            "vs_dpsgd": statistics.mean(a - b for a, b in zip(acc, base_acc)), "bytes_ratio": ratio,
            "bits_per_parameter": statistics.mean(r.bits_per_parameter() for r in runs),
            "mb_sent": statistics.mean(r.end["bytes_sent"] for r in runs) / 1e6, "wrapped_parts": wrapped,
            "commands": [r.command for r in runs]}


def main() -> None:
    """Run the grid sequentially, then write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--cases", default="", help="comma list of labels (default: all)")
    parser.add_argument("--extra", action="store_true", help="also ResNet-32 and an 8-rank ring (first seed)")
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    enter_loopback_namespace()
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = [c for c in CASES if not args.cases or c[0] in args.cases.split(",")]
    if chosen[0][0] != "D-PSGD":
        chosen.insert(0, CASES[0])
    rows, payload = [], []
    groups = [("ResNet-20, 4-ring", "resnet20", 4, chosen, seeds)]
    if args.extra:
        groups += [(g, m, n, [(label, extra, 2) for label, extra, _ in CASES if label in EXTRA_CASES], seeds)
                   for g, m, n in EXTRA]
    for group, model, ranks, cases, group_seeds in groups:
        results = {label: [run_case(label, extra, model, ranks, s, args.epochs, args.fresh)
                           for s in group_seeds[:most or len(group_seeds)]]
                   for label, extra, most in cases}
        for label, _, _ in cases:
            s = summarise(results[label], results["D-PSGD"][:len(results[label])])
            rows.append([group, label, " / ".join(f"{a:.1f}" for a in s["accuracy"]),
                         f"{s['mean']:.1f} ± {s['spread'] / 2:.1f}", f"{s['vs_dpsgd']:+.1f}",
                         f"{s['bits_per_parameter']:.2f}", f"{s['mb_sent']:.1f}", f"{s['bytes_ratio']:.1f}x",
                         "/".join(str(w) for w in s["wrapped_parts"])])
            payload.append({"group": group, "case": label, "seeds": group_seeds[:len(results[label])], **s})
    header = ["setting", "case", "acc % per seed", "mean ± half-spread", "vs D-PSGD (points)", "bits/param/step",
              "MB sent/rank", "fewer bytes than D-PSGD", "wrapped parts (per seed)"]
    table = markdown_table(header, rows)
    title = f"Moniqua on ResNet, digits 32x32, {args.epochs} epochs, seeds {args.seeds}, lr 0.1 cosine, momentum 0.9"
    write_table("moniqua_resnet", title, table, {"rows": payload})


if __name__ == "__main__":
    main()
