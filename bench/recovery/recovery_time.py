"""Seconds from a rank's SIGKILL to the survivors' next completed step, against model size, ranks and method.

    unshare -n bash -c 'ip link set lo up && nice python bench/recovery/recovery_time.py'

Each case launches a job under the fault-tolerant stack (``scripts/ft_run.sh``, ``--on-rank-loss continue``,
``--log-every 1``), waits for the ``train`` event of step ``--kill-after`` in its ``metrics.jsonl`` (read every
~1 ms), and SIGKILLs the last rank's process (pid from ``/proc/*/environ``'s ``OMPI_COMM_WORLD_RANK``), taking
the time just before the signal. Reported per case:

* ``kill_to_step_s``: from the kill to the first ``train`` event, written after the ``rank_lost`` event, of a
  step past the one the survivors continued from — the whole cost of the loss as a user sees it (detection, the
  survivors' revoke/shrink/gather/rebuild, and the interrupted step trained again);
* ``recover_s``: what the survivors report in ``rank_lost`` (from their first error to the rebuilt run);
* ``steps_redone``: the interrupted step plus any step logged before the kill that the survivors did not keep;
* ``step_s``: the median whole step before the kill (commit and log line included), for scale.

Models: ``resnet20`` (``apps/train_resnet.py``, 0.27 M parameters) and ``mlp:P`` (``bench/recovery/mlp_app.py``,
about P million parameters), both on the embedded digits, batch 32 per rank. A case whose estimated memory
exceeds ``--mem-gib`` is skipped and listed. Then ``--overhead-models`` are run without a kill, once with
``--on-rank-loss stop`` and once with ``continue``: the ratio of their median step times is the per-step cost of
being able to continue (one agreement and one copy of the state per step).
Raw results: ``bench/results/recovery_time.json``; a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftjob import RESULTS, Job, load_average, median, save_json, step_times  # noqa: E402
from mlp_app import mlp_params  # noqa: E402

RESNET20_PARAMS = 272_474
CENTRALIZED = {"allreduce_sgd"}


def model_args(model: str) -> tuple[str, list[str], int]:
    """(script, its model options, parameters) of ``resnet20`` or ``mlp:P``."""
    if model == "resnet20":
        return "apps/train_resnet.py", ["--model", "resnet20", "--no-augment"], RESNET20_PARAMS
    if model.startswith("mlp:"):
        return "bench/recovery/mlp_app.py", ["--params-m", model[4:]], mlp_params(float(model[4:]))
    raise SystemExit(f"--models: expected resnet20 or mlp:P (millions), got {model!r}")


def memory_gib(params: int, ranks: int, algorithm: str) -> float:
    """A rough peak for the job: per rank the parameters, gradients, optimizer state, the committed copy and the
    exchange buffers; for a decentralized method also the survivors' states that every survivor gathers."""
    per = params * 4 / 2**30
    if algorithm in CENTRALIZED:
        return ranks * per * 6
    survivors = ranks - 1
    return ranks * per * 8 + survivors * survivors * per * 4


def run_case(args, model: str, ranks: int, algorithm: str, tag: str, kill: bool, on_loss: str = "continue") -> dict:
    """One job; with ``kill``, the last rank is killed after step ``--kill-after``."""
    script, extra, params = model_args(model)
    out = args.work / tag.replace(":", "")
    shutil.rmtree(out, ignore_errors=True)
    steps = args.steps if kill else args.overhead_steps
    job = Job(ranks, script, [*extra, "--algorithm", algorithm, "--on-rank-loss", on_loss, "--log-every", "1",
                              "--epochs", "100000", "--max-steps", str(steps), "--eval-every", "100000",
                              "--seed", str(args.seed)], out)
    row = {"model": model, "params": params, "ranks": ranks, "algorithm": algorithm, "on_rank_loss": on_loss,
           "load_before": load_average()}
    try:
        if kill:
            job.wait_for(lambda e: e.get("event") == "train" and e["step"] >= args.kill_after, "the kill step")
            job.poll()
            seen = max(e["step"] for e in job.of("train"))
            t_kill = job.kill(ranks - 1)
            lost = job.wait_for(lambda e: e.get("event") == "rank_lost", "a rank_lost event")
            after = job.events.index(lost)
            nxt = job.wait_for(lambda e: e.get("event") == "train" and e["step"] > lost["step"]
                               and job.events.index(e) > after, "the next step")
            row.update(step_at_kill=seen, continued_from=lost["step"], recover_s=lost["recover_s"],
                       rule=lost["rule"], kill_to_event_s=lost["seen"] - t_kill, kill_to_step_s=nxt["seen"] - t_kill,
                       steps_redone=max(0, seen - lost["step"]) + 1, new_size=lost["new_size"])
        code = job.finish()
    except Exception as exc:  # noqa: BLE001 - a failed case is reported, the others still run
        job.finish(timeout=5)
        row.update(error=str(exc)[:800])
        code = job.proc.returncode
    end = job.of("end")
    times = step_times([e for e in job.events if not kill or e.get("step", 0) <= args.kill_after])
    row.update(exit=code, finished=bool(end) and end[0]["step"] == end[0]["total_steps"], step_s=median(times),
               step_times=times, wall_s=time.monotonic() - job.started, log_tail=job.tail(400) if code else "")
    shutil.rmtree(out, ignore_errors=True)
    print(f"# {tag}: {({k: v for k, v in row.items() if k not in ('step_times', 'log_tail')})}", flush=True)
    return row


