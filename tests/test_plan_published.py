"""bench/planner/published.py: the published-figure comparison builds, and its exact checks hold."""

from bench.planner.published import TABLE1, TOLERANCE, build


def test_rows_build_and_exact_checks_hold():
    rows = build()
    assert len(rows) == len(TABLE1) + 1 + 6  # the 64-GPU Ethernet row is priced twice
    by_metric = {}
    for r in rows:
        assert r["predicted"] > 0 and r["published"] > 0
        assert r["match"] == (abs(r["predicted"] / r["published"] - 1) <= TOLERANCE)
        by_metric.setdefault(r["metric"], []).append(r)
    volumes = sorted(r["predicted"] for r in by_metric["volume ratio"])
    assert abs(volumes[0] - 16) < 0.01 and abs(volumes[1] - 500) < 1e-9  # FP16 vs 1-bit; DiLoCo H = 500


def test_effective_ethernet_bandwidth_predicts_table1():
    rows = [r for r in build() if r["source"] == "1bit-T1" and "4.1 Gbit/s" in r["setting"]]
    assert len(rows) == 4 and all(r["match"] for r in rows)
    nominal = next(r for r in build() if "nominal" in r["setting"])
    assert nominal["ratio"] < 0.2  # the nominal 40 Gbit/s is far too fast: TCP reached a tenth of it
