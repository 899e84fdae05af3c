"""phasemech: does a token's phase inside a KV-compression chunk decide whether it is retrieved?

Public names: ``CompressionConfig``, ``PhaseTransformerConfig``, ``PhaseTransformer``,
``phase_of``, ``phase_attention``, ``PhaseAttention``.

The package is layered; each layer imports only the layers listed before it:
``core`` (configs, grid, validation, io) -> ``attention`` (one design per file) -> ``model``
(the transformer, phase hooks) -> ``data`` (tasks) -> ``theory`` -> ``measure`` (read-out,
evaluation, statistics) -> ``interventions`` -> ``training`` -> ``viz`` (figures; imports only
``core`` and ``theory``) -> ``experiments`` (the launcher) -> ``cli``.
"""

import importlib

from phasemech import _legacy
from phasemech.core.config import CompressionConfig, PhaseTransformerConfig
from phasemech.core.grid import phase_of
from phasemech.model.phase import PhaseAttention, phase_attention
from phasemech.model.transformer import PhaseTransformer

_legacy.install()


def __getattr__(name: str):
    # `phasemech.stats` and the other pre-layering module paths, as attributes
    if f"phasemech.{name}" in _legacy.MOVED:
        return importlib.import_module(f"phasemech.{name}")
    raise AttributeError(f"module 'phasemech' has no attribute {name!r}")


__all__ = [
    "CompressionConfig",
    "PhaseAttention",
    "PhaseTransformer",
    "PhaseTransformerConfig",
    "phase_attention",
    "phase_of",
]
__version__ = "0.1.0"
