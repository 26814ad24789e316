"""The text ``mpicomm plan`` prints: the ranked table, its sources, and the automatic choice."""

from __future__ import annotations

from .accuracy import ranks_note

__all__ = ["format_plan"]

_HEAD = ("#", "method", "setting", "bits/param", "MB/step", "comm ms", "overlapped ms", "codec ms",
         "step ms", "speed-up", "samples/s", "scaling eff.", "cost >= (95 %)", "acc. cost (points)")


def _row(i: int, p, sources: list[str]) -> tuple[str, ...]:
    c = p.candidate
    if p.accuracy.measured:
        if p.accuracy.source not in sources:
            sources.append(p.accuracy.source)
        acc = f"{p.accuracy.points:+.2f} [{sources.index(p.accuracy.source) + 1}]"
        low = f"{p.accuracy.low:+.2f}"
    else:
        acc, low = "unmeasured", "-"
    setting = c.setting + (", two levels" if p.hierarchical else "")
    return (str(i), c.algorithm, setting, f"{p.bits_per_param:.2f}", f"{p.sent_per_step / 1e6:.3f}",
            f"{1e3 * p.comm_s:.2f}",
            f"{1e3 * p.exposed_overlap_s:.2f}" if c.overlap else "-", f"{1e3 * p.work_s:.2f}",
            f"{1e3 * p.step_s:.2f}", f"{p.speedup:.2f}x", f"{p.throughput:,.0f}", f"{100 * p.efficiency:.0f} %", low,
            acc)


def format_plan(job, preds, choice=None, reason: str = "", refusal: str = "") -> str:
    """The ranked table of ``preds`` for ``job``, the accuracy sources, then the choice and its reason (or the
    ``refusal``)."""
    sources: list[str] = []
    rows = [_HEAD] + [_row(i, p, sources) for i, p in enumerate(preds, 1)]
    widths = [max(len(r[k]) for r in rows) for k in range(len(_HEAD))]
    lines = [f"{job.numel:,} parameters, {job.ranks} ranks ({job.ranks_per_node} per node), --net {job.net} "
             f"(priced on the {job.link} link), compute {1e3 * job.step_time:.1f} ms/step, "
             f"batch {job.batch_size} per rank"]
    prices = sorted({p.price_source for p in preds})
    lines.append("prices: " + "; ".join(prices) if prices else "prices: none")
    if job.price_warning:
        lines.append(f"warning: {job.price_warning}")
    lines.append("")
    for k, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if j in (1, 2) else cell.rjust(w)
                               for j, (cell, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    task = preds[0].accuracy.task if preds else "image"
    lines.append(f"accuracy costs for the {task} task: points below the baseline, mean over seeds, and the one-sided "
                 "95 % bound (Student's t); a candidate is left out when that bound is above the tolerance; "
                 "'unmeasured': never run on this task, not borrowed from another")
    lines += [f"[{i}] docs/results/{s}" for i, s in enumerate(sources, 1)]
    lines.append("MB/step: bytes sent per step and rank (the Ledger's count), averaged over a period; "
                 "comm: communication per step, all exposed without overlap; overlapped: what stays exposed with "
                 "overlap=True (buckets sent as backward, 2/3 of the compute, makes them ready; gossip hidden behind "
                 "the whole step); the step takes the smaller." + (
                     " Across nodes each method is priced flat (the node's card shared by its ranks) and in two "
                     "levels, and takes the faster (two levels: hierarchical=True; bytes are the flat "
                     "exchange's)." if job.two_level else ""))
    if choice is not None:
        c = choice.candidate
        options = ", ".join(f"{k}={v!r}" for k, v in choice.options.items())
        lines += ["", f"auto: {c.algorithm} ({c.setting})" + (f" with {options}" if options else ""),
                  f"  why: {reason}"]
        note = ranks_note(choice.accuracy, job.ranks)
        if note:
            lines.append(f"  note: {note}")
    elif refusal:
        lines += ["", f"auto: none: {refusal}"]
    return "\n".join(lines)
