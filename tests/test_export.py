"""``mpicomm export`` on real runs: the exported files reproduce the run's own evaluation, loaded without mpicomm.

A 2-rank D-PSGD run of each app (4 steps, a checkpoint at the end; D-PSGD so the ranks' models
differ) is exported; the files are loaded into fresh models built by the apps' model code (or by
transformers alone) and evaluated as the apps evaluate: the averaged model must score the final
``eval`` record of ``metrics.jsonl``, each rank's model one of that record's per-rank extremes. The
exported tensors are also checked against the checkpoint read with plain h5py. Bad input: one line,
exit 2, nothing written.

A run stopped after an evaluation (``--stop-at-step``, as SIGUSR1 stops it) is exported as the model its final
line scored. The app runs (the ResNet and BERT runs, the ResNet run without ``--save-every``, the one with
``--eval-bn-batches 0`` and the stopped one) read only their exit status, output and files, so they run one
after another in one 2-rank MPI job (``run_apps``: Python and torch start once). The export itself runs in
this process, and once in a fresh Python without MPI (a subprocess that checks mpi4py is never imported).
"""

import importlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from torch.nn import functional as F

from mpicomm.cli import main as cli

from .app_runs import RESNET, run_apps, strict_records

APPS = Path(__file__).resolve().parents[1] / "apps"
EVAL_LIMIT = int(RESNET[RESNET.index("--eval-limit") + 1])
BERT = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "32", "--eval-sequences", "16", "--max-steps", "4",
        "--log-every", "2", "--no-progress", "--algorithm", "dpsgd", "--lr", "0.5"]


def _app_module(name: str):
    """A module of ``apps/`` imported the way the app scripts see it (``apps/`` on sys.path)."""
    if str(APPS) not in sys.path:
        sys.path.insert(0, str(APPS))
    return importlib.import_module(name)


RESNET_DPSGD = [*RESNET, "--algorithm", "dpsgd", "--momentum", "0.9"]
SAVE_AT_END = ["--save-every", "4"]
RUNS = {  # name: (app, arguments but --out-dir)
    "resnet": ("train_resnet.py", [*RESNET_DPSGD, *SAVE_AT_END]),
    "plain": ("train_resnet.py", RESNET_DPSGD),
    "resnet_bn0": ("train_resnet.py", [*RESNET_DPSGD, "--eval-bn-batches", "0", *SAVE_AT_END]),
    "bert": ("train_bert.py", [*BERT, *SAVE_AT_END]),
    "stopped": ("train_resnet.py", [*RESNET_DPSGD, "--eval-every", "2", "--stop-at-step", "3"]),
}


@pytest.fixture(scope="module")
def app_runs(tmp_path_factory):
    """``(folder, results)``: every run of :data:`RUNS` on 2 ranks, run in one batch; each writes into
    ``folder / name``."""
    root = tmp_path_factory.mktemp("export")
    runs = {name: (app, [*args, "--out-dir", str(root / name)]) for name, (app, args) in RUNS.items()}
    return root, run_apps(2, runs, root / "batch")


