"""APMSqueeze: warm-up == AllReduce-Adam bit for bit, an independent all-ranks reference with both error
buffers, exact bytes per phase, error feedback in closed form, convergence, state, switch allocations, config."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.codecs import SignCodec
from mpicomm.comm import Communicator
from mpicomm.plan.wire import apmsqueeze_chunk_payload

from . import noisy_lsq
from .algo_common import grad_at, initial_flat, make_model, train
from .conftest import run_all
from .onebit_reference import NodeAverage

pytestmark = pytest.mark.mpi


def _comm(comm):
    return Communicator(comm, topo.ring(comm.Get_size()))


def sign_compress(x):
    """C(x) = ||x||_2 / sqrt(len x) * sign(x), sign(0) = +1, in plain torch (independent of SignCodec)."""
    s = x.pow(2).sum().sqrt() / math.sqrt(x.numel())
    return torch.where(x >= 0, s, -s)


def reference_apmsqueeze(n, warmup, steps, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                         deepspeed=False, ranks_per_node=None):
    """All n ranks in one process: Adam for ``warmup`` steps, then the two-sided 1-bit exchange.

    ``deepspeed``: DeepSpeed's 1-bit Adam instead (one worker scale over the padded vector, no bias
    correction). Returns, after every step, (x, m, worker errors (n, D), server errors (n, L)); server
    k owns chunk k. ``ranks_per_node``: the exchange in two levels over nodes of that many ranks (the
    :class:`~tests.onebit_reference.NodeAverage`; the errors are then not returned).
    """
    node_average = None if ranks_per_node is None else NodeAverage(n, ranks_per_node, initial_flat().numel(),
                                                                    per_chunk=not deepspeed)
    c1 = (lambda t: 1.0) if deepspeed else (lambda t: 1 - beta1**t)
    c2 = (lambda t: 1.0) if deepspeed else (lambda t: 1 - beta2**t)
    x = initial_flat()
    d = x.numel()
    L = 8 * math.ceil(d / (8 * n))
    D = n * L
    m, v = torch.zeros(d), torch.zeros(d)
    e, e_srv = torch.zeros(n, D), torch.zeros(n, L)
    denom, out = None, []
    for t in range(1, steps + 1):
        grads = [grad_at(x, r, t - 1) for r in range(n)]
        x = x * (1 - lr * weight_decay)
        if t <= warmup:
            g = torch.stack(grads).mean(0)
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            x = x - lr / c1(t) * m / (v.sqrt() / math.sqrt(c2(t)) + eps)
        else:
            if denom is None:  # v frozen with the bias correction of step T_w
                denom = v.sqrt() / math.sqrt(c2(warmup)) + eps
            if node_average is not None:
                m = node_average(torch.stack([beta1 * m + (1 - beta1) * g for g in grads]))
                x = x - lr / c1(t) * m / denom
                out.append((x, m, None, None))
                continue
            sent = torch.zeros(n, D)
            for i in range(n):
                u = torch.zeros(D)
                u[:d] = beta1 * m + (1 - beta1) * grads[i]
                u = u + e[i]
                if deepspeed:
                    sent[i] = sign_compress(u)
                for k in range(n * (not deepspeed)):
                    sent[i, k * L:(k + 1) * L] = sign_compress(u[k * L:(k + 1) * L])
                e[i] = u - sent[i]
                e[i, d:] = 0
            m_bar = torch.zeros(D)
            for k in range(n):
                real = min(max(d - k * L, 0), L)
                avg = sent[:, k * L:(k + 1) * L].mean(0)
                avg[real:] = 0
                s = avg + e_srv[k]
                c = sign_compress(s)
                e_srv[k] = s - c
                e_srv[k, real:] = 0
                m_bar[k * L:(k + 1) * L] = c
            m = m_bar[:d]
            x = x - lr / c1(t) * m / denom
        out.append((x, m, e.clone(), e_srv.clone()))
    return out


def test_warmup_is_allreduce_adam_bit_for_bit(comm):
    def body():
        options = {"lr": 0.01, "beta1": 0.85, "weight_decay": 0.01}
        adam = make_algorithm("allreduce_adam", make_model(seed=comm.Get_rank()), _comm(comm), **options)
        apms = make_algorithm("apmsqueeze", make_model(seed=comm.Get_rank()), _comm(comm),
                              warmup_steps=5, **options)
        train(adam, 5)
        train(apms, 5)
        assert torch.equal(apms.flat.data, adam.flat.data)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(apms.adam_state()[key], adam.adam_state()[key]), key
        assert apms.stats()["phase"] == "compression"
        assert apms.stats()["total_bytes_sent_alltoall"] == apms.stats()["total_bytes_sent_allgather"] == 0

    run_all(comm, body)


@pytest.mark.parametrize("weight_decay, variant", [(0.0, "paper"), (0.05, "paper"), (0.05, "deepspeed")])
def test_apmsqueeze_matches_reference_step_by_step(comm, weight_decay, variant):
    def body():
        n, rank, warmup, steps = comm.Get_size(), comm.Get_rank(), 3, 9
        options = {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": weight_decay}
        algo = make_algorithm("apmsqueeze", make_model(seed=rank), _comm(comm), warmup_steps=warmup,
                              variant=variant, **options)
        expected = reference_apmsqueeze(n, warmup, steps, **options, deepspeed=variant == "deepspeed")
        tol = {"rtol": 1e-5, "atol": 1e-6}
        for t, (x, m, e, e_srv) in enumerate(expected, start=1):
            train(algo, 1)
            torch.testing.assert_close(algo.flat.data, x, **tol, msg=f"x at step {t}")
            torch.testing.assert_close(algo.adam_state()["exp_avg"], m, **tol, msg=f"m at step {t}")
            torch.testing.assert_close(algo.worker_error, e[rank], **tol, msg=f"worker error at step {t}")
            torch.testing.assert_close(algo.server_error, e_srv[rank], **tol, msg=f"server error at step {t}")
        assert expected[-1][2].abs().sum() > 0 and (n == 1 or expected[-1][3].abs().sum() > 0)

    run_all(comm, body)


@pytest.mark.parametrize("variant", ["paper", "deepspeed"])
def test_two_levels_match_the_reference(comm, variant):
    """Emulated nodes of 2 (and of 1): the warm-up's sum in two exact levels, then the 1-bit average between
    nodes of each node's exact mean, per shard (a scale per chunk in the paper's form, one in DeepSpeed's)."""
    def body():
        n, rank, warmup, steps = comm.Get_size(), comm.Get_rank(), 3, 9
        options = {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.05}
        for k in [k for k in (1, 2) if n % k == 0]:
            c = Communicator(comm, topo.ring(n), ranks_per_node=k)
            algo = make_algorithm("apmsqueeze", make_model(seed=rank), c, warmup_steps=warmup, variant=variant,
                                  hierarchical=True, **options)
            expected = reference_apmsqueeze(n, warmup, steps, **options, deepspeed=variant == "deepspeed",
                                            ranks_per_node=k)
            for t, (x, m, _, _) in enumerate(expected, start=1):
                train(algo, 1)
                torch.testing.assert_close(algo.flat.data, x, rtol=1e-5, atol=1e-6, msg=f"x, k={k}, step {t}")
                torch.testing.assert_close(algo.adam_state()["exp_avg"], m, rtol=1e-5, atol=1e-6,
                                           msg=f"m, k={k}, step {t}")
            shard, nodes = algo.two_level.hi - algo.two_level.lo, n // k  # the error buffers are the shard's
            assert algo.worker_error.numel() == algo.padded == nodes * 8 * math.ceil(shard / (8 * nodes))

    run_all(comm, body)


