"""Moniqua-D²: D²'s extrapolated local step, then Moniqua's modulo-quantized mixing of x_{k+1/2}.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020 (Moniqua-D²);
Tang, Lian, Yan, Zhang, Liu. "D²: Decentralized Training over Decentralized Data." ICML 2018.

Step k on rank i (g_k the gradient at x_k plus weight_decay x_k, alpha_k the step size of step k)::

    x_{k+1/2} = 2 x_k - x_{k-1} - alpha_k g_k + alpha_{k-1} g_{k-1}      (x_0 - alpha_0 g_0 at the first step)
    x_{k+1}   = x_{k+1/2} + gamma sum_j W_ij (x̂_{j,k+1/2} - x̂_{i,k+1/2})   (:class:`.gossip.ModuloGossip`)

The mixing preserves the average exactly, which D²'s recursion relies on. A part the guard skipped was
mixed with I instead of W, and D²'s extrapolation assumes the same mixing on consecutive steps, so the
recursion restarts after a wrap (the next step is a first step again). Options and defaults are
Moniqua's; theta's statistic is alpha ||g_k||_inf per tensor. ``bits=32, gamma=1`` is ``d2`` bit for bit.

``hierarchical`` (auto: on over several nodes of several ranks; ``node_topology``): x_{k+1/2}'s exact node
average, then Moniqua's round between nodes on each local rank's shard (:mod:`.node`), as two-level Moniqua
does; a wrap anywhere on the node restarts the recursion on all its ranks (one allreduce(max) inside the
node), so the node's ranks keep one D² recursion. The mixing matrix is ``W_nodes ⊗ (1/L) 1 1ᵀ`` up to the
quantization, whose smallest eigenvalue is that of ``W_nodes`` (D²'s condition, on the graph of nodes).

No overlap with the forward and backward pass (no ``overlap`` option, unlike ``moniqua``): the codes are
of x_{k+1/2}, which holds -alpha_k g_k, so the message can only be encoded after the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..decentralized.d2 import D2, check_no_momentum
from ..shared.hierarchy import NodeGraphConfig
from .config import MoniquaConfig, default_gamma
from .gossip import ModuloGossip
from .node import NodeModuloGossip

__all__ = ["MoniquaD2", "MoniquaD2Config"]


@dataclass(frozen=True)
class MoniquaD2Config(NodeGraphConfig, MoniquaConfig):
    """Moniqua-D² options: Moniqua's (bits, rounding, gamma, theta, ...), hierarchical and node_topology;
    momentum must stay 0.

    parts: P, each tensor sends one of P rotating parts per step; default 1 here (every coordinate mixed every
    step). D²'s extrapolation 2 x_k - x_(k-1) needs the same mixing matrix on consecutive steps: a coordinate
    mixed with W one step in P and with I the P - 1 others follows a recursion whose consensus error grows (per
    step by 1.32x over a cycle at P = 4 on 2 ranks, where W's second eigenvalue is 0), so P > 1 diverges on a
    well-mixed graph.

    gamma: None (auto) is Moniqua's default for ``bits`` (0.5 at 1-2 bits, else 1) where (1 - gamma) I + gamma W
    meets D²'s condition (smallest eigenvalue above -1/3), else 1 / (1 - lambda_min(W)) (see ``d2``).
    """

    parts: int = 1
    gamma_from_graph = True

    def __post_init__(self):
        super().__post_init__()
        check_no_momentum(self)


class MoniquaD2(D2):
    """Moniqua-D²: D²'s extrapolated step, then Moniqua's modulo-quantized mixing of x_{k+1/2}."""

    name = "moniqua_d2"
    config_class = MoniquaD2Config
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        settled = replace(self.config, gamma=self.gamma)  # the mixing's gamma, settled against the graph
        if self.node_gossip is None:
            self.node_modulo, self.gossip = None, ModuloGossip(comm, settled, self.flat)
        else:
            self.node_modulo = NodeModuloGossip(self.node_gossip, settled, self.flat)
            self.gossip = self.node_modulo.gossip

    def _default_gamma(self) -> float:
        """Moniqua's gamma for ``bits`` (0.5 at 1-2 bits, else 1) where the graph meets D²'s condition."""
        return default_gamma(self.config.bits)

    def _mix(self, x, direction, lr):
        if self.node_modulo is None:
            wrapped = self.gossip.mix(x, self.step_count, self.gossip.step_sizes(direction, lr))
        else:
            wrapped = self.node_modulo.mix(x, self.step_count, self.node_modulo.step_sizes(direction, lr))
            if not self.gossip.identity:  # one recursion per node: restart on every rank if any shard wrapped
                flag = torch.tensor([float(wrapped)])
                wrapped = bool(self.node_gossip.levels.node.allreduce(flag, "max")[0] > 0)
        if wrapped:
            self.started = False  # a skipped part mixed with I this step, not W: restart D²'s recursion

    def stats(self):
        """Base stats plus theta's range, gamma and the guard's counters."""
        return {**super().stats(), **self.gossip.stats()}

    def metrics(self):
        """theta and wrapped parts per tensor group (see :meth:`ModuloGossip.metrics`)."""
        return self.gossip.metrics()

    def close(self):
        """Summarise the guard once (rank 0), then close."""
        self.gossip.close()
        super().close()

    def _extra_state(self):
        return {**super()._extra_state(), "gossip": self.gossip.state_dict()}

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        self.gossip.load_state_dict(extra["gossip"])
