"""mpicomm: communication-efficient distributed training over MPI.

Pure modules (``topology``, ``codecs``, ``ledger``) import no MPI; ``mpicomm.comm`` is the only package
that does, so importing ``mpicomm`` itself never initialises MPI.
"""

__version__ = "0.1.0"
