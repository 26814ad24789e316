"""sbatch templates: parse the ``#SBATCH`` header and the ``: "${KEY:=default}"`` parameters, validate, render.

A template has two kinds of settings, both overridable with ``--set KEY=VALUE``:

* scheduler options, lower-case (``nodes``, ``ntasks-per-node``, ``time``, ``gpus-per-task``, …): the
  ``#SBATCH --key=value`` lines; a commented ``##SBATCH --key=…`` line is enabled with the value, and a known
  option the template lacks is added to the header;
* job parameters, upper-case (``ALGORITHM``, ``EPOCHS``, ``EXTRA_ARGS``, …): shell defaults that
  ``sbatch --export=ALL,KEY=VALUE`` can still override at submission time.

Values are validated before anything reaches the scheduler (``ValueError`` naming the key and what is
allowed): unknown keys, non-positive counts, malformed time limits, unknown algorithms, topologies or
apps, an ``ON_RANK_LOSS`` other than ``stop``/``continue`` (or ``continue`` with ``LAUNCHER=srun``). A
parameter's value is quoted, never evaluated: ``$(…)``, backticks, ``$VAR`` and quotes reach the job as the
literal text given (use ``sbatch --export`` for values the job's shell should expand).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DATA_NAMES", "ON_RANK_LOSS_VALUES", "SBATCH_OPTIONS", "Template", "parse_template", "quote", "render",
           "unquote"]

_HEADER = re.compile(r"^#SBATCH\s+--([a-z-]+)(?:=(.*))?$")
_COMMENTED = re.compile(r"^##SBATCH\s+--([a-z-]+)(?:=(.*))?$")  # a header line left for the user to enable
_PARAM = re.compile(r'^: "\$\{([A-Z][A-Z0-9_]*):=(.*)\}"(\s+#.*)?$')
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_POSITIVE = ("nodes", "ntasks", "ntasks-per-node", "cpus-per-task", "gpus-per-task", "gpus-per-node", "gpus")

DATA_NAMES = ("", "cifar10", "mnist", "python-docs")

ON_RANK_LOSS_VALUES = ("stop", "continue")
"""The values of ``ON_RANK_LOSS`` (the apps' ``--on-rank-loss`` that a job script launches for)."""
"""The values of ``DATA``: the datasets a job keeps in ``MPICOMM_DATA_DIR`` (see ``apps/fetch_data.py``)."""

SBATCH_OPTIONS = frozenset(_POSITIVE + (
    "job-name", "time", "output", "error", "open-mode", "signal", "requeue", "partition", "account", "qos",
    "mem", "mem-per-cpu", "constraint", "exclusive", "gres", "mail-type", "mail-user",
))
"""The scheduler options ``--set`` may set or add."""


@dataclass
class Template:
    """A parsed template: its lines, where each header option and parameter sits, and their values."""

    lines: list[str]
    headers: dict[str, int]
    params: dict[str, int]

    def value(self, key: str) -> str | None:
        """The current value of header option or parameter ``key`` (None for a flag without value).

        A parameter's value is returned as written in the template (a default may use ``${…}``);
        a value set by :func:`render` reads back as the literal text it was given.
        """
        if key in self.headers:
            return _HEADER.match(self.lines[self.headers[key]]).group(2)
        return unquote(_PARAM.match(self.lines[self.params[key]]).group(2))

    def keys(self) -> list[str]:
        """Every settable key present in the template."""
        return sorted(self.headers) + sorted(self.params)


def parse_template(text: str) -> Template:
    """Locate the ``#SBATCH`` options and the parameter defaults of a template."""
    lines = text.splitlines()
    headers, params = {}, {}
    for i, line in enumerate(lines):
        if (m := _HEADER.match(line)) is not None:
            headers[m.group(1)] = i
        elif (m := _PARAM.match(line)) is not None:
            params[m.group(1)] = i
    if not headers:
        raise ValueError("not an sbatch template: no '#SBATCH --option=value' lines")
    return Template(lines, headers, params)


def quote(value: str) -> str:
    """``value`` escaped for a ``: "${KEY:=value}"`` line: the shell keeps it literal, never runs any of it."""
    return re.sub(r'([\\$`"}])', r"\\\1", value)


def unquote(text: str) -> str:
    """The literal value of :func:`quote`'s output."""
    return re.sub(r"\\(.)", r"\1", text)


def _valid_time(value: str) -> bool:
    """Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (minutes, seconds < 60; hours < 24 after days)."""
    m = _TIME.match(value)
    if m is None:
        return False
    days, first, second, third = m.groups()
    if days is None:
        fields = [int(v) for v in (first, second, third) if v is not None]
        return all(v < 60 for v in fields[1:])  # M, M:S or H:M:S: minutes and seconds below 60
    hours, rest = int(first), [int(v) for v in (second, third) if v is not None]
    return hours < 24 and all(v < 60 for v in rest)


def _validate(key: str, value: str) -> None:
    if "\n" in value or "\0" in value:
        raise ValueError(f"--set {key}: values may not contain newlines or NUL")
    if key in _POSITIVE and not (value.isdigit() and int(value) > 0):
        raise ValueError(f"--set {key}={value}: expected a positive integer")
    if key == "time" and not _valid_time(value):
        raise ValueError(f"--set time={value}: expected minutes, MM:SS, HH:MM:SS, D-HH or D-HH:MM[:SS] "
                         "(minutes and seconds below 60, hours below 24 after a day count)")
    if key == "APP":
        _validate_app(value)
    if key in ("EPOCHS", "SAVE_EVERY") and not value.isdigit():
        raise ValueError(f"--set {key}={value}: expected a non-negative integer")
    if key == "ALGORITHM":
        from ..algorithms import ALGORITHMS

        if value not in ALGORITHMS:
            raise ValueError(f"--set ALGORITHM={value}: unknown algorithm; choose one of {sorted(ALGORITHMS)}")
    if key == "TOPOLOGY":
        from ..topology import TOPOLOGIES

        if value not in TOPOLOGIES:
            raise ValueError(f"--set TOPOLOGY={value}: unknown topology; choose one of {sorted(TOPOLOGIES)}")
    if key == "DATA" and value not in DATA_NAMES:
        raise ValueError(f"--set DATA={value}: expected one of {', '.join(DATA_NAMES[1:])} or empty (the app's "
                         "embedded default, or data paths in EXTRA_ARGS)")
    if key == "LAUNCHER" and value not in ("auto", "srun", "mpiexec"):
        raise ValueError(f"--set LAUNCHER={value}: expected auto, srun or mpiexec")
    if key == "ON_RANK_LOSS" and value not in ON_RANK_LOSS_VALUES:
        raise ValueError(f"--set ON_RANK_LOSS={value}: expected stop (a lost rank ends the job) or continue (the "
                         "survivors train on, under the fault-tolerant stack: scripts/setup_env.sh --ft)")
    if key == "MPI_PMI" and value not in ("pmi2", "pmix", "pmix_v3", "pmix_v4", "pmix_v5", "cray_shasta", "none"):
        raise ValueError(f"--set MPI_PMI={value}: expected pmi2, pmix(_vN), cray_shasta or none (srun --mpi)")


def render(text: str, sets: dict[str, str]) -> str:
    """``text`` with every ``sets`` key applied (validated first; nothing is rendered on any error)."""
    template = parse_template(text)
    for key, value in sets.items():
        if key not in template.headers and key not in template.params and key not in SBATCH_OPTIONS:
            raise ValueError(f"--set {key}: unknown key; this template has {template.keys()}, and the "
                             f"scheduler options {sorted(SBATCH_OPTIONS)} can be added")
        _validate(key, value)
    _validate_together(template, sets)
    sets = _batch_signal(template, sets)
    lines = list(template.lines)
    commented = {m.group(1): i for i, line in enumerate(lines) if (m := _COMMENTED.match(line)) is not None}
    added = []
    for key, value in sets.items():
        if key in template.headers:
            lines[template.headers[key]] = f"#SBATCH --{key}={value}"
        elif key in commented:
            lines[commented[key]] = f"#SBATCH --{key}={value}"
        elif key in template.params:
            lines[template.params[key]] = f': "${{{key}:={quote(value)}}}"'
        else:
            added.append(f"#SBATCH --{key}={value}")
    last_header = max(template.headers.values())
    lines[last_header + 1:last_header + 1] = added
    return "\n".join(lines) + "\n"


def _validate_together(template: Template, sets: dict[str, str]) -> None:
    """Refuse parameters that contradict each other once ``sets`` is applied to ``template``."""
    def final(key: str) -> str | None:
        return sets[key] if key in sets else template.value(key) if key in template.params else None

    if final("ON_RANK_LOSS") == "continue" and final("LAUNCHER") == "srun":
        raise ValueError("--set ON_RANK_LOSS=continue starts the ranks with Open MPI's own launcher "
                         "(scripts/ft_run.sh; its start under srun is not fault tolerant): leave LAUNCHER=auto")


def _batch_signal(template: Template, sets: dict[str, str]) -> dict[str, str]:
    """``sets``, with the header's ``--signal=SIG@T`` sent to the batch shell (``B:SIG@T``) when the job runs with
    ``ON_RANK_LOSS=continue``: its ranks are then started by Open MPI's launcher in the batch step, which Slurm's
    plain ``--signal`` skips, and the job script forwards the signal to them."""
    if sets.get("ON_RANK_LOSS") != "continue" or "signal" in sets or "signal" not in template.headers:
        return sets
    value = template.value("signal") or ""
    if value.split("@")[0] not in ("USR1", "SIGUSR1", "10"):  # already B:/R:, or a signal the script keeps
        return sets
    return {**sets, "signal": f"B:{value}"}


def _validate_app(value: str) -> None:
    """APP must name an existing Python script: absolute, or relative to this directory or the checkout."""
    import os

    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    roots = [os.getcwd(), checkout]
    if value.endswith(".py") and any(os.path.isfile(os.path.join(root, value)) for root in roots):
        return
    apps = sorted({f"apps/{f}" for root in roots if os.path.isdir(os.path.join(root, "apps"))
                   for f in os.listdir(os.path.join(root, "apps")) if f.endswith(".py")})
    raise ValueError(f"--set APP={value}: no such Python script here or in {checkout}; the apps are {apps}")
