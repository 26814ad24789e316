"""The accuracy each candidate cost in the project's own measured runs (``docs/results/*.json``), per task.

The cost is in points of accuracy: the full-precision baseline's mean less the method's, both from the same
file and run set (negative: the method ended higher), with its uncertainty: the standard error of that
difference over the seeds (Welch, ``sqrt(s_b^2/n_b + s_m^2/n_m)``; a side run with one seed takes
:data:`NOISE_POINTS` as its spread). A candidate is left out of the automatic choice only when its cost is
*significantly* above the tolerance: when the one-sided 95 % lower bound ``points - t * se`` (Student's t,
``n_b + n_m - 2`` degrees of freedom) is above it. Costs belong to a task family (:data:`TASKS`); a
family never measured for a candidate leaves it unmeasured there, never borrowed from the other.

* ``image`` (image classification; the SGD options of ``apps/train_resnet.py``), best first:
  ``mnist1d.json`` (MNIST-1D, 1-D CNN, 8 ranks on the ring, 10 epochs, 3 seeds: the yardstick built to
  separate methods), ``scale.json`` (full MNIST, ResNet-8, 8 ranks, 1,500 steps, 2 seeds; APMSqueeze
  against AllReduce-Adam), ``peers_resnet.json`` (ResNet-20 on digits, 4 ranks, 2 seeds: PowerSGD) and
  ``time_to_accuracy.json`` (ResNet-20 on digits, 4 ranks, one seed: PD-SGDM). Baseline AllReduce-SGD.
* ``masked-lm`` (BERT masked-LM; the Adam options of ``apps/train_bert.py``): ``bert_mlm_3000.json`` (tiny
  BERT on python-docs, 4 ranks, 3,000 steps, 3 seeds), masked-token accuracy against AllReduce-Adam.

The planner reads the costs from the table shipped inside the package, ``mpicomm/plan/accuracy_costs.json``
(so an installed package plans as the checkout does), which ``python -m mpicomm.plan.accuracy`` writes from
the checkout's ``docs/results`` after a results file changes (a test fails until it is rewritten). With
``MPICOMM_RESULTS_DIR`` set, the costs are derived from that folder instead; there, missing files leave their
candidates unmeasured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["BASELINES", "IMAGE", "MASKED_LM", "NOISE_POINTS", "TABLE", "TASKS", "AccuracyCost", "accuracy_costs",
           "derive_costs", "ranks_note", "results_dir", "write_table"]

NOISE_POINTS = 0.3
"""Seed-to-seed noise of the measured accuracies (points), the default tolerance of the automatic choice."""

IMAGE, MASKED_LM = "image", "masked-lm"
TASKS = (IMAGE, MASKED_LM)
"""The task families costs are measured for: image classification and masked-language-model pre-training."""
BASELINES = {IMAGE: "allreduce_sgd", MASKED_LM: "allreduce_adam"}
"""Each task's full-precision baseline candidate (what the costs are measured against)."""

_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}
"""One-sided 95 % quantiles of Student's t by degrees of freedom (1.645 beyond)."""

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
_BERT = {  # candidate -> the BERT yardstick's method entry (at its defaults)
    "allreduce_adam": "allreduce_adam", "apmsqueeze": "apmsqueeze", "onebit_lamb": "onebit_lamb",
    "zeroone_adam": "zeroone_adam",
}


