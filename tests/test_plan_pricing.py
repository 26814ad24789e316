"""The planner's network prices (serial): a calibration timed at the job's layout is priced as measured (no card
sharing added on top of what it measured), in-node calls are priced on the in-node measurement or the modelled
in-node link (never on the cross-node tables), two levels are taken only where they are priced below flat, the
allreduce's latency follows one algorithm per size, and a calibration used far beyond its rank count says so.

Every expected value is worked out by hand in the comments from the calibration's tables and the alpha-beta
formulas of mpicomm/net/model.py: recursive doubling ``ceil(log2 n) (alpha + m / beta)`` for an allreduce of
``m <= 2 KiB``, Rabenseifner ``2 ceil(log2 n) alpha + 2 (n-1)/n m / beta`` above.
"""

import json
import math

import pytest

from mpicomm.net import Calibration, CostModel, MeasuredCostModel, NetSpec
from mpicomm.net.model import SHORT_ALLREDUCE_BYTES, allreduce_across_nodes
from mpicomm.plan import Job, predict
from mpicomm.plan.candidates import CANDIDATES, candidate
from mpicomm.plan.model import EXTRAPOLATION_LIMIT, _flat_seconds, _two_level_seconds, rank_candidates
from mpicomm.plan.shapes import layers_from_params
from mpicomm.plan.wire import Op

MIB = 1 << 20
LAYERS = layers_from_params(MIB)  # one 1024 x 1024 fp32 matrix: a 4 MiB gradient
VECTOR = 4 * MIB
FLAT_MS = 15.38  # the measured flat allreduce of the 4 MiB gradient on 8 ranks

# A transport "measured" on 8 ranks across nodes (the ring's degree is 2).
TABLES = {"allreduce": [(8, 40e-6), (MIB, 4.0e-3), (4 * MIB, FLAT_MS * 1e-3), (8 * MIB, 30.6e-3)],
          "allgather": [(8, 40e-6), (MIB, 8.0e-3), (8 * MIB, 60e-3)],
          "neighbor": [(8, 20e-6), (MIB, 2.0e-3), (8 * MIB, 16e-3)]}
# The same measurements among the 4 ranks of one node (a shared-memory transport, 15x faster).
NODE_TABLES = {"allreduce": [(8, 5e-6), (4 * MIB, 1.0e-3)],
               "allgather": [(8, 5e-6), (MIB, 0.3e-3)],
               "neighbor": [(8, 3e-6), (MIB, 0.1e-3)]}
PCIE_BYTES_PER_S, PCIE_LATENCY = 200e9 / 8, 5e-6  # the default modelled in-node link (pcie: 200gbit,5us)


def _calibration(ranks=8, **changes) -> Calibration:
    return Calibration(**{**dict(ranks=ranks, transport="synthetic", host="h", latency_s=20e-6, tables=TABLES,
                                 hidden_fraction=0.0), **changes})


def _node() -> Calibration:
    return Calibration(ranks=4, transport="synthetic-shm", host="h", latency_s=1e-6, tables=NODE_TABLES)


def _job(per_node, cal=None, ranks=8, net="measured"):
    return Job(LAYERS, ranks, net, 0.05, per_node, 32, {}, calibration=_calibration() if cal is None else cal)


def _prices(job, key):
    """(flat communication, two-level communication) of candidate ``key`` per step."""
    cand = candidate(key)
    ops, period = cand.traffic(job.layers, job.ranks, 2)
    network = job.network()
    flat = sum(_flat_seconds(job, op, network, network.on("intra")) for op in ops) / period
    return flat, _two_level_seconds(job, cand, network.on("intra"), network.on("inter"))[0]


