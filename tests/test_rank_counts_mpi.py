"""Every app trains to its end at any rank count, with IID and Dirichlet shards: no rank waits for another.

The apps' ``main`` runs in-process on every rank of the MPI tier (1, 2, 3 and 4 ranks), so the matrix of
rank counts costs no extra launches. Shards differ in size (1,438 digit images over 3 ranks: 480, 479,
479; a Dirichlet(0.5) split: anything), which once made ranks plan different numbers of batches per
epoch and hang at the epoch's end. Each run crosses an epoch's end and must finish with exit 0 on every
rank after exactly the closed-form number of steps, evaluated at the epoch's end and at the run's;
``--hang-timeout 120`` turns a hang into a failure within two minutes.
"""

import importlib.util
import os

import pytest

from mpicomm.training.metrics import read_metrics

from .app_runs import REPO
from .conftest import assert_all

pytestmark = pytest.mark.mpi

DIGITS_TRAIN = 1438  # scikit-learn's 1,797 digits less the 20 % test split (359)
BATCH = 96
COMMON = ["--batch-size", str(BATCH), "--epochs", "2", "--no-progress", "--log-every", "5", "--hang-timeout", "120"]
RESNET = ["--model", "resnet8", "--eval-limit", "16", "--eval-bn-batches", "1", "--lr", "0.05",
          "--algorithm", "dpsgd", *COMMON]
BERT = ["--preset", "tiny", "--seq-len", "16", "--eval-sequences", "8", "--lr", "1e-3", "--algorithm", "allreduce_adam",
        *COMMON]
CASES = {
    "resnet-iid": ("train_resnet.py", RESNET),
    "resnet-dirichlet": ("train_resnet.py", RESNET + ["--dirichlet-alpha", "0.5"]),
    "bert": ("train_bert.py", BERT),
}


def _app(name: str):
    spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(REPO, "apps", name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps_per_epoch(app: str, size: int, out: str) -> int:
    """Batches per epoch in closed form: the training set over ranks x batch (BERT: its packed sequences,
    with the tokenizer cached in ``out``, which the run then loads instead of training its own)."""
    if app == "train_resnet.py":
        return DIGITS_TRAIN // (size * BATCH)
    from bert.corpus import load_documents, pack_sequences, split_documents
    from bert.task import SPLIT_SEED
    from bert.tokenizer import obtain_tokenizer

    train, _ = split_documents(load_documents(None), SPLIT_SEED, 0.1)
    tokenizer = obtain_tokenizer(train, 4000, cache_dir=out)
    return len(pack_sequences(tokenizer, train, 16)) // size // BATCH


@pytest.mark.parametrize("case", sorted(CASES))
def test_app_trains_across_an_epoch_to_the_end_at_any_rank_count(comm, tmp_path_factory, case):
    """Exit 0 on every rank after the closed-form number of steps, evaluated at the epoch's end and the run's."""
    app, args = CASES[case]
    out = comm.bcast(str(tmp_path_factory.mktemp(case)) if comm.Get_rank() == 0 else None)
    main = _app(app).main
    per_epoch = comm.bcast(_steps_per_epoch(app, comm.Get_size(), out) if comm.Get_rank() == 0 else None)
    code = main([*args, "--max-steps", str(per_epoch + 1), "--out-dir", out])
    assert_all(comm, code == 0, f"exit {code}")
    records = read_metrics(os.path.join(out, "metrics.jsonl")) if comm.Get_rank() == 0 else []
    start = next((r for r in records if r["event"] == "start"), {})
    end = next((r for r in records if r["event"] == "end"), {})
    evals = [r["step"] for r in records if r["event"] == "eval"]
    ok = comm.Get_rank() != 0 or (start["steps_per_epoch"] == per_epoch and
                                  end["step"] == end["total_steps"] == per_epoch + 1 and
                                  evals == [per_epoch, per_epoch + 1])
    assert_all(comm, ok, f"steps per epoch {start.get('steps_per_epoch')} (expected {per_epoch}), end {end}, "
                         f"evaluations at steps {evals}")
