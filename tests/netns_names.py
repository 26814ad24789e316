"""The machine's named network namespaces (``ip netns``), and whose run each of ``scripts/netshape.sh``'s is.

Named namespaces are global to the machine: tests running beside one another (the other xdist worker,
another copy of the suite) create and remove their own meanwhile, so a test checks only for namespaces
that appeared and whose run is over.
"""

import os
import re
import subprocess


def named_namespaces() -> set:
    """The named namespaces that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def mcns_namespaces() -> set:
    """The ``mcns-`` namespaces that exist now."""
    return {name for name in named_namespaces() if name.startswith("mcns-")}


def of_a_live_run(name: str) -> bool:
    """Whether the namespace ``name`` (mcns-ID-...) belongs to a run still going: its ID is the pid of a live
    process (the script's own pid, the default ID, or ``t<pid>`` of a test's ``--id``)."""
    match = re.match(r"mcns-t?(\d+)", name)
    return bool(match) and os.path.exists(f"/proc/{match.group(1)}")


def left_behind(before: set) -> set:
    """The named namespaces that exist now, not in ``before``, and belong to no ``mcns-`` run still going."""
    return {ns for ns in named_namespaces() - before if not of_a_live_run(ns)}
