"""Capture and restore the global random number generators as plain tensors, arrays and scalars.

Covers torch's CPU generator, every CUDA device's generator (when the run uses CUDA), numpy's global
``np.random`` state (MT19937) and Python's ``random`` module. Generators a program owns itself
(``torch.Generator`` objects, ``np.random.default_rng()``) are not global: they belong in the owner's
``state_dict()`` (the codecs and algorithms keep theirs there).

Across devices: a state captured on a GPU run restores on a CPU run (the CUDA states are ignored), a
CPU state restores on a GPU run (the CUDA generators keep their seeding), and a GPU state restores on
a process that sees another number of GPUs (``srun --gpus-per-task=1`` vs ``mpirun``) by giving the
run's device the state of the device the run was on.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]

_KEYS = ("torch", "cuda", "numpy", "python")


def _uses_cuda(device) -> bool:
    """Whether CUDA generators matter: the run's device is CUDA (None: whenever CUDA is available)."""
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def capture_rng_state(device: torch.device | str | None = None) -> dict:
    """This process's global RNG states as a dict of tensors, arrays and scalars (storable by the tree).

    ``device``: the run's device; CUDA generator states are captured when it is a CUDA device (None:
    whenever CUDA is available), together with the index of the device the run is on.
    """
    name, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    cuda = _uses_cuda(device)
    index = -1
    if cuda:
        index = torch.device(device).index if device is not None else None
        index = torch.cuda.current_device() if index is None else index
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda else [],
        "cuda_device": index,
        "numpy": {"bit_generator": name, "key": key.copy(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": int(version), "internal": np.array(internal, dtype=np.int64),
                   "gauss_next": gauss_next},
    }


def _restore_cuda(saved: list, saved_index: int, device) -> None:
    """Set the CUDA generators from ``saved`` (one state per device the saving process saw)."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == len(saved):
        torch.cuda.set_rng_state_all(saved)
        return
    if device is None:
        raise ValueError(f"state holds CUDA RNG states for {len(saved)} device(s), this process has {have}")
    target = torch.device(device)
    source = saved_index if 0 <= saved_index < len(saved) else 0
    torch.cuda.set_rng_state(saved[source], target)


def restore_rng_state(state: dict, device: torch.device | str | None = None) -> None:
    """Set the global RNGs to what :func:`capture_rng_state` returned (``ValueError`` if it cannot).

    ``device``: the run's device. On a non-CUDA device saved CUDA states are ignored; on a CUDA device
    they are restored, and when this process sees another number of GPUs than the saving one, the
    run's device gets the state of the device the saving run was on. ``None``: restore every saved
    CUDA state, which needs the same number of visible GPUs.
    """
    if not isinstance(state, dict) or any(k not in state for k in _KEYS):
        got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state must be a dict with keys {list(_KEYS)} from capture_rng_state(), got {got}")
    cuda = list(state["cuda"]) if device is None or torch.device(device).type == "cuda" else []
    if cuda:
        _restore_cuda(cuda, int(state.get("cuda_device", -1)), device)
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], np.asarray(npy["key"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"]), py["gauss_next"]))
