"""Every method with only ``--algorithm`` given, as a new user first runs it: does its default train?

    python bench/training/defaults_sweep.py                          # both apps, every method
    python bench/training/defaults_sweep.py --apps resnet --methods d2,powersgd

ResNet: ``apps/train_resnet.py --algorithm A --epochs 6 --max-steps 120`` (the embedded digits, ResNet-20,
batch 32 per rank, seed 0) on 2 ranks; the bar is that of the done criterion: within 10 points of
``allreduce_sgd``'s test accuracy, at least 60 % for the local-update and sign methods. BERT:
``apps/train_bert.py --algorithm A --eval-every 30`` (its whole default run: the tiny preset, the embedded pydoc
corpus, 2 epochs) on 2 ranks; the
bar is a final validation MLM loss below ln 4000 = 8.29, a uniform guess over the preset's 4,000-token
vocabulary, which the untrained model scores about (no divergence; NaN fails it). Nothing else is
set: the learning rate, momentum and every option are the apps' defaults, so the table is what a new user
gets. A finished run of the same command is reused (``--fresh`` reruns it); a run that ends with an error
(a diverged one exits 3) is recorded as such. Writes ``docs/results/defaults.{json,md}``; the runs go to
``bench/results/runs/defaults/``. Run it niced, inside a loopback namespace (it enters one when root).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.apprun import _command, finished, read_complete  # noqa: E402
from bench.common import REPO, RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402
from mpicomm.algorithms import ALGORITHMS  # noqa: E402
from mpicomm.algorithms.registry import default_lr, lr_family  # noqa: E402
from mpicomm.training.options import app_lr  # noqa: E402

RANKS = 2
APPS = {"resnet": ("train_resnet.py", ["--epochs", "6", "--max-steps", "120"]),
        "bert": ("train_bert.py", ["--eval-every", "30"])}
LOCAL_OR_SIGN = {"pdsgdm", "cpdsgdm", "diloco", "sparseloco", "streaming_diloco", "decentralized_diloco",
                 "signsgd", "ef_signsgd"}
"""The methods whose bar is 60 % rather than 10 points of AllReduce-SGD (local updates, sign compression)."""
UNIFORM_GUESS = math.log(4000)
"""BERT's bar: the MLM loss of a uniform guess over the tiny preset's vocabulary."""
FIRST = ["allreduce_sgd", "allreduce_adam", "apmsqueeze", "zeroone_adam", "moniqua_d2", "d2", "powersgd",
         "ef_signsgd", "compressed_sgd"]
"""Run first: the baseline, then the methods whose defaults were in question."""


def run_one(app: str, method: str, fresh: bool) -> dict:
    """Run (or reuse) ``method`` with only ``--algorithm`` in ``app``; its outcome as a dict."""
    script, extra = APPS[app]
    args = ["--algorithm", method, *extra]
    run_dir = os.path.join(RUNS, "defaults", app, method)
    done = None if fresh else finished(method, script, RANKS, args, run_dir)
    if done is not None:
        records, code, wall = done.records, 0, None
        print(f"  reuse  {app:<6} {method}", flush=True)
    else:
        os.makedirs(run_dir, exist_ok=True)
        command = _command(script, RANKS, [*args, "--overwrite"], run_dir, None)
        t0 = time.perf_counter()
        proc = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=3600)
        code, wall = proc.returncode, time.perf_counter() - t0
        metrics = os.path.join(run_dir, "metrics.jsonl")
        records = read_complete(metrics) if os.path.exists(metrics) else []
        if code == 0:
            with open(os.path.join(run_dir, "command.json"), "w") as f:
                json.dump(_command(script, RANKS, args, run_dir, None), f)
        print(f"  ran    {app:<6} {method:<22} exit {code} {wall:6.1f} s", flush=True)
        if code not in (0, 3):
            print(proc.stderr[-2000:], flush=True)
    evals = [r for r in records if r.get("event") == "eval"]
    start = next((r for r in records if r.get("event") == "start"), {})
    out = {"exit": code, "lr": start.get("config", {}).get("lr"), "momentum": start.get("config", {}).get("momentum"),
           "steps": evals[-1]["step"] if evals else 0, "wall_s": wall}
    if app == "resnet":
        out["test_accuracy"] = evals[-1]["test_accuracy"] if evals else None
        out["test_loss"] = evals[-1]["test_loss"] if evals else None
    else:
        out["first_val_mlm_loss"] = evals[0]["val_mlm_loss"] if evals else None
        out["val_mlm_loss"] = evals[-1]["val_mlm_loss"] if evals else None
        out["val_mlm_accuracy"] = evals[-1]["val_mlm_accuracy"] if evals else None
    return out


def verdict(app: str, method: str, result: dict, baseline: float | None) -> str:
    """``ok`` or why the run misses the bar of the done criterion."""
    if result["exit"] != 0:
        return f"exit {result['exit']}"
    if app == "bert":
        loss = result["val_mlm_loss"]
        return "ok" if loss is not None and loss < UNIFORM_GUESS else "diverged"
    accuracy = result["test_accuracy"]
    if method in LOCAL_OR_SIGN:
        return "ok" if accuracy >= 0.60 else "below 60 %"
    if baseline is None:
        return "no baseline"
    return "ok" if accuracy >= baseline - 0.10 else "more than 10 points below allreduce_sgd"


def table(app: str, results: dict) -> str:
    """The markdown table of one app's results."""
    base = results.get("allreduce_sgd", {}).get("test_accuracy")
    rows = []
    for method, r in results.items():
        family = lr_family(method) or "own"
        if app == "resnet":
            acc = "–" if r["test_accuracy"] is None else f"{100 * r['test_accuracy']:.1f} %"
            rows.append([f"`{method}`", family, f"{r['lr']:g}", f"{r['momentum']:g}", acc,
                         "–" if r["test_loss"] is None else f"{r['test_loss']:.3g}", verdict(app, method, r, base)])
        else:
            loss = "–" if r["val_mlm_loss"] is None else f"{r['val_mlm_loss']:.3g}"
            first = "–" if r["first_val_mlm_loss"] is None else f"{r['first_val_mlm_loss']:.3g}"
            rows.append([f"`{method}`", family, f"{r['lr']:g}", first, loss, verdict(app, method, r, base)])
    header = (["method", "lr family", "lr", "momentum", "test accuracy", "test loss", "verdict"] if app == "resnet"
              else ["method", "lr family", "lr", "first val MLM loss", "final val MLM loss", "verdict"])
    return markdown_table(header, rows)


