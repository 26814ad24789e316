"""Export a trained model out of mpicomm's checkpoints: ``mpicomm export RUN_DIR -o OUT``.

``weights`` reads one rank's model, or the average of all ranks', from the per-rank HDF5 files as the
model's own ``state_dict``; ``huggingface`` writes a transformers model as a ``save_pretrained``
folder (tokenizer included when the run's can be found); ``command`` is the CLI. Serial: no MPI.
"""

from .weights import ExportError, Weights, read_weights

__all__ = ["ExportError", "Weights", "read_weights"]
