"""The seeds' claims where users run them: full MNIST, 8 to 32 ranks, 1,500 steps, 2 seeds (mean ± half-spread).

    python bench/training/scale.py [--parts decentralized,large,noniid,scaling,centralized,local,network]
                          [--seeds 0,1] [--steps 1500] [--methods "D-PSGD,Moniqua default"] [--fresh] [--report]

Every case is a real ``mpiexec`` job of ``apps/train_resnet.py --dataset mnist`` (60,000 training images,
evaluated on the first 2,000 test images every 250 steps and at the end; ResNet-8, the 6n+2 family's
smallest: ResNet-20 takes 2.5x its compute, too much for these 8-32-rank runs on 2 cores), batch 8 per
rank, lr 0.1 cosine, momentum 0.9 (D²: 0, its update has none), the ranks oversubscribed on this
machine's cores (time per step is therefore not a cluster's: the ``network`` part models that). Parts:

* ``decentralized``: D-PSGD, Moniqua (the default and the paper's 1-bit form), CHOCO and DCD (4-bit QSGD)
  and D² at 8 ranks on a ring, D-PSGD and Moniqua's default on the exponential graph; IID shards;
* ``large``: D-PSGD and Moniqua's default at 16 ranks, ring and exponential;
* ``noniid``: D-PSGD and Moniqua's default at 8 ranks on a ring, Dirichlet(0.1) shards;
* ``scaling``: CPD-SGDM (4-bit QSGD, period 4) at 4, 8, 16 and 32 ranks with the learning rate scaled
  linearly with the ranks (0.1 at 4; 100 warm-up steps): steps to 97 % against the ranks (linear
  speed-up: steps x ranks constant);
* ``centralized``: HSQ (d=16) against AllReduce-SGD, APMSqueeze against AllReduce-Adam (lr 0.002) at 8 ranks;
* ``local``: the local-update methods at 8 ranks, H = 10 inner steps of the app's SGD (momentum 0.9) between
  syncs, each with its defaults otherwise (DiLoCo's outer Nesterov 0.7/0.9 on an fp32 allreduce, Streaming
  DiLoCo's 4 fragments at 4 bits, SparseLoCo's 2 % top-k at 2 bits, decentralized DiLoCo's ring gossip),
  against ``centralized``'s AllReduce-SGD;
* ``hierarchical``: the seeds' centralized and decentralized methods and their baselines (D-PSGD, Moniqua's
  default, AllReduce-SGD, HSQ, AllReduce-Adam, APMSqueeze) at 8 ranks as 4 emulated nodes of 2
  (``MPICOMM_RANKS_PER_NODE=2 --hierarchical on``: an exact average inside the node, the method between the
  nodes), against the same methods flat from ``decentralized``/``centralized``;
* ``network``: time to 97 % on 16 single-core nodes under ``--net gbit`` and ``--net slow`` for every
  method of ``large``/``decentralized``/``centralized``: the steps to 97 % from the 16-rank (or 8-rank)
  runs, times each method's per-step compute (measured on 2 ranks, one per core) plus its per-step
  modelled communication at 16 ranks (measured over 30 steps under each setting); and, for every method of
  ``hierarchical``, time to 97 % flat against two-level on 4 nodes of 2 GPUs joined by NVLink inside and
  10 Gbit/s or 1 Gbit/s Ethernet between them (``--net intra=nvlink,inter=10gbit,5us`` / ``inter=1gbit,100us``):
  each layout's steps to 97 % at 8 ranks, times the same compute plus its own modelled communication (8 ranks
  as 4 x 2, 30 steps).

A finished case is reused unless ``--fresh``: its runs under bench/results/runs/scale/, or else its row in the
committed docs/results/scale.json (same steps and seeds), so the protocol can be run a few cases at a time on
different days. Writes docs/results/scale.{md,json}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import SETTINGS, AppRun, bench_parser, finished, launch  # noqa: E402
from bench.common import RESULTS, RUNS, enter_loopback_namespace, write_table  # noqa: E402

TARGET = 0.97
BASE = ["--dataset", "mnist", "--model", "resnet8", "--batch-size", "8", "--lr", "0.1", "--momentum", "0.9",
        "--eval-limit", "2000", "--eval-every", "250", "--log-every", "50"]
QSGD4 = ["--codec", "qsgd", "--codec-options", "bits=4"]
METHODS = {
    "D-PSGD": ["--algorithm", "dpsgd"],
    "Moniqua default": ["--algorithm", "moniqua"],
    "Moniqua adaptive theta": ["--algorithm", "moniqua", "--theta", "adaptive"],
    "Moniqua paper 1-bit": ["--algorithm", "moniqua", "--bits", "1", "--parts", "1", "--theta-per", "model",
                            "--rounding", "nearest", "--theta", "adaptive"],
    "CHOCO qsgd 4-bit": ["--algorithm", "choco", *QSGD4, "--gamma", "0.6"],
    "DCD qsgd 4-bit": ["--algorithm", "dcd", *QSGD4],
    "D2": ["--algorithm", "d2", "--momentum", "0"],
    "PD-SGDM p=4": ["--algorithm", "pdsgdm", "--period", "4"],
    "CPD-SGDM qsgd 4-bit p=4": ["--algorithm", "cpdsgdm", *QSGD4, "--period", "4", "--gamma", "0.6"],
    "AllReduce-SGD": ["--algorithm", "allreduce_sgd", "--topology", "complete"],
    "HSQ d=16": ["--algorithm", "hsq", "--d", "16", "--topology", "complete"],
    "QSGD 4-bit": ["--algorithm", "qsgd", "--bits", "4", "--topology", "complete"],
    "TernGrad": ["--algorithm", "terngrad", "--topology", "complete"],
    "AllReduce-Adam": ["--algorithm", "allreduce_adam", "--topology", "complete", "--lr", "0.002", "--momentum", "0"],
    "APMSqueeze": ["--algorithm", "apmsqueeze", "--topology", "complete", "--lr", "0.002", "--momentum", "0"],
    "DiLoCo H=10": ["--algorithm", "diloco", "--period", "10", "--topology", "complete"],
    "Streaming DiLoCo H=10": ["--algorithm", "streaming_diloco", "--period", "10", "--topology", "complete"],
    "SparseLoCo H=10": ["--algorithm", "sparseloco", "--period", "10", "--topology", "complete"],
    "Decentralized DiLoCo H=10": ["--algorithm", "decentralized_diloco", "--period", "10"],
}
DECENTRALIZED = ["D-PSGD", "Moniqua default", "Moniqua adaptive theta", "Moniqua paper 1-bit", "CHOCO qsgd 4-bit",
                 "DCD qsgd 4-bit", "D2"]
HIERARCHICAL = ["D-PSGD", "Moniqua default", "AllReduce-SGD", "HSQ d=16", "AllReduce-Adam", "APMSqueeze"]
RANKS_PER_NODE = 2
NODES = {"MPICOMM_RANKS_PER_NODE": str(RANKS_PER_NODE)}  # the job environment of 4 emulated nodes of 2 at 8 ranks
PART_ENV = {"hierarchical": NODES}
PARTS = {  # part -> [(ranks, topology, extra arguments, methods)]
    "decentralized": [(8, "ring", [], DECENTRALIZED), (8, "exponential", [], ["D-PSGD", "Moniqua default"])],
    "large": [(16, topology, [], ["D-PSGD", "Moniqua default"]) for topology in ("ring", "exponential")],
    "noniid": [(8, "ring", ["--dirichlet-alpha", "0.1"], ["D-PSGD", "Moniqua default"])],
    "scaling": [(n, "ring", ["--lr", f"{0.1 * n / 4:g}", "--lr-warmup-steps", "100"], ["CPD-SGDM qsgd 4-bit p=4"])
                for n in (4, 8, 16, 32)],
    "centralized": [(8, "ring", [], ["AllReduce-SGD", "HSQ d=16", "AllReduce-Adam", "APMSqueeze"])],
    "local": [(8, "ring", [], ["DiLoCo H=10", "Streaming DiLoCo H=10", "SparseLoCo H=10",
                               "Decentralized DiLoCo H=10"])],
    "hierarchical": [(8, "ring", ["--hierarchical", "on"], HIERARCHICAL)],
}


def _run(part: str, ranks: int, topology: str, extra: list[str], method: str, seed: int, steps: int,
         fresh: bool, report: bool) -> AppRun | None:
    """One case's run: launched (or reused), or with ``report`` only the finished one (None if there is none)."""
    args = [*BASE, "--max-steps", str(steps), "--epochs", "1000", "--topology", topology, *METHODS[method],
            *extra, "--seed", str(seed)]
    label = f"{method} {ranks}x {topology} seed {seed}"
    run_dir = os.path.join(RUNS, "scale", part, f"{ranks}-{topology}", method.replace(" ", "_"), f"seed{seed}")
    if report:
        return finished(label, "train_resnet.py", ranks, args, run_dir)
    return launch(label, "train_resnet.py", ranks, args, run_dir, fresh=fresh, timeout=7200, env=PART_ENV.get(part))


