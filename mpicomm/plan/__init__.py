"""The planner behind ``mpicomm plan``: which method (and which of its settings) makes a job's step fastest.

Arithmetic, no communication: bytes per step from the formulas the Ledger books (:mod:`.wire`), time on the
wire from the network model the Communicator charges ``--net`` with (:mod:`mpicomm.net.model`), codec
work from per-element costs measured on this machine (:mod:`.codec_cost`), and the accuracy each method
cost in the project's own measured runs (:mod:`.accuracy`). See ``docs/planner.md``.
"""

import importlib

__all__ = ["CANDIDATES", "MODELS", "Candidate", "Job", "Prediction", "auto_choice", "layers_for_model",
           "layers_from_params", "predict", "rank_candidates"]
_HOMES = {"CANDIDATES": "candidates", "Candidate": "candidates", "MODELS": "shapes", "layers_for_model": "shapes",
          "layers_from_params": "shapes"}


def __getattr__(name: str):
    """Load on first use: the CLI's parser imports this package, and ``mpicomm export`` must not import MPI
    through it (the candidates' layouts live with the algorithms, whose package imports the transport)."""
    if name in __all__:
        return getattr(importlib.import_module(f".{_HOMES.get(name, 'model')}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
