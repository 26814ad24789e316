"""SLURM support: sbatch templates (``slurm/`` at the repository root), a validating renderer, a submitter."""

from .template import SBATCH_OPTIONS, Template, parse_template, render

__all__ = ["SBATCH_OPTIONS", "Template", "parse_template", "render"]
