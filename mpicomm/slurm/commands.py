"""``mpicomm slurm render|submit|regenerate``: the command-line side of the templates (``check``: :mod:`.check`).

Templates are found by path, or by name in ``./slurm/`` and then in the ``slurm/`` folder of the
mpicomm checkout (``mpicomm slurm render generic`` == ``mpicomm slurm render slurm/generic.sbatch``).
The named job templates (ResNet-20 with Moniqua, …) are the generic template rendered with a preset;
``regenerate`` rewrites them and a test checks they never drift from their presets. ``render`` and ``submit``
write the project's folder into the job (``MPICOMM_HOME``), so it runs wherever it is submitted from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from .presets import PRESETS, check_preset
from .template import parse_template, render

__all__ = [
    "find_template", "installed_templates_dir", "main_render", "main_regenerate", "main_submit", "parse_sets",
    "preset_text", "project_home", "repo_slurm_dir",
]


def repo_slurm_dir() -> str:
    """The ``slurm/`` folder of the checkout this package lives in."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "slurm")


def installed_templates_dir() -> str:
    """Where a (non-editable) install keeps the templates: the package data ``mpicomm/slurm/templates``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


def find_template(name: str) -> str:
    """Resolve a template path or name (``./slurm/``, the checkout's, the installed copies); else ``ValueError``."""
    folders = ("slurm", repo_slurm_dir(), installed_templates_dir())
    candidates = [name]
    for folder in folders:
        candidates += [os.path.join(folder, name), os.path.join(folder, name + ".sbatch")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    known = sorted({f[:-7] for folder in folders if os.path.isdir(folder)
                    for f in os.listdir(folder) if f.endswith(".sbatch")})
    raise ValueError(f"template {name!r} not found (as a path, in slurm/ or installed); known templates: {known}")


def parse_sets(items: list[str]) -> dict[str, str]:
    """``["KEY=VALUE", …]`` -> dict, with a clear error for an item without ``=``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def project_home() -> str:
    """The mpicomm project a rendered job runs from: the checkout this package lives in, else this folder,
    whichever holds ``apps/`` ("" when neither does: the job then looks for it itself)."""
    for folder in (os.path.dirname(repo_slurm_dir()), os.getcwd()):
        if os.path.isfile(os.path.join(folder, "apps", "fetch_data.py")):
            return os.path.abspath(folder)
    return ""


def _rendered(args) -> str:
    sets = {}
    if args.preset:
        if args.preset not in PRESETS:
            raise ValueError(f"--preset {args.preset!r}: choose one of {sorted(PRESETS)}")
        sets.update(PRESETS[args.preset])
    sets.update(parse_sets(args.set))
    for name in {args.preset, os.path.basename(args.template).removesuffix(".sbatch")} & set(PRESETS):
        check_preset(name, sets)  # a preset's own template counts as that preset
    with open(find_template(args.template)) as f:
        text = f.read()
    if "MPICOMM_HOME" not in sets and "MPICOMM_HOME" in parse_template(text).params and project_home():
        sets["MPICOMM_HOME"] = project_home()  # the job then runs wherever it is submitted from
    return render(text, sets)


def _submit_line(text: str, path: str) -> str:
    """``text`` with its header's "Submit: sbatch …" naming ``path``, the job file actually written."""
    return re.sub(r"(Submit: sbatch )\S+", lambda m: m.group(1) + path, text, count=1)


def main_render(args) -> int:
    """Print (or write to ``-o``) the rendered template."""
    text = _rendered(args)
    if args.output:
        text = _submit_line(text, args.output)
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def main_submit(args) -> int:
    """Render, write the job file, and hand it to ``sbatch`` (``--wait``: return the job's exit code)."""
    path = args.output or "mpicomm-job.sbatch"
    text = _submit_line(_rendered(args), path)
    with open(path, "w") as f:
        f.write(text)
    cmd = ["sbatch", *(["--wait"] if args.wait else []), *args.sbatch_arg, path]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def main_regenerate(args) -> int:
    """Rewrite every preset template ``slurm/<preset>.sbatch`` from ``slurm/generic.sbatch``."""
    folder = repo_slurm_dir()
    with open(os.path.join(folder, "generic.sbatch")) as f:
        generic = f.read()
    for name in sorted(PRESETS):
        with open(os.path.join(folder, f"{name}.sbatch"), "w") as f:
            f.write(preset_text(generic, name))
        print(os.path.join(folder, f"{name}.sbatch"))
    return 0


def preset_text(generic: str, name: str) -> str:
    """``generic`` rendered with preset ``name``, its leading comment replaced by one naming the preset."""
    body = render(generic, PRESETS[name])
    lines = body.splitlines(keepends=True)
    first_header = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    head = (f"#!/bin/bash\n# {name}: generated from slurm/generic.sbatch with the preset of the same name in\n"
            f"# mpicomm/slurm/presets.py (`mpicomm slurm regenerate`). Submit: sbatch slurm/{name}.sbatch\n"
            f"# Override a parameter at submission: sbatch --export=ALL,EPOCHS=10 slurm/{name}.sbatch\n")
    return head + "".join(lines[first_header:])
