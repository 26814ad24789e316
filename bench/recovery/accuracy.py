"""Final test accuracy after losing ranks mid-run: live recovery against an uninterrupted run and a requeue.

    unshare -n bash -c 'ip link set lo up && nice python bench/recovery/accuracy.py'

For each method (``--algorithms``), on ``bench/recovery/mlp_app.py``'s MLP (``--params-m``) over the embedded
digits, ``--steps`` steps, a checkpoint every ``--save-every`` steps, all under the fault-tolerant stack
(``scripts/ft_run.sh``):

* **uninterrupted**: ``--ranks`` ranks to the end, once per seed in ``--seeds`` (the spread is the noise);
* **continue**: the same run (first seed) with ``--on-rank-loss continue``; once step ``--kill-after`` is logged the
  last ``--lose`` ranks are SIGKILLed; the survivors finish the run in memory;
* **requeue**: the same kill with ``--on-rank-loss stop``; the job ends; then ``--resume latest`` at ``--ranks`` -
  ``--lose`` ranks. Reported: the steps lost (the last step logged before the kill minus the last checkpoint's),
  the seconds from the kill to the job's exit, and the restart's seconds from launch to its first step (no queue
  wait counted).

A run keeps its ``--steps`` at the smaller size (a length in steps: some methods, such as APMSqueeze, fix
their schedule from it and refuse a resume that changes it). Accuracy is the ``end`` event's
``test_accuracy`` (the digits' 359 test images). Raw results: ``bench/results/recovery_accuracy.json``; a
markdown table on stdout.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftjob import RESULTS, Job, load_average, save_json  # noqa: E402

SCRIPT = "bench/recovery/mlp_app.py"


def base_args(args, algorithm: str, seed: int, on_loss: str) -> list[str]:
    """The app's options every run of ``algorithm`` shares."""
    lr = ["--lr", args.lr_of[algorithm]] if algorithm in args.lr_of else []
    return ["--params-m", str(args.params_m), "--algorithm", algorithm, "--epochs", "100000", "--max-steps",
            str(args.steps), *lr, "--seed", str(seed), "--save-every", str(args.save_every), "--keep-last", "2",
            "--log-every", "1", "--on-rank-loss", on_loss, *args.extra.split()]


def final(job: Job) -> dict:
    """The end event's accuracy and step (nan / None when the run did not end)."""
    end = job.of("end")
    return {"accuracy": end[0].get("test_accuracy", float("nan")) if end else float("nan"),
            "final_step": end[0]["step"] if end else None, "exit": job.proc.returncode}


def kill_when_logged(args, job: Job) -> tuple[int, float]:
    """Wait for step ``--kill-after``; kill the last ``--lose`` ranks. (last step logged, monotonic kill time)."""
    job.wait_for(lambda e: e.get("event") == "train" and e["step"] >= args.kill_after, "the kill step")
    job.poll()
    seen = max(e["step"] for e in job.of("train"))
    return seen, job.kill(*range(args.ranks - 1, args.ranks - 1 - args.lose, -1))


