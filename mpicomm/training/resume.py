"""Resuming a run: which checkpoint ``--resume`` means, what it restores, and one clear error if it can't.

``--resume latest`` continues from the newest checkpoint in ``--out-dir`` and starts fresh (saying so)
when there is none yet, so a job script can always pass it (the SLURM templates do). ``--resume PATH``
takes a checkpoint directory, its ``checkpoint.h5``, a run directory, or a ``step-N`` name inside
``--out-dir``; that one must exist.

A checkpoint that cannot be used — missing, truncated or corrupted files, another world size,
algorithm, topology or model — is refused with one error that every rank raises alike (the app prints
it once and exits 2). For a damaged checkpoint it names the newest earlier one that loads intact.

A run resumes with the settings it was saved with, or not at all: when the algorithm's options
(``--lr``, ``--momentum``, ``--weight-decay``, ``--seed``, the method's own) or the optimizer's parameter
groups (``--no-decay-bias-norm``, their weight decay and momentum) differ from the checkpoint's, the resume
is refused with one line listing each difference — a checkpoint's optimizer state would otherwise silently
override the options given, and the run would record values it does not use. A model whose buffers differ
from the checkpoint's (BatchNorm's running statistics against a model without them) is refused alike.

An app also compares its own settings (:class:`AppSettings`, set around the run with
:func:`comparing_app_settings`): everything else the trajectory depends on (data, batch size, the
learning-rate schedule, accumulation, clipping, precision, …) by the flag that sets it, against what the
run that saved the checkpoint recorded in the ``start`` record of its ``metrics.jsonl``. A setting the
record lacks (a checkpoint of an earlier version, a run directory without its metrics) is not compared.
The run's length (``--epochs``, ``--max-steps``) may change only where nothing depends on it: with
``--lr-schedule constant`` and no algorithm option filled in from it (APMSqueeze's ``--total-steps``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, map_location
from ..checkpoint.compatibility import plain, settings_differences, signature_mismatch
from ..checkpoint.resize import load_resized, resized_counters, resized_position
from ..checkpoint.rng import restore_rng_state
from ..checkpoint.tree import CheckpointError
from ..errors import agreed_of, mark_agreed

__all__ = ["LENGTH_FLAGS", "LENGTH_FREE_SCHEDULES", "AppSettings", "Resumed", "comparing_app_settings",
           "resolve_resume", "restore_run", "restore_states"]

LENGTH_FLAGS = ("--epochs", "--max-steps")
"""The flags that set a run's length: compared through the length itself (see :class:`AppSettings`)."""
LENGTH_FREE_SCHEDULES = ("constant",)
"""The learning-rate schedules that do not depend on the run's length (a warm-up is counted in steps)."""


@dataclass(frozen=True)
class AppSettings:
    """What an app's run depends on besides the algorithm's options, compared on resume.

    ``flags``: each setting by the flag that sets it, with its value (JSON: numbers, strings, booleans
    for flags without a value, lists); the app records them in its metrics' ``start`` record.
    ``total_steps``: this run's length in steps. ``schedule``: its ``--lr-schedule``. ``derived``: options
    of the algorithm's config the app filled in from the run's length rather than the user
    (APMSqueeze's ``total_steps``); they are compared as the run's length, not as typed flags.
    """

    flags: dict
    total_steps: int
    schedule: str
    derived: frozenset = frozenset()


_APP_SETTINGS: contextvars.ContextVar[AppSettings | None] = contextvars.ContextVar("app_settings", default=None)


@contextlib.contextmanager
def comparing_app_settings(settings: AppSettings | None):
    """Within the block, :func:`restore_run` also compares ``settings`` with those the checkpoint's run recorded.

    The training loop calls :func:`restore_run` knowing only the library's objects; an app, which knows
    its own flags, sets them around :func:`~mpicomm.training.loop.run_training` (on every rank alike).
    """
    token = _APP_SETTINGS.set(settings)
    try:
        yield
    finally:
        _APP_SETTINGS.reset(token)


