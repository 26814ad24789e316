"""A rank lost mid-run: SIGKILL one rank's process, continue the last checkpoint at one rank fewer.

    python bench/wallclock/lost_rank.py [--methods dpsgd,allreduce_sgd] [--ranks 4] [--steps 132]
        [--save-every 20] [--kill-at 55] [--seed 0] [--model resnet20] [--smaller] [--fresh] [--out lost_rank]

Per method, real ``mpiexec`` jobs of ``apps/train_resnet.py`` (``--model``, ResNet-20 by default; embedded
digits data, 32 images per rank per step, lr 0.1 cosine over ``--steps`` steps, momentum 0.9, ring, an
evaluation of the averaged model every 22 steps and at the end, a metrics line every step):

1. uninterrupted: ``mpiexec -n N`` for ``--steps`` steps;
2. killed: the same with ``--save-every K``; once rank 0's metrics show step ``--kill-at``, the benchmark sends
   SIGKILL to rank N-1's python process (found by its ``PMI_RANK``) and lets ``mpiexec`` end the job;
3. resumed: ``mpiexec -n N-1 ... --resume latest`` in the same output directory, to the end (``--max-steps``
   keeps the run's length and its cosine schedule; docs/training.md, "Another world size").

Steps lost: the last step the killed job logged less the step of the checkpoint the resumed job continued
(its ``resume`` record), i.e. steps trained twice. Seconds lost: rank 0's wall seconds of those steps in the
killed job (evaluations left out; the save of the checkpoint itself falls in the first of them), and the resumed
job's start-up (launch to its first step). Final accuracy of the averaged model against the uninterrupted
N-rank run (``--smaller`` adds an uninterrupted N-1-rank run).

Writes docs/results/NAME.{md,json} (default NAME: lost_rank); runs under bench/results/runs/lost_rank/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import launch, read_complete  # noqa: E402
from bench.common import REPO, RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402

BASE = ["--batch-size", "32", "--lr", "0.1", "--momentum", "0.9", "--topology", "ring",
        "--log-every", "1", "--eval-every", "22", "--epochs", "100"]
METHODS = {"dpsgd": "D-PSGD", "allreduce_sgd": "AllReduce-SGD", "moniqua": "Moniqua", "diloco": "DiLoCo",
           "cpdsgdm": "CPD-SGDM"}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rank_pid(job: int, rank: int) -> int | None:
    """The pid of ``rank``'s python process in the ``mpiexec`` job ``job``."""
    for pid in descendants(job):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if env.get(b"PMI_RANK") == str(rank).encode() and b"train_resnet.py" in cmdline:
            return pid
    return None


def seconds_of_steps(records: list[dict], first: int, last: int) -> float:
    """Rank 0's wall seconds of steps ``first+1 .. last`` (a train record every step), evaluations left out:
    each step's train record less the record before it (the previous step's, or the evaluation after it)."""
    total, previous = 0.0, None
    for r in records:
        if r["event"] in ("train", "eval") and "wall_s" in r:
            if r["event"] == "train" and first < r["step"] <= last and previous is not None:
                total += r["wall_s"] - previous
            previous = r["wall_s"]
    return total


def command(ranks: int, args: list[str], run_dir: str) -> list[str]:
    """The job's command line."""
    return ["mpiexec", "-n", str(ranks), sys.executable, os.path.join("apps", "train_resnet.py"), *args,
            "--out-dir", run_dir, "--no-progress"]