@pytest.mark.parametrize("per_node", [2, 4])
@pytest.mark.parametrize("recorded", [None, "job"])
def test_a_calibration_at_the_job_s_layout_prices_the_flat_allreduce_as_measured(per_node, recorded):
    """The measured 15.38 ms already contains the node's ranks sharing the card: no multiplier on top (it was
    priced as an allreduce of L x 4 MiB, 21 ms and more). Layout unrecorded: the job's rank count stands for it."""
    cal = _calibration(ranks_per_node=per_node if recorded else None)
    job = _job(per_node, cal)
    assert job.at_calibrated_layout and job.price_source == "measured" and job.price_warning == ""
    flat, two = _prices(job, "allreduce_sgd")
    assert flat == pytest.approx(FLAT_MS * 1e-3, rel=0.01)
    pred = predict(job, candidate("allreduce_sgd"), {})
    assert pred.hierarchical is (two < flat)
    assert pred.comm_s == pytest.approx(min(flat, two), rel=1e-9)


@pytest.mark.parametrize("per_node", [2, 4])
def test_two_levels_are_taken_only_where_priced_below_flat(per_node):
    """Every candidate on the synthetic calibration: the prediction is two levels exactly where their step is
    below the flat step (the same job with one rank per node prices flat alone), and takes the smaller."""
    job = _job(per_node)
    taken = {}
    for cand in CANDIDATES:
        pred = predict(job, cand, {})
        flat = predict(_job(1), cand, {})
        two_comm, two_work = _two_level_seconds(job, cand, job.network().on("intra"), job.network().on("inter"))
        two_step = job.step_time + two_work + two_comm
        assert pred.hierarchical is (two_step < flat.step_s)
        assert pred.step_s == pytest.approx(min(flat.step_s, two_step), rel=1e-12)
        taken[cand.key] = pred.hierarchical
    # allreduce_sgd: the measured flat allreduce less its in-node steps on pcie, plus two levels' in-node calls on
    # pcie: never below what was measured (see test_the_in_node_half_is_priced_on_the_modelled_intra_link)
    assert taken["allreduce_sgd"] is False
    assert taken["qsgd4"] is True  # an allgather of 2 nodes' payloads, not 8: below flat


def test_the_in_node_half_is_priced_on_the_modelled_intra_link():
    """No in-node measurement: in-node calls on pcie (200 Gbit/s = 25e9 B/s, 5 us), not on the cross-node tables.
    Two levels of allreduce_sgd at 4 per node, m = 4 MiB:
    inside  = reduce-scatter 3 (5 us) + 3/4 m / 25e9 + allgather of m/4, 3 (5 us + m/4 / 25e9)
            = 30 us + 1.5 m / 25e9
    between = the measured 15.38 ms less the flat allreduce's in-node steps, Rabenseifner over 4 ranks on pcie,
              2 log2 4 (5 us) + 2 * 3/4 m / 25e9 = 20 us + 1.5 m / 25e9
    two levels = 15.38 ms + 10 us: above flat, which stays."""
    job = _job(4)
    intra = job.network().on("intra")
    assert isinstance(intra, CostModel)
    assert (intra.beta, intra.alpha) == pytest.approx((PCIE_BYTES_PER_S, PCIE_LATENCY))
    flat, two = _prices(job, "allreduce_sgd")
    assert two == pytest.approx(FLAT_MS * 1e-3 + 10e-6, rel=1e-9)
    inside = 3 * PCIE_LATENCY + 0.75 * VECTOR / PCIE_BYTES_PER_S + 3 * (PCIE_LATENCY + MIB / PCIE_BYTES_PER_S)
    assert inside == pytest.approx(30e-6 + 1.5 * VECTOR / PCIE_BYTES_PER_S)
    pred = predict(job, candidate("allreduce_sgd"), {})
    assert pred.hierarchical is False and pred.comm_s == pytest.approx(FLAT_MS * 1e-3, rel=1e-9)
    assert job.calibration.intra_source == "modelled: pcie (200gbit,5us)"
    assert "in-node modelled: pcie" in predict(job, candidate("qsgd4"), {}).price_source  # two levels, priced so


