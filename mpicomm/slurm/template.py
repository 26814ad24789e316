"""sbatch templates: parse the ``#SBATCH`` header and the ``: "${KEY:=default}"`` parameters, validate, render.

A template has two kinds of settings, both overridable with ``--set KEY=VALUE``:

* scheduler options, lower-case (``nodes``, ``ntasks-per-node``, ``time``, ``gpus-per-task``, …): the
  ``#SBATCH --key=value`` lines; a known option the template lacks is added to the header;
* job parameters, upper-case (``ALGORITHM``, ``EPOCHS``, ``EXTRA_ARGS``, …): shell defaults that
  ``sbatch --export=ALL,KEY=VALUE`` can still override at submission time.

Values are validated before anything reaches the scheduler (``ValueError`` naming the key and what is
allowed): unknown keys, non-positive counts, malformed time limits, unknown algorithms or topologies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["SBATCH_OPTIONS", "Template", "parse_template", "render"]

_HEADER = re.compile(r"^#SBATCH\s+--([a-z-]+)(?:=(.*))?$")
_PARAM = re.compile(r'^: "\$\{([A-Z][A-Z0-9_]*):=(.*)\}"$')
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
_POSITIVE = ("nodes", "ntasks", "ntasks-per-node", "cpus-per-task", "gpus-per-task", "gpus-per-node", "gpus")

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
        """The current value of header option or parameter ``key`` (None for a flag without value)."""
        if key in self.headers:
            return _HEADER.match(self.lines[self.headers[key]]).group(2)
        return _PARAM.match(self.lines[self.params[key]]).group(2)

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


def _validate(key: str, value: str) -> None:
    if "\n" in value or '"' in value or "`" in value or "}" in value:
        raise ValueError(f"--set {key}: values may not contain newlines, double quotes, backticks or '}}'")
    if key in _POSITIVE and not (value.isdigit() and int(value) > 0):
        raise ValueError(f"--set {key}={value}: expected a positive integer")
    if key == "time" and not _TIME.match(value):
        raise ValueError(f"--set time={value}: expected minutes, MM:SS, HH:MM:SS or D-HH:MM:SS")
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
    if key == "LAUNCHER" and value not in ("auto", "srun", "mpiexec"):
        raise ValueError(f"--set LAUNCHER={value}: expected auto, srun or mpiexec")
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
    lines = list(template.lines)
    added = []
    for key, value in sets.items():
        if key in template.headers:
            lines[template.headers[key]] = f"#SBATCH --{key}={value}"
        elif key in template.params:
            lines[template.params[key]] = f': "${{{key}:={value}}}"'
        else:
            added.append(f"#SBATCH --{key}={value}")
    last_header = max(template.headers.values())
    lines[last_header + 1:last_header + 1] = added
    return "\n".join(lines) + "\n"
