"""``auto`` from an installed package: a wheel built from this checkout, installed outside it, plans
(``mpicomm plan --measure``) and chooses (``wrap(..., "auto")`` at 2 ranks) from its shipped accuracy table.

The wheel is built from a copy of the package's sources, so the checkout's ``build/`` (which the
non-editable install of tests/test_slurm_templates.py uses) is never shared by two builds at once. The
installed copy comes first on ``PYTHONPATH`` and runs from a folder outside the checkout: no
``docs/results`` is within its reach, and the editable install of the environment is shadowed. The
checkout's compiled codec kernels go with it (numba keys its on-disk cache by the source file's stamp), so
the job does not compile them again for 20-30 s; with a cold cache it is only slower.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from mpicomm.plan import CANDIDATES
from mpicomm.plan.accuracy import AccuracyCost

from .app_runs import REPO, mpiexec

JOB = '''
import json, sys
import torch
import mpicomm
from mpicomm.plan import accuracy

torch.manual_seed(mpicomm.init().rank)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
algo = mpicomm.wrap(model, optimizer, "auto", step_time=0.01)
for _ in range(2):
    algo.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    algo.step()
if algo.comm.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"file": mpicomm.__file__, "table": str(accuracy.TABLE), "results": str(accuracy.results_dir()),
                   "trained": algo.name, "record": algo.auto_choice}, f)
algo.close()
'''


def _install(root: Path) -> Path:
    """The folder a wheel built from the checkout is installed into (``--target``)."""
    src = root / "src"
    src.mkdir()
    for name in ("setup.py", "setup.cfg", "README.md"):
        shutil.copy(os.path.join(REPO, name), src)
    for name in ("mpicomm", "slurm"):
        shutil.copytree(os.path.join(REPO, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(root / "dist"), str(src)], capture_output=True, text=True, cwd=root)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel, = (root / "dist").glob("mpicomm-*.whl")
    site = root / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    kernels, installed = Path(REPO, "mpicomm", "codecs", "kernels"), site / "mpicomm" / "codecs" / "kernels"
    for source in kernels.glob("*.py"):
        stat = source.stat()
        os.utime(installed / source.name, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (installed / "__pycache__").mkdir(exist_ok=True)
    for cached in [*kernels.glob("__pycache__/*.nbi"), *kernels.glob("__pycache__/*.nbc")]:
        shutil.copy(cached, installed / "__pycache__")
    return site


def _env(site) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MPICOMM_RESULTS_DIR"}
    return dict(env, PYTHONPATH=str(site), OMP_NUM_THREADS="1")


def _shipped(site) -> dict:
    with open(site / "mpicomm" / "plan" / "accuracy_costs.json") as f:
        return json.load(f)["costs"]["image"]


def test_installed_wheel_plans_and_wraps_auto_from_its_shipped_table(tmp_path):
    """From the installed copy: ``mpicomm plan --measure`` (its console script) shows the cost of every
    candidate with a row in the shipped table ("unmeasured" for the others) and names a choice; then
    ``mpicomm.wrap(model, optimizer, "auto", step_time=...)`` on 2 ranks (no ``net``: the transport measured)
    trains the candidate it chose, whose accuracy cost is the shipped table's."""
    site = _install(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    shipped = _shipped(site)
    assert {"hsq", "moniqua", "allreduce_sgd"} <= set(shipped)  # the wheel carries the filled table
    proc = subprocess.run([str(site / "bin" / "mpicomm"), "plan", "--model", "resnet20", "--ranks", "4", "--net",
                           "gbit", "--measure"], capture_output=True, text=True, cwd=run, env=_env(site),
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    measured = sum(c.key in shipped for c in CANDIDATES)
    assert sum(line.endswith("unmeasured") for line in lines) == len(CANDIDATES) - measured, proc.stdout
    assert sum(bool(re.search(r" [+-]\d+\.\d\d \[\d\]$", line)) for line in lines) == measured, proc.stdout
    choice = [line for line in lines if line.startswith("auto: ")]
    assert len(choice) == 1 and choice[0].split()[1] in {c.algorithm for c in CANDIDATES}, proc.stdout

    (run / "job.py").write_text(JOB)
    out = run / "choice.json"
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "job.py", str(out)], capture_output=True,
                          text=True, cwd=run, env=_env(site), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["file"].startswith(str(site)), seen["file"]  # the installed copy, not the checkout's
    assert seen["table"] == str(site / "mpicomm" / "plan" / "accuracy_costs.json")
    assert not os.path.exists(seen["results"])  # no docs/results to fall back on
    record = seen["record"]
    assert seen["trained"] == record["algorithm"]
    candidate = next(c for c in CANDIDATES if c.key == record["candidate"])
    assert candidate.algorithm == record["algorithm"]
    cost = AccuracyCost(**shipped[record["candidate"]])
    assert record["accuracy_points"] == cost.points and not cost.above(record["tolerance"]), record
