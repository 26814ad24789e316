"""What every published-figure case shares: a compared row, its class, the counts and the summary line.

A row's class says what its comparison can show:

* ``identity``: the prediction follows from the byte formulas alone (a volume ratio, a period), so it cannot
  miss; it is listed and never counted as a match;
* ``fitted``: at least one input is not stated by the source for that setting (chosen after seeing a published
  figure, fitted to one, or assumed); ``not_stated`` names each such input and where it came from;
* ``stated``: the source states every input (network, scale, model, batch, compute per step).

Within 25 % (0.75 <= predicted / published <= 1.25) is a match, counted only among non-identity rows.
"""

from __future__ import annotations

TOLERANCE = 0.25
"""A prediction within 25 % of the published figure (ratio in [0.75, 1.25]) counts as a match."""

NO_CODEC_WORK: dict = {}
"""Every source ran on GPUs: the CPU codec timings of this project are not counted."""

KINDS = ("stated", "fitted", "identity")
"""The classes of a compared row (see the module docstring)."""

LATENCY_EFFECT = 0.05
"""An assumed latency counts as an input not stated when zeroing it moves the row's prediction by more."""


def within(ratio: float) -> bool:
    """Whether predicted / published lies within the tolerance."""
    return abs(ratio - 1) <= TOLERANCE


def row(case: str, source: str, setting: str, metric: str, published: float, predicted: float, unit: str,
        note: str, details: dict, not_stated: tuple[str, ...] = (), identity: bool = False) -> dict:
    """One compared figure; its class follows from ``identity`` and ``not_stated`` (see the module docstring)."""
    ratio = predicted / published
    kind = "identity" if identity else ("fitted" if not_stated else "stated")
    return {"case": case, "source": source, "setting": setting, "metric": metric, "published": published,
            "predicted": predicted, "unit": unit, "ratio": ratio, "within": within(ratio), "kind": kind,
            "not_stated": list(not_stated), "match": None if identity else within(ratio), "note": note,
            "details": details}


def note_latency(rows: list[dict], without: list[dict], assumed: str) -> None:
    """Name the assumed latency as an input not stated on every row that zeroing it moves by more than
    :data:`LATENCY_EFFECT` (``without``: the same rows built with every latency zero), reclassifying them."""
    for r, z in zip(rows, without, strict=True):
        effect = abs(r["predicted"] / z["predicted"] - 1)
        r["latency_effect"] = effect
        if effect > LATENCY_EFFECT and r["kind"] != "identity":
            r["not_stated"].append(f"latency ({assumed}; zeroing it moves this row {100 * effect:.0f} %)")
            r["kind"] = "fitted"


def counts(rows: list[dict]) -> dict:
    """Rows and matches per class; identities are listed, never counted as matches."""
    out = {kind: {"rows": 0, "matches": 0} for kind in KINDS}
    for r in rows:
        out[r["kind"]]["rows"] += 1
        out[r["kind"]]["matches"] += bool(r["match"])
    return out


def summary_line(rows: list[dict]) -> str:
    """``k of m stated rows within 25 %; j of l fitted rows; n identities listed, not counted``."""
    c = counts(rows)
    return (f"{c['stated']['matches']} of {c['stated']['rows']} stated rows within 25 %; "
            f"{c['fitted']['matches']} of {c['fitted']['rows']} fitted rows; "
            f"{c['identity']['rows']} identities listed, not counted")


def summary(job, pred) -> dict:
    """What the JSON keeps of one prediction."""
    return {"candidate": pred.candidate.key, "overlap": pred.candidate.overlap, "params": job.numel,
            "ranks": job.ranks, "ranks_per_node": job.ranks_per_node, "net": job.net, "link": job.link,
            "compute_ms": 1e3 * job.step_time, "batch_per_rank": job.batch_size,
            "comm_ms": 1e3 * pred.comm_s, "exposed_ms": 1e3 * (pred.step_s - pred.compute_s - pred.work_s),
            "codec_ms": 1e3 * pred.work_s, "step_ms": 1e3 * pred.step_s,
            "sent_bytes_per_step": pred.sent_per_step, "bits_per_param": pred.bits_per_param,
            "throughput": pred.throughput, "efficiency": pred.efficiency}
