"""Moniqua on D-PSGD: pure-torch reference step by step, identity == D-PSGD bit for bit, the guard's skip keeps
the average, the dither agrees across processes, wire bytes == formula, memory, convergence, N + N == 2N."""

import logging

import pytest
import torch

from mpicomm.algorithms import make_algorithm
from mpicomm.algorithms.moniqua import ThetaBoundError
from mpicomm.codecs.moniqua import dither, stream_key
from mpicomm.comm import Communicator
from mpicomm.plan.wire import moniqua_message_bytes
from mpicomm.topology import Topology

from . import lsq_problem as lsq
from .algo_common import grad_at, initial_flat, make_model, mixing, topologies_for, train
from .conftest import run_all
from .moniqua_reference import LAYER_SIZES, ReferenceTheta, reference_mix, spectral_t_mix

pytestmark = pytest.mark.mpi


def reference_moniqua(schedule, steps, lr, bits, parts, gamma, theta=None, c=1.0, per="tensor", rounding="dither",
                      late=False):
    """Moniqua for every rank: theta from the previous step's statistics, mix the parts, then x -= lr g.
    Yields the (n, d) models after each of the ``steps`` steps.

    theta: None (adaptive), "observed" or a fixed number. late: the statistics of step t are folded in at step
    t + 1, after that step's mix (``overlap=True``: theta one step older)."""
    n = schedule.size
    x = initial_flat().repeat(n, 1)
    observed = theta == "observed"
    fixed = None if observed else theta
    t_mix = spectral_t_mix(schedule.at(0).W, gamma) if fixed is None else 1.0
    rule = ReferenceTheta(fixed, c, per, parts, t_mix, observed=observed)
    earlier = None
    for t in range(steps):
        g = torch.stack([grad_at(x[r], r, t) for r in range(n)])
        if t == 0:
            rule.observe(x, lr * g)
        mixed, distance = reference_mix(x, mixing(schedule, t), t, rule.theta(), bits, parts, gamma, rounding)
        if late and earlier is not None:
            rule.observe(*earlier[:2])
            if observed:
                rule.observe_distance(earlier[2])
        earlier = (x, lr * g, distance)
        if not late:
            rule.observe(x, lr * g)
            if observed:
                rule.observe_distance(distance)
        x = mixed - lr * g
        yield x


@pytest.mark.parametrize("bits,parts,gamma,theta,per,rounding", [
    (4, 4, 1.0, None, "tensor", "dither"),      # the default
    (4, 2, 1.0, None, "tensor", "dither"),
    (1, 1, 0.5, None, "model", "nearest"),      # the paper's form
    (2, 3, 0.5, 0.4, "tensor", "dither"),       # fixed theta, parts that do not divide the tensors
    (8, 1, 1.0, None, "model", "dither"),
    (4, 4, 1.0, "observed", "tensor", "dither"),  # theta from the recovered distances
    (2, 1, 0.5, "observed", "model", "nearest"),
])
def test_moniqua_matches_reference(comm, bits, parts, gamma, theta, per, rounding):
    def body():
        for schedule in topologies_for(comm.Get_size()):
            if theta in (None, "observed") and not isinstance(schedule, Topology):
                continue  # the reference's t_mix uses one symmetric W
            c_ = Communicator(comm, schedule)
            options = dict(theta="adaptive") if theta is None else dict(theta=theta)
            algo = make_algorithm("moniqua", make_model(seed=comm.Get_rank()), c_, lr=0.1, bits=bits, parts=parts,
                                  gamma=gamma, theta_per=per, rounding=rounding, **options)
            reference = reference_moniqua(schedule, 6, 0.1, bits, parts, gamma, theta, per=per, rounding=rounding)
            for step, expected in enumerate(reference, start=1):
                train(algo, 1)
                assert algo.stats()["wrapped_parts"] == 0, (schedule.name, algo.stats())
                torch.testing.assert_close(algo.flat.data, expected[c_.rank], rtol=1e-5, atol=1e-6,
                                           msg=f"{schedule.name} step {step}")

    run_all(comm, body)


