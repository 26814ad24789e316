"""Multi-rank checkpoints: one logical HDF5 file, exact load, agreed errors, atomic commit, exact resume.

Every body runs the same sequence of collectives on every rank and only then asserts (errors are
caught into values with ``caught``), so a wrong outcome on one rank cannot desynchronise the others.
"""

import errno
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.checkpoint import (
    CheckpointError,
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    run_meta,
    save_checkpoint,
    store,
)
from mpicomm.comm import Communicator, World

from .algo_common import batch, make_model, topologies_for
from .conftest import run_all
from .test_checkpoint_tree import flip_byte, same

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[1]


def caught(fn):
    """The exception ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - examined by the caller
        return exc
    return None


def rank_state(rank: int, step: int) -> dict:
    """A state that differs per rank and per step."""
    g = torch.Generator().manual_seed(100 * rank + step)
    return {
        "rank": rank,
        "tag": f"rank {rank} ✓",
        "weights": torch.randn(5, generator=g) + rank,
        "bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "optimizer": {"state": {0: {"momentum_buffer": torch.full((2,), float(rank))}}, "lr": 0.1 * step},
        "loader": {"epoch": step, "position": 17 * rank, "order": np.arange(rank + 2)},
        "nothing": None,
    }


READER = """
import json, sys, h5py
out = {}
with h5py.File(sys.argv[1], "r") as f:
    for name in f["ranks"]:
        g = f["ranks"][name]
        link = f["ranks"].get(name, getlink=True)
        out[name] = {"link": [link.filename, link.path], "rank": int(g["rank"][()]),
                     "weights": g["weights"][:].tolist(), "tag": g["tag"][()].decode()}
    out["world_size"] = int(f["meta/world_size"][()])
