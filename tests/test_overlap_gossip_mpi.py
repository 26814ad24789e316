"""The exchange of x(t) begun before the forward pass (``overlap=True`` and ``begin_step()``) against the blocking
step: bit for bit the same parameters, codec generators and algorithm state, with gradient accumulation, a user
optimizer and a resume through the real checkpoint; a loop without ``begin_step()`` gets the blocking result; and
under a modelled network the clock's books show the transfer hidden behind compute.

Runs at 1, 2 and 4 ranks. The network part reads a clock driven by a virtual time (compute advances it by a set
amount), so what it asserts is the formula, never how long anything took.
"""

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator
from mpicomm.net import CostModel, NetClock, parse_net
from mpicomm.training.loop import TrainConfig, run_training
from mpicomm.training.metrics import read_metrics
from mpicomm.training.param_groups import decay_groups

from .algo_common import batch, loss, make_model
from .conftest import run_all

pytestmark = pytest.mark.mpi

# every method that claims a bit-for-bit overlap, with options that reach its interesting paths (Moniqua: with a
# fixed theta and no wrap; its settled-late agreement against a reference is in test_moniqua_mpi.py)
METHODS = {
    "dpsgd": {"momentum": 0.9, "weight_decay": 0.01},
    "moniqua-fixed": {"bits": 4, "parts": 2, "rounding": "stochastic", "theta": 0.5},  # its own generator
    "moniqua-identity": {"bits": 32, "parts": 1, "gamma": 0.5},
    "choco": {"order": "cta", "codec": "randomk", "codec_options": {"ratio": 0.25}, "momentum": 0.9},  # a generator
    "choco-lossless": {"order": "cta", "codec": "identity", "gamma": 0.5},
    "pdsgdm": {"order": "cta", "period": 2, "momentum": 0.9},  # gossip at steps 1, 3
    "cpdsgdm": {"order": "cta", "period": 3, "codec": "randomk", "codec_options": {"ratio": 0.25}},  # step 2
    "powergossip": {"order": "cta", "rank": 2, "min_compression_rate": 1.0, "momentum": 0.9},  # a round per step
}
STEPS = 4
# the steps of STEPS that post their exchange early: every one, but the periodic methods' local-only steps
POSTED = {"pdsgdm": [1, 3], "cpdsgdm": [2]}
# theta "observed": the first step exchanges blocking (theta needs step 0's gradient); resumed, not compared
RESUMED = {"moniqua-observed": {"bits": 2, "momentum": 0.9}}


def _schedules(n, case=""):
    """A static ring and, at a power of two, the time-varying one-peer exponential graph (not for PowerGossip,
    whose edges must be symmetric: the ring twice)."""
    out = [topology.ring(n)]
    if case.startswith("powergossip"):
        out.append(topology.ring(n))
    elif n > 1 and n & (n - 1) == 0:
        out.append(topology.one_peer_exponential(n))
    return out


def _build(comm, case, schedule, overlap, optimizer=False, **extra):
    name = case.split("-")[0]
    options = {**METHODS[case], "overlap": overlap, **extra}
    model = make_model(seed=comm.Get_rank())
    if optimizer:
        for key in ("momentum", "weight_decay"):
            options.pop(key, None)
        extra_args = {"optimizer": torch.optim.AdamW(decay_groups(model, 0.1), lr=0.01)}
    else:
        extra_args = {}
    return make_algorithm(name, model, Communicator(comm, schedule), **extra_args, **options)


def _count_posts(algo):
    """Wrap the communicator's non-blocking neighbour exchanges; returns the list their calls are appended to."""
    posts = []

    def counting(post):
        def counted(*args, **kwargs):
            posts.append(algo.step_count)
            return post(*args, **kwargs)
        return counted

    for name in ("ineighbor_allgather", "ineighbor_alltoallv"):
        setattr(algo.comm, name, counting(getattr(algo.comm, name)))
    return posts