def test_the_in_node_half_is_priced_on_the_in_node_measurement_where_there_is_one():
    """An in-node measurement on 4 ranks: allreduce of 4 MiB 1.0 ms, allgather of 1 MiB 0.3 ms.
    inside  = reduce-scatter (half the allreduce) 0.5 ms + allgather of m/4 0.3 ms = 0.8 ms
    between = 15.38 ms - the in-node allreduce 1.0 ms = 14.38 ms
    two levels = 15.18 ms, below the measured flat 15.38 ms: taken, and the price says its in-node source."""
    cal = _calibration(node=_node())
    job = _job(4, cal)
    assert isinstance(job.network().on("intra"), MeasuredCostModel)
    flat, two = _prices(job, "allreduce_sgd")
    assert flat == pytest.approx(15.38e-3, rel=1e-9) and two == pytest.approx(15.18e-3, rel=1e-9)
    pred = predict(job, candidate("allreduce_sgd"), {})
    assert pred.hierarchical is True and pred.comm_s == pytest.approx(15.18e-3, rel=1e-9)
    assert pred.price_source == "measured; in-node measured on 4 ranks of one node"
    assert cal.intra_source == "measured on 4 ranks of one node"
    assert json.loads(cal.to_json())["intra_source"] == "measured on 4 ranks of one node"  # the record says which


def test_a_calibration_at_another_layout_shares_the_card_as_modelled():
    """Recorded at 2 ranks per node, the job has 4: the tables are the cross-node link's; the flat allreduce is its
    in-node steps on pcie plus an allreduce over the 2 nodes on the measured tables (scaled from 8 ranks)."""
    cal = _calibration(ranks_per_node=2)
    job = _job(4, cal)
    assert not job.at_calibrated_layout
    assert job.price_source == "measured, scaled (calibrated at 2 ranks per node, job 4)"
    network = job.network()
    flat, _ = _prices(job, "allreduce_sgd")
    assert flat == pytest.approx(network.on("intra").allreduce(VECTOR, 4) + network.allreduce(VECTOR, 2), rel=1e-12)
    assert flat < FLAT_MS * 1e-3  # the 2-node allreduce of the whole vector is scaled down from 8 ranks


@pytest.mark.parametrize("job_ranks, source", [
    (8, "measured"),
    (32, "measured, scaled (calibrated at 8 ranks, job 32)"),  # 4x: still within the limit
    (33, "extrapolated (calibrated at 8 ranks, job 33)"),
    (1024, "extrapolated (calibrated at 8 ranks, job 1,024)"),
])
def test_the_price_source_names_an_extrapolated_calibration(job_ranks, source):
    job = _job(1, ranks=job_ranks)
    assert job.price_source == source
    preds = rank_candidates(job)
    assert all(p.price_source == source for p in preds if not p.hierarchical)
    if job_ranks > EXTRAPOLATION_LIMIT * 8:
        assert "\n" not in job.price_warning
        assert f"taken at 8 ranks and the job has {job_ranks:,}" in job.price_warning
    else:
        assert job.price_warning == ""


def test_a_modelled_network_says_so():
    job = Job(LAYERS, 8, "gbit", 0.05, 4, 32, {})
    assert job.price_source == "modelled" and job.price_warning == ""
    assert predict(job, candidate("allreduce_sgd"), {}).price_source == "modelled"


ALPHA, BETA = 1e-4, 125e6  # 1gbit,100us
MODEL = CostModel(NetSpec(1e9, 1e-4))