print(json.dumps(out))
"""


def test_one_file_shows_every_rank_and_each_rank_loads_its_own_state(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    root = mpi_tmp_path / "ckpt"

    def body():
        c = Communicator(comm, topo.ring(size))
        meta = {**run_meta(c), "note": "unit test"}
        path = save_checkpoint(root, c, rank_state(rank, 3), step=3, meta=meta)
        reader = listing = None
        if rank == 0:  # an independent reader: a fresh process with plain h5py, run from another directory
            out = subprocess.run([sys.executable, "-c", READER, str(path / "checkpoint.h5")], cwd="/",
                                 capture_output=True, text=True, timeout=60)
            reader = json.loads(out.stdout) if out.returncode == 0 else out.stderr
            if shutil.which("h5ls"):
                listing = subprocess.run(["h5ls", "-r", "--follow-symlinks", str(path / "checkpoint.h5")],
                                         cwd="/", capture_output=True, text=True, timeout=60).stdout
        state, got = load_checkpoint(root, c, expect=meta)

        assert path == root / "step-000000003" and latest_checkpoint(root) == path
        assert list_checkpoints(root) == [path] and (root / "latest").read_text() == "step-000000003\n"
        assert sorted(os.listdir(path)) == ["checkpoint.h5"] + [f"rank-{r:05d}.h5" for r in range(size)]
        with h5py.File(path / f"rank-{rank:05d}.h5", "r") as f:  # the same path in the rank's own file
            assert f[f"ranks/{rank:05d}/tag"][()].decode() == f"rank {rank} ✓" and list(f["ranks"]) == [f"{rank:05d}"]
        same(rank_state(rank, 3), state)
        assert got["world_size"] == size and got["step"] == 3 and got["note"] == "unit test"
        assert got["topology"]["name"] == f"ring({size})" and np.array_equal(got["topology"]["W"], c.schedule.W)
        assert got["versions"]["h5py"] == h5py.__version__ and got["versions"]["torch"] == torch.__version__
        if rank == 0:
            assert isinstance(reader, dict), reader
            assert reader["world_size"] == size
            for r in range(size):
                want = rank_state(r, 3)
                assert reader[f"{r:05d}"] == {"link": [f"rank-{r:05d}.h5", f"/ranks/{r:05d}"], "rank": r,
                                             "tag": want["tag"], "weights": want["weights"].tolist()}
            if listing is not None:
                entries = dict(line.split(None, 1) for line in listing.splitlines())
                for r in range(size):
                    assert entries[f"/ranks/{r:05d}"] == f"External Link {{rank-{r:05d}.h5//ranks/{r:05d}}} {{Group}}"
                    assert entries[f"/ranks/{r:05d}/bf16"] == "Dataset {3, 4}"
                    assert entries[f"/ranks/{r:05d}/optimizer/state/0/momentum_buffer"] == "Dataset {2}"
                assert entries["/meta/topology/W"] == f"Dataset {{{size}, {size}}}"

    run_all(comm, body)


def test_mismatches_raise_one_value_error_on_every_rank(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    root = mpi_tmp_path / "ckpt"

    def body():
        c = Communicator(comm, topo.ring(size))
        meta = {**run_meta(c), "algorithm": {"name": "dpsgd", "config": {"lr": 0.1, "momentum": 0.9}}}
        save_checkpoint(root, c, {"x": rank}, step=1, meta=meta)
        W = c.schedule.W
        cases = {
            "topology.name 'ring(": {"topology": {"name": "torus"}},
            "topology.W ndarray of shape": {"topology": {"W": W * 0.5}},
            "algorithm.name 'dpsgd', this job has 'moniqua'": {"algorithm": {"name": "moniqua"}},
            "algorithm.config.momentum 0.9, this job has 0.0": {"algorithm": {"config": {"momentum": 0.0}}},
            "checkpoint has no 'model_signature'": {"model_signature": "(8, ())"},
        }
        errors = {text: caught(lambda e=expect: load_checkpoint(root, c, expect=e)) for text, expect in cases.items()}
        world = None
        if size > 1:  # the same checkpoint read by two smaller jobs
            sub = comm.Split(0 if rank == 0 else 1, rank)
            smaller = World(sub)
            world = (sub.Get_size(), caught(lambda: load_checkpoint(root, smaller)))
            sub.Free()
        ok = load_checkpoint(root, c, expect=meta)[0]

        assert ok == {"x": rank}
        for text, error in errors.items():
            assert type(error) is ValueError and text in str(error), (text, error)
            assert f"failed on rank 0 (and on {size - 1} more rank(s))" in str(error) or size == 1, str(error)
        if world is not None:
            assert type(world[1]) is ValueError, world
            assert f"checkpoint has world size {size}, this job has {world[0]}" in str(world[1]), world

    run_all(comm, body)


def test_missing_truncated_or_corrupted_files_fail_on_every_rank(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    root = mpi_tmp_path / "ckpt"
    last = f"rank-{size - 1:05d}.h5"

    def damage(path, how):
        comm.Barrier()
        if rank == 0:
            how(path)
        comm.Barrier()

    def corrupt_weights(path):
        with h5py.File(path, "r") as f:
            offset = f[f"ranks/{size - 1:05d}/weights"].id.get_chunk_info(0).byte_offset
        flip_byte(path, offset + 2)

    def body():
        c = Communicator(comm, topo.ring(size))
        p1 = save_checkpoint(root, c, rank_state(rank, 1), step=1)
        damage(p1 / last, os.remove)
        missing = caught(lambda: load_checkpoint(p1, c))
        p2 = save_checkpoint(root, c, rank_state(rank, 2), step=2)
        damage(p2 / last, lambda p: p.write_bytes(p.read_bytes()[:1000]))
        truncated = caught(lambda: load_checkpoint(root, c))
        p3 = save_checkpoint(root, c, rank_state(rank, 3), step=3)
        damage(p3 / last, corrupt_weights)
        flipped = caught(lambda: load_checkpoint(p3 / "checkpoint.h5", c))
        p4 = save_checkpoint(root, c, rank_state(rank, 4), step=4)
        damage(p4 / "checkpoint.h5", lambda p: p.write_bytes(p.read_bytes()[:500]))
        index = caught(lambda: load_checkpoint(p4, c))
        nothing = caught(lambda: load_checkpoint(root / "nowhere", c))
        p5 = save_checkpoint(root, c, rank_state(rank, 5), step=5)
        p6 = save_checkpoint(root, c, rank_state(rank, 6), step=6)
        damage(p5 / last, lambda p: shutil.copyfile(p6 / last, p))  # a well-formed file from another save
        foreign = caught(lambda: load_checkpoint(p5, c))

        who = f"failed on rank {size - 1}: CheckpointError: "
        assert isinstance(missing, CheckpointError) and f"{who}{p1 / last} is missing" in str(missing), missing
        assert isinstance(truncated, CheckpointError) and f"{who}{p2 / last} is unreadable" in str(truncated)
        assert "truncated file" in str(truncated), truncated
        assert isinstance(flipped, CheckpointError) and f"{p3 / last} is unreadable or corrupted" in str(flipped)
        assert f"['weights'] (/ranks/{size - 1:05d}/weights) is corrupted" in str(flipped), flipped
        assert who in str(flipped), flipped
        assert isinstance(index, CheckpointError) and f"{p4 / 'checkpoint.h5'} is unreadable" in str(index), index
        assert isinstance(nothing, CheckpointError) and "no checkpoint at" in str(nothing), nothing
        assert isinstance(foreign, CheckpointError) and f"{who}{p5 / last} is unreadable" in str(foreign)
        assert f"belongs to another save: its (rank, world size, step, save id) is ('{size - 1}', '{size}', '6'," \
            in str(foreign), foreign

    run_all(comm, body)


def test_failed_saves_leave_the_previous_checkpoint_and_latest_untouched(comm, mpi_tmp_path, monkeypatch):
    rank, size = comm.Get_rank(), comm.Get_size()
    root = mpi_tmp_path / "ckpt"

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def body():
        c = Communicator(comm, topo.ring(size))
        p1 = save_checkpoint(root, c, rank_state(rank, 1), step=1)
        pointer = (root / "latest").read_text()
        bad = rank_state(rank, 2)
        if rank == size - 1:  # written after the other entries: this rank's file is half written when it fails
            bad["zz_late"] = {"inner": [1, {2, 3}]}
        bad_type = caught(lambda: save_checkpoint(root, c, bad, step=2))
        leftovers_after_type = sorted(os.listdir(root))
        comm.Barrier()  # everyone has looked before rank 0 starts the next save
        with monkeypatch.context() as m:
            if rank == 0:
                m.setattr(store, "_commit", disk_full)
            full = caught(lambda: save_checkpoint(root, c, rank_state(rank, 3), step=3))
        exists = caught(lambda: save_checkpoint(root, c, rank_state(rank, 9), step=1))
        reserved = caught(lambda: save_checkpoint(root, c, {}, step=4, meta={"step": 5}))
        raw = caught(lambda: save_checkpoint(root, comm, {}, step=5))  # an mpi4py communicator is not one
        state, meta = load_checkpoint(root, c)

        assert type(bad_type) is TypeError, bad_type
        assert f"save_checkpoint(step=2) failed on rank {size - 1}: TypeError: ['zz_late']['inner'][1]" in str(bad_type)
        assert "cannot store a value of type builtins.set" in str(bad_type)
        assert leftovers_after_type == ["latest", "step-000000001"], leftovers_after_type
        assert type(full) is OSError and "commit failed on rank 0: OSError: [Errno 28] No space left" in str(full)
        assert type(exists) is FileExistsError and f"{p1} already exists" in str(exists), exists
        assert type(reserved) is ValueError and "meta keys ['step'] are reserved" in str(reserved), reserved
        assert type(raw) is TypeError and "comm must be a Communicator" in str(raw), raw
        assert sorted(os.listdir(root)) == ["latest", "step-000000001"], os.listdir(root)
        assert (root / "latest").read_text() == pointer and latest_checkpoint(root) == p1
        same(rank_state(rank, 1), state)
        assert meta["step"] == 1

    run_all(comm, body)


CRASH = """
import os, sys, torch
from mpicomm.checkpoint import save_checkpoint, tree