@dataclass
class Resumed:
    """Where a resumed run continues: the checkpoint, the data position and the run's counters."""

    path: Path
    step: int
    epoch: int
    batch: int
    counters: dict = field(default_factory=dict)
    resized_from: int | None = None  # the world size it was saved at, when another than this run's
    started_ranks: int = 0  # the world size the run began at (0: this one), the base of --lr-scaling linear


def resolve_resume(resume: str, out_dir: str) -> Path | None:
    """The checkpoint ``--resume`` names (None: ``latest`` with none saved yet); raises for a missing PATH.

    ``step-7`` (or ``7``) inside ``--out-dir`` means ``step-000000007``.
    """
    if resume == "latest":
        return latest_checkpoint(out_dir)
    path = Path(resume)
    if not path.exists() and out_dir:
        short = re.fullmatch(r"(?:step-)?(\d+)", resume)
        for name in (resume, f"step-{int(short.group(1)):09d}" if short else None):
            if name and (Path(out_dir) / name).exists():
                return Path(out_dir) / name
    return path


def restore_run(path: Path, algo, expect: dict, meta: dict, precision, steps_per_epoch: int = 0) -> Resumed:
    """Collective: load ``path`` into ``algo`` (the model's buffers, every RNG, the loss scale); where to go on.

    Tensors land on the device of ``algo``'s parameters, whatever device wrote them. ``expect`` is checked
    against the checkpoint's meta; ``meta`` (this run's :func:`~mpicomm.checkpoint.run_meta`) is compared
    separately so that a different model names the first parameter that differs, and different settings
    are listed one by one. A checkpoint of another world size continues at this one (:func:`_restore_resized`;
    ``steps_per_epoch``: this run's batches per epoch, where the data position lands).
    """
    try:
        state, saved = load_checkpoint(path, algo.comm, expect=expect, any_size=True)
    except Exception as exc:
        mark = agreed_of(exc)
        if mark is None:
            raise
        damaged = isinstance(exc, CheckpointError) and Path(path).exists()
        raise _refusal(path, mark.message, algo, expect, damaged) from exc
    resized = isinstance(state, list)
    app = _APP_SETTINGS.get()
    recorded = _shared_record(path, saved, algo) if app is not None else None
    problem = signature_mismatch(str(saved.get("model_signature", "")), meta["model_signature"]) or \
        _settings_mismatch(saved, algo, app, recorded, resized)
    problem = problem or _agreed(algo, _buffers_mismatch(algo.model, (state[0] if resized else state)["buffers"]))
    if problem:
        raise _refusal(path, problem, algo, expect, damaged=False)
    if resized:
        return _restore_resized(Path(path), state, algo, precision, steps_per_epoch)
    device = algo.flat.data.device
    state = map_location(state, device)
    algo.load_state_dict(state["algorithm"])
    _load_buffers(algo.model, state["buffers"])
    restore_rng_state(state["rng"], device)
    precision.load_state_dict(state.get("precision", {}))
    position = state["position"]
    return Resumed(Path(path), *(int(position[k]) for k in ("step", "epoch", "batch")),
                   counters=state.get("counters", {}), started_ranks=int(position.get("started_ranks", 0)))


def restore_states(states: list, places: list[int], algo, precision, steps_per_epoch: int) -> Resumed:
    """Collective: continue the survivors' committed ``states`` (in memory, one per rank of this job, in its rank
    order; ``places``: their ranks before the loss) after a lost rank, by the same rules as a checkpoint of
    another size (:func:`_restore_resized`)."""
    return _restore_resized(Path("(the survivors' memory)"), states, algo, precision, steps_per_epoch, places)


