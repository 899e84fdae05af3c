"""``python -m phasemech.cli``."""

from phasemech.cli import app

app()
