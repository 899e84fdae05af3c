"""phasemech: does a token's phase inside a KV-compression chunk decide whether it is retrieved?

Public names: ``CompressionConfig``, ``PhaseTransformerConfig``, ``PhaseTransformer``,
``phase_of``, ``phase_attention``.
"""

from phasemech.config import CompressionConfig, PhaseTransformerConfig
from phasemech.grid import phase_of
from phasemech.model import PhaseTransformer
from phasemech.phase import PhaseAttention, phase_attention

__all__ = [
    "CompressionConfig",
    "PhaseAttention",
    "PhaseTransformer",
    "PhaseTransformerConfig",
    "phase_attention",
    "phase_of",
]
__version__ = "0.1.0"