def steps_to(run: AppRun, target: float) -> int | None:
    """The first evaluated step at which the averaged model reaches ``target`` test accuracy (None: never)."""
    return next((step for _, acc, step in run.evals("test_accuracy") if acc >= target), None)


def _summary(runs: list[AppRun]) -> dict:
    accs = [r.end["test_accuracy"] for r in runs]
    reached = [steps_to(r, TARGET) for r in runs]
    return {"accuracy_per_seed": accs, "mean": statistics.fmean(accs), "half_spread": (max(accs) - min(accs)) / 2,
            "consensus_distance": statistics.fmean(r.end.get("consensus_distance") or 0.0 for r in runs),
            "mb_sent_rank0": runs[0].end["bytes_sent"] / 1e6, "bits_per_parameter": runs[0].bits_per_parameter(),
            "steps_to_target": reached,
            "mean_steps_to_target": statistics.fmean(reached) if all(reached) else None,
            "commands": [" ".join(r.command) for r in runs]}


PROBE = [*BASE, "--max-steps", "30", "--epochs", "1000", "--eval-every", "100000", "--log-every", "10",
         "--eval-limit", "100"]  # a short job whose per-step compute or modelled communication is read


def _compute_per_step(method: str, fresh: bool) -> float:
    """Seconds of compute per step of ``method`` on 2 ranks, one per core (steps 11-30 of a 30-step job)."""
    run = launch(f"{method} compute", "train_resnet.py", 2, [*PROBE, *METHODS[method]],
                 os.path.join(RUNS, "scale", "network", method.replace(" ", "_"), "compute"), fresh=fresh)
    return run.per_step(first=10)["compute_s"]