def _wide_model(seed=0):
    """4,225 parameters (not a multiple of 8 n, so the last chunk is padded)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _wide_train(algo, steps):
    for _ in range(steps):
        g = torch.Generator().manual_seed(100 * algo.comm.rank + algo.step_count)
        algo.zero_grad()
        algo.model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
        algo.step()


@pytest.mark.parametrize("variant", ["paper", "deepspeed"])
def test_bytes_per_phase_match_the_formula(comm, variant):
    def body():
        n = comm.Get_size()
        algo = make_algorithm("apmsqueeze", _wide_model(), _comm(comm), lr=0.01, warmup_steps=2, variant=variant)
        d = algo.flat.numel
        L, P = apmsqueeze_chunk_payload(d, n)            # L = 8 ceil(d / 8n); P = one float32 scale + L sign bits
        ledger = algo.comm.ledger
        _wide_train(algo, 2)
        warm = algo.stats()
        assert warm["step_bytes_sent_allreduce"] == 2 * (n - 1) * 4 * d // n
        assert warm["step_bytes_contributed"] == 4 * d
        _wide_train(algo, 3)
        s = algo.stats()
        assert (s["phase"], algo.chunk, algo.padded, algo.chunk_payload) == ("compression", L, n * L, P)
        assert s["step_bytes_contributed"] == n * P + P
        assert s["step_bytes_sent_alltoall"] == s["step_bytes_sent_allgather"] == (n - 1) * P
        assert s["step_bytes_sent_allreduce"] == 0
        assert ledger.bytes_contributed("alltoall") == 3 * n * P and ledger.bytes_contributed("allgather") == 3 * P
        assert s["total_bytes_sent_allreduce"] == 2 * warm["step_bytes_sent_allreduce"]
        if n > 1:  # fp32 allreduce volume over compressed volume: 4 d / (n P) = 31.0 (n = 4), 31.5 (n = 2)
            ratio = warm["step_bytes_sent"] / s["step_bytes_sent"]
            assert ratio == (2 * (n - 1) * 4 * d // n) / (2 * (n - 1) * P)
            assert ratio >= 30, ratio
        assert s["step_bytes_sent"] == 2 * (n - 1) * P

    run_all(comm, body)


def test_error_buffers_hold_what_the_compressor_dropped(comm):
    """One compression step from hand-set m, e and gradient: e_i = u_i - C(u_i), e'_k = s_k - C(s_k)."""
    def body():
        n, rank, beta1 = comm.Get_size(), comm.Get_rank(), 0.5
        model = torch.nn.Linear(16, 1, bias=False)       # d = 16: chunks of 16 (n=1) or 8 (n=2, 4: two are padding)
        algo = make_algorithm("apmsqueeze", model, _comm(comm), lr=0.1, beta1=beta1, warmup_steps=1)
        feature = torch.arange(16.0) - 7.5 + rank         # loss = w . feature, so the gradient is `feature`
        algo.zero_grad()
        (model.weight.reshape(-1) @ feature).backward()
        algo.step()                                       # warm-up: creates m, v
        m = torch.linspace(-1, 1, 16)
        e_old = 0.1 * torch.cos(torch.arange(16.0) + rank)
        algo.adam_state()["exp_avg"].copy_(m)
        algo.worker_error[:16].copy_(e_old)
        algo.zero_grad()
        (model.weight.reshape(-1) @ feature).backward()
        algo.step()
        L = algo.chunk
        u = torch.zeros(n * L)
        u[:16] = beta1 * m + (1 - beta1) * feature + e_old
        c = torch.cat([sign_compress(u[k * L:(k + 1) * L]) for k in range(n)])
        expected_e = (u - c)[:16]
        every_c = comm.allgather(c)                       # what each server received, decoded
        real = min(max(16 - rank * L, 0), L)
        s = torch.stack([cj[rank * L:(rank + 1) * L] for cj in every_c]).mean(0)
        s[real:] = 0
        expected_srv = s - sign_compress(s)
        expected_srv[real:] = 0
        # values of order 4 (float32 ulp 4.8e-7); the order of the fused operations differs by CPU
        torch.testing.assert_close(algo.worker_error[:16], expected_e, rtol=1e-6, atol=2e-6)
        assert torch.equal(algo.worker_error[16:], torch.zeros(n * L - 16))
        torch.testing.assert_close(algo.server_error, expected_srv, rtol=1e-6, atol=2e-6)

    run_all(comm, body)


