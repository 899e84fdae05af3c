"""The ``phasemech`` command line: one module per group of commands (``data``, ``training``,
``evaluate``, ``interventions``, ``experiments``, ``audit``), registered on one ``typer`` app
(:mod:`phasemech.cli.base`, which also holds the shared options and helpers, ``info`` and
``theory``). Importing a group's module registers its commands.
"""

from phasemech.cli import audit, data, evaluate, experiments, interventions, training  # noqa: F401
from phasemech.cli.base import app

__all__ = ["app"]
