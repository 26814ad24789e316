"""Resuming an app run with changed settings: every setting the trajectory depends on is compared.

A tiny run is trained once per app; each case resumes it with something changed. A refused resume ends
before training (exit 2 on every rank, rank 0 printing one line that lists each difference in the flags
typed, with the checkpoint's value); an allowed change resumes. The run's length may change only with a
constant schedule (docs/training.md). Also here: options refused at parse time and data paths that are
no dataset, each in one line.

Every run's test reads only its exit status, output and files, so the runs go one after another in three
MPI jobs (``run_apps``: Python and torch start once per rank), each in the order the runs depend on
each other: the 1-rank runs (the BERT run and its refused resume, the constant-schedule run and its
resumes, the refused options and data paths); the 2-rank ResNet run and its resumes; and, once a copy
of that run has had the settings taken out of its metrics, that copy's two resumes.
"""

import dataclasses
import json
import shutil

import pytest

from mpicomm.training.resume import AppSettings, _settings_mismatch

from .app_runs import run_apps, strict_records

RESNET = ["--model", "resnet8", "--batch-size", "8", "--eval-limit", "8", "--eval-bn-batches", "1", "--max-steps", "2",
          "--log-every", "1", "--no-progress", "--algorithm", "dpsgd"]
BERT = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "16", "--eval-sequences", "4", "--vocab-size", "200",
        "--log-every", "1", "--no-progress", "--lr", "1e-3", "--max-steps", "2"]
CORPUS = "\n\n".join(f"Paragraph {i} holds words such as apple, river, stone and {i % 7} more lines of text here."
                     for i in range(200))


