"""The local-update family (DiLoCo, Streaming DiLoCo, SparseLoCo, decentralized DiLoCo) against the rest on BERT.

    python bench/wallclock/local_updates.py [--settings slow] [--steps 300] [--seeds 0,1] [--only LABEL,...] [--fresh]

Every case is a real 4-rank ``mpiexec`` job of ``apps/train_bert.py`` (tiny preset: 2 layers, hidden
64; 16 sequences of 64 tokens per rank per step; the embedded Python pydoc corpus; cosine schedule to 0)
with ``--net SETTING``, once per seed (``--seed``: model init, data order and the algorithms' own random
choices). Methods:

* AllReduce-AdamW: one fp32 ring allreduce of the gradient per step, AdamW (lr 1e-3, weight decay 0.01).
* APMSqueeze: Adam warm-up (20 % of the steps), then 1-bit error-compensated momentum (lr 1e-3).
* 1-bit LAMB: LAMB warm-up (``--freeze-step``, 20 % of the steps, as APMSqueeze), then 1-bit momentum; lr
  1e-2, LAMB's as in ``peers_apps.py`` (at lr 1e-3 it barely moves here: 7.80 and 7.83 after 300 steps at
  seeds 0 and 1, from 8.3 at the start).
* PD-SGDM: local SGD with momentum, a full-precision ring gossip every 10th step.
* DiLoCo H=10 and H=50: H inner steps, an fp32 allreduce of the pseudo-gradient, outer Nesterov SGD
  (outer lr 0.7, momentum 0.9: the paper's settings and the defaults).
* DiLoCo H=10 with outer lr 1 and no outer momentum: the outer step is then the plain average of the
  models, i.e. local AdamW with periodic averaging; it separates what the outer Nesterov step adds.
* Streaming DiLoCo: H=10, P=4 fragments, delay 1, alpha 0.5, 4-bit outer gradients (its defaults). Its
  fragments are whole tensors, and the tiny preset's word embedding (4000 x 64) is 75 % of the 339,680
  parameters, so its largest fragment is that one tensor; the lower peak comes mostly from the 4 bits.
* SparseLoCo: H=10, 2 % chunked top-k at 2 bits with error feedback, outer lr 1 (its defaults).
* Decentralized DiLoCo: H=10, one ring gossip round of the local models per sync, outer Nesterov 0.7/0.9.

Inner optimizer of the local-update methods: AdamW with AllReduce-AdamW's settings (``--inner-optimizer
adamw --lr 1e-3 --weight-decay 0.01``, betas 0.9/0.999), as in the DiLoCo papers, so the family differs from
the reference only in how often and how it communicates. PD-SGDM keeps its defining local momentum SGD (lr
0.1, momentum 0.9).

Steps: 300 by default. AllReduce-AdamW alone for 300 steps (this setting, seed 0, evaluated every 20
steps) reached 5.508 at step 100, 5.441 at 200 and 5.430 at 300: under 0.3 % change over the last
third, so its validation loss has flattened; 300 is also a multiple of both periods (10, 50), so
every method ends on a sync.

Reported per method (mean +- half the spread over seeds): final validation MLM loss and its change
relative to AllReduce-AdamW's; bytes sent by rank 0 per step (the Ledger; initial broadcast excluded)
and the most sent in one step (max over the per-step train records; Streaming DiLoCo also reports its
own ``peak_bytes_per_step``, the bytes it hands to MPI, kept in the JSON: 1/(n - 1) of what the allgather
sends); both as ratios of AllReduce-AdamW's; ``train_s``
(compute + modelled communication + waiting, no evaluation); the training time at which the
validation loss first reaches the common loss (the worst final loss of any run, so every run
reaches it). Writes docs/results/local_updates.{md,json,png}.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import SETTINGS, AppRun, bench_parser, describe, run_grid, time_to_target  # noqa: E402
from bench.common import RESULTS, markdown_table, plot_series, write_table  # noqa: E402

RANKS = 4
BASE = ["--preset", "tiny", "--batch-size", "16", "--seq-len", "64", "--eval-sequences", "128", "--epochs", "100",
        "--log-every", "1"]
ADAM = ["--lr", "1e-3"]
INNER_ADAMW = ["--inner-optimizer", "adamw", *ADAM, "--weight-decay", "0.01"]  # the reference's AdamW, inside
FRAGMENTS = 4  # Streaming DiLoCo's P (its default), stated for the peak-bytes target
WARMUP_FRACTION = 0.2  # APMSqueeze's default warm-up; 1-bit LAMB's freeze step is set to match
REFERENCE = "AllReduce-AdamW"
PLAIN_OUTER = "DiLoCo H=10, outer lr 1 no momentum"  # periodic averaging of local AdamW (Local Adam)


def methods(steps: int) -> list[tuple[str, list[str]]]:
    """``(label, arguments)`` of every method for a run of ``steps`` steps."""
    return [
        (REFERENCE, ["--algorithm", "allreduce_adam", *ADAM, "--weight-decay", "0.01"]),
        ("APMSqueeze", ["--algorithm", "apmsqueeze", *ADAM]),
        ("1-bit LAMB", ["--algorithm", "onebit_lamb", "--lr", "1e-2",
                        "--freeze-step", str(max(1, int(WARMUP_FRACTION * steps)))]),
        ("PD-SGDM H=10", ["--algorithm", "pdsgdm", "--period", "10"]),
        ("DiLoCo H=10", ["--algorithm", "diloco", "--period", "10", *INNER_ADAMW]),
        ("DiLoCo H=50", ["--algorithm", "diloco", "--period", "50", *INNER_ADAMW]),
        (PLAIN_OUTER, ["--algorithm", "diloco", "--period", "10", "--outer-lr", "1", "--outer-momentum", "0",
                       *INNER_ADAMW]),
        ("Streaming DiLoCo H=10", ["--algorithm", "streaming_diloco", "--period", "10",
                                   "--fragments", str(FRAGMENTS), *INNER_ADAMW]),
        ("SparseLoCo H=10", ["--algorithm", "sparseloco", "--period", "10", *INNER_ADAMW]),
        ("Decentralized DiLoCo H=10", ["--algorithm", "decentralized_diloco", "--period", "10",
                                       "--topology", "ring", *INNER_ADAMW]),
    ]


def mean_half(values: list[float]) -> tuple[float, float]:
    """Mean and half the spread (max - min) / 2."""
    return statistics.fmean(values), (max(values) - min(values)) / 2


def fmt(values: list[float], digits: int) -> str:
    """``mean ± half-spread``."""
    mean, half = mean_half(values)
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def step_bytes(run: AppRun, key: str = "bytes_sent") -> list[float]:
    """Rank 0's ``key`` in each step (needs a train record at every step: ``--log-every 1``)."""
    previous, out = run.start.get("init_traffic", {}).get(key, 0), []
    for r in run.records:
        if r["event"] == "train":
            out.append(r[key] - previous)
            previous = r[key]
    return out