NETWORK = [("large", 16, "ring", "D-PSGD"), ("large", 16, "ring", "Moniqua default"),
           ("decentralized", 8, "ring", "Moniqua paper 1-bit"), ("decentralized", 8, "ring", "CHOCO qsgd 4-bit"),
           ("decentralized", 8, "ring", "DCD qsgd 4-bit"), ("decentralized", 8, "ring", "D2"),
           ("scaling", 16, "ring", "CPD-SGDM qsgd 4-bit p=4"),
           ("centralized", 8, "ring", "AllReduce-SGD"), ("centralized", 8, "ring", "HSQ d=16")]


def _network(table: dict, fresh: bool) -> list[dict]:
    """Time to target on 16 single-core nodes: steps to target x (compute on 2 ranks, one per core, + modelled
    communication at 16 ranks) per step, for each method of :data:`NETWORK` whose runs exist and reached it."""
    out = []
    for key in NETWORK:
        row = table.get(key)
        if row is None or row["mean_steps_to_target"] is None:
            continue
        method = key[3]
        base = os.path.join(RUNS, "scale", "network", method.replace(" ", "_"))
        compute = _compute_per_step(method, fresh)
        entry = {"method": method, "steps_to_target_at": key[1], "steps_to_target": row["mean_steps_to_target"],
                 "compute_s_per_step": compute}
        for setting in ("gbit", "slow"):
            run = launch(f"{method} {setting}", "train_resnet.py", 16,
                         [*PROBE, "--topology", "ring", *METHODS[method], "--net", SETTINGS[setting]],
                         os.path.join(base, setting), fresh=fresh)
            comm = run.per_step(first=10)["comm_s"]
            entry[f"comm_s_per_step_{setting}"] = comm
            entry[f"time_to_target_s_{setting}"] = row["mean_steps_to_target"] * (compute + comm)
        out.append(entry)
    return out