def test_converges_like_allreduce_adam_on_least_squares(comm):
    """300 steps (60 warm-up), lr 0.02, batch 16, each rank its own optimum: APMSqueeze within 10 % of
    AllReduce-Adam and of L* over all ranks' rows, and its excess over L* ten times below that of APMSqueeze run
    by each rank alone (which ends near its own optimum).

    Measured (APMSqueeze, Adam, L*, alone): (2.31, 2.29, 2.20, -)e-3 at n = 1 (one rank, one optimum),
    (0.148, 0.150, 0.144, 0.314) at n = 2, (0.467, 0.472, 0.464, 1.05) at n = 4: excess over L* 50x and 199x
    below the ranks' alone.
    """
    def body():
        steps = 300
        shard = noisy_lsq.data(comm.Get_rank())
        finals = {}
        for name, extra in (("allreduce_adam", {}), ("apmsqueeze", {"total_steps": steps})):
            torch.manual_seed(0)
            algo = make_algorithm(name, torch.nn.Linear(10, 1), _comm(comm), lr=0.02, **extra)
            noisy_lsq.train(algo, shard, steps)
            finals[name] = noisy_lsq.loss_of_each_model(comm, algo, shard)
        alone = noisy_lsq.alone("apmsqueeze", steps, shard, lr=0.02, total_steps=steps)
        finals["alone"] = noisy_lsq.loss_of_each_model(comm, alone, shard)
        best = noisy_lsq.optimum(comm, shard)
        assert finals["allreduce_adam"] <= 1.1 * best, (finals, best)
        assert finals["apmsqueeze"] <= 1.1 * best, (finals, best)
        assert finals["apmsqueeze"] <= 1.1 * finals["allreduce_adam"], (finals, best)
        noisy_lsq.check_beats_alone(finals["apmsqueeze"], finals["alone"], best, comm.Get_size())

    run_all(comm, body)