def _stored(path: str) -> dict:
    """The outcomes recorded so far, by app and method: the runs' store, else (a fresh checkout, whose runs are not
    kept) the published table's, so that a sweep of a few ``--methods`` keeps the other rows."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        published = os.path.join(REPO, "docs", "results", "defaults.json")
        if not os.path.exists(published):
            return {}
        with open(published) as f:
            return json.load(f).get("results", {})
    with open(path) as f:
        return json.load(f)


def main() -> None:
    """Parse, run every chosen (app, method), write the tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apps", default="resnet,bert", help="comma list of resnet, bert")
    p.add_argument("--methods", default="", help="comma list (default: every registered method)")
    p.add_argument("--fresh", action="store_true", help="rerun finished runs")
    args = p.parse_args()
    methods = args.methods.split(",") if args.methods else [*FIRST, *sorted(set(ALGORITHMS) - set(FIRST))]
    unknown = sorted(set(methods) - set(ALGORITHMS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}")
    enter_loopback_namespace()
    path = os.path.join(RUNS, "defaults", "results.json")
    for app in args.apps.split(","):
        for method in methods:
            outcome = run_one(app, method, args.fresh)
            results = _stored(path)  # read again: another sweep may have added runs meanwhile
            results.setdefault(app, {})[method] = outcome
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
    results = _stored(path)
    order = [*FIRST, *sorted(set(ALGORITHMS) - set(FIRST))]
    results = {app: {m: results[app][m] for m in order if m in results[app]} for app in results}
    parts = []
    for app in ("resnet", "bert"):
        if app in results:
            command = f"apps/{APPS[app][0]} --algorithm A {' '.join(APPS[app][1])}, {RANKS} ranks"
            parts.append(f"### {app}: `{command}`\n\n{table(app, results[app])}")
    defaults = {m: {"library": default_lr(m), "apps": app_lr(m)} for m in ALGORITHMS}
    intro = ("Bars: ResNet within 10 points of `allreduce_sgd`, at least 60 % for the local-update and sign methods; "
             "BERT a final validation MLM loss below ln 4000 = 8.29 (a uniform guess). `lr` and `momentum` are "
             "what the run used (the start record's config). `compressed_sgd`'s default codec is `identity`: it "
             "compresses nothing in these runs. The 1-bit family freezes its variance (and starts compressing) once "
             "it has settled, between 20 % and 50 % of each run (`variance_frozen_at` in its metrics.jsonl).")
    write_table("defaults", "Every method with only --algorithm given (the apps' defaults)",
                "\n\n".join([intro, *parts]),
                {"ranks": RANKS, "commands": {a: APPS[a] for a in results}, "default_lr": defaults,
                 "results": results})


if __name__ == "__main__":
    main()
