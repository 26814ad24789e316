"""An MPI job that runs several app runs one after another in the same processes (``tests/app_runs.run_apps``).

usage: mpiexec -n N python tests/app_batch_job.py SPEC.json

``SPEC.json``: ``{"folder": DIR, "runs": [{"name": NAME, "app": "train_resnet.py", "argv": [...]}, ...]}``. Each
run is the app's ``main(argv)`` on every rank, as ``python apps/<app> argv...`` would run it, with this rank's
file descriptors 1 and 2 sent to ``DIR/NAME.<rank>.out`` and ``.err``; its exit status (``main``'s return
value, or a ``SystemExit``'s code) goes into ``DIR/status.<rank>.json``. Starting Python, torch and the app
costs every rank about 3 s of CPU; a batch pays it once.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mpi4py import MPI  # noqa: E402

from tests.app_runs import app_module  # noqa: E402


def run_captured(main, argv: list[str], out: str, err: str) -> int:
    """``main(argv)`` with fds 1 and 2 written to the files ``out`` and ``err``; its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's refusals
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return int(code or 0)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = MPI.COMM_WORLD.Get_rank()
    apps, status = {}, {}
    for run in spec["runs"]:
        name = run["name"]
        if run["app"] not in apps:
            apps[run["app"]] = app_module(run["app"].removesuffix(".py")).main
        path = os.path.join(spec["folder"], f"{name}.{rank}")
        status[name] = run_captured(apps[run["app"]], run["argv"], path + ".out", path + ".err")
        MPI.COMM_WORLD.Barrier()  # the next run starts together, as a new job would
    with open(os.path.join(spec["folder"], f"status.{rank}.json"), "w") as f:
        json.dump(status, f)


if __name__ == "__main__":
    main()