def _run(app_runs, name: str) -> Path:
    """The output folder of the run ``name`` of :data:`RUNS`, which must have succeeded."""
    root, results = app_runs
    proc = results[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / name


@pytest.fixture(scope="module")
def resnet_run(app_runs) -> Path:
    """ResNet-20 with BatchNorm, D-PSGD on 2 ranks, 4 steps: a checkpoint at step 4 and its final eval."""
    return _run(app_runs, "resnet")


@pytest.fixture(scope="module")
def bert_run(app_runs) -> Path:
    """BERT tiny, D-PSGD on 2 ranks, 4 steps (a trained tokenizer cached in the run directory)."""
    return _run(app_runs, "bert")


def _final_eval(run: Path) -> dict:
    return [r for r in strict_records(run / "metrics.jsonl") if r["event"] == "eval"][-1]


def _export(capsys, *args) -> tuple[int, str, str]:
    code = cli(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def _checkpoint_params(run: Path, rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat parameters at the latest checkpoint, read with plain h5py."""
    step = (run / "latest").read_text().strip()
    with h5py.File(run / step / "checkpoint.h5", "r") as f:
        return torch.from_numpy(f[f"ranks/{rank:05d}/algorithm/params"][()])


# ------------------------------------------------------------------------------------------- ResNet
def _resnet_eval(state: dict) -> dict:
    """The app's test metrics of a fresh ResNet-20 holding ``state`` (strict load; ImageTask's evaluation)."""
    images, resnet = _app_module("data.images"), _app_module("models.resnet")
    model = resnet.build_model("resnet20", 10, "batch", seed=123)  # other initial weights: all must be loaded
    model.load_state_dict(state, strict=True)
    data = images.load_digits32(seed=0)
    x, y = data.normalise(data.x_test[:EVAL_LIMIT]), data.y_test[:EVAL_LIMIT]
    model.eval()
    with torch.no_grad():
        logits = model(x)
    return {"test_loss": float(F.cross_entropy(logits, y, reduction="sum")) / len(y),
            "test_accuracy": int((logits.argmax(1) == y).sum()) / len(y)}


def _recomputed_statistics(state: dict, batches: int = 8) -> dict:
    """``state`` with BatchNorm statistics recomputed for its weights, written from the description in
    ``mpicomm.training.batchnorm`` (not its code): each rank's first ``batches`` training batches of epoch 0
    (the app's ImageTask, seed 0) in train mode with a cumulative average, then the mean over the 2 ranks."""
    images, resnet = _app_module("data.images"), _app_module("models.resnet")
    task_module = _app_module("data.image_task")
    data = images.load_digits32(seed=0)
    batch_size = int(RESNET[RESNET.index("--batch-size") + 1])
    per_rank = []
    for rank in range(2):
        model = resnet.build_model("resnet20", 10, "batch", seed=0)
        model.load_state_dict(state, strict=True)
        task = task_module.ImageTask(model, data, rank=rank, size=2, batch_size=batch_size, seed=0)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
        model.train()
        with torch.no_grad():
            for _, (x, _) in zip(range(batches), task.train_batches(0)):
                model(x)
        per_rank.append({k: v.clone() for k, v in model.state_dict().items()})
    out = dict(state)
    for key in state:
        if key.endswith(("running_mean", "running_var")):
            out[key] = ((per_rank[0][key].double() + per_rank[1][key].double()) / 2).float()
    return out


def test_resnet_average_reproduces_the_runs_evaluation(resnet_run, tmp_path, capsys):
    """The run evaluates the averaged parameters with BatchNorm statistics recomputed for them; the exported
    average with those statistics recomputed independently scores the same, rank 0's statistics do not."""
    code, out, _ = _export(capsys, resnet_run, "-o", tmp_path / "avg.pt", "--average", "--buffers", "0")
    assert code == 0 and "the average of 2 ranks' models of step 4" in out and "from rank 0" in out
    state = torch.load(tmp_path / "avg.pt", weights_only=True)
    final = _final_eval(resnet_run)
    got = _resnet_eval(_recomputed_statistics(state))
    assert got["test_accuracy"] == final["test_accuracy"]
    assert got["test_loss"] == pytest.approx(final["test_loss"], rel=1e-5)
    assert _resnet_eval(state)["test_loss"] != pytest.approx(final["test_loss"], rel=1e-5)


def test_the_default_export_of_a_run_is_the_model_it_scored(app_runs, tmp_path, capsys):
    """A run with --out-dir and no --save-every still ends with a checkpoint, and ``mpicomm export`` of it with no
    option gives the model the run's final evaluation scored: the same accuracy and loss, loaded in plain torch."""
    root, results = app_runs
    out = root / "plain"
    proc = results["plain"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, printed, _ = _export(capsys, out, "-o", tmp_path / "model.pt")
    assert code == 0 and "the model the run evaluated at step 4" in printed, printed
    final = _final_eval(out)
    got = _resnet_eval(torch.load(tmp_path / "model.pt", weights_only=True))
    assert got["test_accuracy"] == final["test_accuracy"]
    assert got["test_loss"] == pytest.approx(final["test_loss"], rel=1e-6)


def test_a_stopped_runs_final_line_and_export_name_the_same_evaluated_model(app_runs, tmp_path, capsys):
    """Stopped at step 3 (as by SIGUSR1) after its evaluation at step 2: the final line gives step 2's score and
    says it is step 2's model's; ``mpicomm export`` with no option writes that model, which scores it again."""
    root, results = app_runs
    proc = results["stopped"]
    assert proc.returncode == 128 + signal.SIGUSR1, proc.stderr[-3000:]
    out = root / "stopped"
    evals = [r for r in strict_records(out / "metrics.jsonl") if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [2]
    final = [line for line in proc.stdout.splitlines() if "test accuracy of the averaged model" in line]
    assert final == [f"train_resnet: test accuracy of the averaged model of step 2 (its last evaluation; mpicomm "
                     f"export {out} writes that model): {100 * evals[0]['test_accuracy']:.2f} %  |  steps 3/4"
                     + final[0].split("steps 3/4", 1)[-1]], proc.stdout
    code, printed, _ = _export(capsys, out, "-o", tmp_path / "model.pt")
    assert code == 0 and "the average of 2 ranks' models of step 2 (" in printed, printed
    assert "the model the run evaluated at step 2" in printed and "stopped at step 3" in printed, printed
    got = _resnet_eval(torch.load(tmp_path / "model.pt", weights_only=True))
    assert got["test_accuracy"] == evals[0]["test_accuracy"]
    assert got["test_loss"] == pytest.approx(evals[0]["test_loss"], rel=1e-6)
    code, printed, _ = _export(capsys, out, "-o", tmp_path / "now.pt", "--buffers", "average")  # step 3's own
    assert code == 0 and "models of step 3 (" in printed, printed
    now, then = (torch.load(tmp_path / name, weights_only=True)["fc.weight"] for name in ("now.pt", "model.pt"))
    assert not torch.equal(now, then)


def test_resnet_evaluation_with_rank_0s_statistics(app_runs, tmp_path, capsys):
    """``--eval-bn-batches 0``: the averaged model is evaluated with rank 0's statistics, as export --buffers 0."""
    run = _run(app_runs, "resnet_bn0")
    code, _, _ = _export(capsys, run, "-o", tmp_path / "avg.pt", "--average", "--buffers", "0")
    final = _final_eval(run)
    got = _resnet_eval(torch.load(tmp_path / "avg.pt", weights_only=True))
    assert code == 0 and got["test_accuracy"] == final["test_accuracy"]
    assert got["test_loss"] == pytest.approx(final["test_loss"], rel=1e-5)


def test_resnet_rank_exports_are_the_ranks_own_models(resnet_run, tmp_path, capsys):
    scores = []
    for rank in (0, 1):
        assert _export(capsys, resnet_run, "-o", tmp_path / f"r{rank}.pt", "--rank", rank)[0] == 0
        state = torch.load(tmp_path / f"r{rank}.pt", weights_only=True)
        flat = torch.cat([v.reshape(-1) for k, v in state.items() if "running" not in k and "num_batches" not in k])
        assert torch.equal(flat, _checkpoint_params(resnet_run, rank))
        scores.append(_resnet_eval(state))
    final = _final_eval(resnet_run)
    for key in ("test_loss", "test_accuracy"):
        values = sorted(s[key] for s in scores)
        assert values == pytest.approx([final[f"{key}_rank_min"], final[f"{key}_rank_max"]], rel=1e-5)
    assert scores[0]["test_loss"] != scores[1]["test_loss"]  # D-PSGD: the ranks' models differ


def test_resnet_average_averages_parameters_and_batchnorm_statistics(resnet_run, tmp_path, capsys):
    code, out, _ = _export(capsys, resnet_run, "-o", tmp_path / "avg.pt", "--buffers", "average")
    assert code == 0 and "floating-point BatchNorm statistics averaged" in out
    for rank in (0, 1):
        cli(["export", str(resnet_run), "-o", str(tmp_path / f"r{rank}.pt"), "--rank", str(rank)])
    avg, r0, r1 = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("avg", "r0", "r1"))
    reference = _app_module("models.resnet").build_model("resnet20", 10, "batch").state_dict()
    assert list(avg) == list(reference) and all(avg[k].shape == v.shape for k, v in reference.items())
    params = (_checkpoint_params(resnet_run, 0).double() + _checkpoint_params(resnet_run, 1).double()) / 2
    offset = 0
    for key, value in avg.items():
        if "running" in key:
            assert torch.equal(value, ((r0[key].double() + r1[key].double()) / 2).float()), key
            assert not torch.equal(r0[key], r1[key]), key  # each rank's statistics saw its own shard
        elif "num_batches_tracked" in key:
            assert int(value) == int(r0[key]) == 4
        else:
            assert torch.equal(value.reshape(-1), params[offset:offset + value.numel()].float()), key
            offset += value.numel()
    assert offset == params.numel()


def test_bad_input_is_one_line_and_exit_2(resnet_run, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "empty-run").mkdir()
    cases = {
        "--rank must be in [0, 1]": [resnet_run, "-o", tmp_path / "a.pt", "--rank", "2"],
        "--format hf needs a run of a transformers model": [resnet_run, "-o", tmp_path / "hf", "--format", "hf"],
        "no checkpoint at": [tmp_path / "empty-run", "-o", tmp_path / "a.pt"],
        "is not a folder": [resnet_run, "-o", tmp_path / "file" / "a.pt"],
        "is a folder; --format torch writes one file": [resnet_run, "-o", tmp_path],
        "exists and is not an empty folder": [resnet_run, "-o", tmp_path / "full", "--format", "hf"],
        "--buffers must be 'evaluated', 'average' or a rank in [0, 1]":
            [resnet_run, "-o", tmp_path / "a.pt", "--buffers", "2"],
        "--buffers applies to the averaged model only":
            [resnet_run, "-o", tmp_path / "a.pt", "--rank", "1", "--buffers", "0"],
    }
    for expected, args in cases.items():
        code, out, err = _export(capsys, *args)
        assert code == 2 and not out and err.count("\n") == 1 and err.startswith("mpicomm export: error: "), err
        assert expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-run", "file", "full"]  # nothing written


def test_the_command_runs_without_mpi_and_refuses_without_a_traceback(resnet_run, tmp_path):
    script = ("import sys; from mpicomm.cli import main; ok = main(sys.argv[1:5]); bad = main(sys.argv[5:]); "
              "assert 'mpi4py' not in sys.modules; sys.exit(10 * ok + bad)")
    proc = subprocess.run([sys.executable, "-c", script, "export", str(resnet_run), "-o", str(tmp_path / "m.pt"),
                           "export", str(resnet_run), "-o", str(tmp_path / "x.pt"), "--rank", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and (tmp_path / "m.pt").is_file(), proc.stderr[-2000:]  # 0 then 2: exit 10 * 0 + 2
    assert proc.stderr == "mpicomm export: error: --rank must be in [0, 1]: " \
        f"{resnet_run / 'step-000000004'} holds 2 ranks, got -1\n"


def test_a_checkpoint_without_the_key_record_exports_parameters_and_buffers(resnet_run, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(resnet_run, old)
    step = (old / "latest").read_text().strip()
    with h5py.File(old / step / "checkpoint.h5", "r+") as f:  # as an mpicomm 0.1.0 checkpoint: no meta["model"]
        del f["meta/model"]
        f["meta"].attrs["keys"] = json.dumps([k for k in json.loads(f["meta"].attrs["keys"]) if k != "model"])
    code, out, _ = _export(capsys, old, "-o", tmp_path / "old.pt", "--rank", "1")
    assert code == 0 and "strict=False" in out
    assert _export(capsys, resnet_run, "-o", tmp_path / "new.pt", "--rank", "1")[0] == 0
    old_state, new_state = (torch.load(tmp_path / n, weights_only=True) for n in ("old.pt", "new.pt"))
    assert sorted(old_state) == sorted(new_state)  # ResNet: no tied weights, no non-persistent buffers
    assert all(torch.equal(old_state[k], new_state[k]) for k in new_state)


# --------------------------------------------------------------------------------------------- BERT
@pytest.fixture(scope="module")
def bert_task(bert_run):
    """The run's validation data and tokenizer, rebuilt by the app's own code (tokenizer from the run's cache)."""
    bert = _app_module("bert")
    return bert.build_task("tiny", None, None, 32, 8, 0, 2, 0, None, bert_run, eval_sequences=16)


def test_bert_hf_export_loads_with_transformers_and_reproduces_the_validation(bert_run, bert_task, tmp_path, capsys):
    from transformers import AutoTokenizer, BertForMaskedLM

    code, out, err = _export(capsys, bert_run, "-o", tmp_path / "hf", "--format", "hf")
    assert code == 0 and "tokenizer from" in out and not err, out + err
    model = BertForMaskedLM.from_pretrained(tmp_path / "hf")
    final = _final_eval(bert_run)
    got = bert_task.evaluate(model)
    assert got["val_mlm_accuracy"] == final["val_mlm_accuracy"]
    assert got["val_mlm_loss"] == pytest.approx(final["val_mlm_loss"], rel=1e-5)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The quick brown fox jumps over the lazy dog; def f(x): return x ** 2"
    assert tok(text)["input_ids"] == bert_task.tokenizer.encode(text).ids
    assert tok.mask_token_id == bert_task.tokenizer.token_to_id("[MASK]")


def test_bert_rank_and_torch_exports(bert_run, bert_task, tmp_path, capsys):
    from transformers import BertForMaskedLM

    losses = []
    for rank in (0, 1):
        assert _export(capsys, bert_run, "-o", tmp_path / f"hf{rank}", "--format", "hf", "--rank", rank)[0] == 0
        losses.append(bert_task.evaluate(BertForMaskedLM.from_pretrained(tmp_path / f"hf{rank}"))["val_mlm_loss"])
    final = _final_eval(bert_run)
    assert sorted(losses) == pytest.approx([final["val_mlm_loss_rank_min"], final["val_mlm_loss_rank_max"]], rel=1e-5)
    assert losses[0] != losses[1]
    assert _export(capsys, bert_run, "-o", tmp_path / "m.pt")[0] == 0
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    fresh = BertForMaskedLM(BertForMaskedLM.config_class.from_pretrained(tmp_path / "hf0"))
    fresh.load_state_dict(state, strict=True)  # the tied decoder weight is in the file under its own key too
    assert torch.equal(state["cls.predictions.decoder.weight"], state["bert.embeddings.word_embeddings.weight"])
    assert bert_task.evaluate(fresh)["val_mlm_loss"] == pytest.approx(final["val_mlm_loss"], rel=1e-5)
