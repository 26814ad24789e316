"""Methods x seeds of BERT masked-LM on the python-docs corpus at N ranks: final validation loss and masked-token
accuracy, mean ± std over the seeds, traffic per step, and the most-frequent-token baseline.

    python bench/training/bert_yardstick.py --ranks 4 --seeds 0,1,2 --steps 3000 --warmup 100

(its default ``--methods``: AllReduce-Adam, APMSqueeze, 0/1 Adam, 1-bit LAMB, Moniqua and DiLoCo, each with only
``--algorithm`` given: the app's defaults, the 1-bit family's variance frozen once it has settled). 3,000 steps is
long enough for the yardstick to separate: AllReduce-Adam ends at three times the input-blind baseline's
accuracy, where 600 steps left it at twice and the Adam family's warm-ups on the loss plateau.

Each run is ``apps/train_bert.py --dataset python-docs --algorithm A --seed S --max-steps STEPS --epochs 10
--lr-warmup-steps W --eval-every STEPS/4`` on ``--ranks`` ranks (the tiny preset, sequences of 64 tokens, batch 16
per rank, the cosine schedule after the warm-up, every other option the app's default); a method entry
``A+flag=value+...`` adds ``--flag value`` for each pair, as in :mod:`bench.training.yardstick`, and is its row's
label. The validation sequences and their mask are the same in every run (the app's fixed split seed); ``--seed``
moves the initial weights, the order, the training masks and the methods' own draws.

The baseline is what a model that ignores its input scores: always predicting the token most frequent in the
training sequences gives the accuracy row, and predicting the training sequences' unigram distribution (add-one
smoothed) gives the loss row, both on the same validation labels the app scores (built here with the app's own
task code). The table gives each row's final validation loss and accuracy of the averaged model (mean ± sample
standard deviation over the seeds, every seed's value), the bytes per parameter per step that rank 0 handed to
MPI, and the app's wall seconds per run. Finished runs are reused and so are failed ones, whose last error line
is kept in ``failed.txt`` beside the run (``--fresh`` reruns both); a failed run is listed as failed. Writes
``docs/results/<name>.{md,json}``; the runs go to ``bench/results/runs/bert_yardstick/``. Run it niced; it enters
a loopback namespace when root.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.apprun import launch  # noqa: E402
from bench.common import RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402
from bench.training.yardstick import add_table_options, method_args, table_plan  # noqa: E402

DATASET = "python-docs"
TOKENIZER = os.path.join(RUNS, "bert_yardstick", "tokenizer-python-docs-v4000.json")


def baseline() -> dict:
    """The input-blind predictors' scores on the app's validation labels (tiny preset, its default vocabulary);
    saves the task's tokenizer to ``TOKENIZER``, the one every run loads (the same the app would train)."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "apps"))
    from bert.masking import IGNORE_INDEX
    from bert.task import build_task
    from bert.tokenizer import SPECIAL_TOKENS, save_tokenizer

    task = build_task("tiny", None, None, 64, 16, 0, 1, 0, None, dataset=DATASET)
    save_tokenizer(task.tokenizer, TOKENIZER)  # the runs load it instead of each rank training the same one again
    vocab = task.tokenizer.get_vocab_size()
    counts = torch.bincount(task.train_sequences.flatten(), minlength=vocab).double()
    for token in SPECIAL_TOKENS:
        counts[task.tokenizer.token_to_id(token)] = 0  # never a label: the masker selects no special token
    labels = task.val_labels[task.val_labels != IGNORE_INDEX]
    top = int(counts.argmax())
    probabilities = (counts + 1) / (counts + 1).sum()
    val_counts = torch.bincount(labels, minlength=vocab)
    return {"most_frequent_token": task.tokenizer.id_to_token(top),
            "accuracy": float((labels == top).double().mean()),
            "best_token_accuracy": int(val_counts.max()) / len(labels),
            "unigram_loss": float(-probabilities[labels].log().mean()), "uniform_loss": math.log(vocab),
            "masked_validation_tokens": len(labels), "vocabulary": vocab}


