"""A user's torch optimizer under the algorithms: against single-process references, refusals, exact resume.

The references run every rank in one process (``grad_at``): D-PSGD with the optimizer's update taken at
the pre-mixing iterate, AllReduce with the optimizer stepping the averaged gradient.
"""

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import ALGORITHMS, make_algorithm
from mpicomm.comm import Communicator
from mpicomm.training.param_groups import decay_groups

from .algo_common import grad_at, in_turns, initial_flat, make_model, mixing, topologies_for, train
from .conftest import run_all
from .test_d2_mpi import settled_gamma

pytestmark = pytest.mark.mpi


def _adamw(model, lr=0.01):
    """AdamW over two groups of ``model``: decay on weights, none on biases."""
    return torch.optim.AdamW(decay_groups(model, 0.1), lr=lr)


def _sgd(model, lr=0.05):
    """Momentum SGD over two groups of ``model``: decay on weights, none on biases."""
    return torch.optim.SGD(decay_groups(model, 0.01), lr=lr, momentum=0.9)


def _reference(n, steps, build, mix, adapt_first=False):
    """Every rank's flat parameters after ``steps``, each optimizer's update d taken at the rank's iterate x.

    ``mix(x, t)``: the gossip; then x <- mix(x) + d (D-PSGD's order) or, ``adapt_first``, mix(x + d).
    ``mix=None``: centralized, every optimizer steps the gradient averaged over the ranks.
    """
    models = [make_model(0) for _ in range(n)]
    optimizers = [build(m) for m in models]
    for t in range(steps):
        x = torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])
        updates = []
        for r, (m, opt) in enumerate(zip(models, optimizers)):
            g = grad_at(x[r], r, t) if mix is not None else torch.stack(
                [grad_at(x[r], s, t) for s in range(n)]).mean(0)
            for p, gp in zip(m.parameters(), _split(g, m)):
                p.grad = gp
            opt.step()
            updates.append(torch.nn.utils.parameters_to_vector(m.parameters()).detach() - x[r])
        d = torch.stack(updates)
        new = x + d if mix is None else (mix(x + d, t) if adapt_first else mix(x, t) + d)
        for r, m in enumerate(models):
            torch.nn.utils.vector_to_parameters(new[r], m.parameters())
    return torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])


def _reference_d2(n, steps, build, schedule, gamma):
    """D² with the optimizer's update d in place of -alpha g: x_{k+1/2} = 2 x_k - x_{k-1} + d_k - d_{k-1}, mixed
    by (1 - gamma) I + gamma W."""
    models = [make_model(0) for _ in range(n)]
    optimizers = [build(m) for m in models]
    x_prev = d_prev = None
    for t in range(steps):
        x = torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])
        for r, (m, opt) in enumerate(zip(models, optimizers)):
            for p, gp in zip(m.parameters(), _split(grad_at(x[r], r, t), m)):
                p.grad = gp
            opt.step()
        d = torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach() for m in models]) - x
        half = x + d if x_prev is None else 2 * x - x_prev + d - d_prev
        x_prev, d_prev = x, d
        new = half + gamma * (mixing(schedule, t) @ half - half)
        for r, m in enumerate(models):
            torch.nn.utils.vector_to_parameters(new[r], m.parameters())
    return torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])


def _split(g, model):
    """The flat ``g`` cut into copies shaped like ``model``'s parameters."""
    out, i = [], 0
    for p in model.parameters():
        out.append(g[i:i + p.numel()].view_as(p).clone())
        i += p.numel()
    return out


# Decentralized algorithms in a configuration whose gossip is exact (D-PSGD's mixing with W).
DECENTRALIZED = {
    "dpsgd": {},
    "moniqua": {"bits": 32, "parts": 1, "gamma": 1.0},
    "dcd": {"codec": "identity"},
    "choco-cta": {"codec": "identity", "gamma": 1.0, "order": "cta"},
    "choco-atc": {"codec": "identity", "gamma": 1.0},
    "pdsgdm": {"period": 1, "order": "cta"},
    "cpdsgdm": {"codec": "identity", "gamma": 1.0, "period": 1, "order": "cta"},
}