TWO_NETWORKS = {"10gbit": "intra=nvlink,inter=10gbit,5us", "1gbit": "intra=nvlink,inter=1gbit,100us"}
LAYOUTS = {"flat": ("off", ("decentralized", "centralized")), "two-level": ("on", ("hierarchical",))}


def _two_networks(table: dict, fresh: bool) -> list[dict]:
    """Time to target on 4 nodes of 2, flat against two-level, for each method of :data:`HIERARCHICAL` whose
    runs reached it in both layouts: steps to target x (compute + that layout's modelled communication)."""
    out = []
    for method in HIERARCHICAL:
        rows = {layout: next((table[(part, 8, "ring", method)] for part in parts if (part, 8, "ring", method) in table),
                             None) for layout, (_, parts) in LAYOUTS.items()}
        if any(r is None or r["mean_steps_to_target"] is None for r in rows.values()):
            continue
        entry = {"method": method, "compute_s_per_step": _compute_per_step(method, fresh)}
        for layout, (hierarchical, _) in LAYOUTS.items():
            entry[f"steps_to_target_{layout}"] = steps = rows[layout]["mean_steps_to_target"]
            for network, spec in TWO_NETWORKS.items():
                run = launch(f"{method} {layout} {network}", "train_resnet.py", 8,
                             [*PROBE, "--topology", "ring", *METHODS[method], "--net", spec,
                              "--hierarchical", hierarchical],
                             os.path.join(RUNS, "scale", "two_networks", method.replace(" ", "_"),
                                          f"{layout}-{network}"), fresh=fresh, env=NODES)
                comm = run.per_step(first=10)["comm_s"]
                entry[f"comm_s_per_step_{layout}_{network}"] = comm
                entry[f"inter_kb_per_step_{layout}"] = run.traffic_per_step("bytes_sent_inter", 10, 30) / 1e3
                entry[f"time_to_target_s_{layout}_{network}"] = steps * (entry["compute_s_per_step"] + comm)
        out.append(entry)
    return out


def _two_networks_markdown(rows: list[dict]) -> list[str]:
    lines = ["", f"Time to {100 * TARGET:.0f} % on 4 nodes of 2 GPUs, flat against two-level (steps to target at 8 "
             "ranks x (compute + modelled communication) per step; "
             + ", ".join(f"{n} = `--net {spec}`" for n, spec in TWO_NETWORKS.items()) + "):", "",
             "| method | steps to target, flat / two-level | compute s/step | inter-node kB/step, flat / two-level | "
             "comm ms/step 10gbit, flat / two-level | comm ms/step 1gbit, flat / two-level | "
             "time to target 10gbit (s), flat / two-level | time to target 1gbit (s), flat / two-level |",
             "|---|---|---|---|---|---|---|---|"]
    for e in rows:
        def pair(key: str, scale: float = 1.0, digits: int = 1, e=e) -> str:
            return " / ".join(f"{scale * e[key.format(layout)]:.{digits}f}" for layout in LAYOUTS)
        lines.append(f"| {e['method']} | {pair('steps_to_target_{}', digits=0)} | {e['compute_s_per_step']:.4f} | "
                     f"{pair('inter_kb_per_step_{}')} | {pair('comm_s_per_step_{}_10gbit', 1e3, 2)} | "
                     f"{pair('comm_s_per_step_{}_1gbit', 1e3, 2)} | {pair('time_to_target_s_{}_10gbit')} | "
                     f"{pair('time_to_target_s_{}_1gbit')} |")
    return lines


