"""The vocabulary of the compression config: the design names, the values each field allows,
the defaults of the design-specific fields, and the groups of designs that take a field or
follow a rule. Plain constants: :mod:`phasemech.core.config` checks a config against them.

Names as in :class:`phasemech.core.config.CompressionConfig`: a *design* is one way of
compressing the KV cache (``none`` is dense attention); a *selecting* design reads raw tokens of
the blocks it picks; a *local* design composes a sliding-window layer with the grid.
"""

from __future__ import annotations

from typing import Literal

DESIGNS = (
    "none", "mean", "gated", "mlp", "route", "evict", "quest", "kpool", "nsa", "dsa", "csa", "hca",
    "partition",
)  # fmt: skip
#: the designs the from-scratch experiments train (their profiles' default); ``quest`` and
#: ``kpool`` are post-hoc selection rules for the audit of pretrained models
TRAINED_DESIGNS = ("none", "mean", "gated", "mlp", "route", "evict")
VISIBILITY = ("inclusive", "strict")
OFFSET_MODES = ("aligned", "per_layer", "per_head", "per_layer_head", "random")
GATES = ("scalar", "channel")
BLOCK_SCOPES = ("outside_window", "before_window", "all")

Design = Literal[
    "none", "mean", "gated", "mlp", "route", "evict", "quest", "kpool", "nsa", "dsa", "csa", "hca",
    "partition",
]  # fmt: skip
OffsetSpec = str | int | tuple[int, ...] | tuple[tuple[int, ...], ...]

DEFAULT_TOP_K = 2
DEFAULT_OBS_WINDOW = 8
#: designs that attend raw tokens of selected blocks (top-k over the pooled designs' candidates)
SELECTING_DESIGNS = ("route", "evict", "quest", "kpool", "dsa", "partition")
#: designs that take ``top_k``: the selecting ones with a ranking rule, and ``nsa``'s selection
TOP_K_DESIGNS = ("route", "evict", "quest", "kpool", "dsa", "nsa")
#: designs that take ``sink_tokens``: those that rank blocks by a rule (``nsa`` always reads its
#: initial block already; ``partition`` ranks nothing)
SINK_DESIGNS = ("route", "evict", "quest", "kpool", "dsa")
#: DeepSeek-V4's compressors: entries and the raw window in one softmax by default
SERIES_DESIGNS = ("csa", "hca")
#: designs whose compressed entries and raw window overlap by default (``block_scope="all"``)
ALL_SCOPE_DESIGNS = ("nsa", *SERIES_DESIGNS)
POOL_ROPE = ("pre", "post")
INDEXER_TRAINING = ("kl", "end_to_end")
DEFAULT_INDEX_HEADS = 2

#: designs whose every read goes through the shared geometry: they compose a sliding window
LOCAL_DESIGNS = ("mean", "gated", "mlp", "route", "quest", "kpool", "partition")
