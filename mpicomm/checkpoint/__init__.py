"""Checkpoints: every rank's state in one logical HDF5 checkpoint, committed atomically, resumed exactly.

``store``: the collective ``save_checkpoint`` / ``load_checkpoint`` (the commit protocol, the agreed read);
``layout``: the files' names under a root, listing and pruning; ``durable``: crash-safe HDF5 writing;
``reading``: serial reading of a committed checkpoint; ``meta``: what the meta records and how a job's
expectation is compared with it; ``agreement``: the ranks' agreement on errors; ``tree``: a nested state
dict to HDF5 (pure h5py); ``rng``: the global RNGs; ``resize`` / ``resize_rules``: a checkpoint resumed at
another world size. See docs/checkpoints.md for the layout (one file per rank joined by ``checkpoint.h5``
of external links), the commit protocol and the failure behaviour.
"""

from .layout import latest_checkpoint, list_checkpoints
from .meta import run_meta
from .placement import map_location
from .rng import capture_rng_state, restore_rng_state
from .store import load_checkpoint, save_checkpoint
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