def _markdown(table: dict, network: list[dict], two_networks: list[dict]) -> str:
    lines = ["| part | ranks | topology | method | test acc % (per seed) | mean ± half-spread | vs D-PSGD (points) | "
             f"consensus distance | MB sent by rank 0 | bits/param/step | steps to {100 * TARGET:.0f} % |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (part, ranks, topology, method), row in table.items():
        base = table.get((part, ranks, topology, "D-PSGD"))
        delta = f"{100 * (row['mean'] - base['mean']):+.2f}" if base else "–"
        reached = " / ".join(str(s) if s else "never" for s in row["steps_to_target"])
        lines.append(f"| {part} | {ranks} | {topology} | {method} | "
                     f"{' / '.join(f'{100 * a:.2f}' for a in row['accuracy_per_seed'])} | "
                     f"{100 * row['mean']:.2f} ± {100 * row['half_spread']:.2f} | {delta} | "
                     f"{row['consensus_distance']:.3g} | {row['mb_sent_rank0']:.1f} | "
                     f"{row['bits_per_parameter']:.2f} | {reached} |")
    if network:
        lines += ["", f"Time to {100 * TARGET:.0f} % on 16 single-core nodes (steps to target x (compute + modelled "
                  "communication) per step):", "",
                  "| method | steps to target | compute s/step | comm s/step gbit | comm s/step slow | "
                  "time to target gbit (s) | time to target slow (s) |", "|---|---|---|---|---|---|---|"]
        for e in sorted(network, key=lambda e: e["time_to_target_s_slow"]):
            lines.append(f"| {e['method']} | {e['steps_to_target']:.0f} ({e['steps_to_target_at']} ranks) | "
                         f"{e['compute_s_per_step']:.4f} | {e['comm_s_per_step_gbit']:.4f} | "
                         f"{e['comm_s_per_step_slow']:.4f} | {e['time_to_target_s_gbit']:.1f} | "
                         f"{e['time_to_target_s_slow']:.1f} |")
    if two_networks:
        lines += _two_networks_markdown(two_networks)
    return "\n".join(lines)


def _committed(steps: int, seeds: str) -> dict:
    """The committed docs/results/scale.json if it was measured with these steps and seeds, else {}."""
    path = os.path.join(RESULTS, "scale.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        previous = json.load(f)
    return previous if previous.get("steps") == steps and previous.get("seeds") == seeds else {}


def _by_case(committed: dict) -> dict:
    """The committed rows by case ``(part, ranks, topology, method)``."""
    return {(r["part"], r["ranks"], r["topology"], r["method"]): {k: v for k, v in r.items()
                                                                  if k not in ("part", "ranks", "topology", "method")}
            for r in committed.get("rows", [])}


def main() -> None:
    """Run the chosen parts, then write the table and JSON."""
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join([*PARTS, "network"]),
                        help="the parts to launch; the table covers every part, the others from their finished "
                             "runs or committed rows")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--methods", default=None,
                        help="comma-separated method names: launch only these (the rest as with --report)")
    parser.add_argument("--report", action="store_true",
                        help="launch nothing: write the tables from the cases whose every seed has finished")
    args = parser.parse_args()
    enter_loopback_namespace()
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = args.parts.split(",")
    reported_network = {} if args.fresh else _committed(args.steps, args.seeds)
    reported = _by_case(reported_network)
    launched = None if args.methods is None else set(args.methods.split(","))
    table, missing = {}, []
    for part in PARTS:
        for ranks, topology, extra, methods in PARTS[part]:
            for method in methods:
                if (part, ranks, topology, method) in reported:
                    table[(part, ranks, topology, method)] = reported[(part, ranks, topology, method)]
                    continue
                report = args.report or part not in chosen or (launched is not None and method not in launched)
                runs = [_run(part, ranks, topology, extra, method, seed, args.steps, args.fresh, report)
                        for seed in seeds]
                if all(runs):
                    table[(part, ranks, topology, method)] = _summary(runs)
                else:
                    missing.append(f"{part}: {method}, {ranks} ranks, {topology}")
    launch_network = "network" in chosen and not args.report
    network = _network(table, args.fresh) if launch_network else reported_network.get("network", [])
    two_networks = _two_networks(table, args.fresh) if launch_network else reported_network.get("two_networks", [])
    title = (f"Full MNIST, ResNet-8, batch 8 per rank, {args.steps} steps, seeds {args.seeds}; accuracy of the "
             "averaged model on 2,000 test images")
    rows = [{"part": k[0], "ranks": k[1], "topology": k[2], "method": k[3], **v} for k, v in table.items()]
    payload = {"target": TARGET, "steps": args.steps, "seeds": args.seeds, "rows": rows, "network": network,
               "two_networks": two_networks, "not_run": missing}
    not_run = "\n\nNot run yet (every seed needed): " + "; ".join(missing) + "." if missing else ""
    write_table("scale", title, _markdown(table, network, two_networks) + not_run, payload)


if __name__ == "__main__":
    main()