@pytest.mark.parametrize("n, steps", [(2, 1), (8, 3), (64, 6)])
def test_allreduce_latency_is_one_algorithm_per_size(n, steps):
    """log2 2 = 1, log2 8 = 3, log2 64 = 6 steps. Up to 2 KiB recursive doubling: each step one latency and the
    whole buffer; above, Rabenseifner: a latency per step of the reduce-scatter and of the allgather, and the
    bandwidth-optimal volume 2 (n-1)/n m."""
    small, large = 1024, MIB
    expected_small = {2: 1 * (ALPHA + small / BETA), 8: 3 * (ALPHA + small / BETA), 64: 6 * (ALPHA + small / BETA)}
    expected_large = {2: 2 * ALPHA + 1 * large / BETA, 8: 6 * ALPHA + 1.75 * large / BETA,
                      64: 12 * ALPHA + 2 * 63 / 64 * large / BETA}
    assert MODEL.allreduce(small, n) == pytest.approx(expected_small[n], rel=1e-12)
    assert MODEL.allreduce(large, n) == pytest.approx(expected_large[n], rel=1e-12)
    assert MODEL.allreduce(0, n) == pytest.approx(steps * ALPHA, rel=1e-12)  # latency alone
    assert MODEL.allreduce(SHORT_ALLREDUCE_BYTES, n) == pytest.approx(steps * (ALPHA + 2048 / BETA), rel=1e-12)
    assert MODEL.allreduce(SHORT_ALLREDUCE_BYTES + 4, n) == pytest.approx(
        2 * steps * ALPHA + 2 * (n - 1) / n * 2052 / BETA, rel=1e-12)


def test_a_flat_allreduce_across_nodes_shares_the_card_as_its_algorithm_does():
    """8 ranks, 2 nodes of 4 (intra 100gbit,1us = 12.5e9 B/s; inter 1gbit,100us). Rabenseifner, 1 MiB: in-node
    steps 2 log2 4 (1 us) + 2 * 3/4 m / 12.5e9, crossing steps 2 log2 2 (100 us) + 2 * 1/2 m / 125e6 (the card
    carries the node's 4 quarters of each half: one 2-rank allreduce). Recursive doubling, 1 KiB: in-node
    2 (1 us + m / 12.5e9), crossing 1 step of 100 us + 4 m / 125e6 (every rank's whole buffer through the card)."""
    links = CostModel(NetSpec(100e9, 1e-6)), MODEL
    large, small = MIB, 1024
    assert allreduce_across_nodes(*links, large, 2, 4) == pytest.approx(
        4e-6 + 1.5 * large / 12.5e9 + 2 * ALPHA + large / BETA, rel=1e-12)
    assert allreduce_across_nodes(*links, small, 2, 4) == pytest.approx(
        2 * (1e-6 + small / 12.5e9) + ALPHA + 4 * small / BETA, rel=1e-12)
    job = Job(LAYERS, 8, "intra=100gbit,1us,inter=1gbit,100us", 0.05, 4, 32, {})
    flat = _flat_seconds(job, Op("allreduce", large), job.cost_model(), job.network().on("intra"))
    assert flat == pytest.approx(allreduce_across_nodes(*links, large, 2, 4), rel=1e-12)
    assert math.isclose(_flat_seconds(Job(LAYERS, 4, "gbit", 0.05, 4, 32, {}), Op("allreduce", large),
                                      MODEL), MODEL.allreduce(large, 4))  # one node: nothing shared


def test_the_calibration_records_its_layout_and_in_node_source():
    cal = _calibration(ranks_per_node=4, node=_node())
    assert Calibration.from_json(cal.to_json()) == cal
    assert "8 ranks (4 per node)" in cal.summary() and cal.summary().endswith(
        "; in-node measured on 4 ranks of one node")
    other = _calibration(intra_net="nvlink")
    assert Calibration.from_json(other.to_json()).intra_source == "modelled: nvlink (2.4tbit,2us)"
    with pytest.raises(ValueError, match=r"^a calibration's ranks per node must be an integer in 1\.\.8 or None, "
                                         r"got 9$"):
        _calibration(ranks_per_node=9)
    with pytest.raises(ValueError, match=r"^a calibration's in-node link must be a --net setting of one link"):
        _calibration(intra_net="intra=pcie,inter=gbit")
