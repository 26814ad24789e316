"""Values no run or plan can use are refused in one line before any work: a modelled link so slow or so far
that its sleeps cannot be taken, an infinite straggler, a planner input that is infinite, not a number, or so
large that the plan would run for hours (serial: the parsers and ``mpicomm plan`` in this process)."""

import argparse

import pytest

from mpicomm.cli import main
from mpicomm.net import parse_net
from mpicomm.plan import shapes
from mpicomm.training.arguments import slowdowns


@pytest.mark.parametrize("text, says", [
    ("1gbit,1e300s", "latency must be in [0s, 10s], got 1e+300 s"),
    ("1gbit,11s", "latency must be in [0s, 10s], got 11 s"),
    ("1e-300bit,1us", "bandwidth must be a finite rate of at least 1kbit, got 1e-300 bit/s"),
    ("1e400gbit,1us", "bandwidth must be a finite rate of at least 1kbit, got inf bit/s"),
    ("intra=nvlink,inter=10gbit,1e300s", "latency must be in [0s, 10s]"),
])
def test_a_link_that_cannot_be_slept_is_refused(text, says):
    with pytest.raises(ValueError) as info:
        parse_net(text)
    assert str(info.value).startswith("--net: ") and says in str(info.value) and "\n" not in str(info.value)


def test_the_bounds_of_a_link_are_accepted():
    assert parse_net("1kbit,10s").latency_s == 10.0 and parse_net("1kbit,10s").bits_per_s == 1e3


@pytest.mark.parametrize("text", ["0:inf", "0:1e300", "1:1001", "0:nan"])
def test_an_infinite_or_absurd_straggler_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"factors >= 1 \(at most 1000\)"):
        slowdowns(text)
    assert slowdowns("0:1000") == ((0, 1000.0),)


def _plan(capsys, *args) -> tuple[int, str, str]:
    code = main(["plan", "--ranks", "4", "--net", "gbit", "--no-codec-work", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, line", [
    (["--params", "1000000", "--step-time", "inf"], "--step-time must be a number of seconds in (0, 3600], got inf"),
    (["--params", "1000000", "--step-time", "nan"], "--step-time must be a number of seconds in (0, 3600], got nan"),
    (["--params", "1000000", "--step-time", "1e300"],
     "--step-time must be a number of seconds in (0, 3600], got 1e+300"),
    (["--params", "1000000", "--step-time", "0.1", "--tolerance", "nan"],
     "--tolerance must be a finite number of accuracy points, got nan"),
    (["--params", "1000000", "--step-time", "0.1", "--tolerance", "inf"],
     "--tolerance must be a finite number of accuracy points, got inf"),
])
def test_plan_refuses_infinite_and_nan_inputs_in_one_line(capsys, args, line):
    code, out, err = _plan(capsys, *args)
    assert (code, out, err) == (2, "", f"mpicomm plan: error: {line}\n")


def test_plan_refuses_a_parameter_count_past_its_bound_before_building_anything(capsys, monkeypatch):
    """10^15 parameters would be 10^9 stand-in matrices (hours of work): refused before one is built."""

    def built(shapes_list):
        raise AssertionError(f"the stand-in model was built ({len(shapes_list)} layers)")

    monkeypatch.setattr(shapes, "layers_of", built)
    code, out, err = _plan(capsys, "--params", str(10**15), "--step-time", "0.1")
    assert (code, out) == (2, "")
    assert err == "mpicomm plan: error: --params must be an integer in 1..200,000,000,000, got 1000000000000000\n"
    monkeypatch.setattr(shapes, "layers_of", lambda shapes_list: shapes_list)  # the bound itself is taken
    assert len(shapes.layers_from_params(2 * 10**11)) == 2 * 10**11 // 2**20 + 1