def main() -> int:
    """Run every case, write the JSON, print the tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet20,mlp:1,mlp:10,mlp:30,mlp:100")
    p.add_argument("--ranks", default="4,8")
    p.add_argument("--algorithms", default="allreduce_sgd,dpsgd")
    p.add_argument("--kill-after", type=int, default=4, help="kill once this step is logged")
    p.add_argument("--steps", type=int, default=9, help="the run's --max-steps")
    p.add_argument("--mem-gib", type=float, default=14.0, help="skip cases estimated above this (the machine: 24 GiB)")
    p.add_argument("--overhead-models", default="mlp:10", help="stop vs continue, no kill, at 4 ranks")
    p.add_argument("--overhead-steps", type=int, default=14)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=RESULTS / "recovery_runs")
    p.add_argument("--out", default="recovery_time.json")
    args = p.parse_args()
    rows, overhead, skipped = [], [], []
    for model in filter(None, args.overhead_models.split(",")):
        for algorithm in args.algorithms.split(","):
            pair = {on: run_case(args, model, 4, algorithm, f"overhead-{model}-{algorithm}-{on}", False, on)
                    for on in ("stop", "continue")}
            overhead.append({"model": model, "algorithm": algorithm, "stop_step_s": pair["stop"]["step_s"],
                             "continue_step_s": pair["continue"]["step_s"],
                             "ratio": pair["continue"]["step_s"] / pair["stop"]["step_s"], "runs": pair})
    for model in filter(None, args.models.split(",")):
        params = model_args(model)[2]
        for ranks in map(int, args.ranks.split(",")):
            for algorithm in args.algorithms.split(","):
                need = memory_gib(params, ranks, algorithm)
                if need > args.mem_gib:
                    skipped.append({"model": model, "ranks": ranks, "algorithm": algorithm, "est_gib": round(need, 1)})
                    print(f"# skipped {model} {ranks} {algorithm}: ~{need:.1f} GiB estimated", flush=True)
                    continue
                rows.append(run_case(args, model, ranks, algorithm, f"{model}-{ranks}-{algorithm}", True))
    path = save_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "cases": rows,
                                "overhead": overhead, "skipped": skipped, "load_after": load_average()})
    print(f"\nraw results: {path}\n")
    print("| model | params | ranks | method | kill → next step (s) | recover_s (s) | steps redone | step (s) | exit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.2f} M | {r['ranks']} | {r['algorithm']} | "
              f"{r.get('kill_to_step_s', float('nan')):.2f} | {r.get('recover_s', float('nan')):.2f} | "
              f"{r.get('steps_redone', '-')} | {r['step_s']:.2f} | {r['exit']}{' ERROR' if 'error' in r else ''} |")
    if skipped:
        print("\nskipped (memory): " + ", ".join(f"{s['model']}@{s['ranks']} {s['algorithm']} (~{s['est_gib']} GiB)"
                                                 for s in skipped))
    if overhead:
        print("\n| model | method | step, stop (s) | step, continue (s) | continue / stop |")
        print("|---|---|---|---|---|")
        for o in overhead:
            print(f"| {o['model']} | {o['algorithm']} | {o['stop_step_s']:.3f} | {o['continue_step_s']:.3f} | "
                  f"{o['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
