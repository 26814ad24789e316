"""Checkpoints: every rank's state in one logical HDF5 checkpoint, committed atomically, resumed exactly.

``save_checkpoint`` / ``load_checkpoint`` are collective; ``tree`` maps a nested state dict to HDF5
(pure h5py); ``rng`` captures the global RNGs. See docs/checkpoints.md for the layout (one file per rank
joined by ``checkpoint.h5`` of external links), the commit protocol and the failure behaviour.
"""

from .placement import map_location
from .rng import capture_rng_state, restore_rng_state
from .store import latest_checkpoint, list_checkpoints, load_checkpoint, run_meta, save_checkpoint
from .tree import CheckpointError, read_tree, write_tree

__all__ = [
    "CheckpointError",
    "capture_rng_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "map_location",
    "read_tree",
    "restore_rng_state",
    "run_meta",
    "save_checkpoint",
    "write_tree",
]