@pytest.mark.parametrize("warmup, variant", [(2, "paper"), (4, "paper"), (4, "deepspeed")])
def test_state_round_trip_is_bit_exact_across_the_switch(comm, warmup, variant):
    """3 + 3 steps == 6 steps; saved in compression (warm-up 2) or resumed across the switch (warm-up 4)."""
    def body():
        options = {"lr": 0.01, "weight_decay": 0.01, "warmup_steps": warmup, "variant": variant}
        straight = make_algorithm("apmsqueeze", make_model(), _comm(comm), **options)
        train(straight, 6)
        first = make_algorithm("apmsqueeze", make_model(), _comm(comm), **options)
        train(first, 3)
        state = first.state_dict()
        assert state["extra"]["phase"] == ("compression" if warmup < 3 else "warmup")
        resumed = make_algorithm("apmsqueeze", make_model(seed=9), _comm(comm), **options)
        resumed.load_state_dict(state)
        train(resumed, 3)
        assert torch.equal(resumed.flat.data, straight.flat.data)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed.adam_state()[key], straight.adam_state()[key]), key
        assert torch.equal(resumed.worker_error, straight.worker_error)
        assert torch.equal(resumed.server_error, straight.server_error)

    run_all(comm, body)


def _bytes_allocated_by_step(algo):
    """Bytes torch allocates on the CPU inside ``algo.step()`` (the backward pass is done beforehand)."""
    g = torch.Generator().manual_seed(algo.step_count)
    algo.zero_grad()
    algo.model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        algo.step()
    return sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)


