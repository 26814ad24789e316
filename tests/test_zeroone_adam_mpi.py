"""0/1 Adam against an all-ranks pure-torch reference (both phases, both error buffers, the schedules),
compression off == Adam without bias correction bit for bit, exact bytes per step kind, convergence,
state across the freeze and inside a local interval, and config errors on every rank."""

import math

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from . import noisy_lsq
from .algo_common import grad_at, initial_flat, make_model, train
from .conftest import run_all
from .onebit_reference import FlatAverage, NodeAverage

pytestmark = pytest.mark.mpi

SCHEDULE = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
# Steps 1..16 under SCHEDULE: variance 1, 2, 4, 6; compressed 3, 5; sync 7, 8, 10, 12, 16; local the rest.
KINDS = ["variance", "variance", "compressed", "variance", "compressed", "variance", "sync", "sync", "local",
         "sync", "local", "sync", "local", "local", "local", "sync"]


def _comm(comm):
    return Communicator(comm, topo.ring(comm.Get_size()))


def reference(n, steps, lr, beta1, beta2, eps, wd, compression, ranks_per_node=None):
    """All ranks of 0/1 Adam under SCHEDULE (kinds from KINDS); returns each rank's x after every step.
    ``ranks_per_node``: the 1-bit averages in two levels over nodes of that many ranks."""
    x = initial_flat().repeat(n, 1)
    d = x.shape[1]
    onebit = FlatAverage(n, d) if ranks_per_node is None else NodeAverage(n, ranks_per_node, d)
    m, v = torch.zeros(n, d), torch.zeros(d)
    u, synced, lrs, decay, denom, out = torch.zeros(n, d), None, 0.0, 1.0, None, []

    def average(rows):
        return onebit(rows) if compression else rows.mean(0)

    for t in range(1, steps + 1):
        grads = torch.stack([grad_at(x[r], r, t - 1) for r in range(n)])
        kind = KINDS[t - 1]
        if kind in ("variance", "compressed"):
            g = grads.mean(0) if kind == "variance" else average(grads)
            if kind == "variance":
                v = beta2 * v + (1 - beta2) * g * g
            m = beta1 * m + (1 - beta1) * g
            x = x * (1 - lr * wd) - lr * m / (v.sqrt() + eps)
            if t == SCHEDULE["var_freeze_step"]:
                denom, synced = v.sqrt() + eps, x[0].clone()
                onebit.reset()
        else:
            m = beta1 * m + (1 - beta1) * grads
            x = x * (1 - lr * wd) - lr * m / denom
            decay *= 1 - lr * wd
            u, lrs = u + lr * m, lrs + lr
            if kind == "sync":
                ubar = average(u)
                m = (ubar / lrs).repeat(n, 1)
                x = (decay * synced - ubar / denom).repeat(n, 1)
                synced, u, lrs, decay = x[0].clone(), torch.zeros(n, d), 0.0, 1.0
        out.append(x.clone())
    return out


