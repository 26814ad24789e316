"""The planner across nodes: a flat collective shares the node's card, two levels are priced as they run, and the
choice carries the ``hierarchical`` it was priced with. Expected seconds are worked by hand from the alpha-beta
formulas (zero latency, so only the bandwidth terms remain). A flat allreduce of m bytes over N nodes of L
consecutive ranks (Rabenseifner, nearest partner first) costs its in-node steps, 2 (L-1)/L m on intra, plus its
crossing steps, whose volume through the shared card is an N-rank allreduce's, 2 (N-1)/N m on inter."""

import pytest
import torch

from mpicomm.plan import Job, predict
from mpicomm.plan.candidates import candidate
from mpicomm.plan.shapes import layers_from_params

MIB4 = 4 * 1024 * 1024  # one 1024 x 1024 fp32 matrix
NET = "intra=100gbit,0us,inter=1gbit,0us"  # 12.5e9 and 125e6 bytes/s


def _job(ranks, per_node, step_time=1e-3, net=NET):
    return Job(layers_from_params(1024 * 1024), ranks, net, step_time, per_node, 32, {})


def test_flat_allreduce_across_nodes_costs_what_two_levels_do_and_stays_flat():
    pred = predict(_job(8, 4), candidate("allreduce_sgd"))
    # flat, 8 ranks, 4 on each card: in-node steps 2 * 3/4 * 4 MiB / 12.5e9 = 0.0005033 s, crossing steps
    #       2 * 1/2 * 4 MiB / 125e6 = 0.0335544 s (the 4 ranks' halves through the card: one 2-rank allreduce)
    # two levels: reduce-scatter 3/4 * 4 MiB / 12.5e9 + allgather 3 * 1 MiB / 12.5e9 = 0.0005033 s inside,
    #             allreduce of 4 MiB over 2 nodes 2 * 1/2 * 4 MiB / 125e6 = 0.0335544 s between
    # the same price: two levels are taken only below flat
    assert pred.hierarchical is False
    assert pred.comm_s == pytest.approx(0.0340577, rel=1e-5)
    assert pred.options["hierarchical"] is False


def test_two_levels_lose_where_the_inside_link_is_as_slow():
    pred = predict(_job(8, 4, net="intra=1gbit,0us,inter=1gbit,0us"), candidate("dpsgd"))
    # flat ring gossip: 2 neighbours x 4 MiB through one boundary rank's share of the card: 8 MiB / 125e6
    # = 0.0671089 s; two levels: 0.0503316 s inside + 4 MiB to the one other node 0.0335544 s = 0.0838861 s
    assert pred.hierarchical is False
    assert pred.comm_s == pytest.approx(0.0671089, rel=1e-5)
    assert pred.options["hierarchical"] is False


def test_one_node_weighs_no_levels_and_shares_no_card():
    pred = predict(_job(4, 4), candidate("allreduce_sgd"))
    # on intra, no sharing: 2 * 3/4 * 4 MiB / 12.5e9 = 0.0005033 s
    assert pred.hierarchical is None and "hierarchical" not in pred.options
    assert pred.comm_s == pytest.approx(0.00050332, rel=1e-4)


def test_unequal_nodes_weigh_no_levels():
    assert not _job(6, 4).two_level and _job(8, 4).two_level and not _job(8, 1).two_level
    assert predict(_job(6, 4), candidate("allreduce_sgd")).hierarchical is None


def _record(monkeypatch, ranks, per_node):
    from mpicomm.plan import choose, codec_cost

    monkeypatch.setattr(codec_cost, "codec_costs", lambda: {})  # no timing of codecs in a unit test
    model = torch.nn.Linear(1024, 1024, bias=False)
    return choose._plan(model, ranks, per_node, NET, 1e-3, 0.3, 32, True, False)


def test_the_choice_carries_the_levels_it_was_priced_with(monkeypatch):
    across = _record(monkeypatch, 8, 4)
    chosen = predict(_job(8, 4), candidate(across["candidate"]))
    assert across["options"]["hierarchical"] is chosen.hierarchical  # the levels it was priced with
    assert across["label"].endswith(", two levels") is chosen.hierarchical
    assert not (chosen.hierarchical and "overlap" in across["options"])  # two levels cannot overlap
    assert predict(_job(8, 4), candidate("qsgd4")).hierarchical is True  # an allgather method's two levels win
    one_node = _record(monkeypatch, 4, 4)
    assert "hierarchical" not in one_node["options"] and "two levels" not in one_node["label"]


def _measured_job(hidden):
    from mpicomm.net.calibration import Calibration

    tables = {op: [(1000, 0.001), (1_000_000, 0.1)] for op in ("allreduce", "allgather", "neighbor")}
    cal = Calibration(4, "test", "host", 1e-5, tables, hidden)
    return Job(layers_from_params(1024 * 1024), 4, "measured", 0.2, 4, 32, {}, calibration=cal)


def test_overlap_is_credited_by_the_measured_hidden_fraction():
    # 4 MiB to each ring neighbour, past the table's end: 0.1 + (4194304 - 1e6) * 0.099 / 999000 = 0.4165526 s
    half = predict(_measured_job(0.5), candidate("dpsgd"))
    assert half.comm_s == pytest.approx(0.4165526, rel=1e-6)
    assert half.exposed_overlap_s == pytest.approx(0.4165526 - 0.5 * 0.2, rel=1e-6) and half.overlap_helps
    none = predict(_measured_job(0.0), candidate("dpsgd"))
    assert none.exposed_overlap_s == pytest.approx(none.comm_s) and not none.overlap_helps
    unmeasured = predict(_measured_job(None), candidate("dpsgd"))  # no measurement: the modelled credit
    assert unmeasured.exposed_overlap_s == pytest.approx(0.4165526 - 0.2, rel=1e-6)


def test_buckets_take_the_allreduce_hidden_fraction_where_it_was_measured():
    from mpicomm.plan.candidates import BUCKETS, STEP

    job = _measured_job(0.9)
    assert job.hidden_fraction(STEP) == job.hidden_fraction(BUCKETS) == 0.9  # no allreduce measured: the exchange's
    job.calibration.bucket_hidden_fraction = 0.25
    assert (job.hidden_fraction(STEP), job.hidden_fraction(BUCKETS)) == (0.9, 0.25)
    assert _job(4, 4).hidden_fraction(BUCKETS) == 1.0  # a modelled network
