"""Launching the apps under mpiexec from tests: the command, the short ResNet case, strict metrics reading."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET = ["--model", "resnet20", "--batch-size", "8", "--eval-limit", "32", "--max-steps", "4", "--log-every", "1",
          "--no-progress"]


def launch(ranks: int, app: str, args: list[str], timeout: int = 240,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``apps/<app>`` on ``ranks`` ranks with ``env`` added; its output (the timeout only catches a hang)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, os.path.join(REPO, "apps", app), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def strict_records(path) -> list[dict]:
    """A metrics file's records, failing on anything that is not strict JSON (NaN, Infinity)."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f if line.strip()]
