"""Resume at another world size: each family's rule checked exactly on the reloaded state, and training goes on.

``tests/resize_job.py`` saves every algorithm of its list at 4 ranks, then resumes each at 2, 3 and 6, and the
2-rank run's own checkpoint at 4, in one 6-rank ``mpiexec`` whose first N ranks form each world of N ranks in
turn; rank 0 reports the saved and the restored states. Checked:

* centralized and 1-bit / low-rank methods: parameters and optimizer state bit-identical to the saved ones;
  error-feedback residuals summed over the new ranks equal their sum over the saved ranks; APMSqueeze's server
  errors reassembled exactly; PowerSGD's Q carried;
* decentralized methods: every new rank holds the average of the saved replicas (and of their momenta);
  CHOCO's public copies are the new replica;
* DiLoCo and Streaming DiLoCo: the global copy and the outer optimizer bit-identical, the inner models averaged,
  the fragments in flight carried;
* every method: the step continues and the averaged model's loss goes down over the next steps.

The 2-rank checkpoint is the one the 2-rank job saves after training on from the 4-rank one.

Plus the app: ``apps/train_resnet.py`` saved at 2 ranks and ``--resume latest`` at 3 records a ``resize`` event
and trains on; and the rules of :mod:`mpicomm.algorithms.resize` on plain tensors (no MPI).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from mpicomm.algorithms import resize

from .app_runs import RESNET, launch, mpiexec, strict_records

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "resize_job.py")
CENTRALIZED = {"allreduce_sgd", "ef_signsgd", "powersgd", "apmsqueeze"}
DECENTRALIZED = {"dpsgd", "moniqua", "choco", "cpdsgdm", "adpsgd"}
OUTER = {"diloco", "streaming_diloco"}
PAIRS = [(4, 2), (4, 3), (4, 6), (2, 4)]


def _launch(n: int, *args) -> None:
    """``mpiexec -n n python -m mpi4py tests/resize_job.py args...``; fails the test with its output otherwise."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", JOB, *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The load jobs' reports by (saved size, new size): saved at 4, resumed at 2 (and saved there again after
    training on), 3 and 6; the 2-rank checkpoint resumed at 4."""
    root = tmp_path_factory.mktemp("resize")
    _launch(6, root)
    out = {}
    for old, new in PAIRS:
        with open(root / f"report{old}to{new}.json") as f:
            out[(old, new)] = json.load(f)
        assert out[(old, new)]["size"] == new
    return out


def _t(value) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _get(state: dict, path: str):
    for key in path.split("."):
        state = state[key]
    return state


def _mean(states: list, path: str) -> torch.Tensor:
    return torch.stack([_t(_get(s, path)) for s in states]).mean(0)


def _sum(states: list, path: str) -> torch.Tensor:
    return torch.stack([_t(_get(s, path)) for s in states]).sum(0)


def _momentum(state: dict) -> torch.Tensor:
    return _t(next(iter(state["extra"]["optimizer"]["state"].values()))["momentum_buffer"])


def _check_centralized(name: str, saved: list, restored: list) -> None:
    for state in restored:
        assert state["params"] == saved[0]["params"], "parameters not carried exactly"
        assert state["extra"].get("optimizer") == saved[0]["extra"].get("optimizer"), "optimizer not carried"
    if name in ("ef_signsgd", "powersgd"):
        torch.testing.assert_close(_sum(restored, "extra.error"), _sum(saved, "extra.error"), rtol=1e-5, atol=1e-6)
        first = _t(restored[0]["extra"]["error"])
        assert all(torch.equal(_t(s["extra"]["error"]), first) for s in restored), "residual not sum / M everywhere"
    if name == "powersgd":
        assert all(s["extra"]["q"] == saved[0]["extra"]["q"] for s in restored), "Q not carried"
    if name == "apmsqueeze":
        d = len(saved[0]["params"])
        torch.testing.assert_close(_sum(restored, "extra.worker_error")[:d], _sum(saved, "extra.worker_error")[:d],
                                   rtol=1e-5, atol=1e-6)
        whole = [torch.cat([_t(s["extra"]["server_error"]) for s in group])[:d] for group in (saved, restored)]
        assert torch.equal(*whole), "server errors not reassembled exactly"


def _check_decentralized(name: str, saved: list, restored: list) -> None:
    average = _mean(saved, "params")
    for state in restored:
        torch.testing.assert_close(_t(state["params"]), average, rtol=1e-6, atol=1e-7)
        if saved[0]["extra"]["optimizer"]["state"]:
            torch.testing.assert_close(_momentum(state), torch.stack([_momentum(s) for s in saved]).mean(0),
                                       rtol=1e-6, atol=1e-7)
        if name in ("choco", "cpdsgdm"):
            for pair in state["extra"]["gossip"]["own_and_sum"]:
                assert all(row == state["params"] for row in pair), "public copies not the new replica"


def _check_outer(name: str, saved: list, restored: list) -> None:
    average = _mean(saved, "params")
    for state in restored:
        extra, first = state["extra"], saved[0]["extra"]
        assert extra["global_params"] == first["global_params"], "global copy not carried exactly"
        assert extra["outer_optimizer"] == first["outer_optimizer"], "outer optimizer not carried exactly"
        torch.testing.assert_close(_t(state["params"]), average, rtol=1e-6, atol=1e-7)
        if name == "streaming_diloco":
            assert first["pending"], "no fragment in flight at the save"
            assert extra["pending"] == first["pending"] and extra["outer_grad"] == first["outer_grad"]
    if "error" in saved[0]["extra"]:
        torch.testing.assert_close(_sum(restored, "extra.error"), _sum(saved, "extra.error"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
@pytest.mark.parametrize("name", sorted(CENTRALIZED | DECENTRALIZED | OUTER))
def test_rule_holds_and_training_goes_on(reports, pair, name):
    """The family's rule on the reloaded state of every new rank; then the loss goes down at the new size."""
    old, new = pair
    result = reports[pair]["results"][name]
    saved, restored = result["saved"], result["restored"]
    assert len(saved) == old and len(restored) == new
    assert result["step"] == saved[0]["step"] and all(s["step"] == result["step"] for s in restored)
    check = (_check_centralized if name in CENTRALIZED else
             _check_decentralized if name in DECENTRALIZED else _check_outer)
    check(name, saved, restored)
    assert result["after"] < result["before"], f"loss {result['before']} -> {result['after']}"


