"""The theory model: gradient flow of an idealised retrieval model (``gradient_flow``, its
predictions in ``derivations``, both gathered in ``dynamics``: numpy only) and its comparison
with trained models (``fit``)."""

from phasemech.theory.dynamics import *  # noqa: F403  (the old ``phasemech.theory`` names)
from phasemech.theory.dynamics import __all__  # noqa: F401