def _restore_resized(path: Path, states: list, algo, precision, steps_per_epoch: int,
                     places: list[int] | None = None) -> Resumed:
    """Collective: continue the N saved ``states`` at this job's size (docs/checkpoints.md, Another world size):
    the algorithm by its family's rule, the buffers and generators (:func:`~mpicomm.checkpoint.resize.
    load_resized`), the loss scale (agreed: rank 0's), the data position and this rank's counters."""
    position = states[0]["position"]
    old, new = len(states), algo.comm.size
    error = None
    try:
        load_resized(states, algo, int(position["step"]), places)
    except ValueError as exc:
        error = exc
    problems = algo.comm.allgather_object(str(error) if error else "", "the agreement on the resized checkpoint")
    problem = next((p for p in problems if p), "")
    if problem:
        raise _refusal(path, f"it was saved at {old} ranks, this run has {new}: {problem}", algo, {}, damaged=False)
    precision.load_state_dict(states[0].get("precision", {}))
    step, epoch, batch = resized_position(position, old, new, steps_per_epoch or int(position["batch"]) + 1)
    return Resumed(path, step, epoch, batch, counters=resized_counters(states, algo.comm.rank), resized_from=old,
                   started_ranks=int(position.get("started_ranks", old)))


def _refusal(path: Path, why: str, algo, expect: dict, damaged: bool) -> CheckpointError:
    """The agreed error for an unusable checkpoint, naming an intact earlier one when ``path`` is damaged."""
    hint = ""
    if damaged:
        intact = _newest_intact_before(Path(path), algo, expect)
        hint = (f"; the earlier checkpoint {intact.name} is intact: --resume {intact}" if intact else
                "; no earlier checkpoint is intact")
    exc = CheckpointError(f"cannot resume from {path}: {why}{hint}")
    size = algo.comm.size
    return mark_agreed(exc, str(exc), range(size), size)


def _run_directory(path: Path) -> tuple[Path, Path]:
    """(the checkpoint directory ``path`` names, the run directory holding it): ``path`` may be either, or
    the checkpoint's ``checkpoint.h5``."""
    directory = path.parent if path.is_file() else path
    return directory, directory.parent if directory.name.startswith("step-") else directory


def _newest_intact_before(path: Path, algo, expect: dict) -> Path | None:
    """Collective: the newest checkpoint older than ``path`` in its run directory that loads cleanly."""
    directory, root = _run_directory(path)
    older = [p for p in list_checkpoints(root) if p.resolve() != directory.resolve()]
    if directory.name.startswith("step-"):
        older = [p for p in older if p.name < directory.name]
    for candidate in reversed(older[-3:]):
        try:
            load_checkpoint(candidate, algo.comm, expect=expect, any_size=True)
            return candidate
        except Exception as exc:
            if agreed_of(exc) is None:
                raise
    return None


def _settings_mismatch(saved: dict, algo, app: AppSettings | None = None, recorded: dict | None = None,
                       resized: bool = False) -> str:
    """What of the run's settings differs from the checkpoint's, or ``""``: the algorithm's options, the
    optimizer's groups and, for an app, its own settings and the run's length (``recorded``: what the
    checkpoint's run recorded, see :func:`_recorded_run`; ``resized``: saved at another world size, where
    the length in steps follows the new global batch and only the typed length flags are compared)."""
    derived = app.derived if app is not None else frozenset()
    differ = _setting_differences(saved, algo, derived)
    why = ""
    if app is not None:
        differ += _flag_differences(app, recorded or {})
        length, why = _length_difference(app, recorded or {}, saved, algo, resized)
        differ += length
    if not differ:
        return ""
    return ("this run's settings differ from those it was saved with: " + ", ".join(differ) + why +
            "; resume with the same options, or start a new run in another --out-dir")


def _shown(value, flag: str = "") -> str:
    """``value`` as it is typed on the command line (a list comma-joined, a dict as KEY=VALUE,...)."""
    if isinstance(value, bool):
        return (flag if value else f"--no-{flag[2:]}") if flag else str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(_shown(v) for v in value)
    if isinstance(value, dict):
        return ",".join(f"{k}={_shown(v)}" for k, v in value.items())
    return str(value)


