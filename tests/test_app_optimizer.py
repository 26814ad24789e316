"""``--no-decay-bias-norm``, ``--accumulate`` and ``--clip-grad-norm`` in the apps (serial tier: MPI jobs).

The parameter groups are checked on the apps' real models; with weight decay 0 the groups' torch SGD
must reproduce the stored D-PSGD reference curve of the built-in optimizer (same tolerance as
``test_apps``), and bad combinations must fail on every rank with one message.

The app runs (the two training runs and the bad combinations) read only their exit status, output and
files, so they run one after another in one 2-rank MPI job (``run_apps``: Python and torch start once).
"""

import importlib
import json
import os
import sys

import pytest
import torch

from mpicomm.training.metrics import read_metrics
from mpicomm.training.param_groups import decay_groups

from .app_runs import REPO, RESNET, run_apps

APPS = os.path.join(REPO, "apps")
REFERENCE = os.path.join(REPO, "tests", "reference", "apps.json")


GROUPS = [*RESNET, "--algorithm", "dpsgd", "--momentum", "0.9", "--no-decay-bias-norm"]
TOGETHER = [*RESNET, "--algorithm", "allreduce_sgd", "--overlap", "--momentum", "0.9", "--weight-decay", "5e-4",
            "--no-decay-bias-norm", "--accumulate", "2", "--clip-grad-norm", "1.0"]
BAD_COMBINATIONS = [
    (["--algorithm", "hsq", "--no-decay-bias-norm"], "--no-decay-bias-norm needs an algorithm that accepts"),
    (["--algorithm", "lamb", "--clip-grad-norm", "1"], "lamb does not support clip_grad_norm_"),
]


@pytest.fixture(scope="module")
def app_runs(tmp_path_factory):
    """``(folder, results)``: the groups run (``groups``), the run of everything together (``together``) and each
    of :data:`BAD_COMBINATIONS` (``bad-<i>``), run in one batch; a training run writes into ``folder / name``."""
    root = tmp_path_factory.mktemp("optimizer")
    runs = {"groups": ("train_resnet.py", [*GROUPS, "--out-dir", str(root / "groups")]),
            "together": ("train_resnet.py", [*TOGETHER, "--out-dir", str(root / "together")])}
    for i, (args, _) in enumerate(BAD_COMBINATIONS):
        runs[f"bad-{i}"] = ("train_resnet.py", ["--max-steps", "1", "--no-progress", *args])
    return root, run_apps(2, runs, root / "batch")


def _apps_module(name):
    if APPS not in sys.path:
        sys.path.insert(0, APPS)
    return importlib.import_module(name)


def _names(model, group):
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_resnet_groups_put_biases_and_batchnorm_in_the_group_without_decay():
    model = _apps_module("models.resnet").build_model("resnet20", 10)
    decayed, plain = decay_groups(model, 5e-4)
    assert (decayed["weight_decay"], plain["weight_decay"]) == (5e-4, 0.0)
    names = dict(model.named_modules())
    for name in _names(model, plain):
        module = names[name.rsplit(".", 1)[0]]
        assert isinstance(module, torch.nn.BatchNorm2d) or name.endswith("bias"), name
    assert all(names[n.rsplit(".", 1)[0]].__class__ in (torch.nn.Conv2d, torch.nn.Linear) and n.endswith("weight")
               for n in _names(model, decayed))
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_bert_groups_put_biases_and_layernorm_in_the_group_without_decay():
    model = _apps_module("bert.model").build_model("tiny", 128, seed=0)
    decayed, plain = decay_groups(model, 0.01)
    assert any("LayerNorm.weight" in n for n in _names(model, plain))
    assert not any("LayerNorm" in n or n.endswith("bias") for n in _names(model, decayed))
    assert any("word_embeddings" in n for n in _names(model, decayed))


def test_groups_without_decay_reproduce_the_builtin_dpsgd_curve(app_runs):
    """Weight decay 0: the app's torch SGD over two groups takes the built-in SGD's steps (stored curve)."""
    root, results = app_runs
    proc = results["groups"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(root / "groups" / "metrics.jsonl"))
    assert records[0]["optimizer"] == "SGD over 2 parameter groups (weight_decay 0, 0)"
    losses = [r["loss"] for r in records if r["event"] == "train"]
    expected = json.load(open(REFERENCE))["resnet-dpsgd-2"]
    assert losses[0] == pytest.approx(expected[0], rel=1e-5)
    assert losses[1:] == pytest.approx(expected[1:], rel=3e-2)


def test_accumulation_clipping_and_groups_run_together(app_runs):
    root, results = app_runs
    proc = results["together"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(root / "together" / "metrics.jsonl"))
    start = records[0]
    assert start["train_config"]["accumulate"] == 2 and start["train_config"]["clip_grad_norm"] == 1.0
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(0 < r["loss"] < 10 for r in train)
    assert train[-1]["sum_count"] == 2 * 8 * 2  # one step = 2 micro-batches of 8 on each of 2 ranks


@pytest.mark.parametrize("index", range(len(BAD_COMBINATIONS)),
                         ids=[f"args{i}-{message}" for i, (_, message) in enumerate(BAD_COMBINATIONS)])
def test_bad_combinations_fail_with_one_clear_message(index, app_runs):
    message = BAD_COMBINATIONS[index][1]
    proc = app_runs[1][f"bad-{index}"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count(message) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
