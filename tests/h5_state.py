"""A saved rank's state read with plain h5py, written from the layout docs/checkpoints.md documents.

Independent of ``mpicomm.checkpoint``'s readers, so that a test can compare what a method restored with what
was saved without reading the checkpoint through the code it checks. The layout: ``ROOT/step-<9 digits>/``
holds one ``rank-<5 digits>.h5`` per rank with that rank's state under the group ``/ranks/<5 digits>``; a dict
is a group (attribute ``kind`` = ``dict``, its keys in the JSON attribute ``keys``, each child's link name the
key with ``%``, ``/``, NUL and a leading ``.`` percent-escaped, ``""`` as ``%``); a list or tuple of other
things is a group of children ``0, 1, ...``; a tensor is a dataset with its torch ``dtype`` attribute; a list
of plain numbers is one 1-D dataset (attribute ``element``); a scalar a 0-d dataset; ``None`` an empty one.
"""

import json
import os

import h5py
import numpy as np
import torch


def checkpoint_dir(root) -> str:
    """The one ``step-*`` directory under ``root`` (a save directory holding a single checkpoint)."""
    steps = sorted(d for d in os.listdir(root) if d.startswith("step-")
                   and os.path.isfile(os.path.join(root, d, "checkpoint.h5")))
    assert len(steps) == 1, f"{root}: expected one checkpoint, found {steps}"
    return os.path.join(root, steps[0])


def _link(key) -> str:
    name = str(key).replace("%", "%25").replace("/", "%2F").replace("\0", "%00")
    return ("%2E" + name[1:] if name.startswith(".") else name) or "%"


def _value(obj):
    kind = obj.attrs["kind"]
    if isinstance(obj, h5py.Group):
        if kind == "dict":
            return {key: _value(obj[_link(key)]) for key in json.loads(obj.attrs["keys"])}
        items = [_value(obj[str(i)]) for i in range(int(obj.attrs["length"]))]
        return tuple(items) if kind == "tuple" else items
    if kind == "none":
        return None
    data = obj[()]
    if kind == "tensor":
        dtype = getattr(torch, str(obj.attrs["dtype"]).removeprefix("torch."))
        tensor = torch.from_numpy(np.array(data))
        assert tensor.dtype == dtype, f"{obj.name}: stored as {tensor.dtype}, not {dtype} (not read here)"
        return tensor
    if kind in ("list", "tuple"):
        convert = {"int": int, "float": float, "bool": bool,
                   "str": lambda v: v.decode("utf-8") if isinstance(v, bytes) else v}[obj.attrs["element"]]
        items = [convert(v) for v in data.tolist()]
        return tuple(items) if kind == "tuple" else items
    if kind == "str":
        return data.decode("utf-8") if isinstance(data, bytes) else bytes(data).decode("utf-8")
    return {"int": int, "float": float, "bool": bool}[kind](data[()] if isinstance(data, np.ndarray) else data)


def rank_state(directory: str, rank: int, entry: str = "algorithm"):
    """Rank ``rank``'s ``entry`` of the checkpoint in ``directory``, as Python values and torch tensors."""
    with h5py.File(os.path.join(directory, f"rank-{rank:05d}.h5"), "r") as f:
        return _value(f[f"ranks/{rank:05d}/{_link(entry)}"])


def saved_states(root, entry: str = "algorithm") -> list:
    """Every rank's ``entry`` of the single checkpoint under ``root``, in rank order."""
    directory = checkpoint_dir(root)
    ranks = sorted(int(n[5:10]) for n in os.listdir(directory) if n.startswith("rank-") and n.endswith(".h5"))
    assert ranks == list(range(len(ranks))), f"{directory}: rank files {ranks}"
    return [rank_state(directory, r, entry) for r in ranks]
