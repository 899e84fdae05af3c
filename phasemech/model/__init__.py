"""The model layer: :class:`PhaseTransformer` (a TransformerLens ``HookedTransformer`` whose
attention layers compress), phase hooks and tables, and the bundled SmolLM2 loader.
Imports only ``core`` and ``attention``."""

from phasemech.model.transformer import *  # noqa: F403  (the old ``phasemech.model`` names)
from phasemech.model.transformer import __all__  # noqa: F401
