"""The BERT masked-LM app's pieces: preset models, corpus, WordPiece tokenizer, masking, and the Task.

``build_task(...)`` is the entry point ``apps/train_bert.py`` uses; see ``task`` for the Task's fields.
"""

from .masking import IGNORE_INDEX, Masker
from .model import PRESETS, BertPreset, build_model
from .task import SPLIT_SEED, BertTask, build_task

__all__ = ["IGNORE_INDEX", "PRESETS", "SPLIT_SEED", "BertPreset", "BertTask", "Masker", "build_model", "build_task"]