def run_one(entry: str, seed: int, ranks: int, steps: int, warmup: int, fresh: bool) -> dict:
    """Run (or reuse) one method entry at one seed; its final loss and accuracy, traffic and seconds."""
    args = ["--dataset", DATASET, "--tokenizer", TOKENIZER, *method_args(entry), "--seed", str(seed), "--epochs", "10",
            "--max-steps", str(steps), "--lr-warmup-steps", str(warmup), "--eval-every", str(max(steps // 4, 1))]
    run_dir = os.path.join(RUNS, "bert_yardstick", f"{ranks}r-{steps}s-w{warmup}", entry.replace("=", "-"),
                           f"seed{seed}")
    marker = os.path.join(run_dir, "failed.txt")
    if os.path.exists(marker) and not fresh:  # a divergence is deterministic: keep its error, do not rerun it
        with open(marker) as f:
            return {"seed": seed, "failed": True, "error": f.read().strip()}
    t0 = time.perf_counter()
    try:
        run = launch(f"{entry} seed {seed}", "train_bert.py", ranks, args, run_dir, fresh=fresh, timeout=3600)
    except RuntimeError as exc:
        print(str(exc)[-2000:], flush=True)
        error = str(exc).strip().splitlines()[-1]
        with open(marker, "w") as f:
            f.write(error)
        return {"seed": seed, "failed": True, "error": error}
    evals = [(r["step"], r["val_mlm_loss"], r["val_mlm_accuracy"]) for r in run.records if r["event"] == "eval"]
    return {"seed": seed, "failed": False, "val_mlm_loss": run.end["val_mlm_loss"],
            "val_mlm_accuracy": run.end["val_mlm_accuracy"], "steps": run.end["step"], "evals": evals,
            "bytes_per_parameter_per_step": run.traffic_per_step("bytes_contributed") / run.start["parameters"],
            "app_wall_s": run.end["wall_s"], "launch_s": time.perf_counter() - t0}


def summary(runs: list[dict]) -> dict:
    """Mean and sample standard deviation (None below 2 runs) of the finished runs' loss and accuracy."""
    done = [r for r in runs if not r["failed"]]
    out = {"finished": len(done), "failed": len(runs) - len(done)}
    for key in ("val_mlm_loss", "val_mlm_accuracy", "bytes_per_parameter_per_step", "app_wall_s"):
        values = [r[key] for r in done]
        out[key] = statistics.fmean(values) if values else None
        out[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
    return out


def failure(run: dict) -> str:
    """A failed run's cell: ``diverged by step N`` when the app said so, else ``failed``."""
    found = re.search(r"diverged by step \d+", run.get("error", ""))
    return found.group(0) if found else "failed"


def table(results: dict[str, list[dict]], base: dict) -> str:
    """The markdown table: one row per method entry, then the input-blind baseline."""
    def spread(value, std, scale, digits):
        return "–" if value is None else f"{scale * value:.{digits}f}" + ("" if std is None else
                                                                           f" ± {scale * std:.{digits}f}")

    rows = []
    for entry, runs in results.items():
        s = summary(runs)
        seeds = "; ".join(failure(r) if r["failed"] else f"{r['val_mlm_loss']:.3f} / {100 * r['val_mlm_accuracy']:.2f}"
                          for r in runs)
        traffic = "–" if s["bytes_per_parameter_per_step"] is None else f"{s['bytes_per_parameter_per_step']:.3g}"
        wall = "–" if s["app_wall_s"] is None else f"{s['app_wall_s']:.0f}"
        rows.append([f"`{entry}`", spread(s["val_mlm_loss"], s["val_mlm_loss_std"], 1, 3),
                     spread(s["val_mlm_accuracy"], s["val_mlm_accuracy_std"], 100, 2) + " %", seeds, traffic, wall])
    rows.append([f"baseline: always `{base['most_frequent_token']}` / the unigram distribution",
                 f"{base['unigram_loss']:.3f}", f"{100 * base['accuracy']:.2f} %", "–", "0", "–"])
    return markdown_table(["method", "val MLM loss (mean ± std)", "masked-token accuracy (mean ± std)",
                           "per seed (loss / accuracy %)", "bytes / parameter / step", "wall s per run"], rows)


def main() -> None:
    """Parse, compute the baseline, run every (method, seed), write the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=3000, help="training steps per run (--max-steps)")
    p.add_argument("--warmup", type=int, default=100, help="--lr-warmup-steps of every run")
    add_table_options(p, "allreduce_adam,apmsqueeze,zeroone_adam,onebit_lamb,moniqua,diloco", "bert_mlm_3000")
    args = p.parse_args()
    entries, seeds, command = table_plan(args, "bench/training/bert_yardstick.py")
    enter_loopback_namespace()
    base = baseline()
    results = {entry: [] for entry in entries}
    for seed in seeds:  # seed-major: a table cut short still has every method at the first seeds
        for entry in entries:
            results[entry].append(run_one(entry, seed, args.ranks, args.steps, args.warmup, args.fresh))
    intro = (f"`{command}`\n\nEach run: `apps/train_bert.py --dataset {DATASET} --algorithm A --seed S --max-steps "
             f"{args.steps} --epochs 10 --lr-warmup-steps {args.warmup} --eval-every {max(args.steps // 4, 1)}` on "
             f"{args.ranks} ranks (tiny preset: 2 layers, hidden 64, {base['vocabulary']}-token WordPiece "
             "vocabulary; sequences of 64 tokens, batch 16 per rank, cosine schedule after the warm-up; the app's "
             f"defaults otherwise); seeds {args.seeds}. Loss and accuracy: the averaged model's final masked-LM "
             f"cross-entropy and masked-token accuracy on the fixed validation mask ({base['masked_validation_tokens']}"
             " masked tokens of 256 held-out sequences); std: the sample standard deviation over the seeds; bytes / "
             "parameter / step: what rank 0 handed to MPI per step over the parameter count; wall: the app's own "
             f"seconds per run, as loaded as the machine was (load average {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} cores when the table was written; a reused run keeps its own seconds).\n\n"
             f"Baseline (input-blind): always predicting `{base['most_frequent_token']}`, the training sequences' most "
             f"frequent token, scores {100 * base['accuracy']:.2f} % on these labels (the best single token in "
             f"hindsight: {100 * base['best_token_accuracy']:.2f} %); predicting their unigram distribution scores a "
             f"loss of {base['unigram_loss']:.3f} (uniform over the vocabulary: {base['uniform_loss']:.3f}).")
    write_table(args.name, f"BERT masked-LM on {DATASET} at {args.ranks} ranks, {args.steps} steps, "
                f"{len(seeds)} seed(s)", f"{intro}\n\n{table(results, base)}",
                {"command": command, "ranks": args.ranks, "steps": args.steps, "warmup": args.warmup, "seeds": seeds,
                 "baseline": base,
                 "results": {entry: {"runs": runs, **summary(runs)} for entry, runs in results.items()}})


if __name__ == "__main__":
    main()
