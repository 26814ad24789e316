"""The peers' methods on the apps: ResNet-20 (PowerSGD, PowerGossip) and BERT tiny (0/1 Adam, 1-bit LAMB), 2 seeds.

    python bench/wallclock/peers_apps.py [--apps resnet,bert] [--settings gbit] [--seeds 2] [--fresh]

Every case is a real 4-rank ``mpiexec`` job with ``--net SETTING`` (the alpha-beta model on top of
the real transfers, as in ``bench/wallclock/time_to_accuracy.py`` and
``bench/wallclock/bert_speedup.py``, whose settings these are), once per seed (``--seed``: initial model,
data order and the algorithms' own draws).

* resnet: ``apps/train_resnet.py``, ResNet-20 on the embedded digits data, 6 epochs, 32 images per
  rank per step, lr 0.1 cosine, momentum 0.9: AllReduce-SGD and PowerSGD rank 1, 2, 4 (error
  feedback, warm start, no fp32 warm-up); D-PSGD and PowerGossip rank 1 on a ring.
* bert: ``apps/train_bert.py``, tiny preset, 300 steps, 16 sequences of 64 tokens per rank: AllReduce-Adam,
  APMSqueeze (20 % warm-up), 0/1 Adam (variance frozen after 20 % of the steps, local interval doubling
  every 15 steps up to 16), LAMB and 1-bit LAMB (20 % warm-up), lr 1e-3 (LAMB: 1e-2) cosine.

Reported per case: the final test accuracy (resnet) or validation MLM loss (bert) as mean ± sample
standard deviation over the seeds, ``train_s`` (compute + modelled communication + waiting) and the
bytes sent per step, both averaged over the seeds. Writes docs/results/peers_{resnet,bert}.{md,json,png}.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import SETTINGS, bench_parser, describe, run_grid  # noqa: E402
from bench.common import markdown_table, write_outputs  # noqa: E402

RANKS = 4
RESNET = ["--model", "resnet20", "--batch-size", "32", "--lr", "0.1", "--momentum", "0.9", "--epochs", "6"]
RESNET_CASES = [
    ("AllReduce-SGD", ["--algorithm", "allreduce_sgd", "--topology", "ring"]),
    *[(f"PowerSGD r={r}", ["--algorithm", "powersgd", "--rank", str(r)]) for r in (1, 2, 4)],
    ("D-PSGD", ["--algorithm", "dpsgd", "--topology", "ring"]),
    ("PowerGossip r=1", ["--algorithm", "powergossip", "--rank", "1", "--topology", "ring"]),
]
BERT_STEPS = 300
BERT = ["--preset", "tiny", "--batch-size", "16", "--seq-len", "64", "--eval-sequences", "128", "--epochs", "100",
        "--log-every", "1", "--max-steps", str(BERT_STEPS), "--eval-every", "30"]
FREEZE = str(round(0.2 * BERT_STEPS))
BERT_CASES = [
    ("AllReduce-Adam", ["--algorithm", "allreduce_adam", "--lr", "1e-3"]),
    ("APMSqueeze", ["--algorithm", "apmsqueeze", "--lr", "1e-3"]),
    ("0/1 Adam", ["--algorithm", "zeroone_adam", "--lr", "1e-3", "--var-freeze-step", FREEZE,
                  "--local-step-scaler", "15", "--local-step-clipper", "16"]),
    ("LAMB", ["--algorithm", "lamb", "--lr", "1e-2"]),
    ("1-bit LAMB", ["--algorithm", "onebit_lamb", "--lr", "1e-2", "--freeze-step", FREEZE]),
]
APPS = {  # name: (app script, base arguments, cases, metric, metric label, format)
    "resnet": ("train_resnet.py", RESNET, RESNET_CASES, "test_accuracy", "final test acc %", 100.0),
    "bert": ("train_bert.py", BERT, BERT_CASES, "val_mlm_loss", "final val MLM loss", 1.0),
}


def _spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.2g}"


def main() -> None:
    """Run every (app, setting, case, seed), then write one table per app."""
    parser = bench_parser(__doc__.splitlines()[0], default_settings="gbit")
    parser.add_argument("--apps", default="resnet,bert")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    for app in args.apps.split(","):
        script, base, cases, metric, metric_label, scale = APPS[app]
        seeded = [(f"{label} seed {s}", [*extra, "--seed", str(s)]) for label, extra in cases
                  for s in range(args.seeds)]
        results = run_grid(f"peers_{app}", script, RANKS, base, seeded, args.settings, fresh=args.fresh)
        rows, payload, panels = [], [], []
        for setting in args.settings.split(","):
            series = {}
            for label, _ in cases:
                runs = [results[(setting, f"{label} seed {s}")] for s in range(args.seeds)]
                finals = [scale * r.end[metric] for r in runs]
                train_s = statistics.mean(r.end["train_s"] for r in runs)
                mb = statistics.mean(r.traffic_per_step() for r in runs) / 1e6
                rows.append([setting, label, _spread(finals), f"{train_s:.1f}", f"{mb:.4f}",
                             f"{runs[0].bits_per_parameter():.3f}"])
                curve = runs[0].evals(metric)
                series[label] = ([t for t, _, _ in curve], [scale * v for _, v, _ in curve])
                payload.append({"setting": setting, "net": SETTINGS[setting], "case": label,
                                "commands": [r.command for r in runs], "finals": finals, "train_s": train_s,
                                "mb_sent_per_step": mb, "bits_per_parameter_per_step": runs[0].bits_per_parameter()})
            panels.append({"title": f"{setting}: {SETTINGS[setting]} (seed 0)", "xlabel": "training time (s)",
                           "ylabel": metric_label, "series": series})
        header = ["net", "case", f"{metric_label} (mean ± std, {args.seeds} seeds)", "train s (mean)",
                  "MB sent/step", "bits/param/step"]
        title = f"peers on {script}, {RANKS} ranks (2 cores); settings {describe(args.settings)}"
        write_outputs(f"peers_{app}", title, markdown_table(header, rows), {"ranks": RANKS, "rows": payload}, panels)


if __name__ == "__main__":
    main()
