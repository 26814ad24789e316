"""A measured transport's cost model (serial): interpolation, derived operations and rank scaling against values
worked out by hand from a hand-written table, the JSON round trip, the cache path, the planner pricing with it,
and the one-line refusals of a bad calibration and of ``--net measured`` without one."""

import math
import os

import pytest

from mpicomm.cli import main
from mpicomm.net import Calibration, MeasuredCostModel
from mpicomm.net.calibration import default_path
from mpicomm.plan import Job
from mpicomm.plan.candidates import candidate
from mpicomm.plan.model import predict
from mpicomm.plan.shapes import layers_of

# A transport "measured" at 4 ranks (the ring's degree is 2). Bytes: allreduce, the buffer; allgather, one rank's
# part; neighbor, bytes to each neighbour.
TABLES = {"allreduce": [(100, 1e-5), (1100, 2e-5), (2100, 6e-5)],
          "allgather": [(1100, 5e-5), (100, 3e-5)],  # out of order on purpose: the calibration sorts it
          "neighbor": [(100, 2e-5), (1100, 4e-5), (2100, 8e-5)]}
# The neighbour table's last slope is (8e-5 - 4e-5) / 1000 = 4e-8 s per byte to each neighbour; over the ring's
# 2 neighbours the link's s = 2e-8 s/B (beta = 5e7 B/s). alpha = 5e-6 s.


def _calibration(**changes) -> Calibration:
    fields = dict(ranks=4, transport="hand", host="h", latency_s=5e-6, tables=TABLES, hidden_fraction=0.75,
                  created="2026-01-01T00:00:00+00:00")
    return Calibration(**{**fields, **changes})


@pytest.fixture
def model() -> MeasuredCostModel:
    return _calibration().cost_model()


@pytest.mark.parametrize("op,args,expected", [
    ("allreduce", (600, 4), 1.5e-5),     # halfway from 100 to 1100: 1e-5 + 0.5 * 1e-5
    ("allreduce", (1100, 4), 2e-5),      # a measured point
    ("allreduce", (1600, 4), 4e-5),      # 2e-5 + 0.5 * 4e-5
    ("allreduce", (50, 4), 1e-5),        # below the smallest size: the smallest's time
    ("allreduce", (3100, 4), 1e-4),      # beyond: 6e-5 + 1000 * 4e-8
    ("allreduce", (600, 1), 0.0),        # one rank: nothing to send
    # 2 ranks from 4, 600 B <= 2 KiB (recursive doubling, ceil(log2 n) (alpha + m s)):
    # 1.5e-5 * (1 (5e-6 + 600 * 2e-8)) / (2 (5e-6 + 600 * 2e-8)) = 1.5e-5 / 2
    ("allreduce", (600, 2), 7.5e-6),
    # 8 ranks from 4, 3100 B > 2 KiB (Rabenseifner, 2 ceil(log2 n) alpha + 2 (n-1)/n m s): 1e-4 * (6 * 5e-6 + 2 * 7/8
    # * 3100 * 2e-8) / (4 * 5e-6 + 2 * 3/4 * 3100 * 2e-8) = 1e-4 * 1.385e-4 / 1.13e-4
    ("allreduce", (3100, 8), 1e-4 * 1.385e-4 / 1.13e-4),
    ("reduce_scatter", (600, 4), 7.5e-6),  # half the allreduce
    ("allgather", (600, 4), 4e-5),       # halfway from 3e-5 to 5e-5
    ("allgather", (600, 7), 8e-5),       # scaled by (7 - 1) / (4 - 1)
    ("allgatherv", (600, 4), 4e-5),      # as long as the largest part's allgather
    ("alltoall", (2400, 4), 4e-5),       # an allgather of 2400 / 4 = 600 bytes each
    ("neighbor", (1200, 800), 3e-5),     # max 1200 over 2 neighbours: 600 each -> 2e-5 + 0.5 * 2e-5
    ("neighbor", (6200, 0), 1.2e-4),     # 3100 each: 8e-5 + 1000 * 4e-8
    ("neighbor", (0, 0), 0.0),           # nothing sent, nothing received
    ("message", (1000,), 2.5e-5),        # 5e-6 + 1000 * 2e-8
    ("alltoallv", (3000, 1000, 3), 7.5e-5),  # 3 * 5e-6 + 3000 * 2e-8
    ("alltoallv", (3000, 1000, 0), 0.0),
    ("bcast", (1000, 5), 7.5e-5),        # ceil(log2 5) = 3 messages of 2.5e-5
    ("barrier", (8,), 1.5e-5),           # 3 latencies
])
def test_measured_costs_are_the_hand_computed_interpolation(model, op, args, expected):
    assert getattr(model, op)(*args) == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_the_model_has_the_cost_model_s_methods_and_one_link(model):
    from mpicomm.net import CostModel

    public = {name for name in dir(CostModel) if not name.startswith("_") and callable(getattr(CostModel, name))}
    assert public <= {name for name in dir(model) if callable(getattr(model, name))}
    # inter: the tables as measured; intra: no in-node measurement here, so the modelled in-node link (pcie)
    assert model.on("inter") is model and isinstance(model.on("intra"), CostModel)
    assert model.on("intra").beta == pytest.approx(200e9 / 8) and model.on("intra").alpha == pytest.approx(5e-6)
    assert model.beta == pytest.approx(5e7)


def test_a_falling_last_pair_extrapolates_flat():
    tables = {**TABLES, "allreduce": [(100, 3e-5), (1100, 2e-5)]}  # noise: the larger size measured faster
    model = _calibration(tables=tables).cost_model()
    assert model.allreduce(5000, 4) == pytest.approx(2e-5)