def killed_and_resumed(ranks: int, args: list[str], save_every: int, kill_at: int, run_dir: str) -> dict:
    """Run, SIGKILL rank N-1 at step ``kill_at``, resume at N-1 ranks; what was lost and where it ended."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    first = command(ranks, [*args, "--save-every", str(save_every)], run_dir)
    job = subprocess.Popen(first, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    victim, seen, deadline = None, 0, time.monotonic() + 900
    while job.poll() is None and time.monotonic() < deadline:
        if os.path.exists(metrics):
            steps = [r["step"] for r in read_complete(metrics) if r["event"] == "train"]
            seen = max(steps, default=0)
            if seen >= kill_at:
                victim = rank_pid(job.pid, ranks - 1)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    break
        time.sleep(0.02)
    killed_at = time.monotonic()
    try:
        out, _ = job.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # the job's own process group (start_new_session)
        out, _ = job.communicate()
    ended_s = time.monotonic() - killed_at
    if victim is None:
        raise RuntimeError(f"the job ended (exit {job.returncode}) before step {kill_at}:\n{out[-3000:]}")
    before = read_complete(metrics)
    last_step = max(r["step"] for r in before if r["event"] == "train")
    checkpoints = [r["step"] for r in before if r["event"] == "checkpoint"]

    second = command(ranks - 1, [*args, "--resume", "latest"], run_dir)
    t0 = time.monotonic()
    resumed = subprocess.Popen(second, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    first_step_s = None
    while resumed.poll() is None:
        records = read_complete(metrics)[len(before):]
        if first_step_s is None and any(r["event"] == "train" for r in records):
            first_step_s = time.monotonic() - t0
        time.sleep(0.05)
    resumed_out = resumed.communicate()[0]
    resume_s = time.monotonic() - t0
    if resumed.returncode != 0:
        raise RuntimeError(f"{' '.join(second)} exited {resumed.returncode}:\n{resumed_out[-3000:]}")
    after = read_complete(metrics)[len(before):]
    resume = next(r for r in after if r["event"] == "resume")
    resize = next((r for r in after if r["event"] == "resize"), None)
    end = after[-1]
    from_step = resume["step"]
    return {"commands": [first, second], "kill_at": kill_at, "killed_rank": ranks - 1,
            "killed_job_exit": job.returncode, "killed_job_end_s": ended_s, "killed_job_tail": out[-1500:],
            "last_step_before_kill": last_step, "checkpoints_before_kill": checkpoints,
            "resumed_from_step": from_step, "steps_lost": last_step - from_step,
            "training_s_lost": seconds_of_steps(before, from_step, last_step),
            "resumed_job_first_step_s": first_step_s, "resumed_job_s": resume_s, "resize": resize,
            "final_step": end["step"], "final_test_accuracy": end["test_accuracy"],
            "evals_after_resume": [(r["step"], r["test_accuracy"]) for r in after if r["event"] == "eval"]}


def main() -> None:
    """Run every method's three jobs, then write the table and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="dpsgd,allreduce_sgd", help="comma list of " + ", ".join(METHODS))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--model", default="resnet20", help="resnet8, resnet20, ...")
    parser.add_argument("--steps", type=int, default=132)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--kill-at", type=int, default=55)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smaller", action="store_true", help="also an uninterrupted run at N-1 ranks")
    parser.add_argument("--fresh", action="store_true", help="rerun cases that already finished")
    parser.add_argument("--out", default="lost_rank", help="output name under docs/results/")
    args = parser.parse_args()
    enter_loopback_namespace()
    n = args.ranks
    rows, payload = [], []
    for method in args.methods.split(","):
        label = METHODS.get(method, method)
        common = [*BASE, "--model", args.model, "--algorithm", method, "--max-steps", str(args.steps),
                  "--seed", str(args.seed)]
        where = os.path.join(RUNS, "lost_rank", f"{method}_{args.model}_r{n}_s{args.steps}_seed{args.seed}")
        full = launch(f"{label} {n} ranks", "train_resnet.py", n, common, os.path.join(where, "uninterrupted"),
                      fresh=args.fresh)
        smaller = None
        if args.smaller:
            smaller = launch(f"{label} {n - 1} ranks", "train_resnet.py", n - 1, common,
                             os.path.join(where, "uninterrupted_smaller"), fresh=args.fresh)
        stamp = os.path.join(where, "killed.json")
        lost = None
        if not args.fresh and os.path.exists(stamp):
            with open(stamp) as f:
                lost = json.load(f)
            if lost.get("kill_at") != args.kill_at or lost.get("save_every") != args.save_every:
                lost = None
        if lost is None:
            t0 = time.perf_counter()
            lost = killed_and_resumed(n, common, args.save_every, args.kill_at, os.path.join(where, "killed"))
            lost["save_every"] = args.save_every
            with open(stamp, "w") as f:
                json.dump(lost, f, indent=1)
            print(f"  ran    {label} killed + resumed     {time.perf_counter() - t0:6.1f} s", flush=True)
        else:
            print(f"  reuse  {label} killed + resumed", flush=True)
        killed_records = read_complete(os.path.join(where, "killed", "metrics.jsonl"))
        before = killed_records[:next(i for i, r in enumerate(killed_records) if r["event"] == "resume")]
        lost["training_s_lost"] = seconds_of_steps(before, lost["resumed_from_step"], lost["last_step_before_kill"])
        acc_full = full.end["test_accuracy"]
        rows.append([label, f"{n} -> {n - 1}", args.save_every, lost["last_step_before_kill"],
                     lost["resumed_from_step"], lost["steps_lost"], f"{lost['training_s_lost']:.1f}",
                     f"{lost['resumed_job_first_step_s']:.1f}" if lost["resumed_job_first_step_s"] else "-",
                     f"{100 * lost['final_test_accuracy']:.1f}", f"{100 * acc_full:.1f}",
                     f"{100 * (lost['final_test_accuracy'] - acc_full):+.1f}",
                     f"{100 * smaller.end['test_accuracy']:.1f}" if smaller else "-"])
        payload.append({"method": method, "label": label, "ranks": n, "steps": args.steps,
                        "uninterrupted": {"command": full.command, "final_test_accuracy": acc_full,
                                          "train_s": full.end["train_s"], "wall_s": full.end["wall_s"],
                                          "evals": full.evals("test_accuracy")},
                        "uninterrupted_smaller": ({"command": smaller.command,
                                                   "final_test_accuracy": smaller.end["test_accuracy"]}
                                                  if smaller else None),
                        "killed_and_resumed": lost})
    header = ["method", "ranks", "save every", "last step before the kill", "resumed from step", "steps lost",
              "wall s of the lost steps (evaluations left out)", "resumed job: launch to first step (s)",
              "final acc % (killed, resumed)", f"final acc % ({n} ranks, uninterrupted)", "difference (points)",
              f"final acc % ({n - 1} ranks, uninterrupted)"]
    title = (f"A lost rank: {args.model} on digits, {n} ranks (2 cores), ring, {args.steps} steps, "
             f"seed {args.seed}; "
             f"rank {n - 1} SIGKILLed at step {args.kill_at}, resumed at {n - 1} ranks from the last checkpoint")
    notes = "\n".join([
        "Notes", "",
        f"* The kill is real: SIGKILL to rank {n - 1}'s python process once rank 0's metrics show step "
        f"{args.kill_at}; mpiexec then ends the job (exit status in the JSON). The resumed job is "
        f"`mpiexec -n {n - 1} ... --resume latest` in the same directory: the checkpoint of {n} ranks continues "
        "at one rank fewer (a `resize` record; decentralized methods restart from the replicas' average, "
        "AllReduce-SGD carries its model and optimizer exactly), at the same --max-steps and cosine schedule.",
        f"* After the resize every step takes {n - 1} x 32 images instead of {n} x 32, so the finished run has "
        "seen fewer samples than the uninterrupted one; the accuracy difference is one seed, one run each, "
        "and the evaluations are on the 359 test digits (one image is 0.28 points).",
        "* Setting: the embedded digits on the 2-core machine (not a cluster, not full MNIST); wall seconds "
        "are rank 0's while other work shared the cores, so they are indicative only.",
    ])
    write_table(args.out, title, markdown_table(header, rows) + "\n\n" + notes,
                {"ranks": n, "steps": args.steps, "save_every": args.save_every, "kill_at": args.kill_at,
                 "seed": args.seed, "rows": payload})


if __name__ == "__main__":
    main()
