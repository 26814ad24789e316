"""The planner's choice inside a running job: measure the transport, rank the candidates on one rank, agree.

Shared by the apps' ``--algorithm auto`` (:mod:`mpicomm.training.auto`) and the library's
``mpicomm.wrap(model, optimizer, "auto", step_time=...)``. The network is the given ``--net`` setting or a quick
calibration of the real transport (:func:`mpicomm.comm.calibrate.calibrate` with ``quick=True``: ping-pong
latency, allreduce, allgather and ring exchange at 8 B to 8 MiB, the hidden fraction; at most about 2 s), priced by
its :class:`~mpicomm.net.MeasuredCostModel` (``fast`` on one rank, where nothing crosses a network); the record's
``net`` is then the calibration's one-line summary, ``net_source`` ``calibrated`` and ``calibration`` its JSON
fields. Rank 0 ranks the candidates on the model's real parameter shapes and takes the fastest whose measured
accuracy cost is within the tolerance; every rank gets its choice as a record (the choice, its options, its
accuracy cost, why, what was measured, the five fastest predictions, what was left out).
"""

from __future__ import annotations

import json

import torch

from ..algorithms import ALGORITHMS
from ..algorithms.centralized.adam import AdamConfig
from ..comm import raise_together
from ..comm.calibrate import calibrate
from .accuracy import BASELINES, IMAGE, MASKED_LM, ranks_note

__all__ = ["plan_choice"]


def plan_choice(model: torch.nn.Module, comm, step_time: float, net: str, tolerance: float, *, batch_size: int = 32,
                overlap: bool = True, user_optimizer: bool = False, net_source: str = "net",
                who: str = "algorithm='auto'", flag: str = "tolerance", task: str = IMAGE) -> dict:
    """Collective: the planner's choice for ``model`` on the Communicator ``comm``, as a record (every rank).

    ``step_time``: compute seconds per step (agreed); ``net``: a ``--net`` setting, or ``""`` to calibrate the
    transport; ``overlap``: whether the choice may overlap its exchange; ``user_optimizer``: only methods
    that take the user's optimizer qualify (else the built-in optimizer's family of ``task``: SGD-type for
    ``image``, Adam-type for ``masked-lm``, whose lr is on another scale); ``who`` and ``flag``: how the caller
    names the request and the tolerance in a refusal; ``task``: the task family whose measured accuracy costs
    apply (:data:`~mpicomm.plan.accuracy.TASKS`). ``ValueError`` (one line, every rank) when no measured
    candidate is within ``tolerance``.
    """
    calibration = None
    if not net and comm.size > 1:
        calibration = calibrate(comm, quick=True)
        net, net_source = calibration.summary(), "calibrated"
    elif not net:
        net, net_source = "fast", "one rank"
    ranks_per_node = comm.node_layout(require_equal=False).local_size
    record, refusal = None, ""
    if comm.rank == 0:  # one rank plans (codec costs are timed where none are cached), every rank follows
        try:
            record = _plan(model, comm.size, ranks_per_node, net, step_time, tolerance, batch_size, overlap,
                           user_optimizer, calibration, task)
            record.update(net=net, net_source=net_source, step_time_s=step_time, ranks_per_node=ranks_per_node)
            if calibration is not None:
                record["calibration"] = json.loads(calibration.to_json())
        except ValueError as exc:
            refusal = f"{who}: {str(exc).replace('--tolerance', flag)}"
    record, refusal = comm.bcast_object((record, refusal), 0, "the automatic choice")
    raise_together(comm, ValueError(refusal) if refusal else None)
    return record


def _qualifies(algorithm: str, user_optimizer: bool, task: str) -> bool:
    cls = ALGORITHMS[algorithm]
    if user_optimizer:
        return cls.takes_optimizer
    return issubclass(cls.config_class, AdamConfig) == (task == MASKED_LM)


def _plan(model: torch.nn.Module, ranks: int, ranks_per_node: int, net: str, step_time: float, tolerance: float,
          batch_size: int, overlap: bool, user_optimizer: bool, calibration=None, task: str = IMAGE) -> dict:
    """Rank the planner's candidates for this job; the choice as a record (``ValueError``: one line)."""
    from ..plan.codec_cost import codec_costs
    from ..plan.model import Job, auto_choice, rank_candidates
    from ..plan.shapes import layers_of

    layers = layers_of([tuple(p.shape) for p in model.parameters() if p.requires_grad])
    job = Job(layers, ranks, net, step_time, ranks_per_node, batch_size, codec_costs(), calibration=calibration)
    ranked = rank_candidates(job, task=task)
    preds = [p for p in ranked if _qualifies(p.candidate.algorithm, user_optimizer, task)]
    choice, reason = auto_choice(preds, tolerance, BASELINES[task])
    cand = choice.candidate
    options = choice.options  # hierarchical as priced; overlap where the prediction hides the exchange
    if not overlap:
        options.pop("overlap", None)
    label = cand.setting + (", two levels" if choice.hierarchical else "")
    return {"algorithm": cand.algorithm, "candidate": cand.key, "label": label, "options": options,
            "reason": reason, "tolerance": tolerance, "accuracy_points": choice.accuracy.points, "task": task,
            "accuracy_evidence": choice.accuracy.evidence(), "accuracy_note": ranks_note(choice.accuracy, ranks),
            "left_out": [p.candidate.key for p in ranked if p not in preds], "predicted_step_s": choice.step_s,
            "fastest": [{"candidate": p.candidate.key, "step_s": p.step_s,
                         "accuracy_points": p.accuracy.points if p.accuracy.measured else None}
                        for p in preds[:5]]}