def main() -> None:
    """Run every (setting, method, seed), then write the table, JSON and plot."""
    parser = bench_parser(__doc__.splitlines()[0], default_settings="slow")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seeds", default="0,1", help="comma list of --seed values")
    parser.add_argument("--only", default="", help="comma list of method labels to run (no outputs written)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = methods(args.steps)
    if args.only:
        chosen = [m for m in chosen if m[0] in args.only.split(",")]
    cases = [(f"{label} s{seed}", [*extra, "--seed", str(seed)]) for label, extra in chosen for seed in seeds]
    results = run_grid("local_updates", "train_bert.py", RANKS,
                       [*BASE, "--max-steps", str(args.steps), "--eval-every", str(args.eval_every)],
                       cases, args.settings, fresh=args.fresh)
    if args.only:
        for (setting, label), run in results.items():
            print(setting, label, f"final {run.end['val_mlm_loss']:.3f}", f"train_s {run.end['train_s']:.1f}",
                  [round(v, 3) for _, v, _ in run.evals("val_mlm_loss")])
        return
    rows, payload, panels, notes = [], [], [], []
    for setting in args.settings.split(","):
        runs = {label: [results[(setting, f"{label} s{seed}")] for seed in seeds] for label, _ in chosen}
        target = max(run.end["val_mlm_loss"] for group in runs.values() for run in group)
        ref_loss = statistics.fmean(run.end["val_mlm_loss"] for run in runs[REFERENCE])
        ref_bytes = statistics.fmean(run.traffic_per_step("bytes_sent") for run in runs[REFERENCE])
        ref_peak = statistics.fmean(max(step_bytes(run)) for run in runs[REFERENCE])
        series, stats = {}, {}
        for label, _ in chosen:
            group = runs[label]
            loss = [run.end["val_mlm_loss"] for run in group]
            sent = [run.traffic_per_step("bytes_sent") for run in group]
            peak = [max(step_bytes(run)) for run in group]
            train_s = [run.end["train_s"] for run in group]
            tta = [time_to_target(run.evals("val_mlm_loss"), target, lower_is_better=True) for run in group]
            split = [run.per_step() for run in group]
            curves = [run.evals("val_mlm_loss") for run in group]
            series[label] = ([statistics.fmean(c[i][0] for c in curves) for i in range(len(curves[0]))],
                             [statistics.fmean(c[i][1] for c in curves) for i in range(len(curves[0]))])
            rel = 100 * (statistics.fmean(loss) / ref_loss - 1)
            stats[label] = {"loss": loss, "rel": rel, "sent": statistics.fmean(sent), "peak": statistics.fmean(peak),
                            "tta": tta,
                            "reported_peak": [run.end.get("peak_bytes_per_step") for run in group]}
            rows.append([setting, label, fmt(loss, 3), f"{rel:+.2f} %", f"{statistics.fmean(sent) / 1e3:.1f}",
                         f"{statistics.fmean(peak) / 1e3:.1f}",
                         f"{ref_bytes / statistics.fmean(sent):.1f}x", f"{ref_peak / statistics.fmean(peak):.1f}x",
                         fmt(train_s, 1), fmt(tta, 1) if all(t is not None for t in tta) else "never",
                         " + ".join(f"{statistics.fmean(s[k] for s in split):.3f}"
                                    for k in ("compute_s", "comm_s", "wait_s"))])
            payload.append({
                "setting": setting, "net": SETTINGS[setting], "method": label, "seeds": seeds,
                "commands": [run.command for run in group], "final_val_mlm_loss": loss,
                "final_val_mlm_loss_mean": statistics.fmean(loss), "loss_vs_reference_pct": rel,
                "bytes_sent_per_step": sent, "peak_bytes_sent_in_one_step": peak,
                "reported_peak_bytes_per_step": stats[label]["reported_peak"],
                "reported_mean_bytes_per_step": [run.end.get("mean_bytes_per_step") for run in group],
                "bytes_ratio_vs_reference": ref_bytes / statistics.fmean(sent),
                "peak_ratio_vs_reference": ref_peak / statistics.fmean(peak),
                "train_s": train_s, "common_loss": target, "time_to_common_loss_s": tta,
                "per_step_s": split, "parameters": group[0].start["parameters"], "curves": curves})
        panels.append({"title": f"{setting}: {SETTINGS[setting]}", "xlabel": "training time (s)",
                       "ylabel": "validation MLM loss (mean over seeds)", "series": series, "hline": target})
        notes.append(targets(setting, stats, target, args.eval_every))
    header = ["net", "method", "final MLM loss", f"vs {REFERENCE}", "KB sent/step (mean)", "KB in the peak step",
              f"bytes: {REFERENCE} / method", "peak: AdamW / method", "train s", "time to common loss (s)",
              "s/step compute + comm + wait"]
    title = (f"BERT tiny MLM, {RANKS} ranks (2 cores), {args.steps} steps, seeds {args.seeds} "
             f"(mean ± half-spread); settings {describe(args.settings)}")
    note = ("Bytes: what rank 0 sent per step (Ledger); the peak is the most in one step. The local-update "
            "methods' inner optimizer is AdamW with the reference's settings (lr 1e-3, weight decay 0.01); "
            "PD-SGDM's is SGD with momentum 0.9 at lr 0.1. train s and the time to the common loss include the "
            "compute, which the 4 ranks sharing 2 cores slow unevenly (compute s/step differs between methods "
            "although every method computes the same gradients); the modelled comm s/step does not depend on it.")
    write_table("local_updates", title, "\n\n".join([markdown_table(header, rows), note, *notes]),
                {"ranks": RANKS, "steps": args.steps, "eval_every": args.eval_every, "seeds": seeds, "rows": payload})
    plot_series(os.path.join(RESULTS, "local_updates.png"), panels,
                f"BERT tiny, {RANKS} ranks, {args.steps} steps, {len(seeds)} seeds")


def targets(setting: str, stats: dict, target: float, eval_every: int) -> str:
    """The targets, met or not, with the numbers they rest on."""
    out = [f"Targets at {setting} (common loss: the worst final loss of any run, {target:.3f}):"]
    ref = stats[REFERENCE]
    for label in ("DiLoCo H=10", "DiLoCo H=50"):
        if label in stats:
            m = stats[label]
            ratio = ref["sent"] / m["sent"]
            met = "met" if m["rel"] <= 2 and ratio >= 10 else "missed"
            out.append(f"* {label}: final loss {m['rel']:+.2f} % vs {REFERENCE} (within 2 %: "
                       f"{'yes' if m['rel'] <= 2 else 'no'}), {ratio:.3f}x fewer bytes (>= 10x: "
                       f"{'yes' if ratio >= 10 else 'no'}): {met}.")
    if "DiLoCo H=10" in stats and "Streaming DiLoCo H=10" in stats:
        d, s = stats["DiLoCo H=10"], stats["Streaming DiLoCo H=10"]
        ds, ss = statistics.fmean(d["loss"]), statistics.fmean(s["loss"])
        contributed = [p for p in s["reported_peak"] if p is not None]
        peak_met = "yes" if d["peak"] / s["peak"] >= FRAGMENTS else "no"
        out.append(f"* Streaming DiLoCo H=10 vs DiLoCo H=10: final loss {ss:.3f} vs {ds:.3f} "
                   f"({100 * (ss / ds - 1):+.2f} %); {d['sent'] / s['sent']:.3f}x fewer bytes per step (>= 4x: "
                   f"{'yes' if d['sent'] / s['sent'] >= 4 else 'no'}); {d['peak'] / s['peak']:.2f}x lower peak "
                   f"bytes sent in one step (>= P = {FRAGMENTS}: {peak_met})"
                   + (f"; its own peak_bytes_per_step (bytes handed to MPI) {statistics.fmean(contributed):.0f}"
                      if contributed else "") + ". Bytes: its 4-bit payloads are allgathered (3 x d/2 bytes sent "
                   "a period at 4 ranks) against DiLoCo's fp32 ring allreduce (1.5 x 4d): 4x less the 8-byte "
                   "min/max each fragment's message carries.")
    order = sorted((statistics.fmean(m["tta"]), label) for label, m in stats.items() if None not in m["tta"])
    family = [label for label in stats if label.startswith(("DiLoCo", "Streaming", "SparseLoCo", "Decentralized"))]
    first = order[0][1] if order else None
    out.append("* Time to the common loss, fastest first: " + ", ".join(f"{label} {t:.1f} s" for t, label in order)
               + f". The family first: {'yes' if first in family else 'no'}.")
    if len(order) > 1:
        (t0, a), (t1, b) = order[0], order[1]
        if t0 + mean_half(stats[a]["tta"])[1] >= t1 - mean_half(stats[b]["tta"])[1]:
            out.append(f"  {a} and {b} are within each other's seed spread (the times are those of the first "
                       f"evaluation at or below the common loss; one every {eval_every} steps).")
    return "\n".join(out)


if __name__ == "__main__":
    main()