def _resize(values, rule, rank=0, size=3, fresh=None):
    states = [{"params": torch.zeros(4)} for _ in values]
    return rule(values, fresh, resize.Resize(states, {"params": torch.zeros(4)}, rank, size))


def test_default_rule_carries_averages_or_keeps_own():
    """Identical values carried bit for bit; differing floats averaged; other differing values old rank r's
    (r < N) or the freshly built one."""
    same = [torch.tensor([0.1, -0.0]), torch.tensor([0.1, -0.0])]
    assert _resize(same, resize.agreed_or_merged) is same[0]
    assert torch.equal(_resize([torch.tensor([1.0]), torch.tensor([2.0])], resize.agreed_or_merged),
                       torch.tensor([1.5]))
    gens = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]
    assert _resize(gens, resize.agreed_or_merged, rank=1) is gens[1]
    fresh = torch.tensor([9], dtype=torch.uint8)
    assert _resize(gens, resize.agreed_or_merged, rank=2, fresh=fresh) is fresh


def test_share_of_sum_keeps_the_sum():
    """Residuals of 2 ranks re-split over 3: each gets the sum / 3."""
    out = _resize([torch.tensor([3.0, 0.0]), torch.tensor([0.0, 6.0])], resize.share_of_sum,
                  fresh=torch.zeros(2))
    assert torch.equal(out, torch.tensor([1.0, 2.0]))


def test_onebit_server_errors_follow_the_new_chunks():
    """Old owners' chunks (2 of 2) reassembled and cut into 3 chunks of the new padded length."""
    saved = [torch.arange(0.0, 2.0), torch.arange(2.0, 4.0)]
    pieces = [resize.onebit_server_errors(saved, torch.zeros(2), resize.Resize(
        [{}, {}], {"params": torch.zeros(4)}, r, 3)) for r in range(3)]
    assert torch.equal(torch.cat(pieces), torch.tensor([0.0, 1.0, 2.0, 3.0, 0.0, 0.0]))


def test_app_resumes_at_another_size(tmp_path):
    """apps/train_resnet.py saved at 2 ranks continues at 3 with ``--resume latest``: a ``resize`` event, then on
    to the end, with the learning rate scaled by 3/2 (``--lr-scaling linear``)."""
    args = [*RESNET, "--max-steps", "6", "--out-dir", str(tmp_path), "--lr", "0.08", "--lr-schedule", "constant",
            "--lr-scaling", "linear"]
    first = launch(2, "train_resnet.py", [*args, "--stop-at-step", "3"])
    assert first.returncode == 128 + 10, first.stderr[-3000:]  # SIGUSR1 outside a requeueing job
    second = launch(3, "train_resnet.py", [*args, "--resume", "latest"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(saved at 2 ranks, continued at 3)" in second.stdout
    records = strict_records(tmp_path / "metrics.jsonl")
    events = [r for r in records if r["event"] == "resize"]
    assert len(events) == 1 and (events[0]["old_size"], events[0]["new_size"], events[0]["step"]) == (2, 3, 3)
    assert records[-1]["event"] == "end" and records[-1]["step"] == 6 and records[-1]["stopped_by_signal"] == 0
    steps = [r["step"] for r in records[records.index(events[0]):] if r["event"] == "train"]
    assert steps == [4, 5, 6]
    lrs = {r["step"]: r["lr"] for r in records if r["event"] == "train"}
    assert events[0]["lr_factor"] == 1.5 and "learning rate x 1.5" in second.stdout, second.stdout[-2000:]
    assert [lrs[s] for s in range(1, 7)] == pytest.approx([0.08] * 3 + [0.12] * 3, rel=1e-12), lrs