def _train(algo, steps, begin=True, accumulate=1):
    """``steps`` updates of ``accumulate`` micro-batches each; ``begin_step()`` before the first forward when asked."""
    algo.accumulate(accumulate)
    rank = algo.comm.rank
    for _ in range(steps):
        if begin:
            algo.begin_step()
        for m in range(accumulate):
            algo.zero_grad()
            loss(algo.model, rank, accumulate * algo.step_count + m).backward()
            algo.step()


def _same(a, b, where="state"):
    """'' when the nested states ``a`` and ``b`` are equal bit for bit (tensors by torch.equal), else where not."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return "" if torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b) else where
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(a)} != {sorted(b)}"
        return next((d for k in a if (d := _same(a[k], b[k], f"{where}.{k}"))), "")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _same(x, y, f"{where}[{i}]"))), "")
    return "" if a == b else f"{where}: {a!r} != {b!r}"


def _state(algo):
    """The state without what overlap alone changes: the option itself, and Moniqua's agreement still to apply
    (settled first, as the next step or close() would)."""
    if getattr(algo, "node_modulo", True) is None:
        algo.gossip.settle(algo.flat.data)
    state = algo.state_dict()
    state["config"].pop("overlap")
    state["extra"].get("gossip", {}).pop("deferred", None)
    return state


@pytest.mark.parametrize("case", sorted(METHODS))
def test_overlapped_step_is_the_blocking_step_bit_for_bit(comm, case):
    """Parameters, algorithm state (codec generators, public copies, theta, optimizer) and the step's traffic
    are identical, on a static graph and on a time-varying one with accumulation; the exchange was
    really posted before the forward pass of every step that can (all but Moniqua's first under observed theta)."""
    def body():
        schedules = _schedules(comm.Get_size(), case)
        for schedule, accumulate in [(schedules[0], 1), (schedules[-1], 2)]:  # static; time-varying
            blocking = _build(comm, case, schedule, overlap=False)
            _train(blocking, STEPS, begin=True, accumulate=accumulate)  # begin_step is a no-op without overlap
            overlapped = _build(comm, case, schedule, overlap=True)
            posts = _count_posts(overlapped)
            _train(overlapped, STEPS, accumulate=accumulate)
            where = f"{schedule.name}, accumulate {accumulate}"
            assert torch.equal(overlapped.flat.data, blocking.flat.data), where
            differ = _same(_state(overlapped), _state(blocking))
            assert not differ, (where, differ)
            assert overlapped.stats()["step_bytes_sent"] == blocking.stats()["step_bytes_sent"], where
            alone = case == "powergossip" and comm.Get_size() == 1  # no neighbour, no round to post
            assert posts == ([] if alone else POSTED.get(case, list(range(STEPS)))), (where, posts)

    run_all(comm, body)


@pytest.mark.parametrize("case", ["dpsgd", "moniqua-fixed", "choco", "powergossip"])
def test_user_optimizer_overlapped_is_blocking(comm, case):
    def body():
        schedule = _schedules(comm.Get_size(), case)[-1]
        blocking = _build(comm, case, schedule, overlap=False, optimizer=True)
        _train(blocking, STEPS, accumulate=2)
        overlapped = _build(comm, case, schedule, overlap=True, optimizer=True)
        _train(overlapped, STEPS, accumulate=2)
        assert torch.equal(overlapped.flat.data, blocking.flat.data)
        differ = _same(_state(overlapped), _state(blocking))
        assert not differ, differ

    run_all(comm, body)


def test_loop_without_begin_step_and_the_forward_hook(comm):
    """overlap=True without begin_step() exchanges blocking (nothing posted) and ends where the blocking run does;
    the forward pre-hook begins each step once (not at evaluation under no_grad) and ends there too."""
    def body():
        schedule = _schedules(comm.Get_size())[-1]
        rank = comm.Get_rank()
        for case in ("dpsgd", "moniqua-fixed", "choco"):
            blocking = _build(comm, case, schedule, overlap=False)
            _train(blocking, STEPS, accumulate=2)
            forgot = _build(comm, case, schedule, overlap=True)
            posts = _count_posts(forgot)
            _train(forgot, STEPS, begin=False, accumulate=2)
            assert posts == [] and torch.equal(forgot.flat.data, blocking.flat.data), case
            hooked = _build(comm, case, schedule, overlap=True)
            posts = _count_posts(hooked)
            handle = hooked.overlap_with()
            hooked.accumulate(2)
            for _ in range(STEPS):
                with torch.no_grad():
                    hooked.model(batch(rank, 0)[0])  # evaluation: starts nothing
                assert not hooked.exchange_in_flight
                for m in range(2):  # two forward passes (micro-batches) in one update: one exchange
                    hooked.zero_grad()
                    loss(hooked.model, rank, 2 * hooked.step_count + m).backward()
                    assert hooked.exchange_in_flight
                    hooked.step()
                assert not hooked.exchange_in_flight
            handle.remove()
            assert posts == list(range(STEPS)), (case, posts)
            assert torch.equal(hooked.flat.data, blocking.flat.data), case
            for algo in (forgot, hooked):
                algo.close()

    run_all(comm, body)


def test_no_state_while_in_flight(comm):
    """state_dict, load_state_dict and averaged_model refuse while a begun exchange is in flight; after step() all
    work."""
    def body():
        algo = _build(comm, "dpsgd", _schedules(comm.Get_size())[0], overlap=True)
        saved = algo.state_dict()
        algo.begin_step()
        assert algo.exchange_in_flight
        for call in (algo.state_dict, lambda: algo.load_state_dict(saved), lambda: algo.averaged_model().__enter__()):
            with pytest.raises(RuntimeError, match="in flight"):
                call()
        algo.zero_grad()
        loss(algo.model, comm.Get_rank(), 0).backward()
        algo.step()
        assert not algo.exchange_in_flight and algo.state_dict()["step"] == 1

    run_all(comm, body)


def test_gradient_dependent_messages_refuse_overlap(comm):
    def body():
        with pytest.raises(ValueError, match="overlap=True needs order='cta'"):
            _build(comm, "choco", _schedules(comm.Get_size())[0], overlap=True, order="atc")
        for refused in ({"order": "atc"}, {"average_momentum": True}):
            with pytest.raises(ValueError, match="overlap=True needs order='cta' and average_momentum=False"):
                _build(comm, "pdsgdm", _schedules(comm.Get_size())[0], overlap=True, **refused)
        with pytest.raises(ValueError, match="overlap=True needs order='cta': with 'atc' the round mixes"):
            _build(comm, "powergossip", _schedules(comm.Get_size())[0], overlap=True, order="atc")

    run_all(comm, body)


class _TinyTask:
    """The tiny MLP on per-rank batches, with dropout so the torch RNG goes through the checkpoint; ``compute``
    (if set) is called at every forward pass (the network test advances its virtual clock there)."""

    def __init__(self, rank, compute=None):
        self.rank, self.compute = rank, compute
        self.model = torch.nn.Sequential(make_model(0), torch.nn.Dropout(0.1))
        self.steps_per_epoch = 4

    def train_batches(self, epoch, start=0):
        for b in range(start, self.steps_per_epoch):
            yield batch(self.rank, 100 * epoch + b)

    def loss(self, model, data):
        if self.compute is not None:
            self.compute()
        x, y = data
        return torch.nn.functional.cross_entropy(model(x), y), {"count": len(y)}

    def evaluate(self, model):
        x, y = batch(self.rank, 10_000)
        return {"test_loss": float(torch.nn.functional.cross_entropy(model(x), y))}


def _run(comm, case, overlap, out_dir, steps, net=None, compute=None, clock=None, **cfg):
    task = _TinyTask(comm.Get_rank(), compute)
    c = Communicator(comm, topology.ring(comm.Get_size()), net=net)
    algo = make_algorithm(case.split("-")[0], task.model, c, **{**METHODS, **RESUMED}[case], overlap=overlap)
    if clock is not None:
        c.clock = clock
    config = TrainConfig(epochs=4, max_steps=steps, lr=0.05, log_every=1, out_dir=out_dir, progress=False,
                         handle_signals=False, **cfg)
    return algo, run_training(task, algo, config)


@pytest.mark.parametrize("case", ["dpsgd", "moniqua-fixed", "moniqua-observed", "choco", "pdsgdm", "cpdsgdm",
                                  "powergossip"])
def test_resume_overlapped_is_bit_exact(comm, case, tmp_path_factory):
    """N + N overlapped steps through the real checkpoint (accumulating 2 micro-batches) == 2N blocking ones (2N
    overlapped ones for Moniqua's observed theta, one step older overlapped; its agreement pending at the save)."""
    root = comm.bcast(str(tmp_path_factory.mktemp("overlap")) if comm.Get_rank() == 0 else None)

    def body():
        straight, _ = _run(comm, case, case in RESUMED, f"{root}/straight", 6, accumulate=2)
        _, first = _run(comm, case, True, f"{root}/split", 6, accumulate=2, stop_at_step=3)
        assert first["step"] == 3 and first["stopped_by_signal"]
        resumed, last = _run(comm, case, True, f"{root}/split", 6, accumulate=2, resume="latest")
        assert last["step"] == 6
        assert torch.equal(resumed.flat.data, straight.flat.data), float((resumed.flat.data -
                                                                          straight.flat.data).abs().max())
        assert not _same(_state(resumed), _state(straight))

    run_all(comm, body)


class _VirtualTime:
    """A clock's ``now`` and ``sleep`` on a virtual time: only ``advance`` (compute) and ``sleep`` move it."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds

    def advance(self, seconds):
        self.t += seconds


NET = "80mbit,2ms"


@pytest.mark.parametrize("compute_ms", [1.0, 20.0])
def test_modelled_network_hides_the_transfer_behind_compute(comm, compute_ms, tmp_path_factory):
    """Each step's exchange costs its formula c either way; blocking, the step's reported comm is c; overlapped it
    is what compute did not hide, max(0, c - compute) (so 0 when compute outlasts the transfer): from the clock's
    books and from metrics.jsonl's comm_s_per_step."""
    root = comm.bcast(str(tmp_path_factory.mktemp("overlap_net")) if comm.Get_rank() == 0 else None)

    def body():
        model = CostModel(parse_net(NET))
        schedule = topology.ring(comm.Get_size())
        numel = sum(p.numel() for p in make_model(0).parameters())
        k_in = len(schedule.at(0).in_neighbors(comm.Get_rank()))
        k_out = len(schedule.at(0).out_neighbors(comm.Get_rank()))
        cost = model.neighbor(4 * numel * k_out, 4 * numel * k_in)
        compute = compute_ms / 1e3
        books = {}
        for overlap in (False, True):
            virtual = _VirtualTime()
            clock = NetClock(model, now=virtual.now, sleep=virtual.sleep)
            out = f"{root}/{compute_ms}-{overlap}"
            _run(comm, "dpsgd", overlap, out, 3, net=NET, compute=lambda v=virtual: v.advance(compute), clock=clock)
            train = [r for r in read_metrics(f"{out}/metrics.jsonl") if r["event"] == "train"]
            books[overlap] = clock.totals(), [r["comm_s_per_step"] for r in train]
        exposed = max(0.0, cost - compute)
        for overlap, want in ((False, cost), (True, exposed)):
            totals, per_step = books[overlap]
            assert totals["modelled_s"] == pytest.approx(3 * cost, rel=1e-12, abs=1e-15), (overlap, totals, cost)
            assert totals["slept_s"] == pytest.approx(3 * want, rel=1e-9, abs=1e-12), (overlap, totals, want)
            assert len(per_step) == 3
            # metrics.jsonl averages over the ranks (each rank's exchange costs the same on a ring)
            assert per_step == pytest.approx([want] * 3, rel=1e-9, abs=1e-12), (overlap, per_step, want)

    run_all(comm, body)
