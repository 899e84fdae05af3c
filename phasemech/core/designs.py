"""The vocabulary of the compression config: the design names, the values each field allows,
the defaults of the design-specific fields, and the groups of designs that take a field or
follow a rule. The groups are views of one table, :data:`TRAITS` (the design registry: each
design's traits), which every check of the package reads; :mod:`phasemech.core.config` checks
a config against them.

Names as in :class:`phasemech.core.config.CompressionConfig`: a *design* is one way of
compressing the KV cache (``none`` is dense attention); a *selecting* design reads raw tokens of
the blocks it picks; a *local* design composes a sliding-window layer with the grid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

DESIGNS = (
    "none", "mean", "gated", "mlp", "route", "evict", "quest", "kpool", "nsa", "dsa", "csa", "hca",
    "partition",
)  # fmt: skip
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
POOL_ROPE = ("pre", "post")
INDEXER_TRAINING = ("kl", "end_to_end")
DEFAULT_INDEX_HEADS = 2
#: the regimes a design is run in (:mod:`phasemech.model.decode`): ``trained`` (every query
#: reads the compressed history) and ``decode`` (a dense prefill, then a compressed KV cache)
REGIMES = ("trained", "decode")


@dataclass(frozen=True)
class Traits:
    """What one design is and takes; every check of the package reads these (one row each).

    ``selecting``: attends raw tokens of the blocks it picks. ``top_k``: takes ``top_k`` (a
    ranking rule, or ``nsa``'s selection branch). ``sink``: takes ``sink_tokens`` (it ranks
    blocks a sink could win). ``local``: composes a sliding-window layer with the grid (every
    read goes through the shared geometry). ``serves_from_cache``: a KV cache (keys and values
    only) holds what it reads, so it runs in the ``decode`` regime. ``learned``: it has
    parameters of its own that need training (the rest apply post hoc to any model's weights).
    ``selector``: how it picks (``None``: it picks nothing; ``rule``: a parameter-free score;
    ``learned``: a trainable scorer, ``dsa``'s indexer or ``nsa``'s compressed branch).
    ``phase_bias``: a learned intra-block position bias. ``series``: DeepSeek-V4's compressors
    (entries and the raw window in one softmax). ``all_scope``: its entries and the raw window
    overlap by default. ``sweep``: the from-scratch experiments train it by default."""

    selecting: bool = False
    top_k: bool = False
    sink: bool = False
    local: bool = False
    serves_from_cache: bool = True
    learned: bool = False
    selector: Literal["rule", "learned"] | None = None
    phase_bias: bool = False
    series: bool = False
    all_scope: bool = False
    sweep: bool = False

    @property
    def regimes(self) -> tuple[str, ...]:
        return REGIMES if self.serves_from_cache else ("trained",)

    @property
    def post_hoc(self) -> bool:
        """Applies to a model's own weights with nothing to train."""
        return not self.learned


#: the design registry: one row per design of :data:`DESIGNS` (``sel``: selecting, top-k,
#: sink and a rule selector; ``own``: learned parameters, no KV-cache regime)
_SEL = dict(selecting=True, top_k=True, sink=True, selector="rule")
_OWN = dict(learned=True, serves_from_cache=False)
TRAITS: dict[str, Traits] = {
    "none": Traits(sweep=True),
    "mean": Traits(local=True, sweep=True),
    "gated": Traits(local=True, phase_bias=True, sweep=True, **_OWN),
    "mlp": Traits(local=True, learned=True, sweep=True),  # its pooling MLP reads cached keys
    "route": Traits(local=True, sweep=True, **_SEL),
    "evict": Traits(sweep=True, **_SEL),
    "quest": Traits(local=True, **_SEL),
    "kpool": Traits(local=True, **_SEL),
    "nsa": Traits(top_k=True, selector="learned", all_scope=True, **_OWN),
    "dsa": Traits(
        selecting=True, top_k=True, sink=True, selector="learned", phase_bias=True, **_OWN
    ),  # fmt: skip
    "csa": Traits(phase_bias=True, series=True, all_scope=True, **_OWN),
    "hca": Traits(phase_bias=True, series=True, all_scope=True, **_OWN),
    "partition": Traits(selecting=True, local=True),  # each head reads its own share
}
assert tuple(TRAITS) == DESIGNS, "the registry has one row per design, in DESIGNS' order"


def designs_where(**traits: Any) -> tuple[str, ...]:
    """The designs (in :data:`DESIGNS`' order) whose traits equal every ``name=value`` given;
    ``designs_where(selecting=True, post_hoc=True)``."""
    unknown = [t for t in traits if not hasattr(Traits(), t)]
    if unknown:
        raise ValueError(f"designs_where: unknown traits {unknown}: allowed {list(_TRAIT_NAMES)}")
    return tuple(d for d, t in TRAITS.items() if all(getattr(t, k) == v for k, v in traits.items()))


_TRAIT_NAMES = (*(f.name for f in dataclasses.fields(Traits)), "regimes", "post_hoc")


def traits(design: str) -> Traits:
    """The registry's row of ``design``; a one-line error names the designs."""
    if design not in TRAITS:
        raise ValueError(f"design={design!r} is invalid: allowed {', '.join(DESIGNS)}")
    return TRAITS[design]


# the groups the checks read, each a view of the registry
#: the designs the from-scratch experiments train (their profiles' default); ``quest`` and
#: ``kpool`` are post-hoc selection rules for the audit of pretrained models
TRAINED_DESIGNS = designs_where(sweep=True)
#: designs that attend raw tokens of selected blocks (top-k over the pooled designs' candidates)
SELECTING_DESIGNS = designs_where(selecting=True)
#: designs that take ``top_k``: the selecting ones with a ranking rule, and ``nsa``'s selection
TOP_K_DESIGNS = designs_where(top_k=True)
#: designs that take ``sink_tokens``: those that rank blocks by a rule (``nsa`` always reads its
#: initial block already; ``partition`` ranks nothing)
SINK_DESIGNS = designs_where(sink=True)
#: DeepSeek-V4's compressors: entries and the raw window in one softmax by default
SERIES_DESIGNS = designs_where(series=True)
#: designs whose compressed entries and raw window overlap by default (``block_scope="all"``)
ALL_SCOPE_DESIGNS = designs_where(all_scope=True)
#: designs whose every read goes through the shared geometry: they compose a sliding window
LOCAL_DESIGNS = designs_where(local=True)
#: designs that apply to a pretrained model's own weights (nothing to train): the real-model
#: studies' designs
POST_HOC_DESIGNS = tuple(d for d in designs_where(post_hoc=True) if d != "none")
#: designs with a learned intra-block bias (``phase_bias`` ablates it)
BIAS_DESIGNS = designs_where(phase_bias=True)
#: designs that serve the ``decode`` regime (read a KV cache)
CACHE_DESIGNS = designs_where(serves_from_cache=True)
