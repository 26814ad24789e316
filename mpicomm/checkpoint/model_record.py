"""What a checkpoint records about the model beyond its flat parameters, so it can be exported without it.

A rank's state holds the flat parameter vector (named by ``model_signature``) and every buffer by
name; a plain ``model.state_dict()`` differs from those in three ways this record settles:

* tied weights appear under every name that shares them (BERT's MLM decoder weight *is* its word
  embedding; ``named_parameters()`` lists it once, ``state_dict()`` twice);
* non-persistent buffers (``register_buffer(..., persistent=False)``, e.g. BERT's ``position_ids``)
  are buffers but not ``state_dict`` entries;
* a transformers model is rebuilt from its class and config, which no tensor name carries.

:func:`model_record` is stored in the checkpoint's meta (``meta["model"]``) by
:func:`~.store.run_meta`; ``mpicomm export`` reads it (pure torch, no transformers import here).
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["model_record"]


def _state_sources(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(``state_dict`` keys in order, the parameter or buffer name whose tensor each is; "" for other state)."""
    canonical: dict[int, str] = {}
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        canonical.setdefault(id(tensor), name)
    alias = {name: canonical[id(tensor)] for name, tensor in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))}
    keys = list(model.state_dict(keep_vars=True))
    return keys, [alias.get(key, "") for key in keys]


def model_record(model: torch.nn.Module) -> dict:
    """``{"state_keys", "state_sources"}``, plus ``transformers: {"class", "config"}`` for a transformers model.

    ``state_sources[i]`` is the ``named_parameters()``/``named_buffers()`` name holding
    ``state_keys[i]`` (itself, or the tensor it is tied to); ``config`` is the model config's full JSON.
    """
    keys, sources = _state_sources(model)
    record: dict = {"class": f"{type(model).__module__}.{type(model).__qualname__}",
                    "state_keys": keys, "state_sources": sources}
    config = getattr(model, "config", None)
    if type(model).__module__.startswith("transformers.") and hasattr(config, "to_json_string"):
        record["transformers"] = {"class": type(model).__name__, "config": config.to_json_string(use_diff=False)}
    return record
