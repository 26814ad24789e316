"""The planner behind ``mpicomm plan``: which method (and which of its settings) makes a job's step fastest.

Pure arithmetic, no MPI: bytes per step from the formulas the Ledger books (:mod:`.wire`), time on the
wire from the network model the Communicator charges ``--net`` with (:mod:`mpicomm.net.model`), codec
work from per-element costs measured on this machine (:mod:`.codec_cost`), and the accuracy each method
cost in the project's own measured runs (:mod:`.accuracy`). See ``docs/planner.md``.
"""

from .candidates import CANDIDATES, Candidate
from .model import Job, Prediction, auto_choice, predict, rank_candidates
from .shapes import MODELS, layers_for_model, layers_from_params

__all__ = ["CANDIDATES", "MODELS", "Candidate", "Job", "Prediction", "auto_choice", "layers_for_model",
           "layers_from_params", "predict", "rank_candidates"]