def test_switch_allocates_no_more_than_a_steady_compression_step(comm):
    def body():
        SignCodec().roundtrip(torch.ones(16))            # build the codec's one-off lookup tables
        algo = make_algorithm("apmsqueeze", _wide_model(), _comm(comm), lr=0.01, warmup_steps=2)
        buffers = {k: v.data_ptr() for k, v in vars(algo).items() if torch.is_tensor(v)}
        warmup_alloc = [_bytes_allocated_by_step(algo) for _ in range(2)]
        switch, steady = _bytes_allocated_by_step(algo), _bytes_allocated_by_step(algo)
        assert {k: v.data_ptr() for k, v in vars(algo).items() if torch.is_tensor(v)} == buffers
        assert switch <= steady + 256, (warmup_alloc, switch, steady)   # no one-off buffers (d floats = 16,900 B)

    run_all(comm, body)


def test_compression_phase_keeps_two_model_copies_and_two_chunks_beyond_adam(comm):
    """Beyond Adam's m and v: the padded u_i and e_i, the server sum and e'_k; vhat lives in v's buffer."""
    def body():
        algo = make_algorithm("apmsqueeze", _wide_model(), _comm(comm), lr=0.01, warmup_steps=1)
        for _ in range(3):  # one warm-up step, two compression steps
            _bytes_allocated_by_step(algo)
        own = [v for v in vars(algo).values() if torch.is_tensor(v) and v.is_floating_point()
               and v.data_ptr() != algo.flat.data.data_ptr()]  # not the Parameter over the flat buffer
        floats = [v for v in vars(algo.onebit).values() if torch.is_tensor(v) and v.is_floating_point()]
        assert not [v for v in own if v.numel() >= algo.flat.numel]
        assert sum(v.numel() for v in floats) == 2 * algo.padded + 2 * algo.chunk, [v.numel() for v in floats]
        assert algo.frozen_denominator.data_ptr() == algo.adam_state()["exp_avg_sq"].data_ptr()

    run_all(comm, body)


@pytest.mark.parametrize("option, message", [
    ({"warmup_steps": 10, "total_steps": 10}, r"warm-up \(10 steps\) must be shorter than total_steps \(10\)"),
    ({"warmup_fraction": 0.2}, "needs its warm-up length"),
    ({"warmup_steps": 3, "warmup_fraction": 0.2, "total_steps": 10}, "not both"),
    ({"warmup_steps": 0}, "warmup_steps must be None or an int >= 1"),
    ({"warmup_fraction": 1.0, "total_steps": 10}, r"warmup_fraction must be in \(0.0, 1.0\)"),
    ({"warmup_steps": 2, "beta1": 1.0}, r"beta1 must be in \[0.0, 1.0\)"),
    ({"warmup_steps": 2, "beta2": 1.5}, r"beta2 must be in \[0.0, 1.0\)"),
    ({"warmup_steps": 2, "eps": 0.0}, r"eps must be in \(0.0, inf\)"),
    ({"warmup_steps": 2, "eps": -1e-8}, r"eps must be in \(0.0, inf\)"),
    ({"warmup_steps": 2, "variant": "onebit"}, r"variant must be one of \('paper', 'deepspeed'\)"),
])
def test_bad_config_fails_on_every_rank(comm, option, message):
    def body():
        with pytest.raises(ValueError, match=message):
            make_algorithm("apmsqueeze", make_model(), _comm(comm), **option)

    run_all(comm, body)


def test_non_float32_model_is_refused_on_every_rank(comm):
    def body():
        with pytest.raises(TypeError, match="apmsqueeze needs float32 parameters"):
            make_algorithm("apmsqueeze", make_model().double(), _comm(comm), warmup_steps=2)

    run_all(comm, body)


def test_warmup_fraction_of_total_steps(comm):
    """A fraction of total_steps is fixed at construction; total_steps alone leaves the warm-up to the freeze
    policy (None until it decides)."""
    def body():
        algo = make_algorithm("apmsqueeze", make_model(), _comm(comm), total_steps=40, warmup_fraction=0.25)
        default = make_algorithm("apmsqueeze", make_model(), _comm(comm), total_steps=40)
        assert (algo.warmup, default.warmup) == (10, None)
        assert (algo.phase, default.phase) == ("warmup", "warmup")

    run_all(comm, body)
