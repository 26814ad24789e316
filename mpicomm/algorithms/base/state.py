"""An algorithm's state: ``state_dict`` / ``load_state_dict`` (everything needed to continue bit-exactly) and
:meth:`reshard_state`, the state at another world size by the rules the method declares.

Part of :class:`~mpicomm.algorithms.base.Algorithm` (a base class of it), kept apart so each file has one job.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from ...checkpoint.resize_rules import REACHED_RULES, Resize, check_rule_paths, replica_mean, reshard_tree

__all__ = ["CheckpointState", "clone_optimizer_state"]


def clone_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """A deep copy of ``optimizer.state_dict()`` (torch returns references to live buffers)."""
    state = optimizer.state_dict()
    return {
        "state": {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                  for k, s in state["state"].items()},
        "param_groups": [dict(g) for g in state["param_groups"]],
    }


class CheckpointState:
    """The checkpoint part of :class:`~mpicomm.algorithms.base.Algorithm` (see :meth:`state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly: parameters, step, lr, and the subclass's state.

        Between steps only: with an exchange in flight (:meth:`begin_step`) it raises ``RuntimeError``.
        """
        self.check_model("state_dict()")
        self._refuse_in_flight("state_dict() was called")
        state = {
            "algorithm": self.name,
            "config": dataclasses.asdict(self.config),
            "step": self.step_count,
            "lr": self.lr,
            "params": self.flat.data.detach().clone(),
            "frozen": {name: p.detach().clone() for name, p in self.flat.frozen.items()},
            "extra": self._extra_state(),
        }
        if self.reached is not None:  # what gradients reached (:mod:`..shared.reached`)
            state["reached"] = self.reached.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on a freshly built algorithm of the same kind)."""
        self.check_model("load_state_dict()")
        self._refuse_in_flight("load_state_dict() was called")
        if state.get("algorithm") != self.name:
            raise ValueError(f"state is for algorithm {state.get('algorithm')!r}, this is {self.name!r}")
        params = state["params"]
        if params.numel() != self.flat.numel:
            raise ValueError(f"state holds {params.numel()} parameters, the model has {self.flat.numel}")
        frozen = state.get("frozen", {})  # absent from checkpoints written before frozen parameters were kept
        if frozen and set(frozen) != set(self.flat.frozen):
            raise ValueError(f"state holds frozen parameters {sorted(frozen)}, the model's are "
                             f"{sorted(self.flat.frozen)}")
        self.flat.data.copy_(params)
        with torch.no_grad():
            for name, value in frozen.items():
                self.flat.frozen[name].copy_(value)
        self.step_count = int(state["step"])
        self.lr = float(state["lr"])
        if self.reached is not None:
            self.reached.load_state_dict(state.get("reached"))
        self._load_extra_state(state["extra"])

    def _extra_state(self) -> dict[str, Any]:
        """Subclass state (buffers, optimizer state, generators); override and call super()."""
        return {}

    # ------------------------------------------------------------------ another world size
    resize_family: ClassVar[str] = "centralized"
    """Which rule of docs/checkpoints.md (Another world size) this method follows on a resize."""
    resize_sharded: ClassVar[bool] = False
    """Whether the method keeps error buffers or public copies per node shard under a two-level exchange."""

    def resize_refusal(self) -> str:
        """Why this method cannot continue a checkpoint of another world size (``""``: it can)."""
        sharding = getattr(self, "sharding", None)
        node_residual = sharding is not None and sharding.levels is not None and self.config.shard_bits != 32
        if (self.resize_sharded and self._two_level_in_use()) or node_residual:
            return (f"{self.name} with a two-level (hierarchical) exchange cannot change world size: its error "
                    "buffers or public copies are kept per node shard, whose layout changes with the size; "
                    "resume at the saved size, or with hierarchical=off on both sides")
        return ""

    def _two_level_in_use(self) -> bool:
        """Whether this algorithm exchanges in two levels (a node layout) at this world size."""
        levels = [getattr(self, "two_level", None), getattr(self, "node_gossip", None),
                  *(getattr(self, "levels", None) or [])]
        return any(level is not None for level in levels)

    def _resize_rules(self) -> dict:
        """Dotted paths of :meth:`state_dict` with the rule that builds them on a resize
        (:mod:`~mpicomm.checkpoint.resize_rules`); an entry no path covers must be identical on every saved rank.
        The family's rules: none for a centralized method (everything is agreed); a consensus restart for a
        decentralized one (the replica and every per-rank floating-point entry of ``extra`` averaged); the
        DiLoCo family averages the inner model and inner optimizer. Override and extend."""
        rules = dict(REACHED_RULES) if self.reached is not None else {}
        if self.resize_family == "decentralized":
            return {**rules, "params": replica_mean, "extra": replica_mean}
        if self.resize_family == "outer":
            return {**rules, "params": replica_mean, "extra.optimizer": replica_mean}
        return rules

    def check_resize_rules(self) -> None:
        """ValueError naming a path of :meth:`_resize_rules` that names no entry of :meth:`state_dict` (checked
        when the algorithm is built: a misspelled rule would never apply)."""
        check_rule_paths(self.name, self._resize_rules(), self.state_dict())

    def reshard_state(self, states: list[dict[str, Any]], places: list[int] | None = None) -> dict[str, Any]:
        """This rank's state at the current world size from ``states``, the ``state_dict()`` of every rank of a
        checkpoint saved at another world size (old rank order); load it with :meth:`load_state_dict`.
        ``places``: each state's old rank when some old ranks' states are missing (the survivors of a lost rank).

        The rules per family are in :mod:`~mpicomm.checkpoint.resize_rules` and docs/checkpoints.md. Raises
        ``ValueError`` naming the method where it cannot continue (:meth:`resize_refusal`). Not collective.
        """
        refusal = self.resize_refusal()
        if refusal:
            raise ValueError(refusal)
        names = {s.get("algorithm") for s in states}
        if names != {self.name}:
            raise ValueError(f"states are for algorithm(s) {sorted(map(str, names))}, this is {self.name!r}")
        built = self.state_dict()  # as built at this world size: the shapes and the own-rank values
        rules = self._resize_rules()
        check_rule_paths(self.name, rules, built)
        resize = Resize(states, built, self.comm.rank, self.comm.size, self.name, places)
        return reshard_tree(states, built, resize, rules)

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        """Restore :meth:`_extra_state`; override and call super()."""