def _entry(flag: str, now, then, negatable: bool) -> str:
    """One difference, in the flag the user types: ``--batch-size 64 (the checkpoint's: 32)``.

    A flag without a value shows as given or not (``negatable``: as ``--flag`` / ``--no-flag``).
    """
    if isinstance(now, bool) and isinstance(then, bool):
        if negatable:
            return f"{_shown(now, flag)} (the checkpoint's: {_shown(then, flag)})"
        return f"{flag} {'given' if now else 'not given'} (the checkpoint's: {'given' if then else 'not given'})"
    return f"{flag} {_shown(now)} (the checkpoint's: {_shown(then)})"


def _setting_differences(saved: dict, algo, derived: frozenset) -> list[str]:
    """The algorithm's options (``derived`` ones aside) and optimizer groups that differ from the checkpoint's,
    as typed flags (:func:`~mpicomm.checkpoint.compatibility.settings_differences`; the topology is compared
    by the checkpoint's ``expect``)."""
    config = {f.name for f in dataclasses.fields(algo.config)}
    out = []
    for key, now, then in settings_differences(saved, algo):
        if key in config and key not in derived:
            out.append(_entry(_flag(key), now, then, negatable=True))
        elif key == "optimizer":
            out.append(f"the optimizer {now} (the checkpoint's: {then}; --no-decay-bias-norm makes two)")
        elif key.startswith("optimizer group"):
            out.append(f"{key} {now!r} (the checkpoint's: {then!r})")
    return out


def _json(value):
    """``value`` as a JSON round trip gives it back (tuples as lists), so a recorded value compares equal."""
    return json.loads(json.dumps(value))


def _flag_differences(app: AppSettings, recorded: dict) -> list[str]:
    """The app's settings that differ from those recorded; one missing on either side is not compared."""
    then = recorded.get("settings") or {}
    return [_entry(flag, value, then[flag], negatable=False) for flag, value in app.flags.items()
            if flag not in LENGTH_FLAGS and flag in then and _json(value) != then[flag]]


def _flag(key: str) -> str:
    """The command-line flag of config field ``key`` (``total_steps`` -> ``--total-steps``)."""
    return "--" + key.replace("_", "-")


def _moved_derived(app: AppSettings, saved: dict, algo) -> dict:
    """The ``derived`` options of the algorithm whose value differs from the checkpoint's: {key: (then, now)}."""
    config = dict(saved.get("algorithm", {}).get("config", {}))
    pairs = {key: (plain(config.get(key)), plain(getattr(algo.config, key, None))) for key in app.derived}
    return {key: pair for key, pair in pairs.items() if pair[0] != pair[1]}


def _length_dependents(app: AppSettings, algo, moved: dict) -> list[str]:
    """What of this run follows its length: a schedule shaped by it, algorithm options filled in from it."""
    out = [f"its {app.schedule} learning-rate schedule"] if app.schedule not in LENGTH_FREE_SCHEDULES else []
    return out + [f"{algo.name}'s {key} (filled in from it when {_flag(key)} is not given)" for key in sorted(moved)]