@pytest.mark.parametrize("compression, wd", [(True, 0.0), (True, 0.02), (False, 0.02)])
def test_matches_all_ranks_reference(comm, compression, wd):
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        options = {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": wd}
        algo = make_algorithm("zeroone_adam", make_model(seed=rank), _comm(comm), compression=compression,
                              **SCHEDULE, **options)
        expected = reference(n, 16, options["lr"], options["beta1"], options["beta2"], options["eps"], wd,
                             compression)
        for t, x in enumerate(expected, start=1):
            train(algo, 1)
            assert algo.stats()["last_kind"] == KINDS[t - 1]
            torch.testing.assert_close(algo.flat.data, x[rank], rtol=1e-5, atol=1e-6, msg=f"x after step {t}")
        assert compression is False or algo.onebit.worker_error.abs().sum() > 0

    run_all(comm, body)


@pytest.mark.parametrize("compression", [True, False])
def test_two_levels_match_the_all_ranks_reference(comm, compression):
    """Emulated nodes of 2 (and of 1): exact means in two levels, 1-bit averages of node means per shard."""
    def body():
        n, rank = comm.Get_size(), comm.Get_rank()
        options = {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.02}
        for k in [k for k in (1, 2) if n % k == 0]:
            c = Communicator(comm, topo.ring(n), ranks_per_node=k)
            algo = make_algorithm("zeroone_adam", make_model(seed=rank), c, compression=compression,
                                  hierarchical=True, **SCHEDULE, **options)
            assert algo.two_level is not None
            expected = reference(n, 16, options["lr"], options["beta1"], options["beta2"], options["eps"],
                                 options["weight_decay"], compression, ranks_per_node=k)
            for t, x in enumerate(expected, start=1):
                train(algo, 1)
                torch.testing.assert_close(algo.flat.data, x[rank], rtol=1e-5, atol=1e-6, msg=f"k={k}, step {t}")

    run_all(comm, body)


def test_compression_off_with_every_step_a_variance_step_is_adam_without_bias_correction(comm):
    """The same iterates bit for bit as APMSqueeze(variant="deepspeed")'s warm-up (DeepSpeed's Adam)."""
    def body():
        options = {"lr": 0.01, "beta1": 0.85, "weight_decay": 0.01}
        adam = make_algorithm("apmsqueeze", make_model(seed=comm.Get_rank()), _comm(comm), warmup_steps=100,
                              variant="deepspeed", **options)
        zo = make_algorithm("zeroone_adam", make_model(seed=comm.Get_rank()), _comm(comm), compression=False,
                            var_update_scaler=10_000, **options)
        train(adam, 8)
        train(zo, 8)
        assert torch.equal(zo.flat.data, adam.flat.data)
        assert torch.equal(zo.m, adam.adam_state()["exp_avg"]) and torch.equal(zo.v, adam.adam_state()["exp_avg_sq"])
        assert zo.stats()["variance_steps"] == 8

    run_all(comm, body)


def test_bytes_match_the_formula_per_step_kind(comm):
    """fp32 allreduce on variance steps, one 1-bit average on compressed and sync steps, nothing on local ones."""
    def body():
        n = comm.Get_size()
        algo = make_algorithm("zeroone_adam", make_model(), _comm(comm), lr=0.01, **SCHEDULE)
        d = algo.flat.numel
        L = 8 * math.ceil(d / (8 * n))
        P = 4 + L // 8
        per_kind = {"variance": 2 * (n - 1) * 4 * d // n, "compressed": 2 * (n - 1) * P, "sync": 2 * (n - 1) * P,
                    "local": 0}
        contributed = {"variance": 4 * d, "compressed": (n + 1) * P, "sync": (n + 1) * P, "local": 0}
        for t in range(16):
            train(algo, 1)
            s = algo.stats()
            assert s["step_bytes_sent"] == per_kind[KINDS[t]], (t + 1, s)
            assert s["step_bytes_contributed"] == contributed[KINDS[t]], (t + 1, s)
        s = algo.stats()
        assert [s[f"{k}_steps"] for k in ("variance", "compressed", "sync", "local")] == [4, 2, 5, 5]
        assert s["total_bytes_sent"] == sum(per_kind[k] for k in KINDS)

    run_all(comm, body)


def test_converges_like_adam_on_least_squares(comm):
    """300 mini-batch steps, lr 0.02 / (1 + t / 30), variance frozen after 60, local interval doubling every
    20 steps up to 8, each rank its own optimum: within 10 % of L* over all ranks' rows and of AllReduce-Adam
    (the APMSqueeze test's problem and tolerance), and an excess over L* ten times below that of 0/1 Adam run by
    each rank alone (which ends near its own optimum). Measured (0/1 Adam, L*, alone): (0.149, 0.144, 0.315) at
    n = 2, (0.494, 0.464, 1.02) at n = 4: 39x and 19x below. With a constant lr 0.02 it ends 13 % (n = 1) to 44 %
    (n = 2) above AllReduce-Adam on one shared optimum: no bias correction and local steps leave a larger
    noise floor than Adam's."""
    def body():
        steps = 300
        shard = noisy_lsq.data(comm.Get_rank())
        options = {"var_freeze_step": 60, "var_update_scaler": 16, "local_step_scaler": 20, "local_step_clipper": 8}
        schedule = lambda t: 0.02 / (1 + t / 30)  # noqa: E731
        finals = {}
        for name, extra in (("allreduce_adam", {}), ("zeroone_adam", options)):
            torch.manual_seed(0)
            algo = make_algorithm(name, torch.nn.Linear(10, 1), _comm(comm), lr=0.02, **extra)
            noisy_lsq.train(algo, shard, steps, lr=schedule)
            finals[name] = noisy_lsq.loss_of_each_model(comm, algo, shard)
        alone = noisy_lsq.alone("zeroone_adam", steps, shard, 0.02, schedule, **options)
        finals["alone"] = noisy_lsq.loss_of_each_model(comm, alone, shard)
        best = noisy_lsq.optimum(comm, shard)
        assert finals["zeroone_adam"] <= 1.1 * best, (finals, best)
        assert finals["zeroone_adam"] <= 1.1 * finals["allreduce_adam"], (finals, best)
        noisy_lsq.check_beats_alone(finals["zeroone_adam"], finals["alone"], best, comm.Get_size())

    run_all(comm, body)


@pytest.mark.parametrize("split", [6, 9, 13])
def test_state_round_trip_is_bit_exact(comm, split):
    """split + rest == 16 steps: at the freeze (6), inside a local interval (9, 13); every buffer and schedule."""
    def body():
        options = {"lr": 0.01, "weight_decay": 0.01, **SCHEDULE}
        straight = make_algorithm("zeroone_adam", make_model(), _comm(comm), **options)
        train(straight, 16)
        first = make_algorithm("zeroone_adam", make_model(), _comm(comm), **options)
        train(first, split)
        state = first.state_dict()
        resumed = make_algorithm("zeroone_adam", make_model(seed=3), _comm(comm), **options)
        resumed.load_state_dict(state)
        train(resumed, 16 - split)
        assert torch.equal(resumed.flat.data, straight.flat.data)
        for key in ("m", "v", "u", "synced"):
            assert torch.equal(getattr(resumed, key), getattr(straight, key)), key
        assert torch.equal(resumed.onebit.worker_error, straight.onebit.worker_error)
        assert resumed.schedule == straight.schedule and resumed.counts == straight.counts

    run_all(comm, body)


@pytest.mark.parametrize("option, message", [
    ({"var_freeze_step": 0}, "var_freeze_step must be an int >= 1"),
    ({"var_update_scaler": 0}, "var_update_scaler must be an int >= 1"),
    ({"local_step_scaler": 2.5}, "local_step_scaler must be an int >= 1"),
    ({"local_step_clipper": -1}, "local_step_clipper must be an int >= 1"),
    ({"compression": "no"}, "compression must be a bool"),
    ({"beta2": 1.0}, r"beta2 must be in \[0.0, 1.0\)"),
    ({"momentum": 0.9}, "momentum must be 0 for Adam-type algorithms"),
])
def test_bad_config_fails_on_every_rank(comm, option, message):
    def body():
        with pytest.raises(ValueError, match=message):
            make_algorithm("zeroone_adam", make_model(), _comm(comm), **option)

    run_all(comm, body)
