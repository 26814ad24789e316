"""The two-level (node-aware) exchange against the flat one: bytes per link class and modelled communication.

    python bench/wallclock/hierarchy.py [--methods allreduce_sgd,qsgd,terngrad,signsgd] [--networks 10gbit,1gbit]
                                        [--steps 15] [--fresh]

A case already in the committed docs/results/hierarchy.json (same steps) is kept unless ``--fresh``, so new
methods can be added a few at a time.

8 ranks as 4 emulated nodes of 2 (``MPICOMM_RANKS_PER_NODE=2``), each case a real ``mpiexec`` job of
``apps/train_resnet.py`` (ResNet-20, the embedded digits, batch 16 per rank, ``--steps`` steps, one small
evaluation at the end) under a modelled network of two link classes (docs/network.md, "Two networks"):

* ``10gbit``: ``--net intra=nvlink,inter=10gbit,5us``;
* ``1gbit``: ``--net intra=nvlink,inter=1gbit,100us``.

Methods: ``allreduce_sgd`` (lr 0.1, momentum 0.9), ``qsgd`` (4 bits, bucket_size 512), ``terngrad`` (lr 0.1,
momentum 0.9), ``signsgd`` (majority vote, lr 0.001, momentum 0.9), ``dpsgd`` (ring, lr 0.1, momentum 0.9),
``d2`` (ring, lr 0.1), ``choco`` (ring, 4-bit QSGD, gamma 0.6, lr 0.1, momentum 0.9), ``allreduce_adam``
(lr 0.002), ``dcd`` (ring, 4-bit QSGD, lr 0.1, momentum 0.9), ``moniqua`` (ring, its defaults, lr 0.1,
momentum 0.9), ``hsq`` (d = 16), ``powersgd`` (rank 2, 3 warm-up steps), ``lamb``, ``apmsqueeze``,
``zeroone_adam`` and ``onebit_lamb`` (lr 0.002; 3 warm-up or freeze steps where they have them), ``moniqua_d2``
(ring, lr 0.1), ``pdsgdm`` and ``cpdsgdm`` (ring, period 4; 4-bit QSGD, gamma 0.6), ``powergossip`` (ring),
``diloco``, ``sparseloco`` and ``decentralized_diloco`` (5 inner steps a round) and ``streaming_diloco`` (8, its
4 fragments), each run twice with the same seed:

* ``flat``: ``--hierarchical off``, one collective over all 8 ranks, charged and booked at the ``inter`` link;
* ``two-level``: ``--hierarchical on``, reduce-scatter inside the node, the method's exchange of each local
  rank's shard between the 4 nodes (D-PSGD: one gossip round on the ring of 4 nodes), allgather inside the
  node.

Flat D-PSGD on the ring of 8 ranks sends the model to its two neighbours, both booked between nodes; on a real
cluster one of them shares the rank's node, so its real inter-node traffic is half what is booked, the same as
the two-level run's: the two-level gossip's gain is its mixing (the consensus over 4 nodes rather than 8
ranks, the second eigenvalue of the ring of 4 rather than of 8), not bytes.

Reported per method and network, from rank 0's Ledger and each job's ``metrics.jsonl`` (steps 2..``--steps``,
the first step's warm-up left out): bytes sent per step between nodes (``bytes_sent_inter``) flat and two-level
and their ratio, against the target two-level <= 1/(ranks per node) = 0.5 x flat; bytes sent per step inside
the node (``bytes_sent_intra``); the modelled communication the rank waited for (``comm_s_per_step``: every
exchange here is blocking, so this is the modelled cost of the step's collectives), against the target
two-level < flat; compute (the step less the time blocked in communication) and the whole step; the last
step's training loss of each run and the largest gap between the two runs' per-step training losses
(AllReduce-SGD's two-level sum differs from the flat one only in the order of float32 additions).

Measured (docs/results/hierarchy.md, 2 shared cores, 15 steps): every target met. Inter-node bytes two-level
/ flat: 0.43 for AllReduce-SGD (809 / 1,888 kB a step), 0.21 for QSGD, TernGrad and SignSGD; the two-level runs
add 1,079 kB a step inside the node. Modelled communication per step, flat -> two-level, at 10gbit,5us between
nodes: 1.58 -> 0.69 ms (AllReduce-SGD), 0.80 -> 0.19 (QSGD), 0.41 -> 0.10 (TernGrad), 0.22 -> 0.06 (SignSGD);
at 1gbit,100us: 16.5 -> 7.1, 8.4 -> 2.0, 4.5 -> 1.1, 2.6 -> 0.7 ms. Two-level AllReduce-SGD's per-step losses
equal the flat run's bit for bit (final 1.9681); the compressed methods end within 0.04 of flat. The step
(0.7-1.0 s, 8 ranks on 2 cores) is nearly all compute waiting for a core: the 0.2-9 ms saved do not show in it,
flat and two-level differing by up to 0.17 s a step either way. D-PSGD (ring): 0.50 of the booked flat bytes
(1,079 / 2,158 kB), modelled communication 1.73 -> 0.88 ms at 10gbit and 17.4 -> 8.7 ms at 1gbit, final loss
2.140 two-level against 2.179 flat (another mixing matrix: spectral gap 0.667 against 0.195); D² the same bytes
and times (final 2.190 against 2.226); CHOCO 4-bit 137.0 / 273.9 kB (0.5002: the target missed by the
scale each shard's payload carries), modelled 0.22 -> 0.12 ms and 2.3 -> 1.2 ms, final 2.049 against 2.161;
AllReduce-Adam as AllReduce-SGD (0.43, losses bit-identical); DCD 4-bit as CHOCO (137.0 / 273.9 kB, 0.5002,
missed the same way; 0.22 -> 0.12 and 2.29 -> 1.20 ms; final 2.069 against 2.160); Moniqua's default 34.9 /
69.1 kB (0.505: missed by the header and fingerprint each tensor part of a shard carries), 0.13 -> 0.07 and
2.05 -> 0.99 ms, final 2.205 against 2.488.

Writes docs/results/hierarchy.{md,json}; the runs go to bench/results/runs/hierarchy/ (reused unless --fresh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.apprun import AppRun, launch  # noqa: E402
from bench.common import RESULTS, RUNS, enter_loopback_namespace, markdown_table, write_table  # noqa: E402

RANKS = 8
RANKS_PER_NODE = 2
INTER_RATIO_TARGET = 1 / RANKS_PER_NODE  # two-level inter-node bytes at most this fraction of flat
NETWORKS = {"10gbit": "intra=nvlink,inter=10gbit,5us", "1gbit": "intra=nvlink,inter=1gbit,100us"}
SGD = ["--lr", "0.1", "--momentum", "0.9"]
METHODS = {  # the method's options
    "allreduce_sgd": SGD,
    "qsgd": [*SGD, "--bits", "4", "--bucket-size", "512"],
    "terngrad": SGD,
    "signsgd": ["--lr", "0.001", "--momentum", "0.9"],
    "dpsgd": [*SGD, "--topology", "ring"],
    "d2": ["--lr", "0.1", "--momentum", "0", "--topology", "ring"],
    "choco": [*SGD, "--topology", "ring", "--codec", "qsgd", "--codec-options", "bits=4", "--gamma", "0.6"],
    "allreduce_adam": ["--lr", "0.002", "--momentum", "0"],
    "dcd": [*SGD, "--topology", "ring", "--codec", "qsgd", "--codec-options", "bits=4"],
    "moniqua": [*SGD, "--topology", "ring"],
    "hsq": [*SGD, "--d", "16"],
    "powersgd": [*SGD, "--rank", "2", "--warmup-steps", "3"],
    "lamb": ["--lr", "0.002", "--momentum", "0"],
    "apmsqueeze": ["--lr", "0.002", "--momentum", "0", "--warmup-steps", "3"],
    "zeroone_adam": ["--lr", "0.002", "--momentum", "0"],
    "onebit_lamb": ["--lr", "0.002", "--momentum", "0", "--freeze-step", "3"],
    "moniqua_d2": ["--lr", "0.1", "--momentum", "0", "--topology", "ring"],
    "pdsgdm": [*SGD, "--topology", "ring", "--period", "4"],
    "cpdsgdm": [*SGD, "--topology", "ring", "--period", "4", "--codec", "qsgd", "--codec-options", "bits=4",
                "--gamma", "0.6"],
    "powergossip": [*SGD, "--topology", "ring"],
    "diloco": [*SGD, "--period", "5"],
    "sparseloco": [*SGD, "--period", "5"],
    "streaming_diloco": [*SGD, "--period", "8"],
    "decentralized_diloco": [*SGD, "--topology", "ring", "--period", "5"],
}
GOSSIP = {"dpsgd", "d2", "choco", "dcd", "moniqua", "moniqua_d2", "pdsgdm", "cpdsgdm", "powergossip",
          "decentralized_diloco"}  # methods whose two-level form is a gossip between nodes
LAYOUTS = {"flat": "off", "two-level": "on"}  # case label -> --hierarchical
JOB_ENV = {"MPICOMM_RANKS_PER_NODE": str(RANKS_PER_NODE), "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def train_losses(run: AppRun) -> dict[int, float]:
    """The mean training loss over ranks of every logged step, by step."""
    return {r["step"]: r["loss"] for r in run.records if r["event"] == "train"}


def summarize(run: AppRun) -> dict:
    """Bytes per step by link class, mean seconds per step and the losses of one run (steps 2 onwards)."""
    losses = train_losses(run)
    return {"bytes_sent_inter": run.traffic_per_step("bytes_sent_inter", first=1),
            "bytes_sent_intra": run.traffic_per_step("bytes_sent_intra", first=1),
            "bytes_sent": run.traffic_per_step("bytes_sent", first=1),
            **run.per_step(first=1), "final_train_loss": losses[max(losses)], "train_loss": losses,
            "test_loss": run.end.get("test_loss"), "test_accuracy": run.end.get("test_accuracy")}


def compare(flat: dict, two_level: dict) -> dict:
    """The ratios and targets of one (network, method): inter-node bytes and modelled communication."""
    ratio = two_level["bytes_sent_inter"] / flat["bytes_sent_inter"]
    gap = max(abs(two_level["train_loss"][s] - flat["train_loss"][s]) for s in flat["train_loss"])
    return {"inter_ratio": ratio, "inter_target_met": ratio <= INTER_RATIO_TARGET,
            # None: the flat run left no communication exposed (Streaming DiLoCo's in-flight exchange), no target
            "comm_ratio": two_level["comm_s"] / flat["comm_s"] if flat["comm_s"] else None,
            "comm_target_met": two_level["comm_s"] < flat["comm_s"] if flat["comm_s"] else None,
            "largest_train_loss_gap": gap}


def table_row(network: str, method: str, flat: dict, two_level: dict, verdict: dict) -> list[str]:
    """One markdown row: flat / two-level side by side for every figure."""
    def pair(key: str, scale: float, digits: int) -> str:
        return f"{scale * flat[key]:.{digits}f} / {scale * two_level[key]:.{digits}f}"

    return [network, method, pair("bytes_sent_inter", 1e-3, 1), f"{verdict['inter_ratio']:.3f}",
            "met" if verdict["inter_target_met"] else "missed", pair("bytes_sent_intra", 1e-3, 1),
            pair("comm_s", 1e3, 3), "–" if verdict["comm_ratio"] is None else f"{verdict['comm_ratio']:.3f}",
            {True: "met", False: "missed", None: "none exposed flat"}[verdict["comm_target_met"]],
            pair("compute_s", 1, 3), pair("step_s", 1, 3), pair("final_train_loss", 1, 4),
            f"{verdict['largest_train_loss_gap']:.2g}"]


def committed(steps: int) -> dict:
    """The committed docs/results/hierarchy.json's results (by network, then method) if measured over ``steps``
    steps, else {}: a case found there is reused unless ``--fresh``."""
    path = os.path.join(RESULTS, "hierarchy.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        previous = json.load(f)
    return previous["results"] if previous.get("steps") == steps else {}


def no_overlap(method: str) -> list[str]:
    """``--no-overlap`` for a method that has the option (two levels exclude it), else nothing."""
    from mpicomm.algorithms.registry import ALGORITHMS

    return ["--no-overlap"] if "overlap" in {f.name for f in fields(ALGORITHMS[method].config_class)} else []


def gossip_note() -> str:
    """What the gossip rows mean: their booked flat bytes against a real node placement, and the mixings' gaps."""
    from mpicomm import topology

    nodes = RANKS // RANKS_PER_NODE
    flat, two_level = topology.ring(RANKS).spectral_gap(), topology.ring(nodes).spectral_gap()
    return ("Gossip methods (D-PSGD, D², CHOCO, DCD, Moniqua, Moniqua-D², PD-/CPD-SGDM, PowerGossip, decentralized "
            "DiLoCo): the flat ring sends to both neighbours, booked between nodes; on "
            f"real nodes one neighbour shares the node, so the real flat inter-node bytes are half those booked, "
            f"about the two-level run's. The two-level gossip gains in mixing: its matrix (ring of {nodes} nodes ⊗ "
            f"node average) has spectral gap {two_level:.3f} against {flat:.3f} for the ring of {RANKS} ranks.")


