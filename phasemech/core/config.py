"""Configuration of chunked KV compression, and the model config that carries it.

Axis names used throughout phasemech: ``batch``, ``pos`` (token position), ``head`` (query
head), ``kv_head`` (key/value head; equals ``head`` without grouped-query attention),
``block`` (one compressed cache entry), ``slot`` (a token's index inside its block, ``0..l-1``)
and ``phase`` (a token's offset inside its stride segment, ``(pos - offset) mod stride``).

Geometry (see ``phasemech.core.grid``): block ``i`` of a head with grid offset ``o`` covers
positions ``[i*d + o - l, i*d + o - 1]`` (``d`` the stride, ``l >= d`` the block length; ``l > d``
means neighbouring blocks overlap by ``l - d`` tokens). Block 0 may start before position 0;
its missing slots count as padding.

The vocabulary the config is checked against (design names, allowed values, defaults, the
groups of designs that take a field) is :mod:`phasemech.core.designs`; the offsets' freezing
and the refusal of a compression that could never act are :mod:`phasemech.core.config_checks`.
Both stay importable from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from transformer_lens import HookedTransformerConfig

from phasemech.core.config_checks import check_compression_acts, freeze_offsets, invalid_field
from phasemech.core.designs import (
    ALL_SCOPE_DESIGNS,
    BLOCK_SCOPES,
    DEFAULT_INDEX_HEADS,
    DEFAULT_OBS_WINDOW,
    DEFAULT_TOP_K,
    DESIGNS,
    GATES,
    INDEXER_TRAINING,
    LOCAL_DESIGNS,
    OFFSET_MODES,
    POOL_ROPE,
    SELECTING_DESIGNS,
    SERIES_DESIGNS,
    SINK_DESIGNS,
    TOP_K_DESIGNS,
    VISIBILITY,
    Design,
    OffsetSpec,
)

# the vocabulary moved to ``core.designs``: `X as X` keeps it importable here
from phasemech.core.designs import TRAINED_DESIGNS as TRAINED_DESIGNS
from phasemech.core.validation import is_int

#: fields that only some designs use; ``to_dict`` leaves them out while ``None`` so that the
#: cache keys of configs written before they existed do not change
_OPTIONAL_FIELDS = (
    "select_len", "index_heads", "indexer_train", "pool_rope", "gate_hidden", "sink_tokens"
)  # fmt: skip


@dataclass(frozen=True)
class CompressionConfig:
    """How (and whether) a model compresses its KV cache in fixed-stride chunks.

    Args:
        design: ``"none"`` (dense attention), ``"mean"`` (mean-pooled K/V per block),
            ``"gated"`` (softmax-gated pooling with a learned intra-block position bias),
            ``"mlp"`` (NSA compressor MLP over the flattened block), ``"route"`` (MoBA block
            routing over raw tokens), ``"quest"`` (Quest: blocks ranked by the upper bound of
            ``q . k`` from element-wise key bounds), ``"kpool"`` (pools of ``d`` tokens ranked by
            their best token's ``q . k``, GLM-5.3's k-pool rule), ``"evict"`` (ChunkKV chunk
            eviction: raw tokens of the chunks that recent queries attended most) or ``"nsa"``
            (NSA's three branches: compressed, selected blocks, sliding window, mixed by
            sigmoid gates; :mod:`phasemech.attention.nsa`) or ``"dsa"`` (GLM-5.3's learned k-pool
            indexer picks the pools whose raw tokens are read; :mod:`phasemech.attention.dsa`),
            ``"csa"`` / ``"hca"`` (DeepSeek-V4's compressors: per-channel gates over projection
            series, a learned slot bias, RMSNorm; :mod:`phasemech.attention.csa`) or
            ``"partition"`` (head-partitioned history: head ``h`` of ``H`` reads every ``H``-th
            block raw; :mod:`phasemech.attention.partition`).
        stride: ``d``, the distance between consecutive block starts.
        block_len: ``l >= d``; ``None`` means ``l = d`` (no overlap), ``2d`` for ``csa``.
            ``csa`` / ``hca`` need a multiple of ``d`` (one projection series per ``d`` slots).
        window: ``W``, the raw sliding window in tokens (query included); ``None`` means ``2d``.
            ``0`` leaves only the query's own incomplete block raw (MoBA/Quest "current block",
            GLM-5.3 tail); under ``inclusive`` a query in the last slot of its block then has
            no raw token and reads that block compressed (``route`` forces it instead).
        visibility: ``"inclusive"`` (a block is visible to query ``t`` once its last token is
            ``<= t``; NSA, DeepSeek-V4) or ``"strict"`` (last token ``< t``; lucidrains NSA).
        offsets: the grid offset ``o``: ``"aligned"`` (0 everywhere), ``"per_layer"``
            (compressed layer ``r`` of ``n`` gets ``(r*d)//n``), ``"per_head"`` (KV head ``g`` of
            ``G`` gets ``(g*d)//G``), ``"per_layer_head"`` (both, summed mod ``d``),
            ``"random"`` (a fresh offset per sequence at every training forward,
            ``eval_offset`` in eval mode), or explicit ints: one int, one per KV head
            ``[kv_head]``, or one per layer and KV head ``[layer, kv_head]`` (a tensor works).
        layers: indices of compressed layers; ``None`` means all layers.
        top_k: blocks selected per query by ``route``, ``quest`` and ``kpool`` / kept per query
            and KV head by ``evict`` / ranked selection blocks per KV head by ``nsa`` (beside its
            forced initial and local blocks); ``None`` means 2. Only these designs accept it.
        gate: ``gated`` only: ``"scalar"`` (one gate per KV head and token: pooling weights are
            an exact convex mass, so token attribution is exact) or ``"channel"`` (DeepSeek-V4
            style, one gate per channel).
        eval_offset: the offset that ``offsets="random"`` uses in eval mode.
        block_scope: ``None`` means ``"all"`` for ``nsa`` (its compressed branch reads every
            complete block; the window is a separate branch), ``csa`` and ``hca`` (as
            DeepSeek-V4) and ``"outside_window"`` for the rest. ``"outside_window"``: blocks
            wholly inside the raw window are not used, so at most ``l - 1`` tokens are reached
            both raw and compressed; ``"before_window"`` (the raw span starts at a block
            boundary, ``W`` to ``W + d - 1`` tokens, and only blocks wholly before it are used:
            no block is partly raw) or
            ``"all"`` (DeepSeek-V4: every complete block plus the raw window, in one softmax).
            The selecting designs (``route``, ``evict``, ``quest``, ``kpool``, ``dsa``,
            ``partition``) refuse ``"all"``.
        obs_window: ``evict`` only: how many recent queries (the query included) score the
            chunks by the dense attention they pay to them; ``None`` means 8.
        select_len: ``nsa`` only: ``l'``, the length of a selection block, a multiple of
            ``stride``; ``None`` means ``stride``. Selection blocks lie on the compression grid's
            offset: block ``j`` covers ``[j*l' + o - l', j*l' + o - 1]``.
        gate_hidden: ``nsa`` only: ``None`` (default) computes each branch gate with one
            linear map of the input; an int ``n`` with an MLP of ``n`` SiLU units (NSA's paper:
            "an MLP and sigmoid activation").
        index_heads: ``dsa`` only: the indexer's heads; ``None`` means 2.
        indexer_train: ``dsa`` only: ``"kl"`` (default; DSA's auxiliary KL toward the main
            attention's mass on each pool: every candidate in the dense warm-up, the selected
            ones in the sparse stage) or ``"end_to_end"`` (a straight-through gradient of
            the main loss through the kept pools).
        pool_rope: ``csa`` / ``hca`` only: ``"pre"`` (default, as DeepSeek-V4: pool pre-RoPE
            keys, rotate the entry at its block's stride start) or ``"post"`` (pool rotated keys).
        sink_tokens: ``route``, ``quest``, ``kpool``, ``evict`` and ``dsa`` only: ``N``, the
            attention sink: the first ``N`` real tokens of a sequence are read raw by every
            later query (StreamingLLM's initial tokens), counted in its KV budget, and never
            ranked: a block's sink tokens leave its score (it is scored on its other tokens;
            a block of only sink tokens is no candidate). ``None`` or ``0``: no sink.

    The exact coverage rule (which past token is reached raw, which through a block) is in
    ``phasemech.core.grid``.
    """

    design: Design
    stride: int = 4
    block_len: int | None = None
    window: int | None = None
    visibility: Literal["inclusive", "strict"] = "inclusive"
    offsets: OffsetSpec = "aligned"
    layers: tuple[int, ...] | None = None
    top_k: int | None = None
    gate: Literal["scalar", "channel"] = "scalar"
    eval_offset: int = 0
    block_scope: Literal["outside_window", "before_window", "all"] | None = None
    obs_window: int | None = None
    select_len: int | None = None
    gate_hidden: int | None = None
    index_heads: int | None = None
    indexer_train: Literal["kl", "end_to_end"] | None = None
    pool_rope: Literal["pre", "post"] | None = None
    sink_tokens: int | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise with object.__setattr__ (``_set``), validate before any
        # work starts. With several bad fields the first check to fail names its field.
        if self.design not in DESIGNS:
            raise invalid_field("design", self.design, f"allowed: {DESIGNS}")
        self._check_grid()
        self._check_offsets()
        self._check_layers()
        self._check_top_k()
        self._check_obs_window()
        self._check_select_len()
        self._check_indexer()
        self._check_series()
        self._check_sink()
        self._check_rest()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_grid(self) -> None:
        """``stride``, ``block_len``, ``window`` (filling their defaults) and ``visibility``."""
        if not is_int(self.stride) or self.stride < 1:
            raise invalid_field("stride", self.stride, "must be an int >= 1")
        self._set("stride", int(self.stride))
        if self.block_len is None:
            self._set("block_len", 2 * self.stride if self.design == "csa" else self.stride)
        if not is_int(self.block_len) or self.block_len < self.stride:
            raise invalid_field(
                "block_len", self.block_len, f"must be an int >= stride ({self.stride})"
            )
        self._set("block_len", int(self.block_len))
        if self.window is None:
            self._set("window", 2 * self.stride)
        if not is_int(self.window) or self.window < 0:
            raise invalid_field("window", self.window, "must be an int >= 0 (raw tokens per query)")
        self._set("window", int(self.window))
        if self.visibility not in VISIBILITY:
            raise invalid_field("visibility", self.visibility, f"allowed: {VISIBILITY}")

    def _check_offsets(self) -> None:
        offsets = freeze_offsets(self.offsets)
        if isinstance(offsets, str) and offsets not in OFFSET_MODES:
            raise invalid_field(
                "offsets", offsets, f"allowed modes: {OFFSET_MODES}, or explicit ints"
            )
        if not isinstance(offsets, str):
            flat = [offsets] if isinstance(offsets, int) else list(np.ravel(offsets))
            bad = [o for o in flat if not 0 <= o < self.stride]
            if bad:
                raise invalid_field(
                    "offsets",
                    self.offsets,
                    f"explicit offsets must lie in [0, stride={self.stride})",
                )
        self._set("offsets", offsets)

    def _check_layers(self) -> None:
        if self.layers is None:
            return
        if isinstance(self.layers, str) or not isinstance(self.layers, Sequence):
            raise invalid_field(
                "layers", self.layers, "must be None or a non-empty tuple of ints >= 0"
            )
        layers = tuple(self.layers)
        if not layers or not all(is_int(i) and i >= 0 for i in layers):
            raise invalid_field(
                "layers", self.layers, "must be None or a non-empty tuple of ints >= 0"
            )
        if len(set(layers)) != len(layers):
            raise invalid_field("layers", self.layers, "layer indices must be unique")
        self._set("layers", tuple(sorted(int(i) for i in layers)))

    def _takes(self, name: str, designs: tuple[str, ...], refusal: str) -> bool:
        """Whether this design takes the design-specific field ``name``; a value given to a
        design that does not is refused with ``refusal``."""
        if self.design in designs:
            return True
        if getattr(self, name) is not None:
            raise invalid_field(name, getattr(self, name), refusal)
        return False

    def _positive_int(self, name: str, default: int, allowed: str) -> None:
        """``name`` filled with ``default`` when None, then checked to be an int >= 1."""
        if getattr(self, name) is None:
            self._set(name, default)
        value = getattr(self, name)
        if not is_int(value) or value < 1:
            raise invalid_field(name, value, allowed)
        self._set(name, int(value))

    def _check_top_k(self) -> None:
        refusal = f"only designs {TOP_K_DESIGNS} select blocks, not {self.design!r}"
        if self._takes("top_k", TOP_K_DESIGNS, refusal):
            allowed = f"must be an int >= 1 for design={self.design!r}"
            self._positive_int("top_k", DEFAULT_TOP_K, allowed)

    def _check_obs_window(self) -> None:
        refusal = f"only design='evict' scores chunks by observation queries, not {self.design!r}"
        if self._takes("obs_window", ("evict",), refusal):
            allowed = "must be an int >= 1 (observation queries)"
            self._positive_int("obs_window", DEFAULT_OBS_WINDOW, allowed)

    def _check_select_len(self) -> None:
        refusal = f"only design='nsa' has selection blocks, not {self.design!r}"
        if self._takes("select_len", ("nsa",), refusal):
            allowed = f"must be a multiple of stride={self.stride}"
            self._positive_int("select_len", self.stride, allowed)
            if self.select_len % self.stride:
                raise invalid_field("select_len", self.select_len, allowed)
        refusal = f"only design='nsa' has branch gates, not {self.design!r}"
        if self._takes("gate_hidden", ("nsa",), refusal) and self.gate_hidden is not None:
            self._positive_int("gate_hidden", 1, "must be None (a linear gate) or an int >= 1")

    def _check_indexer(self) -> None:
        refusal = f"only design='dsa' has an indexer, not {self.design!r}"
        takes = [self._takes(name, ("dsa",), refusal) for name in ("index_heads", "indexer_train")]
        if not all(takes):
            return
        self._positive_int("index_heads", DEFAULT_INDEX_HEADS, "must be an int >= 1")
        if self.indexer_train is None:
            self._set("indexer_train", "kl")
        if self.indexer_train not in INDEXER_TRAINING:
            raise invalid_field("indexer_train", self.indexer_train, f"allowed: {INDEXER_TRAINING}")

    def _check_series(self) -> None:
        refusal = f"only designs {SERIES_DESIGNS} take it, not {self.design!r}"
        if not self._takes("pool_rope", SERIES_DESIGNS, refusal):
            return
        if self.pool_rope is None:
            self._set("pool_rope", "pre")
        if self.pool_rope not in POOL_ROPE:
            raise invalid_field("pool_rope", self.pool_rope, f"allowed: {POOL_ROPE}")
        if self.block_len % self.stride:
            raise invalid_field(
                "block_len",
                self.block_len,
                f"{self.design} needs a multiple of stride={self.stride} (one projection series "
                "per stride)",
            )

    def _check_sink(self) -> None:
        if self.sink_tokens == 0 and is_int(self.sink_tokens):
            self._set("sink_tokens", None)  # no sink: the config (and its cache key) of before
        refusal = f"only designs {SINK_DESIGNS} rank blocks a sink could win, not {self.design!r}"
        if self._takes("sink_tokens", SINK_DESIGNS, refusal) and self.sink_tokens is not None:
            self._positive_int("sink_tokens", 1, "must be an int >= 0 (tokens read raw)")

    def _check_rest(self) -> None:
        """``gate``, ``eval_offset`` and ``block_scope``, and how they fit the design."""
        if self.gate not in GATES:
            raise invalid_field("gate", self.gate, f"allowed: {GATES}")
        if self.gate != "scalar" and self.design != "gated":
            raise invalid_field(
                "gate", self.gate, f"only design='gated' has a gate, not {self.design!r}"
            )
        if not is_int(self.eval_offset) or not 0 <= self.eval_offset < self.stride:
            raise invalid_field(
                "eval_offset", self.eval_offset, f"must be an int in [0, stride={self.stride})"
            )
        if self.block_scope is None:
            scope = "all" if self.design in ALL_SCOPE_DESIGNS else "outside_window"
            self._set("block_scope", scope)
        if self.block_scope not in BLOCK_SCOPES:
            raise invalid_field("block_scope", self.block_scope, f"allowed: {BLOCK_SCOPES}")
        if self.block_scope == "all" and self.design in SELECTING_DESIGNS:
            raise invalid_field(
                "block_scope",
                self.block_scope,
                f"design={self.design!r} reads blocks raw, so its candidates must lie outside "
                "the window",
            )
        if self.design in ("kpool", "dsa") and self.block_len != self.stride:
            raise invalid_field(
                "block_len",
                self.block_len,
                f"{self.design}'s pools are disjoint runs of stride={self.stride} tokens; "
                "allowed: block_len=None or = stride",
            )
        if self.eval_offset != 0 and self.offsets != "random":
            raise invalid_field(
                "eval_offset", self.eval_offset, "only offsets='random' uses eval_offset"
            )

    @property
    def enabled(self) -> bool:
        return self.design != "none"

    def is_compressed(self, layer: int) -> bool:
        return self.enabled and (self.layers is None or layer in self.layers)

    def compressed_layers(self, n_layers: int) -> list[int]:
        return [i for i in range(n_layers) if self.is_compressed(i)]

    def base_offsets(self, n_layers: int, n_kv_heads: int) -> np.ndarray:
        """Static grid offsets ``[layer, kv_head]`` before any per-sequence shift."""
        d = self.stride
        out = np.zeros((n_layers, n_kv_heads), dtype=np.int64)
        spec = self.offsets
        if spec in ("per_layer", "per_head", "per_layer_head"):
            if spec != "per_head":  # compressed layer r of n: (r*d)//n
                layers = self.compressed_layers(n_layers)
                for rank, layer in enumerate(layers):
                    out[layer, :] = (rank * d) // len(layers)
            if spec != "per_layer":  # KV head g of G: (g*d)//G, added mod d
                out[:, :] = (out + (np.arange(n_kv_heads) * d) // n_kv_heads) % d
        elif isinstance(spec, int):
            out[:, :] = spec
        elif isinstance(spec, tuple):
            arr = np.asarray(spec, dtype=np.int64)
            out[:, :] = arr  # broadcast [kv_head] or [layer, kv_head]; shape checked by the model
        return out

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in _OPTIONAL_FIELDS:
            if out[name] is None:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompressionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown or "design" not in d:
            raise ValueError(
                f"CompressionConfig fields {unknown or ['design']} are "
                f"{'unknown' if unknown else 'missing'}: allowed {sorted(known)}, design required"
            )
        d = dict(d)
        if isinstance(d.get("offsets"), list):
            d["offsets"] = freeze_offsets(d["offsets"])
        if isinstance(d.get("layers"), list):
            d["layers"] = tuple(d["layers"])
        return cls(**d)


def _no_compression() -> CompressionConfig:
    return CompressionConfig(design="none")


def layer_types(cfg: HookedTransformerConfig) -> list[str]:
    """``local`` (sliding-window) or ``global`` for each layer of any TransformerLens config."""
    if not cfg.use_local_attn:
        return ["global"] * cfg.n_layers
    return [str(t) for t in (cfg.attn_types or ["local"] * cfg.n_layers)]


#: the names a layer set may take beside ints and ranges (by each layer's type)
LAYER_KINDS = ("global", "local", "all")


def layers_of_kind(types: Sequence[str], kind: str, model: str = "the model") -> tuple[int, ...]:
    """The layers ``kind`` (one of :data:`LAYER_KINDS`) names among layers of ``types``
    (``layer_types``); a one-line ``ValueError`` where none are."""
    if kind not in LAYER_KINDS:
        raise ValueError(f"layers={kind!r} is invalid: allowed {', '.join(LAYER_KINDS)} or ints")
    out = tuple(i for i, t in enumerate(types) if kind in ("all", t))
    if not out:
        raise ValueError(f"layers={kind!r} is invalid: {model} has no {kind} layers")
    return out


@dataclass
class PhaseTransformerConfig(HookedTransformerConfig):
    """A ``HookedTransformerConfig`` with a ``compression`` field (a ``CompressionConfig``).

    It survives into every component's ``self.cfg``; a dict is accepted and converted, so
    ``from_dict`` round-trips. ``use_token_pattern`` switches ``hook_token_pattern`` on, as
    ``use_attn_result`` does for ``hook_result``.
    """

    compression: CompressionConfig = field(default_factory=_no_compression)
    use_token_pattern: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.compression, dict):
            self.compression = CompressionConfig.from_dict(self.compression)
        if not isinstance(self.compression, CompressionConfig):
            raise ValueError(
                f"PhaseTransformerConfig.compression={self.compression!r} is invalid: "
                "expected a CompressionConfig or a dict of its fields"
            )
        c = self.compression
        if c.layers is not None:
            bad = [i for i in c.layers if i >= self.n_layers]
            if bad:
                raise ValueError(
                    f"CompressionConfig.layers={c.layers!r} is invalid: layer(s) {bad} do not "
                    f"exist, allowed 0..{self.n_layers - 1}"
                )
        g = self.n_kv_heads
        if isinstance(c.offsets, tuple):
            shape = np.shape(c.offsets)
            if shape not in ((g,), (self.n_layers, g)):
                raise ValueError(
                    f"CompressionConfig.offsets has shape {shape}: explicit offsets must be "
                    f"[kv_head]=({g},) or [layer, kv_head]=({self.n_layers}, {g})"
                )
        if c.enabled:
            base = c.base_offsets(self.n_layers, self.n_kv_heads)[
                c.compressed_layers(self.n_layers)
            ]
            # random offsets: training draws every offset of the stride
            offsets = set(range(c.stride)) if c.offsets == "random" else set(base.ravel().tolist())
            check_compression_acts(c, self.n_ctx, offsets)
        if c.enabled and self.attention_dir != "causal":
            raise ValueError(
                f"attention_dir={self.attention_dir!r} is invalid with compression: chunked KV "
                "compression is defined for causal attention only"
            )
        if c.enabled:
            # TL attention features the compressed forward does not reproduce: refuse them
            # rather than silently compute something else.
            unsupported = {
                "use_attention_sinks": self.use_attention_sinks,
                "use_logn_attn": self.use_logn_attn,
            }
            bad = [name for name, on in unsupported.items() if on]
            if bad:
                raise ValueError(
                    f"{', '.join(bad)} is not supported with compression "
                    f"(design={c.design!r}): compress another layer set or use design='none'"
                )
            self._check_local_layers(c)
        if c.enabled and self.positional_embedding_type in ("alibi", "relative_positional_bias"):
            raise ValueError(
                f"positional_embedding_type={self.positional_embedding_type!r} is not supported "
                "with compression: allowed 'standard', 'rotary', 'shortformer'"
            )

    def _check_local_layers(self, c: CompressionConfig) -> None:
        """A sliding-window layer composes its window with the grid (``phasemech.core.grid``)
        in the designs that read the shared geometry alone; the others are refused on it,
        naming the global layers."""
        types = layer_types(self)
        local = [i for i in c.compressed_layers(self.n_layers) if types[i] == "local"]
        if local and c.design not in LOCAL_DESIGNS:
            glob = [i for i, t in enumerate(types) if t == "global"]
            raise ValueError(
                f"CompressionConfig.layers={c.layers!r} is invalid: layer(s) {local} use local "
                f"(sliding-window, {self.window_size} keys) attention, which {c.design!r} does "
                f"not compose with (its branches, indexer or observations read past the "
                f"window; composing designs: {', '.join(LOCAL_DESIGNS)}); allowed: the global "
                f"layers {glob} (--layers global)"
            )

    @property
    def n_kv_heads(self) -> int:
        """Number of key/value heads: ``n_key_value_heads`` under GQA, else ``n_heads``."""
        if self.n_key_value_heads is None or self.ungroup_grouped_query_attention:
            return self.n_heads
        return self.n_key_value_heads