def _one_error(proc, app: str = "train_resnet") -> str:
    """The single ``error:`` line rank 0 printed (nothing else reached stderr), after exit status 2."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{app}: error: "), proc.stderr[-3000:]
    return lines[0]


def _resume(run, *changed: str, base=RESNET, app: str = "train_resnet.py") -> tuple[str, list[str]]:
    """The run (app, arguments) resuming ``run`` from its latest checkpoint with ``changed`` options after the
    ones it was trained with."""
    return app, [*base, "--out-dir", str(run), "--resume", "latest", *changed]


CHANGED = {"--batch-size": ("4", "8"), "--dirichlet-alpha": ("0.5", "0.0"), "--lr-schedule": ("step", "cosine"),
           "--lr-warmup-steps": ("1", "0"), "--accumulate": ("2", "1"), "--clip-grad-norm": ("1.5", "0.0"),
           "--precision": ("bf16", "fp32"), "--norm": ("group", "batch"), "--seed": ("3", "0"),
           "--lr": ("0.2", "0.1")}
DATA_PATHS = [
    ("train_bert.py", "--data", "--data: /dev/null is neither a file nor a folder (a device, pipe or socket)"),
    ("train_resnet.py", "--data-dir", "--data-dir '/dev/null' is not a folder"),
]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """``(run, results)``: ``run`` (``train``: 2 ranks, 2 steps of ResNet-8 on the digits with the default cosine
    schedule, saved at the end), then its resumes in one job: ``every-setting`` (each of :data:`CHANGED` and
    ``--no-augment``), ``longer`` (--epochs 1 --max-steps 0) and ``cadence`` (evaluation, checkpoint and
    logging cadence, the hang timeout, an --epochs that --max-steps caps)."""
    root = tmp_path_factory.mktemp("resnet")
    run = root / "run"
    runs = {"train": ("train_resnet.py", [*RESNET, "--out-dir", str(run)]),
            "every-setting": _resume(run, *[a for flag, (now, _) in CHANGED.items() for a in (flag, now)],
                                     "--no-augment"),
            "longer": _resume(run, "--epochs", "1", "--max-steps", "0"),
            "cadence": _resume(run, "--eval-every", "1", "--eval-limit", "4", "--save-every", "1", "--log-every",
                               "2", "--hang-timeout", "300", "--epochs", "5")}
    return run, run_apps(2, runs, root / "batch")


@pytest.fixture(scope="module")
def resnet_run(two_rank_runs):
    """2 ranks, 2 steps of ResNet-8 on the digits with the default cosine schedule, saved at the end."""
    run, results = two_rank_runs
    assert results["train"].returncode == 0, results["train"].stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """``(root, base, results)``, the 1-rank runs of one job, in this order: ``bert`` (2 steps of tiny BERT with
    APMSqueeze, the app's default, on a small corpus: arguments ``base``, into ``root / "bert"``) and
    ``bert-changed`` (its resume with other settings); ``constant`` (a ResNet run with a constant schedule, into
    ``root / "constant"``), ``constant-3`` and ``constant-1`` (its resumes to 3 steps, then to 1);
    ``dcd-overlap``; and ``data-<app>`` for each of :data:`DATA_PATHS`."""
    root = tmp_path_factory.mktemp("one-rank")
    corpus = root / "corpus.txt"
    corpus.write_text(CORPUS)
    base = [*BERT, "--data", str(corpus)]
    constant = [*RESNET, "--lr-schedule", "constant", "--out-dir", str(root / "constant")]
    runs = {"bert": ("train_bert.py", [*base, "--out-dir", str(root / "bert")]),
            "bert-changed": _resume(root / "bert", "--max-steps", "4", "--seq-len", "32", "--batch-size", "2",
                                    "--dropout", "0.2", base=base, app="train_bert.py"),
            "constant": ("train_resnet.py", constant),
            "constant-3": ("train_resnet.py", [*constant, "--resume", "latest", "--max-steps", "3"]),
            "constant-1": ("train_resnet.py", [*constant, "--resume", "latest", "--max-steps", "1"]),
            "dcd-overlap": ("train_resnet.py", [*RESNET, "--algorithm", "dcd", "--overlap"])}
    for app, option, _ in DATA_PATHS:
        runs[f"data-{app}"] = (app, [option, "/dev/null", "--max-steps", "1", "--no-progress"])
    return root, base, run_apps(1, runs, root / "batch")


@pytest.fixture(scope="module")
def bert_run(one_rank_runs):
    """1 rank, 2 steps of tiny BERT with APMSqueeze (the app's default) on a small corpus."""
    root, base, results = one_rank_runs
    assert results["bert"].returncode == 0, results["bert"].stderr[-3000:]
    return root / "bert", base


def test_every_changed_setting_is_listed_in_one_line_with_both_values(resnet_run, two_rank_runs):
    """Data split, batch size, schedule, accumulation, clipping, precision, augmentation, norm (GroupNorm on a
    BatchNorm checkpoint), seed and an algorithm option, all in one resume: one line names each."""
    proc = two_rank_runs[1]["every-setting"]
    line = _one_error(proc)
    assert f"cannot resume from {resnet_run / 'step-000000002'}: this run's settings differ" in line
    for flag, (now, then) in CHANGED.items():
        assert f"{flag} {now} (the checkpoint's: {then})" in line, flag
    assert "--no-augment given (the checkpoint's: not given)" in line
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_longer_cosine_run_is_refused_naming_the_flags_typed(resnet_run, two_rank_runs):
    """--epochs and --max-steps as typed; the length sets the cosine schedule; how to train a run to extend."""
    line = _one_error(two_rank_runs[1]["longer"])
    assert "--epochs 1 (the checkpoint's: 3), --max-steps 0 (the checkpoint's: 2)" in line
    assert "the run's length sets its cosine learning-rate schedule, so it cannot change on resume" in line
    assert "only a run trained with --lr-schedule constant from its start can be extended" in line


def test_changes_that_leave_the_trajectory_alone_resume(resnet_run, two_rank_runs):
    """Evaluation, checkpoint and logging cadence, the hang timeout, and an --epochs that --max-steps caps."""
    proc = two_rank_runs[1]["cadence"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {resnet_run / 'step-000000002'} at step 2 of 2" in proc.stdout


@pytest.fixture(scope="module")
def unrecorded_settings_resumes(resnet_run, tmp_path_factory):
    """``results``: a copy of the ResNet run (after its resumes) whose records lost their ``settings``, resumed
    with --batch-size 4 (``batch-size``), then with --norm group (``norm``), in one job."""
    root = tmp_path_factory.mktemp("old")
    run = root / "old"
    shutil.copytree(resnet_run, run)
    records = [{k: v for k, v in r.items() if k != "settings"} for r in strict_records(run / "metrics.jsonl")]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_apps(2, {"batch-size": _resume(run, "--batch-size", "4"), "norm": _resume(run, "--norm", "group")},
                    root / "batch")


def test_a_checkpoint_whose_run_recorded_no_settings_is_compared_on_what_it_records(unrecorded_settings_resumes):
    """An earlier version's run (no ``settings`` in its start record): nothing unknown is refused, and a model
    without the checkpoint's BatchNorm buffers is still one line."""
    proc = unrecorded_settings_resumes["batch-size"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = _one_error(unrecorded_settings_resumes["norm"])
    assert "its model keeps other buffers than this job's (such as BatchNorm's running statistics): the " \
           "checkpoint has 21 buffer(s) this job's model lacks (" in line


def test_a_constant_schedule_run_extends_and_cannot_shrink_below_its_checkpoint(one_rank_runs):
    root, _, results = one_rank_runs
    run = root / "constant"
    assert results["constant"].returncode == 0
    proc = results["constant-3"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run / 'step-000000002'} at step 2 of 3" in proc.stdout
    assert strict_records(run / "metrics.jsonl")[-1]["step"] == 3
    line = _one_error(results["constant-1"])
    assert "is at step 3, beyond this run's 1 steps" in line


def test_bert_names_max_steps_not_the_total_steps_it_fills_in(bert_run, one_rank_runs):
    line = _one_error(one_rank_runs[2]["bert-changed"], "train_bert")
    for entry in ("--seq-len 32 (the checkpoint's: 16)", "--batch-size 2 (the checkpoint's: 4)",
                  "--dropout 0.2 (the checkpoint's: 0.1)", "--max-steps 4 (the checkpoint's: 2)"):
        assert entry in line, entry
    assert "--total-steps 4" not in line
    assert "sets its cosine learning-rate schedule and apmsqueeze's total_steps" in line


@dataclasses.dataclass(frozen=True)
class _Config:
    total_steps: int


class _Algorithm:
    name, optimizer = "apmsqueeze", None

    def __init__(self, total_steps: int):
        self.config = _Config(total_steps)


def _mismatch(schedule: str, derived: frozenset, then: int = 4, now: int = 6) -> str:
    """The refusal (or "") of a run of ``now`` steps resumed from a checkpoint of a ``then``-step run."""
    saved = {"algorithm": {"config": dataclasses.asdict(_Config(then))}}
    app = AppSettings({"--max-steps": now, "--lr-schedule": schedule}, now, schedule, derived)
    recorded = {"settings": {"--max-steps": then, "--lr-schedule": schedule}, "total_steps": then}
    return _settings_mismatch(saved, _Algorithm(now), app, recorded)


def test_the_length_rule_counts_an_option_filled_in_from_the_length():
    """Constant schedule: free to extend, unless an algorithm option follows the length (APMSqueeze's
    total_steps, when --total-steps was not typed); a typed one is compared as typed."""
    assert _mismatch("constant", frozenset()).startswith("this run's settings differ from those it was saved with: "
                                                         "--total-steps 6 (the checkpoint's: 4)")
    assert _mismatch("constant", frozenset(), then=4, now=4) == ""
    derived = _mismatch("constant", frozenset({"total_steps"}))
    assert derived.startswith("this run's settings differ from those it was saved with: --max-steps 6 (the "
                              "checkpoint's: 4); the run's length sets apmsqueeze's total_steps"), derived
    assert "--lr-schedule constant and --total-steps given" in derived
    assert "--total-steps 6" not in derived


def test_an_option_of_another_algorithm_is_one_line(one_rank_runs):
    proc = one_rank_runs[2]["dcd-overlap"]
    line = _one_error(proc)
    assert line.startswith("train_resnet: error: --overlap: dcd cannot overlap its exchange with compute; the methods "
                           "that can: "), line
    assert "usage:" not in proc.stderr


@pytest.mark.parametrize("app, option, message", DATA_PATHS)
def test_a_data_path_that_is_no_dataset_says_what_it_is(app, option, message, one_rank_runs):
    line = _one_error(one_rank_runs[2][f"data-{app}"], app[:-3])
    assert message in line, line
