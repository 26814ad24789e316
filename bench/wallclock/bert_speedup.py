"""APMSqueeze vs AllReduce-Adam on the BERT app: end-to-end speed-up (warm-up included) per network setting.

    python bench/wallclock/bert_speedup.py [--settings fast,gbit,slow] [--steps 300] [--fresh]

Every case is a real 4-rank ``mpiexec`` job of ``apps/train_bert.py`` (tiny preset: 2 layers, hidden
64; 16 sequences of 64 tokens per rank per step; the embedded Python pydoc corpus; lr 1e-3 cosine)
with ``--net SETTING``. APMSqueeze runs AllReduce-Adam for its warm-up (20 % of the steps, its
default), then 1-bit error-compensated momentum with the variance frozen. Both runs take the same
number of steps; the validation MLM loss is measured every ``--eval-every`` steps.

Reported per setting: final validation loss; training time (``train_s``: compute + modelled
communication + waiting, no evaluation) and Adam's time over it (the end-to-end speed-up, warm-up
included); time to the loss both runs reach; bytes sent per step in each phase; seconds per step
split into compute + comm + wait, per phase.

Writes docs/results/bert_speedup.{md,json,png}.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import SETTINGS, bench_parser, describe, run_grid, time_to_target  # noqa: E402
from bench.common import markdown_table, write_outputs  # noqa: E402
from mpicomm.net import CostModel, parse_net  # noqa: E402

RANKS = 4
BASE = ["--preset", "tiny", "--batch-size", "16", "--seq-len", "64", "--lr", "1e-3", "--eval-sequences", "128",
        "--epochs", "100", "--log-every", "1"]
CASES = [("AllReduce-Adam", ["--algorithm", "allreduce_adam"]), ("APMSqueeze", ["--algorithm", "apmsqueeze"])]
WARMUP_FRACTION = 0.2  # APMSqueeze's default; stated here to find the phase boundary in the metrics
BERT_LARGE_PARAMETERS = 340_000_000


def bert_large_projection(setting: str = "gbit", ranks: int = RANKS) -> dict[str, float]:
    """Model-only arithmetic, no run: seconds of communication per step for BERT-Large's fp32 gradients.

    Adam: one ring allreduce of 4P bytes. APMSqueeze's compression step: an all-to-all of the 1-bit
    payload (P/8 bytes) and an allgather of each rank's 1/n server chunk (scales neglected).
    """
    model = CostModel(parse_net(SETTINGS[setting]))
    nbytes = 4 * BERT_LARGE_PARAMETERS
    one_bit = BERT_LARGE_PARAMETERS / 8
    return {"adam_s": model.allreduce(nbytes, ranks),
            "apmsqueeze_s": model.alltoall(one_bit, ranks) + model.allgather(one_bit / ranks, ranks)}


def main() -> None:
    """Run both optimizers at every setting, then write the table, JSON and plot."""
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=30)
    args = parser.parse_args()
    results = run_grid("bert_speedup", "train_bert.py", RANKS,
                       [*BASE, "--max-steps", str(args.steps), "--eval-every", str(args.eval_every)],
                       CASES, args.settings, fresh=args.fresh)
    warmup = max(1, int(WARMUP_FRACTION * args.steps))
    phases = {"warm-up": (0, warmup), "compression": (warmup, None)}
    rows, payload, panels = [], [], []
    for setting in args.settings.split(","):
        adam = results[(setting, "AllReduce-Adam")]
        target = max(results[(setting, label)].end["val_mlm_loss"] for label, _ in CASES)  # both reach it
        series = {}
        for label, _ in CASES:
            run = results[(setting, label)]
            curve = run.evals("val_mlm_loss")
            series[label] = ([t for t, _, _ in curve], [v for _, v, _ in curve])
            split = {name: run.per_step(lo, hi) for name, (lo, hi) in phases.items()}
            sent = {name: run.traffic_per_step("bytes_sent", lo, hi) for name, (lo, hi) in phases.items()}
            tta = time_to_target(curve, target, lower_is_better=True)
            speedup = adam.end["train_s"] / run.end["train_s"]
            rows.append([setting, label, f"{run.end['val_mlm_loss']:.3f}", f"{run.end['train_s']:.1f}",
                         f"{speedup:.2f}x", f"{tta:.1f}" if tta else "never",
                         f"{sent['warm-up'] / 1e3:.0f} / {sent['compression'] / 1e3:.0f}",
                         " / ".join(f"{split[p]['compute_s']:.3f}+{split[p]['comm_s']:.3f}+{split[p]['wait_s']:.3f}"
                                    for p in phases)])
            payload.append({"setting": setting, "net": SETTINGS[setting], "case": label, "command": run.command,
                            "final_val_mlm_loss": run.end["val_mlm_loss"], "train_s": run.end["train_s"],
                            "speedup_vs_adam": speedup, "target_loss": target, "time_to_target_s": tta,
                            "bytes_sent_per_step": sent, "per_step_s": split, "parameters": run.start["parameters"],
                            "curve": curve})
        panels.append({"title": f"{setting}: {SETTINGS[setting]}", "xlabel": "training time (s)",
                       "ylabel": "validation MLM loss", "series": series, "hline": target})
    header = ["net", "optimizer", "final MLM loss", "train s", "speed-up vs Adam", "time to common loss (s)",
              f"KB sent/step (warm-up {warmup} / rest)", "s/step compute+comm+wait (warm-up / rest)"]
    title = f"BERT tiny MLM, {RANKS} ranks (2 cores), {args.steps} steps; settings {describe(args.settings)}"
    large = bert_large_projection()
    note = (f"Model only (no run): BERT-Large ({BERT_LARGE_PARAMETERS / 1e6:.0f} M parameters) on {RANKS} ranks at "
            f"gbit: Adam allreduce {large['adam_s']:.2f} s/step, APMSqueeze compressed step "
            f"{large['apmsqueeze_s']:.2f} s/step.")
    write_outputs("bert_speedup", title, f"{markdown_table(header, rows)}\n\n{note}",
                  {"ranks": RANKS, "warmup_steps": warmup, "rows": payload, "bert_large_projection": large}, panels)


if __name__ == "__main__":
    main()
