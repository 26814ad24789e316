"""Setuptools shim: metadata lives in setup.cfg; here only what setup.cfg cannot say.

The sbatch templates live in the checkout's top-level ``slurm/`` (where a cluster user looks for them)
and are installed as the package data ``mpicomm/slurm/templates/*.sbatch``, so ``mpicomm slurm render
generic`` works from a non-editable install too. The planner's table of measured accuracy costs,
``mpicomm/plan/accuracy_costs.json`` (written from ``docs/results`` by ``python -m mpicomm.plan.accuracy``),
ships the same way, so ``mpicomm plan`` and ``algorithm="auto"`` choose from an installed package.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["mpicomm", "mpicomm.*"]) + ["mpicomm.slurm.templates"],
    package_dir={"mpicomm.slurm.templates": "slurm"},
    package_data={"mpicomm.slurm.templates": ["*.sbatch"], "mpicomm.plan": ["accuracy_costs.json"]},
)
