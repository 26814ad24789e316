"""Capture and restore the global random number generators as plain tensors, arrays and scalars.

Covers torch's CPU generator, every CUDA device's generator (when CUDA is available), numpy's global
``np.random`` state (MT19937) and Python's ``random`` module. Generators a program owns itself
(``torch.Generator`` objects, ``np.random.default_rng()``) are not global: they belong in the owner's
``state_dict()`` (the codecs and algorithms keep theirs there).
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]

_KEYS = ("torch", "cuda", "numpy", "python")


def capture_rng_state() -> dict:
    """This process's global RNG states as a dict of tensors, arrays and scalars (storable by the tree)."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"bit_generator": name, "key": key.copy(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": int(version), "internal": np.array(internal, dtype=np.int64),
                   "gauss_next": gauss_next},
    }


def restore_rng_state(state: dict) -> None:
    """Set the global RNGs to what :func:`capture_rng_state` returned (``ValueError`` if it cannot)."""
    if not isinstance(state, dict) or any(k not in state for k in _KEYS):
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state must be a dict with keys {list(_KEYS)} from capture_rng_state(), got {got}")
    cuda = list(state["cuda"])
    if cuda:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have != len(cuda):
            raise ValueError(f"state holds CUDA RNG states for {len(cuda)} device(s), this process has {have}")
    torch.set_rng_state(state["torch"])
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], np.asarray(npy["key"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"]), py["gauss_next"]))
