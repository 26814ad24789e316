"""How much of an overlapped exchange each progress mechanism hides, over really shaped TCP.

    python bench/wallclock/progress_overlap.py [--ranks 4] [--bandwidth 100mbit] [--steps 12] [--rounds 2]
                                               [--algorithms dpsgd,moniqua,moniqua_32bit,choco,allreduce_sgd]
                                               [--mechanisms none,mpich,thread] [--name progress_overlap]

Each case is a real job of ``apps/train_resnet.py --model resnet20`` (digits, batch 32 per rank) launched under
``scripts/netshape.sh mpirun --net BANDWIDTH,0us``: every rank in its own network namespace, MPI over TCP on a
veth link shaped to BANDWIDTH each way (root, ip and tc; no added latency), and no modelled ``--net``, so the
time a rank spends blocked in communication is the real transfer's. ``MPICOMM_PROGRESS`` selects the mechanism
that moves a pending message while the rank computes (:mod:`mpicomm.comm.progress`): ``none``, ``mpich``
(MPICH's asynchronous progress thread), ``thread`` (mpicomm's progress thread, for every non-blocking call) or
``gossip`` (the default: the same thread for the neighbour exchanges only, i.e. ``thread`` for the gossip
methods and ``none`` for allreduce_sgd; not run by default).

Per algorithm (dpsgd; moniqua with its defaults, 4-bit codes of a quarter of the coordinates, and with
``--bits 32 --parts 1``, which sends D-PSGD's full message; choco with ``--order cta``; allreduce_sgd with its
default buckets) and round, interleaved: the blocking run (``--no-overlap``) under ``none`` and under ``mpich``
(MPICH's thread runs for the whole job and takes a core even in a blocking run; mpicomm's thread runs only
while a non-blocking call is pending, so a blocking run under ``thread`` or ``gossip`` is the one under
``none``), and the overlapped run (``--overlap``) under each mechanism. Hidden fraction = 1 - (time blocked in
communication per step, overlapped) / (the same, blocking, same round and the blocking run of the same MPICH
setting), from ``comm_s_per_step`` of each job's ``metrics.jsonl`` (without a modelled network, all the time
blocked in communication calls), mean over steps 3..``--steps``. Reported: medians over rounds, with the
per-round values.

Beside the apps, each round runs the exchange probe (``bench/wallclock/progress_exchange.py``, same launcher)
under each mechanism: a ring exchange of ResNet-20's parameters (1.1 MB) and of 4 MiB, posted
non-blocking, then 1.5 x its blocking time of computing outside MPI, then the wait; its hidden fraction is the
transport's alone, free of what the apps' blocked time also holds (waiting for a neighbour that is behind).

Finished app runs are reused (``--fresh`` reruns them); the probe always runs.

Measured (docs/results/progress_overlap.md, ``--rounds 2``, 100 Mbit/s): mpicomm's thread hides 1.00 of D-PSGD's,
CHOCO's and 32-bit Moniqua's exchange and of the probe's (none: 0.86, 0.64, 0.74; the probe's 4.2 MB 0.38);
MPICH's thread 0.88-0.96 but spins, slowing compute on shared cores; Moniqua's default 34 KB message is not what
blocks it (a blocking allreduce for theta is); AllReduce-SGD's buckets leave little to hide (0.26-0.41).

Writes docs/results/NAME.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import launch  # noqa: E402
from bench.common import REPO, RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402

NETSHAPE = os.path.join(REPO, "scripts", "netshape.sh")
ALGORITHMS = {  # a row's name: the app's --algorithm and options
    "dpsgd": ("dpsgd", []), "moniqua": ("moniqua", []), "moniqua_32bit": ("moniqua", ["--bits", "32", "--parts", "1"]),
    "choco": ("choco", ["--order", "cta"]), "allreduce_sgd": ("allreduce_sgd", ["--momentum", "0.9"])}
MECHANISMS = ("none", "mpich", "gossip", "thread")
DEFAULT_MECHANISMS = "none,mpich,thread"
FIRST_COUNTED = 2  # steps 1-2 hold start-up; the means run over steps 3 .. --steps
TARGET = 0.8
PROBE = os.path.join(REPO, "bench", "wallclock", "progress_exchange.py")
PROBE_SIZES = (272474, 2**20)  # float32: ResNet-20's parameters (1.1 MB) and 4 MiB


def blocking_of(mechanism: str) -> str:
    """The mechanism whose blocking run a mechanism's overlapped run is compared with."""
    return "mpich" if mechanism == "mpich" else "none"  # mpicomm's thread serves no blocking call