class One:  # a one-process stand-in for a communicator (the store needs only these three)
    rank, size = 0, 1
    def allgather_object(self, obj, what): return [obj]

root = sys.argv[1]
save_checkpoint(root, One(), {"x": torch.arange(3)}, step=1)
write = tree._write_array
def die_midway(group, name, array, kind):
    if name == "b":
        os._exit(9)  # the process dies with its rank file half written
    return write(group, name, array, kind)
tree._write_array = die_midway
save_checkpoint(root, One(), {"a": torch.ones(1000), "b": torch.ones(5)}, step=2)
"""


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(comm, mpi_tmp_path):
    from mpi4py import MPI

    root = mpi_tmp_path / "crash"

    def body():
        if comm.Get_rank() != 0:  # one process is enough; rank 0 works alone on COMM_SELF
            return
        proc = subprocess.run([sys.executable, "-c", CRASH, str(root)], cwd=REPO, capture_output=True, timeout=60)
        after_crash = sorted(os.listdir(root))
        leftover = os.listdir(root / ".tmp-step-000000002")
        pointer = (root / "latest").read_text()
        alone = World(MPI.COMM_SELF)
        state, meta = load_checkpoint(root, alone)
        p3 = save_checkpoint(root, alone, {"y": 1}, step=3)

        assert proc.returncode == 9, proc.stderr
        assert after_crash == [".tmp-step-000000002", "latest", "step-000000001"], after_crash
        assert leftover == ["rank-00000.h5"], leftover
        assert pointer == "step-000000001\n" and meta["step"] == 1
        assert torch.equal(state["x"], torch.arange(3))
        assert sorted(os.listdir(root)) == ["latest", "step-000000001", "step-000000003"]  # the leftover is gone
        assert latest_checkpoint(root) == p3

    run_all(comm, body)


def test_keep_last_prunes_older_checkpoints(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    root = mpi_tmp_path / "ckpt"

    def body():
        c = Communicator(comm, topo.ring(size))
        for step in (10, 20, 30, 40):
            save_checkpoint(root, c, rank_state(rank, step), step=step, keep_last=2)
        state, meta = load_checkpoint(root, c)
        listed = list_checkpoints(root)
        save_checkpoint(root, c, rank_state(rank, 5), step=5, keep_last=2)  # a run resumed from an earlier step
        after_rewind = sorted(os.listdir(root))

        assert listed == [root / "step-000000030", root / "step-000000040"]
        assert meta["step"] == 40
        same(rank_state(rank, 40), state)
        assert after_rewind == ["latest", "step-000000005", "step-000000040"]  # the new one is never pruned
        assert latest_checkpoint(root) == root / "step-000000005"

    run_all(comm, body)


def noisy_training(algo, steps: int) -> None:
    """The standard loop plus draws from torch's, numpy's and Python's global RNGs (input noise, lr jitter)."""
    rank = algo.comm.rank
    for _ in range(steps):
        algo.zero_grad()
        x, y = batch(rank, algo.step_count)
        x = x + 0.1 * torch.randn_like(x)
        torch.nn.functional.cross_entropy(algo.model(x), y).backward()
        algo.set_lr(0.05 * (1 + 0.5 * random.random()) * (1 + 0.5 * float(np.random.rand())))
        algo.step()