@pytest.mark.parametrize("bits,parts,gamma,theta,per,rounding", [
    (4, 4, 1.0, None, "tensor", "dither"),
    (4, 4, 1.0, "observed", "tensor", "dither"),
    (1, 1, 0.5, None, "model", "nearest"),  # the paper's form
])
def test_overlap_matches_the_reference_with_theta_one_step_older(comm, bits, parts, gamma, theta, per, rounding):
    """overlap=True (exchange posted in begin_step, agreement settled one step later) against the reference whose
    theta folds each step's statistics in one step late."""
    def body():
        schedule = topologies_for(comm.Get_size())[0]
        c_ = Communicator(comm, schedule)
        options = dict(theta="adaptive") if theta is None else dict(theta=theta)
        algo = make_algorithm("moniqua", make_model(seed=comm.Get_rank()), c_, lr=0.1, bits=bits, parts=parts,
                              gamma=gamma, theta_per=per, rounding=rounding, overlap=True, **options)
        reference = reference_moniqua(schedule, 6, 0.1, bits, parts, gamma, theta, per=per, rounding=rounding,
                                      late=True)
        for step, expected in enumerate(reference, start=1):
            algo.begin_step()
            train(algo, 1)
            assert algo.stats()["wrapped_parts"] == 0, algo.stats()
            torch.testing.assert_close(algo.flat.data, expected[c_.rank], rtol=1e-5, atol=1e-6,
                                       msg=f"{schedule.name} step {step}")
        algo.close()

    run_all(comm, body)


def test_identity_with_gamma_one_is_dpsgd_bit_for_bit(comm):
    def body():
        for schedule in topologies_for(comm.Get_size()):
            runs = []
            for name, extra in (("dpsgd", {}), ("moniqua", dict(bits=32, parts=1, gamma=1.0))):
                algo = make_algorithm(name, make_model(seed=comm.Get_rank()), Communicator(comm, schedule), lr=0.05,
                                      momentum=0.9, weight_decay=1e-3, **extra)
                train(algo, 6)
                runs.append(algo)
            assert torch.equal(runs[0].flat.data, runs[1].flat.data), schedule.name
            assert runs[0].stats()["step_bytes_sent"] == runs[1].stats()["step_bytes_sent"], schedule.name

    run_all(comm, body)


def message_bytes(bits: int, parts: int) -> int:
    """4 T header bytes + one slot of ceil(ceil(n_l / P) b / 8) bytes per tensor, rounded up to 4."""
    return moniqua_message_bytes(LAYER_SIZES, bits, parts)


@pytest.mark.parametrize("bits,parts,theta", [(4, 4, "adaptive"), (1, 1, 5.0), (2, 3, 5.0), (8, 2, "adaptive"),
                                              (32, 1, "adaptive"), (4, 4, "observed")])
def test_bytes_on_the_wire_match_the_formula(comm, bits, parts, theta):
    def body():
        n = comm.Get_size()
        T = len(LAYER_SIZES)
        for schedule in topologies_for(n):
            c = Communicator(comm, schedule)
            algo = make_algorithm("moniqua", make_model(), c, lr=0.05, bits=bits, parts=parts, theta=theta)
            train(algo, 1)
            first = algo.stats()
            train(algo, 2)
            d, out_degree = algo.flat.numel, len(c.out_neighbors(2))
            stats = algo.stats()
            if bits == 32:  # identity: the fp32 model only, like D-PSGD
                assert stats["step_bytes_sent"] == out_degree * 4 * d
                continue
            message = message_bytes(bits, parts)
            agreed = 3 * T if theta == "observed" else 2 * T  # float32 agreed per step (+ the distances)
            allreduce = (n - 1) * 8 * agreed // n  # the Ledger's allreduce volume
            assert stats["wrapped_parts"] == 0
            assert stats["step_bytes_sent"] == out_degree * message + allreduce, schedule.name
            assert stats["step_bytes_contributed"] == message + 4 * agreed
            first_extra = 4 * T if theta != 5.0 else 0  # one allreduce of T float32 before the first theta
            assert first["step_bytes_contributed"] == message + 4 * agreed + first_extra

    run_all(comm, body)


def held_tensor_bytes(algo) -> int:
    """Bytes of every tensor the algorithm (and its communicator's caches) keeps, model and gradient excluded."""
    skip = {algo.flat.data.data_ptr(), algo.flat.grad.data_ptr()}
    seen, total, stack = set(), 0, [v for k, v in vars(algo).items() if k not in ("model", "flat", "comm")]
    stack.extend(algo.comm._recv.values())
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.numel() and obj.data_ptr() not in skip and obj.data_ptr() not in seen:
                seen.add(obj.data_ptr())
                total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            stack.append(obj.state)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, logging.Logger)) and id(obj) not in seen:
            seen.add(id(obj))
            stack.extend(vars(obj).values())
    return total