def launcher(args) -> list[str]:
    """``nice scripts/netshape.sh mpirun --ranks N --net BANDWIDTH,0us --``."""
    return ["nice", NETSHAPE, "mpirun", "--ranks", str(args.ranks), "--net", f"{args.bandwidth},0us", "--"]


def run_probe(args, mechanism: str, numel: int) -> dict:
    """The exchange probe under ``mechanism``: its JSON line."""
    command = [*launcher(args), sys.executable, PROBE, "--numel", str(numel)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPICOMM_PROGRESS": mechanism}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"probe {mechanism}: exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  probe  {mechanism:<7} {numel:>8} floats: hidden {out['hidden_fraction']:.2f}", flush=True)
    return out


def run_case(args, algorithm: str, mechanism: str, overlap: bool, round_: int) -> dict:
    """One job; its per-step split (seconds) and command."""
    label = f"{algorithm} {'overlap' if overlap else 'blocking'} {mechanism} #{round_}"
    run_dir = os.path.join(RUNS, args.name, f"{args.ranks}ranks_{args.bandwidth}",
                           f"{algorithm}-{'overlap' if overlap else 'blocking'}-{mechanism}-{round_}")
    options = ["--model", "resnet20", "--batch-size", "32", "--max-steps", str(args.steps), "--log-every", "1",
               "--eval-limit", "32", "--algorithm", ALGORITHMS[algorithm][0], *ALGORITHMS[algorithm][1],
               "--overlap" if overlap else "--no-overlap"]
    env = {"MPICOMM_PROGRESS": mechanism}
    run = launch(label, "train_resnet.py", args.ranks, options, run_dir, fresh=args.fresh, launcher=launcher(args),
                 env=env)
    split = run.per_step(first=FIRST_COUNTED)
    return {**split, "command": f"MPICOMM_PROGRESS={mechanism} " + " ".join(map(shlex.quote, run.command))}


def summarise(results: dict, algorithms: list[str], mechanisms: list[str]) -> tuple[list, dict]:
    """Table rows and JSON payload: per (algorithm, mechanism) the hidden fraction per round and its median."""
    rows, payload = [], {}
    for algorithm in algorithms:
        for mechanism in mechanisms:
            blocking = results[algorithm, "blocking", blocking_of(mechanism)]
            overlapped = results[algorithm, "overlap", mechanism]
            hidden = [1 - o["comm_s"] / b["comm_s"] for o, b in zip(overlapped, blocking)]
            b_comm = [1e3 * r["comm_s"] for r in blocking]
            o_comm = [1e3 * r["comm_s"] for r in overlapped]
            b_step = [1e3 * r["step_s"] for r in blocking]
            o_step = [1e3 * r["step_s"] for r in overlapped]
            h = statistics.median(hidden)
            rows.append([algorithm, mechanism, f"{statistics.median(b_comm):.0f}", f"{statistics.median(o_comm):.0f}",
                         f"{h:.2f}", " / ".join(f"{x:.2f}" for x in hidden), f"{statistics.median(b_step):.0f}",
                         f"{statistics.median(o_step):.0f}"])
            payload.setdefault(algorithm, {})[mechanism] = {
                "hidden_fraction": hidden, "hidden_fraction_median": h, "blocking": blocking, "overlap": overlapped}
    return rows, payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help=", ".join(ALGORITHMS))
    parser.add_argument("--mechanisms", default=DEFAULT_MECHANISMS, help=", ".join(MECHANISMS))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--bandwidth", default="100mbit", help="each rank link's shaped bandwidth, e.g. 100mbit")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="progress_overlap", help="results go to docs/results/NAME.{md,json}")
    parser.add_argument("--fresh", action="store_true", help="rerun app cases that already finished")
    args = parser.parse_args()
    algorithms, mechanisms = args.algorithms.split(","), args.mechanisms.split(",")
    if set(algorithms) - set(ALGORITHMS):
        parser.error(f"--algorithms: unknown {sorted(set(algorithms) - set(ALGORITHMS))}; choose from "
                     f"{', '.join(ALGORITHMS)}")
    if set(mechanisms) - set(MECHANISMS):
        parser.error(f"--mechanisms: unknown {sorted(set(mechanisms) - set(MECHANISMS))}; choose from "
                     f"{', '.join(MECHANISMS)}")
    if args.steps <= FIRST_COUNTED + 1:
        parser.error(f"--steps: expected more than {FIRST_COUNTED + 1}")
    enter_loopback_namespace()
    blocking = sorted({blocking_of(m) for m in mechanisms})
    results: dict = {}
    probes: dict = {}
    for round_ in range(args.rounds):
        for mechanism in mechanisms:
            for numel in PROBE_SIZES:
                probes.setdefault(f"{mechanism} {numel}", []).append(run_probe(args, mechanism, numel))
        for algorithm in algorithms:
            cases = [(False, m) for m in blocking] + [(True, m) for m in mechanisms]
            for overlap, mechanism in cases:
                key = (algorithm, "overlap" if overlap else "blocking", mechanism)
                results.setdefault(key, []).append(run_case(args, algorithm, mechanism, overlap, round_))
    rows, payload = summarise(results, algorithms, mechanisms)
    probe_rows = []
    for mechanism in mechanisms:
        for numel in PROBE_SIZES:
            runs = probes[f"{mechanism} {numel}"]
            hidden = [r["hidden_fraction"] for r in runs]
            probe_rows.append([mechanism, f"{4 * numel / 1e6:.1f}",
                               f"{1e3 * statistics.median(r['blocking_s'] for r in runs):.0f}",
                               f"{1e3 * statistics.median(r['wait_s'] for r in runs):.0f}",
                               f"{statistics.median(hidden):.2f}", " / ".join(f"{h:.2f}" for h in hidden)])
    probe_table = markdown_table(["progress", "MB to each neighbour", "blocking exchange ms", "wait after compute ms",
                                  "hidden fraction (median)", "per round"], probe_rows)
    table = markdown_table(["algorithm", "progress", "blocked in comm ms/step, blocking",
                            "blocked in comm ms/step, overlap", "hidden fraction (median)", "hidden per round",
                            "step ms, blocking", "step ms, overlap"], rows)
    command = "python bench/wallclock/progress_overlap.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    notes = (f"Medians over {args.rounds} interleaved rounds of each job's mean over steps {FIRST_COUNTED + 1}.."
             f"{args.steps}. Hidden fraction = 1 - overlapped / blocking time blocked in communication per step, "
             f"paired by round; the blocking run of `thread` is the one of `none` (its thread runs only while a "
             f"non-blocking call is pending). Target: >= {TARGET} for dpsgd and moniqua.\n\nCommand: `{command}`")
    title = (f"Hidden fraction of overlapped exchanges by progress mechanism, {args.ranks} ranks, ResNet-20 on "
             f"digits, batch 32 per rank, MPI over TCP shaped to {args.bandwidth} per rank link (scripts/netshape.sh)")
    probe_note = ("Exchange probe (`bench/wallclock/progress_exchange.py`): ring exchange posted non-blocking, "
                  "1.5 x its blocking time of computing outside MPI, then the wait; the slowest rank's median.")
    write_table(args.name, title, "\n\n".join([table, notes, probe_table, probe_note]),
                {"command": command, "results": payload, "probe": probes})


if __name__ == "__main__":
    main()
