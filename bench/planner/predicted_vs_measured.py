"""The planner's predicted step against the measured one, on real transports only, for every candidate.

    python bench/planner/predicted_vs_measured.py [--cases 4:loopback,4:1gbit,...,8:10mbit] [--steps 10]
        [--candidates all] [--fresh] [--out planner_vs_measured]

A setting is a real transport: ``loopback`` (every rank in one loopback-only network namespace, MPICH's own
intra-node path, no ``--net``) or a bandwidth such as ``100mbit`` (scripts/netshape.sh: every rank in its own
network namespace, its link shaped to that bandwidth both ways with tc, MPI over TCP; no latency is added:
this kernel has no sch_netem). Nothing is modelled: no ``--net`` is passed to the app.

Per (ranks, setting), first ``mpicomm plan --calibrate`` measures the transport (latency, allreduce, allgather
and neighbour-exchange times, the hidden fraction of an overlapped exchange) under the same launcher, saved as
``calibration.json`` beside the runs; the planner prices every call with that calibration's cost model. Then
each candidate of ``mpicomm plan`` (mpicomm/plan/candidates.py) is one real ``mpiexec -n RANKS`` job of
``apps/train_resnet.py``: ResNet-20 on the embedded digits, 32 images per rank per step, ring, the candidate's
algorithm and options, ``--overlap`` where the planner credits overlap, a metrics line every step.

Per row, over steps 5 .. ``--steps`` (the first four hold start-up and APMSqueeze's fp32 warm-up; a candidate that
exchanges every ``p`` steps runs on to the end of a whole number of periods), rank-averaged:

* measured compute: the step less the time blocked in communication calls (``compute_s_per_step``: forward,
  backward, the optimizer and the codecs' encoding and decoding); measured step: ``step_s_per_step``;
* predicted step: :func:`mpicomm.plan.model.predict` told this run's compute less the codec work it predicts
  (the codecs are inside the measured compute), so predicted step = compute + predicted exposed communication;
* overhead: predicted step - compute against measured step - measured compute (the time blocked in
  communication), and its error |predicted - measured| / measured;
* step error of the planner, and of the null model "step = measured compute", each |x - measured| / measured.

Per setting: the median overhead error (target: at most 25 %), both median step errors, and the choice: ``auto``'s
rule (:func:`mpicomm.plan.model.auto_choice`) on predictions with one compute time for every candidate (the median
of the runs' compute less codec work), against the fastest measured candidate within the accuracy tolerance
(target: within 1.10x), each measured at one compute (the runs' median) plus its own measured overhead, since
the runs' compute follows the shared machine's load (see ``verdict``). Where those candidates span less than
1.2x (slowest / fastest) the setting cannot discriminate and the choice target does not apply.

Writes docs/results/NAME.{md,json} after every setting; runs under bench/results/runs/planner_real/.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import launch  # noqa: E402
from bench.common import REPO, RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402
from mpicomm.net import parse_net  # noqa: E402
from mpicomm.net.calibration import Calibration  # noqa: E402
from mpicomm.plan.accuracy import NOISE_POINTS  # noqa: E402
from mpicomm.plan.candidates import CANDIDATES, Candidate  # noqa: E402
from mpicomm.plan.codec_cost import codec_costs  # noqa: E402
from mpicomm.plan.model import Job, auto_choice, predict, ring_degree  # noqa: E402
from mpicomm.plan.shapes import layers_for_model  # noqa: E402

NETSHAPE = os.path.join(REPO, "scripts", "netshape.sh")
SETTINGS = ("loopback", "1gbit", "100mbit", "10mbit")
RUN_ROOT = os.path.join(RUNS, "planner_real")
BASE = ["--model", "resnet20", "--batch-size", "32", "--topology", "ring", "--log-every", "1", "--epochs", "100",
        "--eval-limit", "64", "--eval-bn-batches", "1"]
FIRST_COUNTED = 4  # steps 1-4 hold start-up and APMSqueeze's warm-up; the means run over steps 5 .. --steps
ADAM_LR = ["--lr", "0.001"]  # an Adam-type candidate's step size (the step's time does not depend on it)
OVERLAP_COMPUTE_S = 0.5
"""Compute seconds per step the overlap decision (``--overlap`` or not) is made with, before any run: about the
least compute measured here (ResNet-20, 4 ranks on 2 cores: 0.4-0.8 s; more at 8 ranks). Which candidates the
calibrated planner overlaps is the same for every compute from 0.5 s up (below it, fewer)."""
OVERHEAD_TARGET, CHOICE_TARGET, DISCRIMINATES = 0.25, 1.10, 1.2


def shown(command: list[str]) -> str:
    """``command`` as a shell line, with ``python`` for this interpreter and paths relative to the repository."""
    return shlex.join("python" if part == sys.executable else part.replace(REPO + os.sep, "") for part in command)


def launcher(setting: str, ranks: int) -> list[str] | None:
    """The launcher of a setting: ``mpiexec -n RANKS`` (None) on loopback, scripts/netshape.sh otherwise."""
    if setting == "loopback":
        return None
    return [NETSHAPE, "mpirun", "--ranks", str(ranks), "--net", f"{setting},0us", "--"]


def parse_case(item: str) -> tuple[int, str]:
    """``RANKS:SETTING`` (a setting: ``loopback`` or a bandwidth) -> ``(ranks, setting)``; ``ValueError`` (one
    line) otherwise."""
    ranks, _, setting = item.partition(":")
    try:
        if ranks.isdigit() and int(ranks) >= 2 and (setting == "loopback" or parse_net(f"{setting},0us") is not None):
            return int(ranks), setting
    except ValueError:
        pass
    raise ValueError(f"--cases: expected RANKS:SETTING with RANKS >= 2 and SETTING loopback or a bandwidth such as "
                     f"100mbit, got {item!r}")


def order(setting: str) -> float:
    """Where a setting's table goes: loopback first, then the bandwidths from the fastest."""
    return -math.inf if setting == "loopback" else -parse_net(f"{setting},0us").bits_per_s