def test_memory_is_message_sized(comm):
    """Moniqua holds send + in-degree receive rows of one message, and 4 T-sized per-tensor vectors; no model copy."""
    def body():
        schedule = topologies_for(comm.Get_size())[0]
        held = {}
        for name, extra in (("dpsgd", {}), ("moniqua", dict(theta=5.0))):
            c = Communicator(comm, schedule)
            algo = make_algorithm(name, make_model(), c, lr=0.05, **extra)
            train(algo, 2)
            held[name] = held_tensor_bytes(algo)
        d, in_degree, T = algo.flat.numel, len(c.in_neighbors(0)), len(LAYER_SIZES)
        assert held["moniqua"] == (1 + in_degree) * message_bytes(4, 4) + 4 * 8 * T, held
        assert held["dpsgd"] == in_degree * 4 * d, held

    run_all(comm, body)


def test_default_converges_to_the_dpsgd_loss(comm):
    """Non-IID least squares, 150 full-batch steps at lr 0.1 / (1 + t/30): F(x̄) - F* within 0.5% of F(x_0) - F*
    of D-PSGD's, for the default and for the paper's form."""
    def body():
        n = comm.Get_size()
        f0, fstar = lsq.objective(torch.zeros(lsq.D), n), lsq.objective(lsq.optimum(n), n)
        for schedule in topologies_for(n)[:2]:
            gaps = {}
            for name, extra in (("dpsgd", {}), ("moniqua", {}),
                                ("moniqua", dict(bits=1, parts=1, theta_per="model", theta="adaptive",
                                                 rounding="nearest"))):
                algo = make_algorithm(name, lsq.make_model(), Communicator(comm, schedule), lr=0.1, **extra)
                lsq.train(algo, 150, lr=lambda t: 0.1 / (1 + t / 30))
                gaps[f"{name} {extra}"] = (lsq.objective(algo.consensus_model(), n) - fstar) / (f0 - fstar)
            dpsgd = gaps.pop("dpsgd {}")
            assert dpsgd < 2e-3, gaps
            for key, gap in gaps.items():
                assert gap <= dpsgd + 5e-3, (schedule.name, key, gap, dpsgd)

    run_all(comm, body)


def test_dither_is_regenerated_identically_by_sender_and_receivers(comm):
    """Every rank regenerates each step's dither (in chunks of any split): bit-identical across processes,
    a fresh stream every step."""
    def body():
        rank = comm.Get_rank()
        for step in (0, 1, 17):
            split = 10 + 37 * rank  # each process regenerates it in its own chunks
            key = stream_key(7, step)
            mine = torch.cat([dither(key, torch.arange(10, split)), dither(key, torch.arange(split, 1000))])
            gathered = comm.allgather(mine.numpy().tobytes())
            assert all(g == gathered[0] for g in gathered)
            assert not torch.equal(mine, dither(stream_key(7, step + 1), torch.arange(10, 1000)))

    run_all(comm, body)


def skewed(comm, guard: str, tiny: float = 1e-4):
    """Moniqua on rank-dependent models (no broadcast), theta 5 everywhere but ``tiny`` x 5 on tensor 0."""
    schedule = topologies_for(comm.Get_size())[0]
    algo = make_algorithm("moniqua", make_model(seed=comm.Get_rank()), Communicator(comm, schedule), lr=0.1,
                          theta=5.0, parts=2, guard=guard, broadcast_init=False)
    algo.gossip.rule.scale[0] = tiny
    return algo


def test_guard_never_mixes_a_wrapped_part_and_keeps_the_average(comm, caplog):
    """A tiny theta on tensor 0: its part wraps, every rank skips it (bit for bit unchanged), the others mix, and
    the cross-rank average is preserved; rank 0 summarises the skips once, at close."""
    def body():
        if comm.Get_size() == 1:
            return  # no neighbours, nothing can wrap
        algo = skewed(comm, "skip")
        x = algo.flat.data
        before = x.clone()
        total_before = comm.allreduce(before.double().numpy())
        with caplog.at_level(logging.WARNING, logger="mpicomm.algorithms.moniqua"):
            wrapped = algo.gossip.mix(x, 0, torch.zeros(len(LAYER_SIZES)))
            algo.close()
        a, b = algo.gossip.layout.part(0, 0)
        assert wrapped and algo.stats()["wrapped_parts"] == 1, algo.stats()
        assert torch.equal(x[a:b], before[a:b])
        assert not torch.equal(x[b:], before[b:])
        total_after = comm.allreduce(x.double().numpy())
        assert abs(total_after - total_before).max() < 1e-5
        warnings = [r.getMessage() for r in caplog.records if "Moniqua guard" in r.getMessage()]
        assert len(warnings) == (1 if comm.Get_rank() == 0 else 0), warnings
        assert float(algo.gossip.rule.scale[0]) == 2e-4  # the wrapped tensor's scale doubled
        flags = comm.allgather(algo.gossip.record.wrapped.tolist())
        assert all(f == flags[0] for f in flags)

    run_all(comm, body)


