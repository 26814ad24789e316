"""Decentralized algorithms on the digits MLP: accuracy and bytes on the wire vs. D-PSGD, on a ring.

    unshare -n bash -c 'ip link set lo up && mpiexec -n 4 python bench/training/decentralized.py \
        [--epochs 20] [--quick]'

Trains bench/training/digits.py's 64-128-10 MLP (9,610 parameters) on every rank's IID shard of the digits data
with SGD momentum 0.9, batch 16, on a ring of all ranks, and reports the consensus (average) model's
final test loss/accuracy, bytes sent per rank, their ratio to D-PSGD's, bits per parameter per step and
wall time. Rows: D-PSGD (the baseline), Moniqua's default, 4 bits on half and the paper's 1-bit form,
CHOCO-SGD and DCD-PSGD with the same two codecs (1-bit sign+scale; 4-bit QSGD), PD-SGDM and CPD-SGDM
(p = 4), PowerGossip rank 1 and 4.

Bytes: the Ledger's bytes *sent* (what leaves a rank), read by ``run_case`` before its final
evaluation, so they are training traffic only.

Target: Moniqua 1-bit within 1 accuracy point of D-PSGD with >= 25x fewer bytes sent.
Writes bench/results/decentralized.json.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpi4py import MPI  # noqa: E402

from bench.common import BENCH_RESULTS  # noqa: E402
from bench.training.digits import benchmark_options, report, run_case  # noqa: E402
from mpicomm.algorithms import ALGORITHMS  # noqa: E402

JSON = os.path.join(BENCH_RESULTS, "decentralized.json")
BATCH, TOPOLOGY, BASELINE = 16, "ring", "D-PSGD"
SGD = {"lr": 0.1, "momentum": 0.9}
SIGN = {"codec": "sign"}
QSGD4 = {"codec": "qsgd", "codec_options": {"bits": 4}}
CASES = [  # label, algorithm, options
    (BASELINE, "dpsgd", SGD),
    ("Moniqua default", "moniqua", SGD),  # 4 bits on a rotating quarter of each tensor, theta per tensor
    ("Moniqua 4-bit 1/2", "moniqua", {**SGD, "parts": 2}),
    ("Moniqua paper 1-bit", "moniqua", {**SGD, "bits": 1, "parts": 1, "theta_per": "model", "theta": "adaptive",
                                              "rounding": "nearest"}),
    ("CHOCO sign", "choco", {**SGD, **SIGN, "gamma": 0.4}),
    ("DCD sign", "dcd", {**SGD, **SIGN}),
    ("CHOCO qsgd 4-bit", "choco", {**SGD, **QSGD4, "gamma": 0.6}),
    ("DCD qsgd 4-bit", "dcd", {**SGD, **QSGD4}),
    ("PD-SGDM p=4", "pdsgdm", {**SGD, "period": 4}),
    ("CPD-SGDM sign p=4", "cpdsgdm", {**SGD, **SIGN, "period": 4, "gamma": 0.4}),
    *[(f"PowerGossip r={r}", "powergossip", {**SGD, "rank": r}) for r in (1, 4)],
]


def _run(comm, epochs: int, notes: list[str], net=None) -> list[dict]:
    rows = []
    for label, algorithm, options in CASES:
        if algorithm not in ALGORITHMS:
            notes.append(f"skipped {label}: algorithm {algorithm!r} is not registered")
            continue
        try:
            rows.append(run_case(comm, label, algorithm, options, epochs=epochs, batch_size=BATCH, topo=TOPOLOGY,
                                 net=net))
        except ValueError as exc:  # config errors are raised on every rank together (make_algorithm)
            notes.append(f"skipped {label}: {exc}")
    return rows


def _target(rows: list[dict]) -> list[str]:
    base = next(r for r in rows if r["label"] == BASELINE)
    moniqua = next((r for r in rows if r["label"] == "Moniqua default"), None)
    if moniqua is None:
        return ["target not evaluated: no Moniqua default row"]
    gap = 100 * (base["test_accuracy"] - moniqua["test_accuracy"])
    fewer = base["bytes_sent_per_rank"] / moniqua["bytes_sent_per_rank"]
    ok = gap <= 1.0 and fewer >= 25
    return [f"Moniqua default: {gap:+.2f} accuracy points below D-PSGD with {fewer:.1f}x fewer bytes sent "
            f"-> {'MET' if ok else 'MISSED'} (target: <= 1 point, >= 25x)"]


def main() -> None:
    opts = benchmark_options(__doc__.splitlines()[0])
    epochs = opts.epochs
    comm = MPI.COMM_WORLD
    notes: list[str] = []
    rows = _run(comm, epochs, notes, opts.net)
    if comm.Get_rank() != 0:
        return
    n = comm.Get_size()
    title = f"Decentralized, {TOPOLOGY} of {n} ranks, {epochs} epochs, batch {BATCH}, SGD momentum 0.9"
    report(rows, BASELINE, JSON, title)
    targets = _target(rows)
    for line in notes + targets:
        print(line)
    with open(JSON, "w") as f:
        json.dump({"title": title, "baseline": BASELINE, "ranks": n, "epochs": epochs, "batch_size": BATCH,
                   "topology": TOPOLOGY, "rows": rows, "targets": targets, "notes": notes}, f, indent=2)
    print(f"wrote {JSON}")


if __name__ == "__main__":
    main()
