"""bench/planner/published.py: the published-figure comparison builds, its exact checks hold, and its counts
never take an identity for a match nor a row with an input the source does not state for a stated one."""

import pytest

from bench.planner.published import TOLERANCE, build
from bench.planner.published_common import counts, note_latency, row, summary_line


@pytest.fixture(scope="module")
def rows():
    return build()


def test_rows_build_and_exact_checks_hold(rows):
    per_source = {}
    for r in rows:
        per_source[r["source"]] = per_source.get(r["source"], 0) + 1
        assert r["predicted"] > 0 and r["published"] > 0
        assert r["within"] == (abs(r["predicted"] / r["published"] - 1) <= TOLERANCE)
    # Table 1's 9 rows, its 4 multi-node Ethernet rows priced twice; ZeRO++ 3; BAGUA 5 methods x 2 networks
    assert per_source == {"1bit-T1": 13, "deepspeed-blog": 3, "horovod": 2, "diloco": 1, "zeropp": 3, "bagua": 10}
    volumes = sorted(r["predicted"] for r in rows if r["metric"] == "volume ratio")
    assert abs(volumes[0] - 16) < 0.01 and abs(volumes[1] - 500) < 1e-9  # FP16 vs 1-bit; DiLoCo H = 500


def test_effective_ethernet_bandwidth_predicts_table1(rows):
    table1 = [r for r in rows if r["source"] == "1bit-T1"]
    effective = [r for r in table1 if "4.1 Gbit/s" in r["setting"] and "nodes x" in r["setting"]]
    assert len(effective) == 4
    assert all(r["within"] for r in effective if "(2 nodes" not in r["setting"])  # 4 to 16 nodes
    nominal = [r for r in table1 if "nominal" in r["setting"]]
    assert len(nominal) == 4 and all(r["ratio"] < 0.2 for r in nominal)  # TCP reached a tenth of 40 Gbit/s


def test_classes_of_the_known_rows(rows):
    identities = {(r["source"], r["metric"]) for r in rows if r["kind"] == "identity"}
    assert identities == {("deepspeed-blog", "volume ratio"), ("diloco", "volume ratio"),
                          ("zeropp", "throughput ratio")}
    for r in rows:
        assert (r["match"] is None) == (r["kind"] == "identity")
        assert (r["kind"] == "fitted") == bool(r["not_stated"]) or r["kind"] == "identity"
    # only the Ethernet rows at the nominal 40 Gbit/s the paper states have every input from their source
    assert {r["setting"] for r in rows if r["kind"] == "stated"} == {
        r["setting"] for r in rows if "40 Gbit/s (nominal)" in r["setting"]}
    fitted = [r for r in rows if r["source"] in ("bagua", "zeropp") and r["kind"] != "identity"]
    assert fitted and all(any("compute per step" in s for s in r["not_stated"]) for r in fitted)


def test_counts_leave_identities_out():
    exact = row("c", "s", "x", "volume ratio", 16.0, 16.0, "x", "", {}, identity=True)
    fitted = row("c", "s", "x", "ms", 100.0, 110.0, "ms", "", {}, not_stated=("bandwidth chosen",))
    stated = row("c", "s", "x", "ms", 100.0, 200.0, "ms", "", {})
    c = counts([exact, fitted, stated])
    assert c == {"stated": {"rows": 1, "matches": 0}, "fitted": {"rows": 1, "matches": 1},
                 "identity": {"rows": 1, "matches": 0}}
    assert summary_line([exact, fitted, stated]) == (
        "0 of 1 stated rows within 25 %; 1 of 1 fitted rows; 1 identities listed, not counted")


def test_an_assumed_latency_that_moves_a_row_makes_it_fitted():
    moved = row("c", "s", "x", "ms", 100.0, 110.0, "ms", "", {})
    still = row("c", "s", "x", "ms", 100.0, 101.0, "ms", "", {})
    exact = row("c", "s", "x", "x", 16.0, 16.0, "x", "", {}, identity=True)
    without = [row("c", "s", "x", "ms", 100.0, 100.0, "ms", "", {})] * 2 + [exact]
    note_latency([moved, still, exact], without, "assumed: 50 us")
    assert moved["kind"] == "fitted" and "latency" in moved["not_stated"][0]  # 10 % > 5 %
    assert still["kind"] == "stated" and exact["kind"] == "identity"
