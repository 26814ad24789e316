"""The BERT app's preset models: the library's (:mod:`mpicomm.models.bert`), which ``mpicomm plan --measure``
times too."""

from mpicomm.models.bert import PRESETS, BertPreset, build_model, get_preset

__all__ = ["PRESETS", "BertPreset", "build_model", "get_preset"]