def test_guard_resync_mixes_the_wrapped_part_at_full_precision(comm):
    def body():
        if comm.Get_size() == 1:
            return
        algo = skewed(comm, "resync")
        x = algo.flat.data
        a, b = algo.gossip.layout.part(0, 0)
        topo = algo.comm.topology(0)
        rows = comm.allgather(x[a:b].clone())
        expected = topo.self_weight(comm.Get_rank()) * rows[comm.Get_rank()]
        for j, w in zip(topo.in_neighbors(comm.Get_rank()), topo.neighbor_weights(comm.Get_rank())):
            expected = expected + w * rows[j]
        algo.gossip.mix(x, 0, torch.zeros(len(LAYER_SIZES)))
        assert algo.stats()["resyncs"] == 1
        torch.testing.assert_close(x[a:b], expected, rtol=1e-6, atol=1e-7)

    run_all(comm, body)


@pytest.mark.parametrize("guard", ["skip", "resync"])
def test_overlap_settles_a_wrap_one_step_later_as_the_blocking_guard_does(comm, guard):
    """Rank 0's tensor 0 moved far from the others': the edges touching rank 0 wrap, rank 2's (at 4 ranks) do
    not. Overlapped, rank 2 mixes the part at once and un-mixes it when the agreement is settled; the models then
    equal the blocking guard's to float32 rounding (skipped or resynced), with the same record and scales, and the
    average is kept."""
    def body():
        if comm.Get_size() == 1:
            return
        out = {}
        for overlap in (False, True):
            schedule = topologies_for(comm.Get_size())[0]
            algo = make_algorithm("moniqua", make_model(seed=comm.Get_rank()), Communicator(comm, schedule),
                                  lr=0.1, theta=5.0, parts=2, guard=guard, broadcast_init=False, overlap=overlap)
            x = algo.flat.data
            if comm.Get_rank() == 0:
                x[:LAYER_SIZES[0]] += 37.25
            total_before = comm.allreduce(x.double().numpy())
            wrapped = algo.gossip.mix(x, 0, torch.zeros(len(LAYER_SIZES)))
            if overlap:
                assert not wrapped and algo.stats()["wrapped_parts"] == 0  # known one step later
                wrapped = algo.gossip.settle(x)
            assert wrapped and algo.stats()["wrapped_parts"] == 1, algo.stats()
            total_after = comm.allreduce(x.double().numpy())
            assert abs(total_after - total_before).max() < 1e-4
            out[overlap] = x.clone(), algo.gossip.rule.scale.clone(), algo.stats()["resyncs"]
            algo.close()
        torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-5)
        assert torch.equal(out[True][1], out[False][1]) and out[True][2] == out[False][2] == (guard == "resync")

    run_all(comm, body)


def test_guard_raises_on_every_rank(comm):
    def body():
        if comm.Get_size() == 1:
            return
        algo = skewed(comm, "raise")
        with pytest.raises(ThetaBoundError, match=r"step 0: the modulo recovery wrapped on 1 tensor part"):
            algo.gossip.mix(algo.flat.data, 0, torch.zeros(len(LAYER_SIZES)))

    run_all(comm, body)


@pytest.mark.parametrize("options,match", [
    (dict(theta=0.0), "theta must be 'adaptive', 'observed' or a finite number > 0"),
    (dict(theta="auto"), "theta must be 'adaptive'"),
    (dict(bits=3), "bits must be one of 1, 2, 4, 8"),
    (dict(parts=0), "parts must be an int >= 1"),
    (dict(bits=32, parts=4), "parts must be 1 with bits=32"),
    (dict(gamma=1.5), r"gamma must be in \(0.0, 1.0\]"),
    (dict(bits=1, rounding="stochastic"), "needs bits >= 2"),
    (dict(theta_per="layer"), "theta_per must be 'tensor' or 'model'"),
    (dict(theta_shrink=0.0), "theta_shrink must be"),
    (dict(guard="ignore"), "guard must be one of"),
])
def test_bad_config_is_one_error_on_every_rank(comm, options, match):
    def body():
        c = Communicator(comm, topologies_for(comm.Get_size())[0])
        with pytest.raises(ValueError, match=match):
            make_algorithm("moniqua", make_model(), c, **options)

    run_all(comm, body)


