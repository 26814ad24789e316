"""``--algorithm auto``: the app chooses with the planner, trains the choice, records it, and keeps it on resume.

Run in-process by the apps' ``main`` on the 2-rank tier. On a 100 kbit/s network a 75k-parameter ResNet-8's
fp32 exchange takes seconds against a compute step well under one, so the choice must be a compressed method
(the planner's ranking itself is tested against known answers in ``test_plan.py``); the resumed run, told
the network is fast (where the planner takes AllReduce-SGD), keeps the recorded choice instead. An impossible
tolerance or a bad network is one line, exit 2. The transport's calibration, which runs when no network is
given, is tested in ``test_calibrate_mpi.py``.
"""

import json
import os
import signal

import pytest

from mpicomm.errors import agreed_of

from .app_runs import app_module
from .conftest import assert_all

pytestmark = pytest.mark.mpi

BASE = ["--model", "resnet8", "--batch-size", "16", "--eval-limit", "32", "--eval-bn-batches", "1",
        "--max-steps", "4", "--log-every", "2", "--no-progress", "--algorithm", "auto"]
UNCOMPRESSED = {"allreduce_sgd", "dpsgd", "pdsgdm", "diloco"}


@pytest.fixture(autouse=True)
def _at_two_ranks(comm):
    """Every case runs once, in the 2-rank tier (on one rank every exchange is free: nothing to choose)."""
    if comm.Get_size() != 2:
        pytest.skip("runs once, in the 2-rank tier")


@pytest.fixture(scope="module")
def main():
    return app_module("train_resnet").main


def _starts(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r["event"] == "start"]


def test_the_choice_is_trained_recorded_and_kept_on_resume(comm, main, tmp_path_factory, capsys):
    out = comm.bcast(str(tmp_path_factory.mktemp("auto")) if comm.Get_rank() == 0 else None)
    args = [*BASE, "--out-dir", out, "--save-every", "2"]
    first = main([*args, "--auto-net", "100kbit,10ms", "--stop-at-step", "2"])
    second = main([*args, "--auto-net", "fast", "--resume", "latest"])
    said = capsys.readouterr().out
    problems = []
    if comm.Get_rank() == 0:
        starts = _starts(out)
        chosen = [s.get("auto", {}) for s in starts]
        if len(starts) != 2 or not all(chosen):
            problems.append(f"start records without the choice: {starts}")
        else:
            if chosen[0]["algorithm"] in UNCOMPRESSED or starts[0]["algorithm"] != chosen[0]["algorithm"]:
                problems.append(f"on 100 kbit/s: chose {chosen[0]['algorithm']}, trained {starts[0]['algorithm']}")
            if not (chosen[1].get("resumed") and starts[1]["algorithm"] == chosen[0]["algorithm"]):
                problems.append(f"the resumed run chose again: {chosen[1]}, trained {starts[1]['algorithm']}")
            if not (chosen[0]["net"] == "100kbit,10ms" and chosen[0]["step_time_s"] > 0 and chosen[0]["fastest"]):
                problems.append(f"the record lacks what decided: {chosen[0]}")
        if "--algorithm auto: " not in said:
            problems.append("no console line names the choice")
    stopped = 128 + int(signal.SIGUSR1)
    assert_all(comm, first == stopped and second == 0 and not problems, f"exit {first}, {second}; {problems}")


def test_bert_chooses_among_the_methods_measured_on_masked_lm(comm, tmp_path_factory):
    """The BERT app's task is masked-LM: on 100 kbit/s its choice is an Adam-type method measured on the BERT
    yardstick (not an SGD method measured on images), and the record says which task and evidence decided."""
    out = comm.bcast(str(tmp_path_factory.mktemp("auto_bert")) if comm.Get_rank() == 0 else None)
    bert = app_module("train_bert").main
    code = bert(["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--eval-sequences", "16",
                 "--max-steps", "4", "--no-progress", "--algorithm", "auto", "--auto-net", "100kbit,10ms",
                 "--out-dir", out])
    problems = []
    if comm.Get_rank() == 0:
        record = _starts(out)[0].get("auto", {})
        if record.get("task") != "masked-lm" or record.get("algorithm") not in ("apmsqueeze", "onebit_lamb",
                                                                               "zeroone_adam"):
            problems.append(f"the choice: {record}")
        elif "masked-lm, 3 seed(s)" not in record.get("accuracy_evidence", ""):
            problems.append(f"the evidence: {record.get('accuracy_evidence')}")
    assert_all(comm, code == 0 and not problems, f"exit {code}; {problems}")


@pytest.mark.parametrize(("extra", "line"), [
    (["--auto-tolerance", "-1"], "--algorithm auto: --auto-tolerance must be >= 0 accuracy points, got -1.0"),
    (["--auto-net", "12 parrots"], "--auto-net: expected BANDWIDTH,LATENCY"),
])
def test_an_impossible_request_is_one_line(comm, main, capsys, extra, line):
    capsys.readouterr()
    code = main([*BASE, *extra])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    expected = f"train_resnet: error: {line}"
    ok = code == 2 and (comm.Get_rank() != 0 or (len(lines) == 1 and lines[0].startswith(expected)))
    assert_all(comm, ok, f"exit {code}; stderr {lines}")


def test_wrap_auto_takes_a_method_for_the_user_optimizer_and_trains(comm):
    """``mpicomm.wrap(model, optimizer, "auto", step_time=...)``: on a 100 kbit/s network a compressed method
    that takes the user's optimizer, trained in step (the ranks' averaged model moves), the choice on the
    algorithm."""
    import torch

    import mpicomm

    def body() -> str:
        torch.manual_seed(comm.Get_rank())
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        algo = mpicomm.wrap(model, optimizer, "auto", step_time=0.01, tolerance=0.3, net="100kbit,10ms")
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            algo.zero_grad()
            model(torch.randn(8, 32)).pow(2).mean().backward()
            algo.step()
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        record = getattr(algo, "auto_choice", {})
        problems = [] if moved else ["the model did not move"]
        if algo.name != record.get("algorithm") or algo.name in UNCOMPRESSED or not algo.takes_optimizer:
            problems.append(f"trained {algo.name}, the choice was {record}")
        algo.close()
        return "; ".join(problems)

    try:
        problem = body()
    except Exception as exc:  # noqa: BLE001 - reported collectively
        problem = repr(exc)
    assert_all(comm, not problem, problem)


def test_wrap_auto_without_a_step_time_is_one_error_on_every_rank(comm):
    import torch

    import mpicomm

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"algorithm='auto' needs step_time=SECONDS > 0") as caught:
        mpicomm.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "auto")
    mark = agreed_of(caught.value)  # agreed: every rank raised it, mpicomm.init's handler prints it once
    messages = comm.allgather(str(caught.value))
    assert_all(comm, mark is not None and len(set(messages)) == 1, f"{mark}; {messages}")