def run_family(args, algorithm: str) -> dict:
    """Every run of one method; a failed run is recorded with its error and the others still run."""
    row: dict = {"algorithm": algorithm, "load_before": load_average()}
    survivors = args.ranks - args.lose

    def attempt(name: str, body):
        out = args.work / f"{algorithm}-{name}"
        shutil.rmtree(out, ignore_errors=True)
        try:
            row[name] = body(out)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row[name] = {"error": str(exc)[:800], "accuracy": float("nan")}
        print(f"# {algorithm} {name}: {row[name]}", flush=True)

    def uninterrupted(seed):
        def body(out):
            job = Job(args.ranks, SCRIPT, base_args(args, algorithm, seed, "stop"), out)
            job.finish()
            return final(job)
        return body

    def live(out):
        job = Job(args.ranks, SCRIPT, base_args(args, algorithm, args.seeds[0], "continue"), out)
        try:
            seen, t_kill = kill_when_logged(args, job)
            lost = job.wait_for(lambda e: e.get("event") == "rank_lost" and e["new_size"] == survivors,
                                "the rank_lost event at the survivors' size")
            after = job.events.index(lost)
            nxt = job.wait_for(lambda e: e.get("event") == "train" and e["step"] > lost["step"]
                               and job.events.index(e) > after, "the next step")
        finally:
            job.finish()
        losses = job.of("rank_lost")
        return {**final(job), "step_at_kill": seen, "continued_from": lost["step"],
                "recover_s": [e["recover_s"] for e in losses], "kill_to_step_s": nxt["seen"] - t_kill,
                "steps_redone": max(0, seen - lost["step"]) + 1}

    def requeue(out):
        job = Job(args.ranks, SCRIPT, base_args(args, algorithm, args.seeds[0], "stop"), out)
        try:
            seen, t_kill = kill_when_logged(args, job)
        finally:
            job.finish()
        t_exit = time.monotonic()
        saved = [e["step"] for e in job.of("checkpoint")]
        resumed = Job(survivors, SCRIPT, [*base_args(args, algorithm, args.seeds[0], "stop"), "--resume", "latest"],
                      out, log=f"{out}.resume.log")
        first = resumed.wait_for(lambda e: e.get("event") == "train", "the first step after the resume")
        resumed.finish()
        checkpoint = max(saved) if saved else 0
        return {**final(resumed), "stop_exit": job.proc.returncode, "step_at_kill": seen,
                "last_checkpoint": checkpoint, "steps_lost": seen - checkpoint, "kill_to_exit_s": t_exit - t_kill,
                "restart_to_first_step_s": first["seen"] - resumed.started}

    for seed in args.seeds:
        attempt(f"uninterrupted_seed{seed}", uninterrupted(seed))
    attempt("continue", live)
    attempt("requeue", requeue)
    for out in args.work.glob(f"{algorithm}-*"):
        if out.is_dir():  # the checkpoints; the logs stay
            shutil.rmtree(out, ignore_errors=True)
    return row


def main() -> int:
    """Run every method, write the JSON, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", default="allreduce_sgd,dpsgd,moniqua,apmsqueeze,diloco")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--lose", type=int, default=1, help="ranks killed at once")
    p.add_argument("--params-m", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=110, help="the run's --max-steps (10 epochs at 4 ranks)")
    p.add_argument("--lr-of", type=lambda s: dict(kv.split("=") for kv in s.split(",") if kv), default="moniqua=0.05",
                   help="METHOD=LR,...: a learning rate other than the method's default")
    p.add_argument("--kill-after", type=int, default=50, help="kill once this step is logged")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--extra", default="", help="more app options for every run, e.g. '--lr 0.05'")
    p.add_argument("--work", type=Path, default=RESULTS / "recovery_accuracy_runs")
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = [run_family(args, a) for a in args.algorithms.split(",")]
    name = args.out or f"recovery_accuracy_{args.ranks}r{args.lose}.json"
    path = save_json(name, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                            "load_after": load_average()})
    n = args.ranks - args.lose
    print(f"\nraw results: {path}\n")
    seeds = " | ".join(f"uninterrupted, seed {s}" for s in args.seeds)
    print(f"| method | {seeds} | continue ({args.ranks}→{n}) | requeue ({args.ranks}→{n}) | recover_s | "
          "kill → next step (s) | requeue: steps lost | requeue: kill → exit (s) | requeue: restart → first step (s) |")
    print("|---|" + "---|" * (len(args.seeds) + 7))
    for r in rows:
        c, q = r["continue"], r["requeue"]
        accs = " | ".join(f"{r[f'uninterrupted_seed{s}']['accuracy']:.3f}" for s in args.seeds)
        rec = ", ".join(f"{x:.2f}" for x in c.get("recover_s", [])) or "-"
        print(f"| {r['algorithm']} | {accs} | {c['accuracy']:.3f} | {q['accuracy']:.3f} | {rec} | "
              f"{c.get('kill_to_step_s', float('nan')):.2f} | {q.get('steps_lost', '-')} | "
              f"{q.get('kill_to_exit_s', float('nan')):.2f} | {q.get('restart_to_first_step_s', float('nan')):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
