"""The ``--net`` parser, the alpha-beta cost formulas and the clock that applies them (serial, fake time)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpicomm.ledger import ANY, Ledger
from mpicomm.net import CostModel, NetClock, NetLinks, NetSpec, parse_net


@pytest.mark.parametrize("text, bits, latency", [
    ("1gbit,100us", 1e9, 100e-6), ("100Mbit, 1ms", 1e8, 1e-3), ("2.5gbit,0s", 2.5e9, 0.0),
    ("fast", 1e10, 1e-6), ("gbit", 1e9, 1e-4), ("slow", 1e8, 1e-3), ("800kbit,1.5s", 8e5, 1.5),
])
def test_parse_net(text, bits, latency):
    spec = parse_net(text)
    assert spec.bits_per_s == pytest.approx(bits) and spec.latency_s == pytest.approx(latency)
    assert parse_net(str(spec)) == spec  # the canonical form parses back to the same setting


@pytest.mark.parametrize("text", ["", "none", None, "  NONE "])
def test_parse_net_none(text):
    assert parse_net(text) is None


@pytest.mark.parametrize("text, says", [
    ("1gbit", "BANDWIDTH,LATENCY"), ("1gb,1ms", "bandwidth '1gb'"), ("1gbit,1m", "latency '1m'"),
    ("0gbit,1ms", "bandwidth must be > 0"), ("fast,1ms", "bandwidth 'fast'"), ("1gbit,1ms,2", "BANDWIDTH,LATENCY"),
])
def test_parse_net_rejects(text, says):
    with pytest.raises(ValueError, match="--net") as info:
        parse_net(text)
    assert says in str(info.value)


@pytest.mark.parametrize("text, intra, inter", [
    ("intra=nvlink,inter=10gbit,5us", (2.4e12, 2e-6), (1e10, 5e-6)),
    ("inter=gbit, intra=pcie", (2e11, 5e-6), (1e9, 1e-4)),
    ("INTRA=100gbit,1us,inter=ib", (1e11, 1e-6), (2e11, 2e-6)),
])
def test_parse_net_two_link_classes(text, intra, inter):
    spec = parse_net(text)
    assert isinstance(spec, NetLinks)
    for link, (bits, latency) in (("intra", intra), ("inter", inter)):
        assert spec.link(link).bits_per_s == pytest.approx(bits) and spec.link(link).latency_s == pytest.approx(latency)
    assert parse_net(str(spec)) == spec
    model = CostModel(spec)
    assert model.on("inter").beta == model.beta == inter[0] / 8 and model.on("intra").beta == intra[0] / 8
    for link, (bits, latency) in (("intra", intra), ("inter", inter)):
        # Rabenseifner over 4 ranks: 2 ceil(log2 4) = 4 latencies + 2 * 3/4 * 1e6 bytes
        assert model.on(link).allreduce(10**6, 4) == pytest.approx(4 * latency + 1.5e6 * 8 / bits)


def test_one_setting_is_both_link_classes():
    spec = parse_net("1gbit,100us")
    model = CostModel(spec)
    assert spec.link("intra") is spec.link("inter") is spec and model.on("intra") is model.on("inter") is model
    with pytest.raises(ValueError, match="link class"):
        model.on("node")


@pytest.mark.parametrize("text, says", [
    ("intra=nvlink", "inter is missing"), ("inter=1gbit,1ms", "intra is missing"),
    ("intra=fast,inter=fast,intra=slow", "given twice"), ("node=fast,inter=fast", "not intra or inter"),
    ("1gbit,inter=fast", "intra=SETTING,inter=SETTING"), ("intra=,inter=fast", "needs a setting"),
    ("intra=1gbit,inter=fast", "(for intra)"), ("intra=fast,inter=1gbit,1ms,2", "(for inter)"),
])
def test_parse_net_two_link_classes_rejects(text, says):
    with pytest.raises(ValueError, match="--net") as info:
        parse_net(text)
    assert says in str(info.value)


def test_ledger_books_each_link_class_and_keeps_it_through_a_checkpoint():
    ledger = Ledger(0)
    ledger.record("allreduce", 400, {ANY: 300}, {ANY: 300})
    ledger.record("reduce_scatter", 400, {1: 200}, {1: 200}, link="intra")
    ledger.record_uniform("allgatherv", 50, [1], [1], link="intra")
    totals = ledger.totals()
    assert (totals["bytes_sent_intra"], totals["bytes_sent_inter"], totals["bytes_sent"]) == (250, 300, 550)
    assert ledger.bytes_received_on("intra") == 250 and ledger.bytes_received_on("inter") == 300
    again = Ledger(0)
    again.load_state_dict(ledger.state_dict())
    assert again.totals() == totals
    old = ledger.state_dict()
    del old["links"]  # a checkpoint written before link classes: everything went between nodes
    again.load_state_dict(old)
    assert again.totals()["bytes_sent_inter"] == 550 and again.totals()["bytes_sent_intra"] == 0
    with pytest.raises(ValueError, match="link"):
        ledger.record("allreduce", 4, {}, {}, link="node")


ALPHA, BETA = 1e-4, 125e6  # 1gbit,100us
MODEL = CostModel(NetSpec(1e9, 1e-4))


@pytest.mark.parametrize("n, m", [(2, 1_000_000), (4, 1_000_000), (8, 4096), (5, 123_457)])
def test_collective_formulas(n, m):
    # Written out by hand from the table in mpicomm/net/model.py (every m here is above 2 KiB: the allreduce is
    # Rabenseifner's, 2 ceil(log2 n) latencies; tests/test_plan_pricing.py checks recursive doubling below).
    assert MODEL.message(m) == pytest.approx(ALPHA + m / BETA)
    assert MODEL.allreduce(m, n) == pytest.approx(2 * math.ceil(math.log2(n)) * ALPHA + 2 * (n - 1) / n * m / BETA)
    assert MODEL.allgather(m, n) == pytest.approx((n - 1) * ALPHA + (n - 1) * m / BETA)
    assert MODEL.alltoall(m, n) == pytest.approx((n - 1) * ALPHA + (n - 1) / n * m / BETA)
    assert MODEL.bcast(m, n) == pytest.approx(math.ceil(math.log2(n)) * (ALPHA + m / BETA))
    assert MODEL.barrier(n) == pytest.approx(math.ceil(math.log2(n)) * ALPHA)
    assert MODEL.neighbor(2 * m, m) == pytest.approx(ALPHA + 2 * m / BETA)  # the busier direction counts
    assert MODEL.reduce_scatter(m, n) == pytest.approx((n - 1) * ALPHA + (n - 1) / n * m / BETA)
    assert MODEL.allgatherv(m, n) == MODEL.allgather(m, n)  # m: the largest part
    assert MODEL.alltoallv(m, 3 * m, n - 1) == pytest.approx((n - 1) * ALPHA + 3 * m / BETA)
    # every part equal: the same as the pairwise-exchange alltoall of the whole send buffer
    assert MODEL.alltoallv((n - 1) * m, (n - 1) * m, n - 1) == pytest.approx(MODEL.alltoall(n * m, n))


def test_one_rank_and_empty_messages_cost_nothing():
    for cost in (MODEL.allreduce(10**6, 1), MODEL.allgather(10**6, 1), MODEL.alltoall(10**6, 1),
                 MODEL.bcast(10**6, 1), MODEL.barrier(1), MODEL.neighbor(0, 0), MODEL.alltoallv(0, 0, 0)):
        assert cost == 0.0


@given(st.integers(2, 64), st.integers(2049, 10**9))
def test_rabenseifner_allreduce_bandwidth_term_stays_under_two_buffers(n, m):
    # Property of the bandwidth-optimal allreduce (above 2 KiB): whatever n, each rank moves under 2 m bytes.
    assert MODEL.allreduce(m, n) - 2 * math.ceil(math.log2(n)) * ALPHA <= 2 * m / BETA + 1e-12


class FakeTime:
    """A clock the test advances by hand; ``sleep`` advances it."""

    def __init__(self):
        self.t = 0.0
        self.slept = []

    def now(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def _clock(spec="80mbit,1ms"):  # beta = 10 MB/s
    fake = FakeTime()
    return NetClock(CostModel(parse_net(spec)), now=fake.now, sleep=fake.sleep), fake


def test_blocking_cost_goes_on_top_of_the_real_transfer():
    clock, fake = _clock()

    def real_transfer():
        fake.t += 0.5  # the real call took 0.5 s (e.g. waiting for a slow peer)

    clock.run(lambda m: m.message(1_000_000), real_transfer)
    assert fake.t == pytest.approx(0.5 + 0.001 + 0.1)
    assert clock.blocked_s == pytest.approx(0.601) and clock.slept_s == pytest.approx(0.101)
    assert clock.modelled_s == pytest.approx(0.101)


def test_nonblocking_transfer_hides_behind_compute_and_queues_on_the_link():
    clock, fake = _clock()
    first = clock.post(lambda m: m.message(1_000_000))   # 0.101 s, link busy until 0.101
    second = clock.post(lambda m: m.message(1_000_000))  # queued behind it: ends at 0.202
    assert (first, second) == (pytest.approx(0.101), pytest.approx(0.202))
    fake.t += 0.15  # compute hides the first transfer completely and half of the second
    clock.complete(first, lambda: None)
    assert fake.slept == []
    clock.complete(second, lambda: None)
    assert fake.slept == [pytest.approx(0.052)] and fake.t == pytest.approx(0.202)
    assert clock.modelled_s == pytest.approx(0.202) and clock.slept_s == pytest.approx(0.052)


def test_blocking_call_waits_for_a_busy_link():
    clock, fake = _clock()
    clock.post(lambda m: m.message(1_000_000))  # link busy until 0.101
    clock.run(lambda m: m.message(0), lambda: None)  # 1 ms message must queue behind it
    assert fake.t == pytest.approx(0.102)


def test_paused_and_unmodelled_clocks_sleep_nothing():
    clock, fake = _clock()
    with clock.paused():
        assert not clock.active
        clock.run(lambda m: m.message(10**9), lambda: None)
        clock.complete(clock.post(lambda m: m.message(10**9)), lambda: None)
    assert fake.t == 0.0 and clock.modelled_s == 0.0 and clock.blocked_s == 0.0
    fake2 = FakeTime()
    plain = NetClock(None, now=fake2.now, sleep=fake2.sleep)

    def real():
        fake2.t += 0.25

    plain.run(lambda m: m.message(10**9), real)
    assert fake2.slept == [] and plain.blocked_s == pytest.approx(0.25) and plain.modelled_s == 0.0
