"""mpicomm: communication-efficient distributed training over MPI.

The library in a few lines (see :mod:`mpicomm.api`)::

    import mpicomm
    job = mpicomm.init()
    algo = mpicomm.wrap(model, optimizer, "moniqua", topology="ring")

Importing ``mpicomm`` initialises nothing: ``init``, ``wrap``, ``sampler``, ``save``, ``restore`` and ``Elastic``
(a loop that outlives a lost rank, :mod:`mpicomm.elastic`) load MPI when first used.
Pure modules (``topology``, ``codecs``, ``ledger``) import no MPI; ``mpicomm.comm`` is the only package
that does.
"""

__version__ = "0.1.0"
__all__ = ["Elastic", "Job", "init", "restore", "sampler", "save", "wrap"]


def __getattr__(name: str):
    if name == "Elastic":
        from .elastic import Elastic

        return Elastic
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'mpicomm' has no attribute {name!r}")
