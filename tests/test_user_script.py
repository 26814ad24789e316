"""A user's own script under ``mpiexec``, run to its end: every mistake is one line on stderr and exit 2.

Nothing else reaches stderr: no traceback and no MPI noise at the exit (a script that wraps twice, one
whose error every rank raised alike, one whose error one rank found).

tests/test_user_script_mpi.py checks in-process which error each mistake raises; here the same scripts
run as a user runs them, so what :func:`mpicomm.init`'s handler makes of the error is checked: one line
(from rank 0 when every rank made the mistake, else naming the rank), exit 2, no traceback, no hang. A
rank that takes fewer steps than the others ends in the hang guard's line, which names the loop's step.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from .app_runs import mpiexec

PRELUDE = """
import os, sys
import torch
import mpicomm
job = mpicomm.init(device=os.environ.get("DEVICE", "auto"))
torch.manual_seed(job.rank)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

def train(algo, steps):
    for _ in range(steps):
        algo.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        algo.step()
"""

SCRIPTS = {
    "re-homed parameter": """
        algo = mpicomm.wrap(model, optimizer, "dpsgd")
        train(algo, 2)
        model[2].weight.data = model[2].weight.data.clone()
        train(algo, 1)
    """,
    "optimizer stepped on one rank": """
        algo = mpicomm.wrap(model, optimizer, "allreduce_sgd")
        train(algo, 2)
        if job.rank == job.size - 1:
            optimizer.step()
        train(algo, 1)
    """,
    "earlier wrap stepped": """
        first = mpicomm.wrap(model, optimizer, "dpsgd")
        second = mpicomm.wrap(model, optimizer, "dpsgd")
        train(second, 2)
        train(first, 1)
    """,
    "half-precision model": """
        mpicomm.wrap(model.half(), None, "dpsgd", lr=0.1)
    """,
    "cuda without a GPU": "",
    "bad hang timeout": "",
}
"""Each script's body after PRELUDE; the last two fail in PRELUDE's init (DEVICE, MPICOMM_HANG_TIMEOUT)."""

EXPECTED = {
    "re-homed parameter": "mpicomm: error: dpsgd.step(): parameter '2.weight' no longer lives in the buffer",
    "optimizer stepped on one rank": "mpicomm: error: rank {last}: optimizer.step() was called outside",
    "earlier wrap stepped": "mpicomm: error: dpsgd.step() was called after the same model was wrapped again",
    "half-precision model": "mpicomm: error: the model's trainable parameters are torch.float16",
    "cuda without a GPU": "mpicomm: error: mpicomm.init(device='cuda'): CUDA is not available",
    "bad hang timeout": "mpicomm: error: MPICOMM_HANG_TIMEOUT must be a number of seconds >= 0, got 'abc'",
}


def _run(ranks: int, body: str, tmp_path, env_extra: dict | None = None, timeout: int = 120):
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(script)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _lines(stderr: str) -> list[str]:
    """stderr's lines but Python's warnings: a clean exit leaves no MPI noise (such as MPICH's 'pending
    references'), so that counts as a line too."""
    return [line for line in stderr.splitlines() if line.strip() and "Warning" not in line
            and not line.startswith("  warnings.warn")]


AT_THREE = ("re-homed parameter", "optimizer stepped on one rank")
"""The cases run at 3 ranks as well: the agreement on one line, and the line of the one rank that failed."""


@pytest.mark.parametrize(("case", "ranks"), [(c, 2) for c in sorted(SCRIPTS)] + [(c, 3) for c in AT_THREE])
def test_each_mistake_is_one_line_and_exit_2(case, ranks, tmp_path):
    env = {"DEVICE": "cuda"} if case == "cuda without a GPU" else {}
    if case == "bad hang timeout":
        env["MPICOMM_HANG_TIMEOUT"] = "abc"
    if case == "cuda without a GPU":
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    done = _run(ranks, SCRIPTS[case], tmp_path, env)
    lines = _lines(done.stderr)
    assert done.returncode == 2, f"exit {done.returncode}; stderr:\n{done.stderr}"
    assert len(lines) == 1, f"expected one line, got:\n{done.stderr}"
    assert lines[0].startswith(EXPECTED[case].format(last=ranks - 1)), lines[0]


def test_a_rank_that_takes_fewer_steps_is_named_by_the_hang_line(tmp_path):
    body = """
        algo = mpicomm.wrap(model, optimizer, "dpsgd")
        train(algo, 5 if job.rank == 0 else 6)
        if job.rank == 0:
            import time
            time.sleep(60)  # still alive, but not taking part
    """
    done = _run(2, body, tmp_path, {"MPICOMM_HANG_TIMEOUT": "3"}, timeout=60)
    assert done.returncode == 4, f"exit {done.returncode}; stderr:\n{done.stderr}"
    assert "(dpsgd.step() call 6 of this rank's loop, after 5 update(s))" in done.stderr, done.stderr
    assert "before training" not in done.stderr


def test_a_script_using_job_world_as_mpi4py_s_communicator_runs(tmp_path):
    """``job.world`` answers the mpi4py calls a script makes on the job's communicator (documented as mpi4py's)."""
    body = f"""
        total = job.world.allreduce(job.rank + 1)
        job.world.Barrier()
        root = job.world.bcast("hello" if job.rank == 0 else None, root=0)
        gathered = job.world.allgather(job.rank)
        assert (total, root, gathered) == (3, "hello", [0, 1]), (total, root, gathered)
        assert (job.world.Get_rank(), job.world.Get_size()) == (job.rank, 2)
        open(os.path.join({str(tmp_path)!r}, f"ok-{{job.rank}}"), "w").close()
    """
    done = _run(2, body, tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}; stderr:\n{done.stderr}"
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists(), done.stdout


def test_a_script_that_ends_well_leaves_nothing_on_stderr(tmp_path):
    """Wrapped twice, trained, averaged, saved and restored: exit 0 and not one line on stderr (no MPI noise)."""
    body = f"""
        first = mpicomm.wrap(model, optimizer, "dpsgd")
        algo = mpicomm.wrap(model, optimizer, "dpsgd")
        train(algo, 3)
        with algo.averaged_model() as averaged:
            averaged(torch.randn(2, 4))
        mpicomm.save({str(tmp_path / "run")!r}, algo, step=3)
        assert mpicomm.restore({str(tmp_path / "run")!r}, algo)[0] == 3
    """
    done = _run(2, body, tmp_path)
    assert done.returncode == 0 and not _lines(done.stderr), f"exit {done.returncode}; stderr:\n{done.stderr}"
