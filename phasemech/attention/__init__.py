"""Compressed attention designs, one per file; ``DESIGN_CLASSES`` maps names to mixins."""

from phasemech.attention.base import CompressedAttentionMixin, make_attention_class
from phasemech.attention.csa import SeriesPoolAttention
from phasemech.attention.dsa import DSAAttention
from phasemech.attention.evict import ChunkEvictAttention
from phasemech.attention.gated import GatedPoolAttention
from phasemech.attention.kpool import KPoolAttention
from phasemech.attention.mean import MeanPoolAttention
from phasemech.attention.mlp import MLPCompressorAttention
from phasemech.attention.nsa import NSAAttention
from phasemech.attention.partition import PartitionAttention
from phasemech.attention.quest import QuestAttention
from phasemech.attention.route import BlockRouteAttention

DESIGN_CLASSES: dict[str, type] = {
    "mean": MeanPoolAttention,
    "gated": GatedPoolAttention,
    "mlp": MLPCompressorAttention,
    "route": BlockRouteAttention,
    "evict": ChunkEvictAttention,
    "quest": QuestAttention,
    "kpool": KPoolAttention,
    "nsa": NSAAttention,
    "dsa": DSAAttention,
    "csa": SeriesPoolAttention,
    "hca": SeriesPoolAttention,
    "partition": PartitionAttention,
}

__all__ = [
    "DESIGN_CLASSES",
    "BlockRouteAttention",
    "ChunkEvictAttention",
    "CompressedAttentionMixin",
    "DSAAttention",
    "GatedPoolAttention",
    "KPoolAttention",
    "MLPCompressorAttention",
    "MeanPoolAttention",
    "NSAAttention",
    "PartitionAttention",
    "QuestAttention",
    "SeriesPoolAttention",
    "make_attention_class",
]
