"""Time to accuracy of the decentralized methods and AllReduce-SGD, at three network settings.

    python bench/wallclock/time_to_accuracy.py [--settings fast,gbit,slow] [--epochs 6] [--target 0.70] \
        [--fresh] [--out NAME] [--overlap]
    python bench/wallclock/time_to_accuracy.py --settings slow --overlap --fresh --out time_to_accuracy_slow

Every case is a real 4-rank ``mpiexec`` job of ``apps/train_resnet.py`` (ResNet-20, embedded digits
data, 32 images per rank per step, lr 0.1 cosine, momentum 0.9, ring, one evaluation of the averaged
model per epoch) with ``--net SETTING``: the alpha-beta model adds each collective's cost on top of the
real shared-memory transfer (see ``mpicomm/net/model.py``). The x-axis is ``train_s``: time inside
training steps (compute + modelled communication + waiting), without evaluation. ``--overlap`` adds the
decentralized methods with their exchange overlapped (``OVERLAP_CASES``), each beside its blocking self in the
same run; "hidden s/step" is the modelled transfer time compute hid (``hidden_s_per_step``).

The 4 ranks share 2 cores (OMP_NUM_THREADS=1), so compute per step is about twice what one rank on its
own core needs (``bench/wallclock/scaling.py`` measures the factor): communication looks cheaper next to compute
than it would on 4 real machines.

Writes docs/results/time_to_accuracy.{md,json,png} (``--out NAME``: docs/results/NAME.*, e.g. for one setting).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import SETTINGS, bench_parser, describe, run_grid, time_to_target  # noqa: E402
from bench.common import markdown_table, write_outputs  # noqa: E402

RANKS = 4
BASE = ["--model", "resnet20", "--batch-size", "32", "--lr", "0.1", "--momentum", "0.9", "--topology", "ring"]
QSGD4 = ["--codec", "qsgd", "--codec-options", "bits=4"]
CASES = [  # label, arguments
    ("AllReduce-SGD", ["--algorithm", "allreduce_sgd"]),
    ("D-PSGD", ["--algorithm", "dpsgd"]),
    ("Moniqua default ~1 bit", ["--algorithm", "moniqua"]),  # 4 bits on a rotating quarter of each tensor
    ("Moniqua theta_c 0.1 ~1 bit", ["--algorithm", "moniqua", "--theta-c", "0.1"]),
    ("Moniqua observed theta ~1 bit", ["--algorithm", "moniqua", "--theta", "observed"]),
    ("Moniqua 4-bit 1/2 ~2 bit", ["--algorithm", "moniqua", "--parts", "2"]),
    ("Moniqua paper 1-bit", ["--algorithm", "moniqua", "--bits", "1", "--parts", "1", "--theta-per", "model",
                             "--theta", "adaptive", "--rounding", "nearest", "--gamma", "0.5"]),
    ("CHOCO qsgd 4-bit", ["--algorithm", "choco", *QSGD4, "--gamma", "0.6"]),
    ("DCD qsgd 4-bit", ["--algorithm", "dcd", *QSGD4]),
    ("PD-SGDM p=4", ["--algorithm", "pdsgdm", "--period", "4"]),
    ("CPD-SGDM qsgd 4-bit p=4", ["--algorithm", "cpdsgdm", *QSGD4, "--period", "4", "--gamma", "0.6"]),
]
BASELINE = "D-PSGD"
CTA = ["--order", "cta"]
OVERLAP_CASES = [  # label, arguments, the blocking case it is measured against (added by --overlap)
    ("D-PSGD overlapped", ["--algorithm", "dpsgd", "--overlap"], "D-PSGD"),
    ("Moniqua default ~1 bit overlapped", ["--algorithm", "moniqua", "--overlap"], "Moniqua default ~1 bit"),
    ("CHOCO qsgd 4-bit cta", ["--algorithm", "choco", *QSGD4, "--gamma", "0.6", *CTA], None),
    ("CHOCO qsgd 4-bit cta overlapped", ["--algorithm", "choco", *QSGD4, "--gamma", "0.6", *CTA, "--overlap"],
     "CHOCO qsgd 4-bit cta"),
    ("PD-SGDM p=4 cta", ["--algorithm", "pdsgdm", "--period", "4", *CTA], None),
    ("PD-SGDM p=4 cta overlapped", ["--algorithm", "pdsgdm", "--period", "4", *CTA, "--overlap"], "PD-SGDM p=4 cta"),
    ("CPD-SGDM qsgd 4-bit p=4 cta", ["--algorithm", "cpdsgdm", *QSGD4, "--period", "4", "--gamma", "0.6", *CTA], None),
    ("CPD-SGDM qsgd 4-bit p=4 cta overlapped",
     ["--algorithm", "cpdsgdm", *QSGD4, "--period", "4", "--gamma", "0.6", *CTA, "--overlap"],
     "CPD-SGDM qsgd 4-bit p=4 cta"),
]
"""The exchange of x(t) posted before the forward pass (``--overlap``), beside each method's blocking self in
the same order (CHOCO and PD-/CPD-SGDM overlap with ``--order cta`` only, so their blocking selves are cta
too)."""


def main() -> None:
    """Run every (setting, case), then write the table, JSON and plot."""
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--target", type=float, default=0.70, help="test accuracy of the averaged model")
    parser.add_argument("--out", default="time_to_accuracy", help="output name under docs/results/")
    parser.add_argument("--overlap", action="store_true", help="add the overlapped cases and their blocking selves")
    args = parser.parse_args()
    blocking_self = {label: of for label, _, of in OVERLAP_CASES} if args.overlap else {}
    cases = CASES + ([(label, extra) for label, extra, _ in OVERLAP_CASES] if args.overlap else [])
    results = run_grid("time_to_accuracy", "train_resnet.py", RANKS, [*BASE, "--epochs", str(args.epochs)],
                       cases, args.settings, fresh=args.fresh)
    rows, payload, panels = [], [], []
    for setting in args.settings.split(","):
        base = results[(setting, BASELINE)]
        base_tta = time_to_target(base.evals("test_accuracy"), args.target)
        series = {}
        for label, _ in cases:
            run = results[(setting, label)]
            curve = run.evals("test_accuracy")
            tta = time_to_target(curve, args.target)
            split = run.per_step()
            speedup = base_tta / tta if (tta and base_tta) else None
            step_speedup = base.per_step()["step_s"] / split["step_s"]
            own = blocking_self.get(label)
            own_tta = time_to_target(results[(setting, own)].evals("test_accuracy"), args.target) if own else None
            own_speedup = own_tta / tta if (tta and own_tta) else None
            series[label] = ([t for t, _, _ in curve], [100 * a for _, a, _ in curve])
            rows.append([setting, label, f"{100 * run.end['test_accuracy']:.1f}",
                         f"{tta:.1f}" if tta else "never", f"{speedup:.2f}x" if speedup else "-",
                         f"{step_speedup:.2f}x",
                         f"{own_speedup:.2f}x" if own_speedup else "-",
                         f"{split['compute_s']:.3f}", f"{split['comm_s']:.3f}", f"{split['hidden_s']:.3f}",
                         f"{split['wait_s']:.3f}", f"{run.traffic_per_step() / 1e6:.3f}", f"{run.end['train_s']:.1f}"])
            payload.append({"setting": setting, "net": SETTINGS[setting], "case": label, "command": run.command,
                            "final_test_accuracy": run.end["test_accuracy"], "time_to_target_s": tta,
                            "speedup_vs_dpsgd": speedup, "step_speedup_vs_dpsgd": step_speedup,
                            "blocking_self": own, "speedup_vs_blocking_self": own_speedup, "per_step_s": split,
                            "bytes_sent_per_step": run.traffic_per_step(), "train_s": run.end["train_s"],
                            "consensus_distance": run.end.get("consensus_distance"), "curve": curve})
        panels.append({"title": f"{setting}: {SETTINGS[setting]}", "xlabel": "training time (s)",
                       "ylabel": "test accuracy of the averaged model (%)", "series": series,
                       "hline": 100 * args.target})
    header = ["net", "case", "final acc %", f"time to {100 * args.target:.0f}% (s)", f"speed-up vs {BASELINE}",
              f"per-step speed-up vs {BASELINE}", "speed-up vs its blocking self", "compute s/step",
              "comm s/step (exposed)", "hidden s/step", "wait s/step", "MB sent/step", "train s"]
    title = (f"ResNet-20 on digits, {RANKS} ranks (2 cores), ring, {args.epochs} epochs; "
             f"settings {describe(args.settings)}")
    write_outputs(args.out, title, markdown_table(header, rows),
                  {"target": args.target, "ranks": RANKS, "rows": payload}, panels)


if __name__ == "__main__":
    main()