@pytest.mark.parametrize("build", [_adamw, _sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize("case", sorted(DECENTRALIZED))
def test_decentralized_user_optimizer_matches_reference(comm, case, build):
    def body():
        n = comm.Get_size()
        for schedule in topologies_for(n)[-1:]:
            model = make_model(seed=comm.Get_rank())
            algo = make_algorithm(case.split("-")[0], model, Communicator(comm, schedule), optimizer=build(model),
                                  **DECENTRALIZED[case])
            train(algo, 5)
            expected = _reference(n, 5, build, lambda x, t, s=schedule: mixing(s, t) @ x,
                                  adapt_first=case.endswith("atc"))[comm.Get_rank()]
            torch.testing.assert_close(algo.flat.data, expected, rtol=1e-5, atol=1e-6)

    run_all(comm, body)


@pytest.mark.parametrize("build", [_adamw, _sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize("name", ["d2", "moniqua_d2"])
def test_d2_user_optimizer_matches_reference(comm, name, build):
    def body():
        schedule = topologies_for(comm.Get_size())[0]
        model = make_model(seed=comm.Get_rank())
        options = {"bits": 32, "parts": 1} if name == "moniqua_d2" else {}
        algo = make_algorithm(name, model, Communicator(comm, schedule), optimizer=build(model), **options)
        train(algo, 5)
        expected = _reference_d2(comm.Get_size(), 5, build, schedule, settled_gamma(schedule))[comm.Get_rank()]
        torch.testing.assert_close(algo.flat.data, expected, rtol=1e-5, atol=1e-6)

    run_all(comm, body)


def test_moniqua_quantized_with_adamw_tracks_dpsgd(comm):
    """8-bit Moniqua with AdamW stays within its quantization error of D-PSGD with AdamW (theta from ||d||_inf)."""
    def body():
        schedule = topologies_for(comm.Get_size())[0]
        model = make_model(seed=comm.Get_rank())
        algo = make_algorithm("moniqua", model, Communicator(comm, schedule), optimizer=_adamw(model),
                              bits=8, parts=1)
        train(algo, 5)
        expected = _reference(comm.Get_size(), 5, _adamw, lambda x, t: mixing(schedule, t) @ x)[comm.Get_rank()]
        assert float((algo.flat.data - expected).abs().max()) < 2e-3
        assert algo.gossip.record.steps == 5

    run_all(comm, body)


# Centralized algorithms in a configuration whose averaging is exact.
CENTRALIZED = {
    "allreduce_sgd": {},
    "allreduce_adam": {},
    "compressed_sgd": {"codec": "identity"},
    "powersgd": {"warmup_steps": 5},
}


@pytest.mark.parametrize("name", sorted(CENTRALIZED))
@pytest.mark.parametrize("build", [_adamw, _sgd], ids=["adamw", "sgd"])
def test_centralized_user_optimizer_matches_reference(comm, name, build):
    def body():
        model = make_model(seed=comm.Get_rank())
        algo = make_algorithm(name, model, Communicator(comm, topologies_for(comm.Get_size())[0]),
                              optimizer=build(model), **CENTRALIZED[name])
        train(algo, 5)
        expected = _reference(comm.Get_size(), 5, build, None)[0]
        torch.testing.assert_close(algo.flat.data, expected, rtol=1e-5, atol=1e-6)
        assert algo.lr == pytest.approx(algo.optimizer.param_groups[0]["lr"])

    run_all(comm, body)


def test_builtin_and_user_sgd_agree(comm):
    """The built-in SGD (decay folded in at x) and torch SGD with the same decay take the same steps."""
    def body():
        c = Communicator(comm, topologies_for(comm.Get_size())[0])
        builtin = make_algorithm("dpsgd", make_model(), c, lr=0.05, momentum=0.9, weight_decay=0.01)
        model = make_model()
        user = make_algorithm("dpsgd", model, c, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01))
        train(builtin, 4)
        train(user, 4)
        torch.testing.assert_close(user.flat.data, builtin.flat.data, rtol=1e-5, atol=1e-7)

    run_all(comm, body)


REFUSING = sorted(n for n, c in ALGORITHMS.items() if not c.takes_optimizer)


def test_the_refusing_algorithms_are_those_whose_optimizer_is_the_method():
    assert REFUSING == ["apmsqueeze", "ef_signsgd", "hsq", "lamb", "onebit_lamb", "zeroone_adam"]


@pytest.mark.parametrize("name", REFUSING)
def test_refusals_name_the_algorithm_on_every_rank(comm, name):
    def body():
        model = make_model()
        refusal = f"{name} does not accept optimizer=: .* the method.*; set lr, .* instead"
        with pytest.raises(ValueError, match=refusal) as info:
            make_algorithm(name, model, Communicator(comm, topologies_for(comm.Get_size())[0]),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert "rank 0" in str(info.value)

    run_all(comm, body)


@pytest.mark.parametrize("name, options, message", [
    ("compressed_sgd", {"error_feedback": True}, "compressed_sgd: error feedback compresses lr"),
    ("pdsgdm", {"average_momentum": True}, "pdsgdm: average_momentum=True averages the built-in"),
])
def test_configurations_whose_step_is_the_method_refuse_an_optimizer(comm, name, options, message):
    def body():
        model = make_model()
        with pytest.raises(ValueError, match=message):
            make_algorithm(name, model, Communicator(comm, topologies_for(comm.Get_size())[0]),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **options)

    run_all(comm, body)


@pytest.mark.parametrize("case", ["foreign", "missing", "lr", "mismatch", "type"])
def test_bad_optimizers_fail_on_every_rank(comm, case):
    def body():
        model = make_model()
        params = list(model.parameters())
        options = {}
        if case == "foreign":
            opt = torch.optim.SGD([*params, torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        elif case == "missing":
            opt = torch.optim.SGD(params[:-1], lr=0.1)
        elif case == "lr":
            opt, options = torch.optim.SGD(params, lr=0.1), {"lr": 0.2}
        elif case == "mismatch":
            opt = torch.optim.SGD(params, lr=0.1 if comm.Get_rank() == 0 else 0.2)
        else:
            opt = "sgd"
        expect = {"foreign": "exactly once", "missing": "missing", "lr": "lr configure the built-in",
                  "mismatch": "optimizer mismatch", "type": "torch.optim.Optimizer"}[case]
        if case == "mismatch" and comm.Get_size() == 1:
            return
        with pytest.raises(ValueError, match=expect):
            make_algorithm("dpsgd", model, Communicator(comm, topologies_for(comm.Get_size())[0]), optimizer=opt,
                           **options)

    run_all(comm, body)


# options, and the optimizers to resume with (both for one algorithm of each family, AdamW for the rest)
RESUME = {"dpsgd": ({}, "both"), "moniqua": ({"bits": 2}, "adamw"), "moniqua_d2": ({"bits": 2}, "sgd"),
          "d2": ({}, "adamw"), "choco": ({}, "sgd"), "dcd": ({}, "adamw"), "cpdsgdm": ({"period": 2}, "adamw"),
          "pdsgdm": ({"period": 2}, "sgd"), "powergossip": ({"min_compression_rate": 1.0}, "adamw"),
          "allreduce_sgd": ({}, "both"), "allreduce_adam": ({}, "adamw"), "compressed_sgd": ({}, "sgd"),
          "qsgd": ({}, "adamw"), "terngrad": ({}, "sgd"), "signsgd": ({}, "adamw"),
          "powersgd": ({"warmup_steps": 2, "min_compression_rate": 1.0}, "sgd"),
          "diloco": ({"period": 2}, "adamw"), "sparseloco": ({"period": 2, "chunk": 32, "density": 0.25}, "sgd"),
          "decentralized_diloco": ({"period": 2}, "adamw"),
          "streaming_diloco": ({"period": 6, "fragments": 2}, "sgd")}  # saved with fragment 1 in flight
BUILDS = {"adamw": _adamw, "sgd": _sgd}


def test_every_algorithm_that_takes_an_optimizer_is_resumed_here():
    assert set(RESUME) | {"adpsgd", "moniqua_adpsgd"} == {n for n, c in ALGORITHMS.items() if c.takes_optimizer}


@pytest.mark.parametrize("name, kind", [(n, k) for n, (_, which) in sorted(RESUME.items())
                                        for k in (("adamw", "sgd") if which == "both" else (which,))])
def test_resume_with_optimizer_and_scheduler_is_bit_exact(comm, name, kind):
    """N + N == 2N with the optimizer's state in state_dict() and a cosine scheduler's in the caller's."""
    schedule = topology.ring(comm.Get_size()) if name == "powergossip" else topologies_for(comm.Get_size())[-1]
    options, build = RESUME[name][0], BUILDS[kind]

    def fresh(seed=0):
        model = make_model(seed)
        opt = build(model)
        algo = make_algorithm(name, model, Communicator(comm, schedule), optimizer=opt, **options)
        return algo, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)

    def run(algo, scheduler, steps):
        for _ in range(steps):
            train(algo, 1)
            scheduler.step()

    def body():
        straight, s1 = fresh()
        run(straight, s1, 6)
        first, s2 = fresh()
        run(first, s2, 3)
        state, sched_state = first.state_dict(), s2.state_dict()
        resumed, s3 = fresh(seed=7)
        resumed.load_state_dict(state)
        s3.load_state_dict(sched_state)
        run(resumed, s3, 3)
        # close (collective, so before any assert): streaming_diloco's straight and resumed runs end with an
        # exchange in flight, a request on COMM_WORLD that MPI_Finalize would otherwise report as pending
        for algo in (straight, first, resumed):
            algo.close()
        assert torch.equal(resumed.flat.data, straight.flat.data)
        assert resumed.lr == straight.lr < build(make_model()).param_groups[0]["lr"]

    run_all(comm, body)


def test_set_lr_writes_every_group(comm):
    def body():
        model = make_model()
        algo = make_algorithm("dpsgd", model, Communicator(comm, topologies_for(comm.Get_size())[0]),
                              optimizer=_adamw(model))
        algo.set_lr(0.125)
        assert [g["lr"] for g in algo.optimizer.param_groups] == [0.125, 0.125] and algo.lr == 0.125
        assert algo.flat.numel == initial_flat().numel()

    run_all(comm, body)


def _reference_in_turns(n, rounds, build, schedule, seed, gamma):
    """AD-PSGD with the optimizer's update, every rank in one process, the ranks stepping in turns (rank 0, then
    1, ...): rank i takes d = opt.step(x_i) - x_i at x_i, draws peer j from its generator (seed + i), then
    x_i <- (1 - gamma/2) x_i + (gamma/2) x_j + d, x_j as j last published it; and publishes x_i."""
    models = [make_model(0) for _ in range(n)]
    optimizers = [build(m) for m in models]
    x = [initial_flat() for _ in range(n)]
    published = [v.clone() for v in x]
    peer_rngs = [torch.Generator().manual_seed(seed + r) for r in range(n)]
    for t in range(rounds):
        for r, (m, opt) in enumerate(zip(models, optimizers)):
            torch.nn.utils.vector_to_parameters(x[r].clone(), m.parameters())
            for p, gp in zip(m.parameters(), _split(grad_at(x[r], r, t), m)):
                p.grad = gp
            opt.step()
            d = torch.nn.utils.parameters_to_vector(m.parameters()).detach() - x[r]
            peers = schedule.union_in_neighbors(r)
            if peers:
                j = peers[int(torch.randint(len(peers), (1,), generator=peer_rngs[r]))]
                x[r] = x[r] * (1 - gamma / 2) + published[j] * (gamma / 2)
            x[r] = x[r] + d
            published[r] = x[r].clone()
    return torch.stack(x)


# Asynchronous algorithms; the identity Moniqua (bits=32) runs AD-PSGD's pull exactly, 8 bits to its grid
# (None: one grid step, 2 theta / 2^8, per round), with a theta wide enough that no model wraps (the
# reference knows no modulo: an adaptive theta wrapped on 3 ranks, and the guard's recovery is not AD-PSGD).
ASYNCHRONOUS = {
    "adpsgd": ({}, 1e-6),
    "moniqua_adpsgd-identity": ({"bits": 32, "parts": 1, "gamma": 1.0}, 1e-6),
    "moniqua_adpsgd-8bit": ({"bits": 8, "parts": 1, "gamma": 1.0, "theta": 0.25}, None),
}


@pytest.mark.parametrize("case", sorted(ASYNCHRONOUS))
def test_asynchronous_user_optimizer(comm, case):
    """Made deterministic by taking turns (4 rounds), AD-PSGD and Moniqua-AD-PSGD with AdamW end where the
    single-process reference does: the optimizer's update taken at the iterate before the pull, added after it,
    the peer drawn from the rank's generator (8 bits: to within its grid); one optimizer step per update."""
    options, atol = ASYNCHRONOUS[case]
    name = case.split("-")[0]

    def body():
        schedule = topologies_for(comm.Get_size())[0]
        model = make_model()
        algo = make_algorithm(name, model, Communicator(comm, schedule), optimizer=_adamw(model), **options)
        in_turns(comm, 4, lambda: train(algo, 1))
        expected = _reference_in_turns(comm.Get_size(), 4, _adamw, schedule, algo.config.seed, algo.gamma)
        got = algo.flat.data.clone()
        tolerance = atol
        if tolerance is None:
            assert sum(algo.metrics()["moniqua_wrapped"].values()) == 0, algo.metrics()
            tolerance = 4 * 2 * float(algo.theta().max()) / 2**8
        algo.close()
        torch.testing.assert_close(got, expected[comm.Get_rank()], rtol=1e-5, atol=tolerance)
        assert all(int(s["step"]) == 4 for s in algo.optimizer.state.values())

    run_all(comm, body)