def calibration_program(label: str, path: str) -> list[str]:
    """The program that measures the transport called ``label`` into ``path``, to run under a launcher."""
    return [sys.executable, "-m", "mpicomm", "plan", "--calibrate", "--transport", label, "--out", path]


def calibrate(setting: str, ranks: int, run_dir: str, fresh: bool) -> tuple[Calibration, str]:
    """``mpicomm plan --calibrate`` of this transport, run under the setting's launcher (reused unless ``fresh``);
    the calibration and its command."""
    path = os.path.join(run_dir, "calibration.json")
    label = setting if setting == "loopback" else f"shaped-{setting}"
    command = [*(launcher(setting, ranks) or ["mpiexec", "-n", str(ranks)]), *calibration_program(label, path)]
    if fresh or not os.path.exists(path):
        os.makedirs(run_dir, exist_ok=True)
        proc = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"calibration {label} x{ranks}: exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        print(f"  calibrated {label} x{ranks}", flush=True)
    return Calibration.load(path), shown(command)


def job(layers, ranks: int, compute_s: float, costs: dict, cal: Calibration) -> Job:
    """The planner's job: these ranks on one node, priced with the transport's calibration."""
    return Job(layers, ranks, "measured", compute_s, ranks, 32, costs, calibration=cal)


def flags(cand: Candidate, overlap: bool) -> list[str]:
    """The app's command-line flags for ``cand`` (its options; ``--overlap`` where the prediction overlaps)."""
    out = ["--algorithm", cand.algorithm, *(ADAM_LR if cand.algorithm == "apmsqueeze" else [])]
    for key, value in cand.options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, dict):
            out += [flag, ",".join(f"{k}={v}" for k, v in value.items())]
        else:
            out += [flag, str(value)]
    return out + (["--overlap"] if overlap else [])