def test_json_round_trip_and_atomic_save(tmp_path):
    cal = _calibration()
    assert Calibration.from_json(cal.to_json()) == cal
    assert cal.tables["allgather"] == [(100, 3e-5), (1100, 5e-5)]  # sorted by bytes
    path = cal.save(tmp_path / "sub" / "c.json")
    assert Calibration.load(path) == cal
    assert os.listdir(tmp_path / "sub") == ["c.json"]  # no temporary file left behind
    unmeasured = _calibration(hidden_fraction=None)
    assert Calibration.from_json(unmeasured.to_json()).hidden_fraction is None
    buckets = _calibration(bucket_hidden_fraction=0.25)
    assert Calibration.from_json(buckets.to_json()).bucket_hidden_fraction == 0.25


@pytest.mark.parametrize("changes,line", [
    ({"ranks": 1}, "a calibration needs at least 2 ranks, got 1"),
    ({"latency_s": math.nan}, "a calibration's latency must be a finite number of seconds >= 0, got nan"),
    ({"hidden_fraction": 1.5}, "a calibration's hidden fraction must be in [0, 1] or None, got 1.5"),
    ({"bucket_hidden_fraction": -0.1}, "a calibration's bucket hidden fraction must be in [0, 1] or None, got -0.1"),
    ({"tables": {"allreduce": [(8, 1e-5)]}}, "a calibration needs tables for allreduce, allgather, neighbor; "
                                              "allgather, neighbor missing"),
])
def test_a_bad_calibration_is_one_line(changes, line):
    with pytest.raises(ValueError) as caught:
        _calibration(**changes)
    assert str(caught.value) == line


def test_a_file_that_is_not_a_calibration_is_one_line_naming_it(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"ranks": 4}')
    with pytest.raises(ValueError) as caught:
        Calibration.load(path)
    assert str(caught.value) == f"{path}: not a calibration: KeyError 'transport'"


def test_the_cache_is_beside_the_codec_costs_per_host_label_and_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("MPICOMM_PLAN_CACHE", str(tmp_path / "costs.json"))
    assert default_path("loopback", 4, "node1") == tmp_path / "calibration-node1-loopback-4.json"
    assert default_path("", 8, "node1") == tmp_path / "calibration-node1-default-8.json"
    with pytest.raises(ValueError, match=r"^--transport must be a label of letters, digits, '\.', '_' and '-', "
                                         r"got '\.\./x'$"):
        default_path("../x", 4)


def test_the_planner_prices_with_the_calibration():
    layers = layers_of([(150,)])  # 600 bytes of fp32
    job = Job(layers, 4, "measured: by hand", 0.1, calibration=_calibration(), codec_costs={})
    assert predict(job, candidate("allreduce_sgd")).comm_s == pytest.approx(1.5e-5)  # allreduce(600, 4)
    assert predict(job, candidate("dpsgd")).comm_s == pytest.approx(3e-5)  # 600 bytes to each of 2 neighbours
    with pytest.raises(ValueError, match="^--net: expected BANDWIDTH,LATENCY .*, got 'measured'$"):
        Job(layers, 4, "measured", 0.1)  # "measured" names no network without a calibration


def test_net_measured_prices_a_cached_calibration_and_refuses_none_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MPICOMM_PLAN_CACHE", str(tmp_path / "costs.json"))
    job = ["plan", "--params", "1000", "--step-time", "0.1", "--no-codec-work"]
    assert main([*job, "--ranks", "4", "--net", "measured", "--transport", "hand"]) == 2
    path = default_path("hand", 4)
    assert capsys.readouterr() == ("", f"mpicomm plan: error: --net measured: no calibration at {path}; run mpiexec "
                                       "-n 4 python -m mpicomm plan --calibrate --transport hand first\n")
    _calibration().save(path)
    assert main([*job, "--ranks", "4", "--net", "measured", "--transport", "hand"]) == 0
    out = capsys.readouterr().out
    assert "--net measured: hand on h, 4 ranks: latency 5.0 us;" in out.splitlines()[0]
    other = tmp_path / "elsewhere.json"
    assert main([*job, "--ranks", "2", "--net", f"measured:{other}"]) == 2
    assert capsys.readouterr().err == (f"mpicomm plan: error: --net measured: no calibration at {other}; run mpiexec "
                                       f"-n 2 python -m mpicomm plan --calibrate --out {other} first\n")
    assert main([*job, "--ranks", "1", "--net", "measured"]) == 2
    assert capsys.readouterr().err == ("mpicomm plan: error: --net measured: one rank sends nothing and has no "
                                       "calibration; any --net (e.g. fast) gives the same plan\n")
    assert main([*job, "--ranks", "4", "--net", "gbit", "--out", str(other)]) == 2
    assert capsys.readouterr().err == "mpicomm plan: error: --out is for --calibrate (the file to write the " \
                                      "calibration to)\n"
    assert main([*job, "--ranks", "4", "--net", "gbit", "--budget", "60"]) == 2
    assert capsys.readouterr().err == "mpicomm plan: error: --budget is for --calibrate (the seconds the " \
                                      "measurement may take)\n"
    for bad in ("0", "nan", "1e9", "soon"):
        with pytest.raises(SystemExit) as ended:
            main(["plan", "--calibrate", "--budget", bad])
        assert ended.value.code == 2
        assert f"argument --budget: expected seconds in (0, 3600], got '{bad}'" in capsys.readouterr().err