def main() -> None:
    """Run every (network, method, layout), flat and two-level back to back, then write the table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    parser.add_argument("--networks", default=",".join(NETWORKS), help="comma list of " + ", ".join(NETWORKS))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--fresh", action="store_true", help="rerun cases that already finished")
    args = parser.parse_args()
    methods, networks = args.methods.split(","), args.networks.split(",")
    if set(methods) - set(METHODS):
        parser.error(f"--methods: unknown {sorted(set(methods) - set(METHODS))}; choose from {', '.join(METHODS)}")
    if set(networks) - set(NETWORKS):
        parser.error(f"--networks: unknown {sorted(set(networks) - set(NETWORKS))}; choose from {', '.join(NETWORKS)}")
    enter_loopback_namespace()
    base = ["--model", "resnet20", "--dataset", "digits", "--batch-size", "16", "--max-steps", str(args.steps),
            "--log-every", "1", "--eval-every", str(10 * args.steps), "--eval-limit", "64", "--eval-bn-batches", "2"]
    results = committed(args.steps)
    for network in networks:
        for method in methods:
            if method in results.get(network, {}) and not args.fresh:
                continue
            summary = {}
            for layout, hierarchical in LAYOUTS.items():
                run_dir = os.path.join(RUNS, "hierarchy", network, f"{method}-{layout}")
                run = launch(f"{network} {method} {layout}", "train_resnet.py", RANKS,
                             [*base, *no_overlap(method), "--net", NETWORKS[network], "--algorithm", method,
                              *METHODS[method], "--hierarchical", hierarchical], run_dir, fresh=args.fresh,
                             env=JOB_ENV)
                summary[layout] = summarize(run)
            results.setdefault(network, {})[method] = {**summary, **compare(summary["flat"], summary["two-level"])}
    results = {n: {m: results[n][m] for m in METHODS if m in results[n]} for n in NETWORKS if n in results}
    rows = [table_row(n, m, r["flat"], r["two-level"], r) for n, by_method in results.items()
            for m, r in by_method.items()]
    header = ["network", "method", "inter-node kB/step, flat / two-level", "ratio",
              f"target <= {INTER_RATIO_TARGET:g}", "intra-node kB/step, flat / two-level",
              "modelled comm ms/step, flat / two-level", "ratio", "target two-level < flat",
              "compute s/step, flat / two-level", "step s/step, flat / two-level",
              "final train loss, flat / two-level", "largest per-step train-loss gap"]
    verdicts = [p[k] for n in results.values() for p in n.values() for k in ("inter_target_met", "comm_target_met")]
    met, judged = sum(v is True for v in verdicts), sum(v is not None for v in verdicts)
    notes = (f"Per rank (rank 0's Ledger) and step, steps 2..{args.steps}. Networks: "
             + ", ".join(f"{n} = `--net {NETWORKS[n]}`" for n in results)
             + ". The flat run books every byte between nodes (a flat collective goes at its slowest link). "
             "Modelled comm is the modelled transfer time the rank waited for (all exchanges blocking); compute "
             "is the step less the time blocked in communication, so on 2 shared cores running 8 ranks it is "
             "mostly waiting for a core and the step time follows it, not the network. Losses: mean over ranks "
             "of the training loss of the last step; the gap is the largest difference between the flat and "
             f"two-level runs' per-step losses. Targets met: {met} of {judged}.")
    if any(GOSSIP & set(by_method) for by_method in results.values()):
        notes += " " + gossip_note()
    title = (f"Two-level exchange against flat, {RANKS} ranks as {RANKS // RANKS_PER_NODE} emulated nodes x "
             f"{RANKS_PER_NODE} (MPICOMM_RANKS_PER_NODE={RANKS_PER_NODE}), ResNet-20, digits, batch 16 per rank, "
             f"{args.steps} steps")
    payload = {"ranks": RANKS, "ranks_per_node": RANKS_PER_NODE, "steps": args.steps, "networks":
               {n: NETWORKS[n] for n in results},
               "methods": {m: METHODS[m] for m in METHODS if any(m in by_method for by_method in results.values())},
               "inter_ratio_target": INTER_RATIO_TARGET, "results": results}
    write_table("hierarchy", title, markdown_table(header, rows) + "\n\n" + notes, payload)


if __name__ == "__main__":
    main()