def test_dpsgd_resumed_from_a_checkpoint_is_bit_identical(comm, mpi_tmp_path):
    rank = comm.Get_rank()
    schedule = topologies_for(comm.Get_size())[-1]
    root = mpi_tmp_path / "ckpt"
    n = 3

    def seed_all(s):
        torch.manual_seed(s)
        np.random.seed(s)
        random.seed(s)

    def build(model_seed):
        c = Communicator(comm, schedule)
        return make_algorithm("dpsgd", make_model(model_seed), c, lr=0.05, momentum=0.9, weight_decay=1e-3)

    def resume(restore_rng: bool):
        algo = build(model_seed=7)  # different initial weights: everything must come from the checkpoint
        seed_all(999)
        state, _ = load_checkpoint(root, algo.comm, expect=run_meta(algo.comm, algo))
        algo.load_state_dict(state["algo"])
        if restore_rng:
            restore_rng_state(state["rng"])
        noisy_training(algo, n)
        return algo, state["loader"]

    def body():
        straight = build(model_seed=0)
        seed_all(10 + rank)
        noisy_training(straight, 2 * n)

        first = build(model_seed=0)
        seed_all(10 + rank)
        noisy_training(first, n)
        state = {"algo": first.state_dict(), "rng": capture_rng_state(), "loader": {"position": first.step_count}}
        save_checkpoint(root, first.comm, state, step=first.step_count, meta=run_meta(first.comm, first))
        del first

        resumed, loader = resume(restore_rng=True)
        control, _ = resume(restore_rng=False)

        assert loader == {"position": n} and resumed.step_count == 2 * n
        assert torch.equal(resumed.flat.data, straight.flat.data)
        assert resumed.lr == straight.lr
        assert not torch.equal(control.flat.data, straight.flat.data)  # the RNG state really matters

    run_all(comm, body)
