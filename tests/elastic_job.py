"""A user's loop with :class:`mpicomm.Elastic` (run by tests/test_rank_loss_ft.py under scripts/ft_run.sh).

    elastic_job.py ALGORITHM OUT.json DIR

Trains a small MLP on the embedded digits for 30 steps, each rank on its shard of (rank, size), re-sharded when
the job shrinks; rank 0 writes the steps committed so far to DIR/steps after each, and after the end the final
step, the size, the recoveries and a digest of every rank's parameters to OUT.json. Each step also waits
:data:`STEP_S` (the MLP's own step takes milliseconds), so that a kill from outside lands in the middle of the run.
"""

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits

import mpicomm

STEPS, BATCH = 30, 16
STEP_S = 0.1


def main() -> None:
    algorithm, out, progress = sys.argv[1], sys.argv[2], Path(sys.argv[3]) / "steps"
    job = mpicomm.init()
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algo = mpicomm.wrap(model, optimizer, algorithm, topology="ring")
    shard = {"rank": job.rank, "size": job.size}

    def reshard(rank: int, size: int) -> None:
        shard.update(rank=rank, size=size)

    elastic = mpicomm.Elastic(algo, topology="ring", on_resize=reshard)
    while elastic.steps < STEPS:
        rows = torch.arange(len(x))[shard["rank"]::shard["size"]]
        start = (elastic.steps * BATCH) % (len(rows) - BATCH)
        batch = rows[start:start + BATCH]
        with elastic.step():
            elastic.algo.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            time.sleep(STEP_S)
            elastic.algo.step()
        if elastic.rank == 0:
            progress.write_text(str(elastic.steps))
    digests = elastic.algo.comm.allgather_object(
        hashlib.sha256(elastic.algo.flat.data.numpy().tobytes()).hexdigest())
    if elastic.rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": elastic.steps, "size": elastic.size, "recoveries": elastic.recoveries,
                       "digests": digests}, f)


if __name__ == "__main__":
    main()
