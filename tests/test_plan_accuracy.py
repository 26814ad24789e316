"""Where the planner's accuracy costs come from: the MNIST-1D yardstick first, full MNIST where it has no row."""

import json

from mpicomm.plan.accuracy import accuracy_costs


def _yardstick(entries: dict) -> dict:
    return {"seeds": [0, 1, 2], "results": {
        name: {"mean": mean, "failed": failed, "finished": 3 - failed} for name, (mean, failed) in entries.items()}}


def test_mnist1d_costs_take_precedence_and_failed_methods_are_left_out(tmp_path, monkeypatch):
    (tmp_path / "mnist1d.json").write_text(json.dumps(_yardstick({
        "allreduce_sgd": (0.9734, 0), "hsq": (0.9520, 0), "moniqua": (0.9696, 0), "diloco": (0.90, 1)})))
    (tmp_path / "scale.json").write_text(json.dumps({"rows": [
        {"part": "centralized", "method": "AllReduce-SGD", "mean": 0.99, "ranks": 8, "topology": "ring"},
        {"part": "centralized", "method": "HSQ d=16", "mean": 0.9877, "ranks": 8, "topology": "ring"},
        {"part": "local", "method": "DiLoCo H=10", "mean": 0.985, "ranks": 8, "topology": "ring"}]}))
    monkeypatch.setenv("MPICOMM_RESULTS_DIR", str(tmp_path))
    costs = accuracy_costs()
    # 97.34 - 95.20 and 97.34 - 96.96 points, from MNIST-1D rather than MNIST's 0.23
    assert costs["hsq"].points == 2.14 and costs["hsq"].source.startswith("mnist1d.json")
    assert costs["moniqua"].points == 0.38
    # a seed failed on MNIST-1D: the MNIST figure (99.0 - 98.5) stands
    assert costs["diloco_h10"].points == 0.5 and costs["diloco_h10"].source.startswith("scale.json")
    assert "dpsgd" not in costs  # in neither file