def _length_difference(app: AppSettings, recorded: dict, saved: dict, algo,
                       resized: bool = False) -> tuple[list[str], str]:
    """(the length flags that differ, why that is refused) when the run's length changed and something
    depends on it; nothing when the length is the same, unknown, or free to change. ``resized``: the same
    length flags at another world size are the same run (its length in steps follows the global batch)."""
    moved = _moved_derived(app, saved, algo)
    then = recorded.get("settings") or {}
    if resized and not moved and all(_json(app.flags.get(flag)) == then.get(flag) for flag in LENGTH_FLAGS
                                     if flag in app.flags and flag in then):
        return [], ""
    before = recorded.get("total_steps")
    if before is None and moved:
        before = next(iter(moved.values()))[0]
    depends = _length_dependents(app, algo, moved)
    if before is None or int(before) == app.total_steps or not depends:
        return [], ""
    differ = [_entry(flag, app.flags[flag], then[flag], negatable=False) for flag in LENGTH_FLAGS
              if flag in app.flags and flag in then and _json(app.flags[flag]) != then[flag]]
    if not differ:  # the flags were not recorded, or the same flags make another length (another batch size)
        given = " ".join(f"{flag} {_shown(app.flags[flag])}" for flag in LENGTH_FLAGS if flag in app.flags)
        differ = [f"{given}: a run of {app.total_steps} steps (the checkpoint's: {before})".lstrip(": ")]
    extend = "--lr-schedule constant" + "".join(f" and {_flag(key)} given" for key in sorted(moved))
    why = (f"; the run's length sets {' and '.join(depends)}, so it cannot change on resume: only a run trained "
           f"with {extend} from its start can be extended")
    return differ, why


def _recorded_run(path: Path, step: int) -> dict:
    """The ``start`` record of the run that saved the checkpoint of ``step`` at ``path`` (``{}``: unknown).

    It is read from ``metrics.jsonl`` of the checkpoint's run directory: the last ``start`` before the
    last ``checkpoint`` event of ``step`` (a run resumed from an earlier step saves that step again).
    """
    start, found = None, {}
    for record in _start_and_checkpoint_records(_run_directory(path)[1] / "metrics.jsonl"):
        if record.get("event") == "start":
            start = record
        elif record.get("event") == "checkpoint" and record.get("step") == step and start is not None:
            found = start
    return {key: found[key] for key in ("settings", "total_steps") if key in found}


def _start_and_checkpoint_records(path: Path) -> list[dict]:
    """The ``start`` and ``checkpoint`` records of a metrics file (none when it cannot be read); the
    other lines, most of a long run's, are not parsed, and a line that is not JSON is passed over."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if '"start"' not in line and '"checkpoint"' not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    out.append(record)
    except OSError:
        return []
    return out


def _shared_record(path: Path, saved: dict, algo) -> dict:
    """Collective: :func:`_recorded_run`, read by rank 0 and given to every rank."""
    record = _recorded_run(Path(path), int(saved.get("step", -1))) if algo.comm.rank == 0 else None
    return algo.comm.allgather_object(record, "the checkpoint's recorded settings")[0]


def _buffers_mismatch(model: torch.nn.Module, saved: dict) -> str:
    """How the checkpoint's buffers (BatchNorm's running statistics) differ from ``model``'s by name, or ``""``."""
    have, want = set(saved), {name for name, _ in model.named_buffers()}
    if have == want:
        return ""
    parts = []
    for names, whose, other in ((have - want, "the checkpoint has", "this job's model lacks"),
                                (want - have, "this job's model has", "the checkpoint lacks")):
        if names:
            shown = sorted(names)
            parts.append(f"{whose} {len(shown)} buffer(s) {other} ({', '.join(shown[:3])}"
                         f"{', …' if len(shown) > 3 else ''})")
    return ("its model keeps other buffers than this job's (such as BatchNorm's running statistics): " +
            "; ".join(parts))


def _agreed(algo, problem: str) -> str:
    """Collective: the first rank's non-empty ``problem`` on every rank (``""`` when no rank has one)."""
    problems = algo.comm.allgather_object(problem, "the agreement on the checkpoint's buffers")
    return next((p for p in problems if p), "")


def _load_buffers(model: torch.nn.Module, saved: dict) -> None:
    """Copy checkpointed buffers (BatchNorm running statistics) into ``model``."""
    buffers = dict(model.named_buffers())
    if set(buffers) != set(saved):
        raise ValueError(f"checkpoint buffers {sorted(saved)} do not match the model's {sorted(buffers)}")
    for name, value in saved.items():
        buffers[name].copy_(value)