@dataclass(frozen=True)
class AccuracyCost:
    """``points`` lost against the baseline (None: unmeasured), ``source`` (the file and what was run), and the
    evidence: ``se`` (standard error of ``points``), ``seeds`` (the fewer of the two sides' seeds), ``df`` (the
    degrees of freedom of its t bound), ``ranks`` (the ranks of the measured runs) and ``task`` (the family,
    :data:`TASKS`)."""

    points: float | None
    source: str
    se: float | None = None
    seeds: int = 0
    df: int = 0
    ranks: int = 0
    task: str = IMAGE

    @property
    def measured(self) -> bool:
        """Whether a measurement exists."""
        return self.points is not None

    @property
    def low(self) -> float | None:
        """The one-sided 95 % lower bound of the cost (``points`` itself when no spread is known)."""
        if self.points is None:
            return None
        if self.se is None:
            return self.points
        return self.points - _T95.get(max(1, self.df), 1.645) * self.se

    def above(self, tolerance: float) -> bool:
        """Whether the cost is significantly above ``tolerance`` points (its lower bound is)."""
        return self.measured and self.low > tolerance

    def evidence(self) -> str:
        """One line: the cost, its 95 % lower bound, seeds, ranks and the task (``unmeasured`` without data)."""
        if not self.measured:
            return f"unmeasured for {self.task}"
        spread = "" if self.se is None else f" (>= {self.low:+.2f} at 95 %)"
        return f"{self.points:+.2f} pts{spread}, {self.task}, {self.seeds} seed(s), {self.ranks} ranks"


UNMEASURED = AccuracyCost(None, "unmeasured")


def ranks_note(cost: AccuracyCost, ranks: int) -> str:
    """What a choice for ``ranks`` ranks borrows: "" when ``cost`` was measured at that many ranks (or is
    unmeasured), else a line saying at how many it was measured."""
    if not cost.measured or not cost.ranks or cost.ranks == ranks:
        return ""
    return f"its accuracy cost was measured at {cost.ranks} ranks, not at {ranks}"


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


def _cost(baseline: list[float], method: list[float], source: str, ranks: int, task: str = IMAGE,
          scale: float = 1.0) -> AccuracyCost:
    """The cost of ``method``'s per-seed accuracies against ``baseline``'s (fractions times ``scale`` = points)."""
    b, m = [scale * v for v in baseline], [scale * v for v in method]

    def var(values):
        return statistics.variance(values) if len(values) > 1 else NOISE_POINTS ** 2

    se = math.sqrt(var(b) / len(b) + var(m) / len(m))
    return AccuracyCost(round(statistics.fmean(b) - statistics.fmean(m), 2), source, round(se, 3),
                        min(len(b), len(m)), max(1, len(b) + len(m) - 2), ranks, task)


def _scale(costs: dict, folder: Path) -> None:
    data = _load(folder, "scale.json")
    if data is None:
        return
    seeds = {(r["part"], r["method"]): r["accuracy_per_seed"] for r in data["rows"]
             if r.get("ranks") == 8 and r.get("topology") == "ring"}
    for key, (part, method, baseline) in _SCALE.items():
        if (part, method) in seeds and ("centralized", baseline) in seeds:
            costs[key] = _cost(seeds[("centralized", baseline)], seeds[(part, method)],
                               f"scale.json: MNIST ResNet-8, 8 ranks, 2 seeds, vs {baseline}", 8, scale=100)


def _peers(costs: dict, folder: Path) -> None:
    data = _load(folder, "peers_resnet.json")
    if data is None:
        return
    finals = {r["case"]: r["finals"] for r in data["rows"] if r.get("setting") == "gbit"}
    for key, case in _PEERS.items():
        if case in finals and "AllReduce-SGD" in finals:
            costs[key] = _cost(finals["AllReduce-SGD"], finals[case],
                               "peers_resnet.json: digits ResNet-20, 4 ranks, 2 seeds, vs AllReduce-SGD", 4)


def _time_to_accuracy(costs: dict, folder: Path) -> None:
    data = _load(folder, "time_to_accuracy.json")
    if data is None:
        return
    finals = {r["case"]: r["final_test_accuracy"] for r in data["rows"] if r.get("setting") == "gbit"}
    for key, case in _TTA.items():
        if case in finals and "AllReduce-SGD" in finals:
            costs[key] = _cost([finals["AllReduce-SGD"]], [finals[case]],
                               "time_to_accuracy.json: digits ResNet-20, 4 ranks, 1 seed, vs AllReduce-SGD", 4,
                               scale=100)