@pytest.mark.parametrize("options", [
    dict(momentum=0.9, weight_decay=1e-3),  # the default: theta per tensor, dither keyed by the step, parts
    dict(bits=2, rounding="stochastic", momentum=0.9),  # the stochastic-rounding generator
    dict(bits=2, theta=2e-3, theta_cap=8.0, parts=3),  # guard events: scales and counters are state
    dict(theta="observed", momentum=0.9),  # the observed distances are state
])
def test_state_round_trip_is_bit_exact(comm, options):
    def body():
        schedule = topologies_for(comm.Get_size())[-1]
        straight = make_algorithm("moniqua", make_model(), Communicator(comm, schedule), lr=0.05, **options)
        train(straight, 6)
        first = make_algorithm("moniqua", make_model(), Communicator(comm, schedule), lr=0.05, **options)
        train(first, 3)
        resumed = make_algorithm("moniqua", make_model(seed=3), Communicator(comm, schedule), lr=0.05, **options)
        resumed.load_state_dict(first.state_dict())
        train(resumed, 3)
        assert torch.equal(resumed.flat.data, straight.flat.data)
        assert torch.equal(resumed.gossip.rule.scale, straight.gossip.rule.scale)
        if options.get("theta") == "observed":
            assert torch.equal(resumed.gossip.rule.distance, straight.gossip.rule.distance)
        assert resumed.stats()["wrapped_parts"] == straight.stats()["wrapped_parts"]

    run_all(comm, body)


@pytest.mark.parametrize("options", [dict(bits=4, parts=4), dict(bits=1, parts=1, rounding="nearest"),
                                     dict(bits=2, parts=3, rounding="stochastic"), dict(bits=8, parts=2, theta=0.02)])
def test_cutting_the_message_into_chunks_changes_no_bit(comm, options):
    """Encode/decode in 8-position chunks (runs split mid-tensor) gives the same models, theta and wrap counts as
    one chunk for the whole message: every step's arithmetic is per coordinate."""
    def body():
        schedule = topologies_for(comm.Get_size())[0]
        runs = []
        for chunk in (None, 8):
            algo = make_algorithm("moniqua", make_model(seed=comm.Get_rank()), Communicator(comm, schedule), lr=0.1,
                                  momentum=0.9, broadcast_init=False, **options)
            if chunk:
                algo.gossip.chunk = chunk
            train(algo, 5)
            runs.append(algo)
        assert len(runs[1].gossip.layout.plan(0, 8)) > 1
        assert torch.equal(runs[0].flat.data, runs[1].flat.data)
        assert torch.equal(runs[0].gossip.rule.theta(), runs[1].gossip.rule.theta())
        assert runs[0].stats()["wrapped_parts"] == runs[1].stats()["wrapped_parts"]

    run_all(comm, body)


@pytest.mark.parametrize("options", [dict(bits=4, parts=4), dict(bits=1, parts=1, rounding="nearest"),
                                     dict(bits=2, parts=3, rounding="stochastic"), dict(bits=4, theta="observed"),
                                     dict(bits=8, parts=2, theta=0.002, guard="skip")])
def test_fused_kernels_change_no_bit(comm, options):
    """The fused CPU kernels (``Frame.encode``/``recover_into``), the numpy path and the torch (CUDA) path give
    the same models, theta, wrap counts and wire bytes, wraps included (theta 0.002)."""
    from mpicomm.codecs import bitpack

    def body():
        schedule = topologies_for(comm.Get_size())[0]
        runs = []
        for backend in ("kernels", "numpy", "torch"):
            with bitpack.use_backend(backend):
                algo = make_algorithm("moniqua", make_model(seed=comm.Get_rank()), Communicator(comm, schedule),
                                      lr=0.1, momentum=0.9, broadcast_init=False, **options)
                train(algo, 5)
            runs.append(algo)
        if options.get("theta") == 0.002 and comm.Get_size() > 1:
            assert runs[0].stats()["wrapped_parts"] > 0  # one rank alone has no neighbour to wrap against
        for other in runs[1:]:
            assert torch.equal(runs[0].flat.data, other.flat.data)
            assert torch.equal(runs[0].gossip.rule.theta(), other.gossip.rule.theta())
            assert torch.equal(runs[0].gossip.send, other.gossip.send)
            assert runs[0].stats() == other.stats()

    run_all(comm, body)
