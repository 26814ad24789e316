"""Put a loaded checkpoint's tensors on the run's device, whatever device they were saved from.

Checkpoints store host copies (HDF5 holds bytes, not devices), so a run saved on ``cuda:3`` resumes on
a CPU and a CPU run resumes on a GPU. :func:`map_location` is the mapping, like ``torch.load``'s
``map_location`` but selective: floating-point tensors (parameters, BatchNorm buffers, momentum,
error-feedback buffers, replicas) move to ``device``; integer, bool and byte tensors (RNG states,
counters, indices) stay on the host, where ``torch.Generator.set_state`` and friends require them, as
does a tensor stored under the key ``"step"`` (``torch.optim`` keeps its step counters on the host).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["map_location"]


def map_location(tree: Any, device: torch.device | str, _key: str = "") -> Any:
    """A copy of ``tree`` (nested dicts, lists, tuples) with its floating-point tensors on ``device``."""
    device = torch.device(device)
    if torch.is_tensor(tree):
        if (tree.is_floating_point() or tree.is_complex()) and _key != "step" and tree.device != device:
            return tree.to(device)
        return tree
    if isinstance(tree, dict):
        return {k: map_location(v, device, str(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_location(v, device, _key) for v in tree)
    return tree
