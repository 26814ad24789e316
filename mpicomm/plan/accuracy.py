"""The accuracy each candidate cost in the project's own measured runs (``docs/results/*.json``).

The cost is in points of test accuracy: the full-precision baseline's mean less the method's, both from
the same file and run set (negative: the method ended higher). Sources, best first:

* ``mnist1d.json``: MNIST-1D, the 1-D CNN, 8 ranks on the ring, 10 epochs, 3 seeds (the yardstick built to
  separate methods: seed-to-seed spread 0.05-0.4 points where full MNIST's differences sat inside theirs).
  Baseline AllReduce-SGD; only the methods run there at the candidate's own configuration, and only where
  every seed finished.
* ``scale.json``: full MNIST, ResNet-8, 8 ranks on the ring, 1,500 steps, 2 seeds. Baseline AllReduce-SGD
  (APMSqueeze: AllReduce-Adam, the same optimizer at full precision). Its seed-to-seed spread is about
  0.1-0.3 points, so differences below ~0.3 points are noise.
* ``peers_resnet.json``: ResNet-20 on digits, 4 ranks, 2 seeds, short runs (PowerSGD against AllReduce-SGD).
* ``time_to_accuracy.json``: ResNet-20 on digits, 4 ranks, 6 epochs, one seed (PD-SGDM against AllReduce-SGD).

A candidate without a row is "unmeasured". The planner reads the costs from the table shipped inside the
package, ``mpicomm/plan/accuracy_costs.json`` (so an installed package plans as the checkout does), which
``python -m mpicomm.plan.accuracy`` writes from the checkout's ``docs/results`` after a results file changes
(a test fails until it is rewritten). With ``MPICOMM_RESULTS_DIR`` set, the costs are derived from that folder
instead; there, missing files leave their candidates unmeasured.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["NOISE_POINTS", "TABLE", "AccuracyCost", "accuracy_costs", "derive_costs", "results_dir", "write_table"]

NOISE_POINTS = 0.3
"""Seed-to-seed noise of the measured accuracies (points), the default tolerance of the automatic choice."""

_SCALE = {  # candidate -> (part, method, baseline method), 8 ranks, ring
    "allreduce_sgd": ("centralized", "AllReduce-SGD", "AllReduce-SGD"),
    "dpsgd": ("decentralized", "D-PSGD", "AllReduce-SGD"),
    "moniqua": ("decentralized", "Moniqua default", "AllReduce-SGD"),
    "choco_qsgd4": ("decentralized", "CHOCO qsgd 4-bit", "AllReduce-SGD"),
    "dcd_qsgd4": ("decentralized", "DCD qsgd 4-bit", "AllReduce-SGD"),
    "cpdsgdm_p4": ("scaling", "CPD-SGDM qsgd 4-bit p=4", "AllReduce-SGD"),
    "hsq": ("centralized", "HSQ d=16", "AllReduce-SGD"),
    "apmsqueeze": ("centralized", "APMSqueeze", "AllReduce-Adam"),
    "diloco_h10": ("local", "DiLoCo H=10", "AllReduce-SGD"),
    "sparseloco_h10": ("local", "SparseLoCo H=10", "AllReduce-SGD"),
}
_MNIST1D = {  # candidate -> the yardstick's method entry (run at its defaults, which are the candidate's)
    "dpsgd": "dpsgd", "moniqua": "moniqua", "pdsgdm_p4": "pdsgdm", "hsq": "hsq", "diloco_h10": "diloco",
}
_PEERS = {"powersgd_r2": "PowerSGD r=2", "powersgd_r4": "PowerSGD r=4"}
_TTA = {"pdsgdm_p4": "PD-SGDM p=4"}


@dataclass(frozen=True)
class AccuracyCost:
    """``points`` lost against the baseline (None: unmeasured) and ``source`` (the file and what was run)."""

    points: float | None
    source: str

    @property
    def measured(self) -> bool:
        """Whether a measurement exists."""
        return self.points is not None


UNMEASURED = AccuracyCost(None, "unmeasured")


TABLE = Path(__file__).with_name("accuracy_costs.json")
"""The shipped table of costs (package data), written by :func:`write_table`."""


def results_dir() -> Path:
    """The folder of measured results the costs are derived from: ``MPICOMM_RESULTS_DIR``, else the checkout's
    ``docs/results``."""
    default = Path(__file__).resolve().parents[2] / "docs" / "results"
    return Path(os.environ.get("MPICOMM_RESULTS_DIR", default))


def _load(folder: Path, name: str):
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None


def _scale(costs: dict, folder: Path) -> None:
    data = _load(folder, "scale.json")
    if data is None:
        return
    means = {(r["part"], r["method"]): 100 * r["mean"] for r in data["rows"]
             if r.get("ranks") == 8 and r.get("topology") == "ring"}
    for key, (part, method, baseline) in _SCALE.items():
        if (part, method) in means and ("centralized", baseline) in means:
            costs[key] = AccuracyCost(round(means[("centralized", baseline)] - means[(part, method)], 2),
                                      f"scale.json: MNIST ResNet-8, 8 ranks, 2 seeds, vs {baseline}")


def _mean(values) -> float:
    return sum(values) / len(values)


def _peers(costs: dict, folder: Path) -> None:
    data = _load(folder, "peers_resnet.json")
    if data is None:
        return
    finals = {r["case"]: _mean(r["finals"]) for r in data["rows"] if r.get("setting") == "gbit"}
    for key, case in _PEERS.items():
        if case in finals and "AllReduce-SGD" in finals:
            costs[key] = AccuracyCost(round(finals["AllReduce-SGD"] - finals[case], 2),
                                      "peers_resnet.json: digits ResNet-20, 4 ranks, 2 seeds, vs AllReduce-SGD")


def _time_to_accuracy(costs: dict, folder: Path) -> None:
    data = _load(folder, "time_to_accuracy.json")
    if data is None:
        return
    finals = {r["case"]: 100 * r["final_test_accuracy"] for r in data["rows"] if r.get("setting") == "gbit"}
    for key, case in _TTA.items():
        if case in finals and "AllReduce-SGD" in finals:
            costs[key] = AccuracyCost(round(finals["AllReduce-SGD"] - finals[case], 2),
                                      "time_to_accuracy.json: digits ResNet-20, 4 ranks, 1 seed, vs AllReduce-SGD")


def _mnist1d(costs: dict, folder: Path) -> None:
    data = _load(folder, "mnist1d.json")
    if data is None:
        return
    means = {entry: 100 * r["mean"] for entry, r in data["results"].items() if r.get("failed") == 0 and r["mean"]}
    if "allreduce_sgd" not in means:
        return
    for key, entry in _MNIST1D.items():
        if entry in means:
            costs[key] = AccuracyCost(round(means["allreduce_sgd"] - means[entry], 2),
                                      f"mnist1d.json: MNIST-1D 1-D CNN, 8 ranks, {len(data['seeds'])} seeds, "
                                      "vs AllReduce-SGD")


def derive_costs(folder: Path) -> dict[str, AccuracyCost]:
    """Candidate key -> its :class:`AccuracyCost` as derived from the results files in ``folder`` (keys without
    a measurement are absent; a missing file leaves its candidates out)."""
    costs: dict[str, AccuracyCost] = {}
    for source in (_time_to_accuracy, _peers, _scale, _mnist1d):  # later sources take precedence
        source(costs, folder)
    return costs


def accuracy_costs() -> dict[str, AccuracyCost]:
    """Candidate key -> its measured :class:`AccuracyCost` (keys without a measurement are absent): the shipped
    :data:`TABLE`, or what ``MPICOMM_RESULTS_DIR``'s files give when it is set."""
    if "MPICOMM_RESULTS_DIR" in os.environ:
        return derive_costs(results_dir())
    try:
        rows = json.loads(TABLE.read_text())["costs"]
    except OSError:  # an install without its package data: every candidate unmeasured, auto refuses
        return {}
    return {key: AccuracyCost(row["points"], row["source"]) for key, row in rows.items()}


def write_table(folder: Path, table: Path = TABLE) -> dict[str, AccuracyCost]:
    """Write the costs derived from ``folder`` to ``table`` (the shipped one by default); returns them."""
    costs = derive_costs(folder)
    text = json.dumps({"derived_from": "docs/results by python -m mpicomm.plan.accuracy",
                       "costs": {key: asdict(costs[key]) for key in sorted(costs)}}, indent=1)
    table.write_text(text + "\n")
    return costs


def main(argv: list[str] | None = None) -> None:
    """``python -m mpicomm.plan.accuracy``: rewrite the shipped table from the measured results (the checkout's
    ``docs/results``, or ``MPICOMM_RESULTS_DIR``)."""
    parser = argparse.ArgumentParser(prog="python -m mpicomm.plan.accuracy", description=main.__doc__)
    parser.parse_args(argv)
    folder = results_dir()
    if not folder.is_dir():
        parser.error(f"{folder}: no results folder (run from a checkout, or set MPICOMM_RESULTS_DIR)")
    costs = write_table(folder)
    print(f"{TABLE}: {len(costs)} candidates from {folder}")


if __name__ == "__main__":
    main()