def measure_case(cand: Candidate, ranks: int, setting: str, steps: int, layers, costs, cal, fresh: bool) -> dict:
    """Run ``cand`` once on the real transport ``setting``; its measured and predicted figures (ms)."""
    overlap = predict(job(layers, ranks, OVERLAP_COMPUTE_S, costs, cal), cand).overlap_helps
    run_dir = os.path.join(RUN_ROOT, f"r{ranks}_{setting}", cand.key)
    period = cand.traffic(layers, ranks, ring_degree(ranks))[1]
    steps = FIRST_COUNTED + period * -(-(steps - FIRST_COUNTED) // period)  # whole periods counted
    run = launch(f"{cand.key} {setting} x{ranks}", "train_resnet.py", ranks,
                 [*BASE, *flags(cand, overlap), "--max-steps", str(steps)], run_dir, fresh=fresh,
                 launcher=launcher(setting, ranks))
    split = run.per_step(first=FIRST_COUNTED)
    compute, step = split["compute_s"], split["step_s"]
    work = predict(job(layers, ranks, compute, costs, cal), cand).work_s
    pred = predict(job(layers, ranks, max(compute - work, 1e-6), costs, cal), cand)
    pred_ovh, meas_ovh = pred.step_s - compute, step - compute
    return {"candidate": cand.key, "algorithm": cand.algorithm, "setting": cand.setting, "overlap": overlap,
            "steps": steps,
            "compute_ms": 1e3 * compute, "measured_ms": 1e3 * step, "predicted_ms": 1e3 * pred.step_s,
            "predicted_codec_ms": 1e3 * work, "predicted_overhead_ms": 1e3 * pred_ovh,
            "measured_overhead_ms": 1e3 * meas_ovh,
            "overhead_error": abs(pred_ovh - meas_ovh) / meas_ovh if meas_ovh > 0 else None,
            "planner_step_error": abs(pred.step_s - step) / step, "null_step_error": abs(compute - step) / step,
            "accuracy_points": pred.accuracy.points if pred.accuracy.measured else None,
            "command": shown(run.command)}


def verdict(rows: list[dict], ranks: int, layers, costs, cal, tolerance: float) -> dict:
    """The setting's medians, and the planner's choice against the fastest measured candidate.

    The choice is made as ``auto`` makes it, with one compute time for every candidate (the median of the runs'
    compute less their predicted codec work) and each candidate's predicted codec work and communication on top.
    The runs' compute follows the shared machine's load, which changes from run to run far more than the methods
    differ, so the candidates are compared as measured at one compute for all: the median of the runs' measured
    compute plus each one's own measured overhead (its step less its compute). The spread (slowest / fastest) is
    taken on the same figures; ``raw_choice_vs_fastest`` compares the runs' own measured steps.
    """
    base = statistics.median(r["compute_ms"] - r["predicted_codec_ms"] for r in rows) / 1e3
    by_key = {c.key: c for c in CANDIDATES}
    common = [predict(job(layers, ranks, base, costs, cal), by_key[r["candidate"]]) for r in rows]
    choice = auto_choice(common, tolerance)[0].candidate.key
    eligible = {r["candidate"]: r for r in rows
                if r["accuracy_points"] is not None and r["accuracy_points"] <= tolerance}
    median_compute = statistics.median(r["compute_ms"] for r in rows)
    at_one = {k: median_compute + r["measured_overhead_ms"] for k, r in eligible.items()}
    fastest, slowest = min(at_one, key=at_one.get), max(at_one, key=at_one.get)
    raw_fastest = min(r["measured_ms"] for r in eligible.values())
    spread = at_one[slowest] / at_one[fastest]
    ovh_errors = [r["overhead_error"] for r in rows if r["overhead_error"] is not None]
    return {"median_overhead_error": statistics.median(ovh_errors),
            "median_overhead_residual_ms": statistics.median(r["measured_overhead_ms"] - r["predicted_overhead_ms"]
                                                             for r in rows),
            "median_planner_step_error": statistics.median(r["planner_step_error"] for r in rows),
            "median_null_step_error": statistics.median(r["null_step_error"] for r in rows),
            "choice_compute_ms": 1e3 * base, "median_compute_ms": median_compute, "choice": choice,
            "fastest_measured": fastest, "slowest": slowest, "choice_ms": at_one[choice], "fastest_ms": at_one[fastest],
            "choice_vs_fastest": at_one[choice] / at_one[fastest],
            "raw_choice_vs_fastest": eligible[choice]["measured_ms"] / raw_fastest,
            "spread": spread, "discriminates": spread >= DISCRIMINATES}


def summary_line(ranks: int, setting: str, v: dict) -> str:
    """One setting's summary: medians, the choice and whether the setting can discriminate."""
    ovh = v["median_overhead_error"]
    line = (f"{ranks} ranks, {setting}: median overhead error {100 * ovh:.0f} %"
            + ("" if ovh <= OVERHEAD_TARGET else f" (target {100 * OVERHEAD_TARGET:.0f} %: missed)")
            + f", measured less predicted overhead {v['median_overhead_residual_ms']:+.1f} ms (median)"
            + f"; median step error {100 * v['median_planner_step_error']:.1f} % (planner) vs "
            f"{100 * v['median_null_step_error']:.1f} % (null model); choice {v['choice']} measured "
            f"{v['choice_vs_fastest']:.2f}x the fastest ({v['fastest_measured']}; "
            f"{v['choice_ms']:.0f} vs {v['fastest_ms']:.0f} ms at one compute of {v['median_compute_ms']:.0f} ms; "
            f"own steps {v['raw_choice_vs_fastest']:.2f}x); spread {v['spread']:.2f}x")
    if not v["discriminates"]:
        return line + f" (under {DISCRIMINATES}x: cannot discriminate)"
    return line + ("" if v["choice_vs_fastest"] <= CHOICE_TARGET else f" (target {CHOICE_TARGET}x: missed)")


def findings(rows: list[dict], ranks: int, layers, cal: Calibration) -> str:
    """What the setting's rows show about the misses: candidates whose messages are larger than the calibration's
    largest size (priced on its last slope), and the time blocked by candidates predicted to communicate almost
    nothing (waiting for the slowest rank, which a calibration timed after a barrier does not contain)."""
    largest = max(b for b, _ in cal.tables["allreduce"])
    by_key, degree = {c.key: c for c in CANDIDATES}, ring_degree(ranks)

    def biggest(key: str) -> int:  # the table's byte argument of the candidate's largest call
        ops, _ = by_key[key].traffic(layers, ranks, degree)
        return max(op.nbytes // ranks if op.kind == "alltoall" else op.nbytes for op in ops)
    beyond = [r["candidate"] for r in rows if biggest(r["candidate"]) > largest]
    quiet = [r["measured_overhead_ms"] for r in rows if r["predicted_overhead_ms"] < 1.0]
    parts = []
    if beyond:
        parts.append(f"{len(beyond)} of {len(rows)} candidates send messages larger than the calibration's largest "
                     f"size ({largest:,} bytes), priced on its last slope")
    if quiet:
        parts.append(f"the {len(quiet)} predicted to block under 1 ms a step measured "
                     f"{statistics.median(quiet):.1f} ms (median): waiting for the slowest rank, not transfer")
    return ("Reading: " + "; ".join(parts) + ".\n\n") if parts else ""


def section(ranks: int, setting: str, rows: list[dict], v: dict, cal_command: str, cal: Calibration,
            layers) -> str:
    """The markdown of one (ranks, setting): its summary, its calibration and its table, by predicted step."""
    header = ["candidate", "overlap", "compute ms", "measured step ms", "predicted step ms", "predicted codec ms",
              "predicted overhead ms", "measured overhead ms", "overhead error", "planner step error",
              "null model step error", ""]
    body = []
    for r in sorted(rows, key=lambda r: r["predicted_ms"]):
        err = r["overhead_error"]
        mark = ("choice" if r["candidate"] == v["choice"] else "") + (
            " fastest" if r["candidate"] == v["fastest_measured"] else "")
        body.append([r["candidate"], "yes" if r["overlap"] else "", f"{r['compute_ms']:.1f}",
                     f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}", f"{r['predicted_codec_ms']:.1f}",
                     f"{r['predicted_overhead_ms']:.1f}", f"{r['measured_overhead_ms']:.1f}",
                     "-" if err is None else f"{100 * err:.0f} %", f"{100 * r['planner_step_error']:.1f} %",
                     f"{100 * r['null_step_error']:.1f} %", mark.strip()])
    return (f"### {ranks} ranks, {setting}\n\n{summary_line(ranks, setting, v)}.\n\n"
            f"{findings(rows, ranks, layers, cal)}Calibration: `{cal_command}`, {cal.summary()}.\n\n"
            f"{markdown_table(header, body)}\n")


def main() -> None:
    """Calibrate and run every (ranks, setting, candidate), writing the table after each setting."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(f"{n}:{s}" for n in (4, 8) for s in SETTINGS),
                        help="comma list of RANKS:SETTING, run in this order; a setting is loopback or a bandwidth "
                             "(shaped by scripts/netshape.sh; root, ip, tc)")
    parser.add_argument("--steps", type=int, default=10)  # what the published table ran
    parser.add_argument("--candidates", default="all", help="comma list of candidate keys, or all")
    parser.add_argument("--tolerance", type=float, default=NOISE_POINTS, help="accuracy points for the choice")
    parser.add_argument("--fresh", action="store_true", help="calibrate and run again what already finished")
    parser.add_argument("--out", default="planner_vs_measured")
    args = parser.parse_args()
    command = "python bench/planner/predicted_vs_measured.py " + shlex.join(sys.argv[1:])
    if args.steps <= FIRST_COUNTED + 1:
        parser.error(f"--steps: expected more than {FIRST_COUNTED + 1} (steps 1-{FIRST_COUNTED} are not counted)")
    try:
        cases = [parse_case(item) for item in args.cases.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    enter_loopback_namespace()
    cands = [c for c in CANDIDATES if args.candidates == "all" or c.key in args.candidates.split(",")]
    layers, costs = layers_for_model("resnet20"), codec_costs()
    sections, payload = [], []
    for ranks, setting in cases:
        run_dir = os.path.join(RUN_ROOT, f"r{ranks}_{setting}")
        cal, cal_command = calibrate(setting, ranks, run_dir, args.fresh)
        rows = [measure_case(c, ranks, setting, args.steps, layers, costs, cal, args.fresh) for c in cands]
        v = verdict(rows, ranks, layers, costs, cal, args.tolerance)
        sections.append((ranks, setting, section(ranks, setting, rows, v, cal_command, cal, layers), v))
        payload.append({"ranks": ranks, "setting": setting, "calibration_command": cal_command,
                        "calibration_summary": cal.summary(),
                        "calibration": os.path.relpath(os.path.join(run_dir, "calibration.json"), REPO),
                        "verdict": v, "rows": rows})
        sections.sort(key=lambda item: (item[0], order(item[1])))
        payload.sort(key=lambda item: (item["ranks"], order(item["setting"])))
        write(args, command, sections, payload)


def write(args, command: str, sections: list, payload: list) -> None:
    """docs/results/NAME.{md,json}: the command, the per-setting summary, the notes, then each setting's table."""
    loads = os.getloadavg()
    summary = "\n".join(f"* {summary_line(n, s, v)}" for n, s, _, v in sections)
    verdicts = [v for _, _, _, v in sections]
    judged = [v for v in verdicts if v["discriminates"]]
    tally = (f"Median overhead error within {100 * OVERHEAD_TARGET:.0f} % on "
             f"{sum(v['median_overhead_error'] <= OVERHEAD_TARGET for v in verdicts)} of {len(verdicts)} settings; "
             f"the choice within {CHOICE_TARGET}x of the fastest measured on "
             f"{sum(v['choice_vs_fastest'] <= CHOICE_TARGET for v in judged)} of the {len(judged)} settings that can "
             f"discriminate; the planner's median step error below the null model's on "
             f"{sum(v['median_planner_step_error'] < v['median_null_step_error'] for v in verdicts)} of "
             f"{len(verdicts)}.")
    notes = (f"Steps {FIRST_COUNTED + 1}-{args.steps} of each run, rank-averaged (a candidate that exchanges every "
             f"p steps runs and counts whole periods: steps {FIRST_COUNTED + 1} to {FIRST_COUNTED} + a multiple of p "
             f"of at least {args.steps - FIRST_COUNTED}); accuracy tolerance "
             f"{args.tolerance} points. Transports: loopback = every rank in one loopback-only network namespace "
             "(MPICH's own intra-node path); a bandwidth = scripts/netshape.sh, every rank in its own namespace, "
             "its link shaped both ways with tbf, MPI over TCP. No latency is added to any setting: this kernel has "
             "no sch_netem. Machine: 2 cores shared with other work (ranks oversubscribed above 2; 1-minute load "
             f"average {loads[0]:.1f} at the end), so each row uses its own run's compute. Compute is the step less "
             "the time blocked in communication calls and includes the codecs' work, so each prediction is told that "
             "compute less its predicted codec work: overhead is the communication the step adds. The runs' compute "
             "follows the machine's load from run to run, so candidates are compared at one compute for all (the "
             "setting's median) plus each one's measured overhead; \"own steps\" compares the runs' own steps. That "
             "comparison leaves out what overlapping adds to compute (the progress of the pending exchange, with "
             "mpicomm's default MPICOMM_PROGRESS). Overlapped candidates (--overlap) are those the planner overlaps "
             f"at {OVERLAP_COMPUTE_S} s of compute.")
    text = (f"Command: `{command}`\n\nPer setting (target: median overhead error <= {100 * OVERHEAD_TARGET:.0f} %; "
            f"choice within {CHOICE_TARGET}x of the fastest measured where the spread is at least "
            f"{DISCRIMINATES}x):\n\n{summary}\n\n{tally}\n\n{notes}\n\n" + "\n".join(s for _, _, s, _ in sections))
    title = ("Planner vs measurement on real transports: ResNet-20 on digits, 32 images per rank, ring, "
             f"{len(payload[0]['rows'])} candidates")
    write_table(args.out, title, text, {"command": command, "steps": args.steps, "tolerance": args.tolerance,
                                        "settings": payload})


if __name__ == "__main__":
    main()