def _seed_values(result: dict, field: str) -> list[float] | None:
    """The per-seed ``field`` of a yardstick entry whose every seed finished (None otherwise)."""
    runs = result.get("runs") or []
    if result.get("failed", 1) != 0 or not runs or any(r.get("failed") for r in runs):
        return None
    values = [r[field] for r in runs if r.get(field) is not None]
    return values if len(values) == len(runs) else None


def _mnist1d(costs: dict, folder: Path) -> None:
    data = _load(folder, "mnist1d.json")
    if data is None:
        return
    seeds = {entry: _seed_values(r, "test_accuracy") for entry, r in data["results"].items()}
    if not seeds.get("allreduce_sgd"):
        return
    for key, entry in _MNIST1D.items():
        if seeds.get(entry):
            costs[key] = _cost(seeds["allreduce_sgd"], seeds[entry],
                               f"mnist1d.json: MNIST-1D 1-D CNN, 8 ranks, {len(data['seeds'])} seeds, "
                               "vs AllReduce-SGD", 8, scale=100)


def _bert(costs: dict, folder: Path) -> None:
    data = _load(folder, "bert_mlm_3000.json")
    if data is None:
        return
    seeds = {entry: _seed_values(r, "val_mlm_accuracy") for entry, r in data["results"].items()}
    if not seeds.get("allreduce_adam"):
        return
    for key, entry in _BERT.items():
        if seeds.get(entry):
            costs[key] = _cost(seeds["allreduce_adam"], seeds[entry],
                               f"bert_mlm_3000.json: BERT tiny masked-LM, {data['ranks']} ranks, {data['steps']} "
                               f"steps, {len(data['seeds'])} seeds, vs AllReduce-Adam", data["ranks"], MASKED_LM,
                               scale=100)


def derive_costs(folder: Path, task: str = IMAGE) -> dict[str, AccuracyCost]:
    """Candidate key -> its :class:`AccuracyCost` for ``task`` as derived from the results files in ``folder``
    (keys without a measurement are absent; a missing file leaves its candidates out)."""
    _check_task(task)
    costs: dict[str, AccuracyCost] = {}
    sources = (_time_to_accuracy, _peers, _scale, _mnist1d) if task == IMAGE else (_bert,)
    for source in sources:  # later sources take precedence
        source(costs, folder)
    return costs


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")


def accuracy_costs(task: str = IMAGE) -> dict[str, AccuracyCost]:
    """Candidate key -> its measured :class:`AccuracyCost` for ``task`` (keys without a measurement are absent):
    the shipped :data:`TABLE`, or what ``MPICOMM_RESULTS_DIR``'s files give when it is set."""
    _check_task(task)
    if "MPICOMM_RESULTS_DIR" in os.environ:
        return derive_costs(results_dir(), task)
    try:
        rows = json.loads(TABLE.read_text())["costs"].get(task, {})
    except OSError:  # an install without its package data: every candidate unmeasured, auto refuses
        return {}
    return {key: AccuracyCost(**row) for key, row in rows.items()}


def write_table(folder: Path, table: Path = TABLE) -> dict[str, dict[str, AccuracyCost]]:
    """Write the costs derived from ``folder`` for every task to ``table`` (the shipped one by default); returns
    them (task -> candidate -> cost)."""
    costs = {task: derive_costs(folder, task) for task in TASKS}
    text = json.dumps({"derived_from": "docs/results by python -m mpicomm.plan.accuracy",
                       "costs": {task: {key: asdict(c[key]) for key in sorted(c)} for task, c in costs.items()}},
                      indent=1)
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
    print(f"{TABLE}: " + ", ".join(f"{len(c)} candidates for {task}" for task, c in costs.items()) + f" from {folder}")


if __name__ == "__main__":
    main()
