"""Compression grid geometry: phases, blocks, and which past token a query reaches how.

Axes: ``batch``, ``kv_head``, ``pos`` (query or key position), ``block``, ``slot``, ``phase``,
``w`` (index into the raw band; band slot ``w`` of query ``t`` is key ``t - Wr + 1 + w``).

Grid: stride ``d``, block length ``l >= d``, offset ``o`` in ``[0, d)`` per (sequence, KV head).
Block ``i`` covers ``[i*d + o - l, i*d + o - 1]``; the positions that fall before 0 (block 0 when
``o > 0``, and the overlap of early blocks) are missing slots, treated as padding. A token's phase
is ``(j - o) mod d`` and its *segment* is the ``d`` tokens ``[j - phase, j - phase + d - 1]``.

Coverage rule (one rule for every design; tested in ``tests/test_coverage.py``):

* **visible blocks**: block ``i`` is visible to query ``t`` once it is complete: its last token
  ``e <= t`` (``inclusive``) or ``e < t`` (``strict``). Let ``e_t`` be the last token of the latest
  visible block (a block boundary, possibly negative);
* **raw**: query ``t`` reaches ``[r_t, t]`` raw, ``r_t = min(t - W + 1, e_t + 1)``: the window, and
  always everything after the latest visible block, so the query's own incomplete block is raw.
  With ``W = 0`` the raw part is exactly that incomplete block (MoBA/Quest "current block",
  GLM-5.3 "tail"); under ``inclusive`` a query in the last slot of its block has an empty tail
  and reads its own block compressed, under ``strict`` it reads it raw;
* **blocks** (``block_scope="outside_window"``, default): query ``t`` uses a visible block that
  holds at least one real token and whose first real token lies before ``r_t`` (a block wholly
  inside the raw window adds nothing). Every past token ``j < r_t`` is then reached through a
  block (its own block ends at or before ``e_t``), every ``j >= r_t`` raw: no token is reachable
  by neither path. Tokens reached **both ways** are the raw tokens of a used block straddling
  ``r_t``: at most ``l - 1`` per query. A naive "blocks that end before the window" rule would
  leave up to ``d - 1`` tokens reachable by neither path;
* ``block_scope="before_window"`` (the candidate-set fix): the raw span starts at a block
  boundary, the start of the segment holding ``t - W + 1``, so ``r_t = min(s(t - W + 1), e_t + 1)``
  and the query reads ``W`` to ``W + d - 1`` tokens raw; it uses only the blocks that end before
  ``r_t`` (wholly before the raw span). No block is partly read raw, so a selecting design never
  spends a top-k pick on a block whose tokens it already holds; nothing is reached both ways and
  nothing is missed (every ``j < r_t`` lies in a block ending before the segment start ``r_t``);
* ``block_scope="all"`` (DeepSeek-V4 CSA/HCA): every visible block with a real token is used, so
  the raw window and the compressed entries overlap (up to ``W`` tokens both ways);
* ``route`` uses the same candidates but attends only the raw tokens of its top-k blocks (plus
  the block the query closes, forced): tokens of unselected blocks are dropped on purpose.

* the **sink** (``sink_tokens = N``, the selecting designs only): the first ``N`` real tokens
  are no block's real tokens (a block is placed, scored and used by its other tokens; one of
  only sink tokens is never used); the selecting engine reads them raw for every query ``t``
  from their position on, until ``r_t`` passes them and the raw span holds them.

* a **sliding-window layer** (``local_window = S``, Gemma's local layers) reads nothing before
  ``t - S + 1``: it uses only the blocks whose first real token lies at or after it, and its raw
  span starts there at the latest, ``max(r_t, t - S + 1)``. A block straddling ``t - S + 1`` is
  dropped whole (a pooled entry cannot leave out its older tokens), so up to ``l - 1`` tokens
  inside the sliding window are reached by neither path. With ``W >= S`` the layer is its own
  sliding window, uncompressed.

Block numbering: block ``i`` ends at ``i*d + o - 1`` (block ``i - 1`` when counting from the
first block after the offset); block 0 lies before the grid offset (all padding, never used, when
``o = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Int
from torch import Tensor

from phasemech.core.validation import is_int


class GridSpec(Protocol):
    """What :func:`reference_grid` reads of a compression config (a
    :class:`~phasemech.core.config.CompressionConfig`, which builds on this module: the grid
    names the fields it needs instead of importing it)."""

    @property
    def stride(self) -> int: ...

    @property
    def offsets(self) -> Any: ...  # a mode name ("aligned", "random", ...), an int or a table

    @property
    def eval_offset(self) -> int: ...


def phase_of(pos, stride: int, offset=0):
    """Phase of position(s) ``pos`` on a grid of stride ``stride`` and offset ``offset``.

    ``(pos - offset) mod stride``, always in ``[0, stride)``. Works on ints, numpy arrays and
    torch tensors (broadcasting ``pos`` against ``offset``).
    """
    if not is_int(stride) or stride < 1:
        raise ValueError(f"phase_of: stride={stride!r} is invalid: must be an int >= 1")
    if isinstance(pos, Tensor):
        if pos.is_floating_point():
            raise ValueError(f"phase_of: pos has dtype {pos.dtype}: positions must be integers")
        return torch.remainder(pos - offset, stride)
    if isinstance(pos, np.ndarray):
        if not np.issubdtype(pos.dtype, np.integer):
            raise ValueError(f"phase_of: pos has dtype {pos.dtype}: positions must be integers")
        return np.mod(pos - np.asarray(offset), stride)
    if not is_int(pos):
        raise ValueError(f"phase_of: pos={pos!r} is invalid: must be an int, array or tensor")
    return int((pos - offset) % stride)


def reference_grid(compression: GridSpec) -> tuple[int, int]:
    """``(stride, offset)`` of the grid phases are reported on.

    Aligned or one explicit offset: the model's own grid. Staggered, random or per-head offsets
    have no single grid; phases are then reported on the aligned reference grid (offset 0,
    or ``eval_offset`` for random offsets, the grid the model is evaluated with). A dense model
    uses the grid of its matched compressed models (its ``stride`` field).
    """
    spec = compression.offsets
    if isinstance(spec, int):
        return compression.stride, spec
    if spec == "random":
        return compression.stride, compression.eval_offset
    return compression.stride, 0


def left_padding(attention_mask: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch"]:
    """Leading zeros of a padding mask: how far each sequence's first real token is shifted."""
    return (attention_mask.long().cumsum(-1) == 0).sum(-1)


def n_blocks(seq_len: int, stride: int) -> int:
    """Blocks per sequence: enough for any offset in ``[0, stride)`` (some end past the end)."""
    return seq_len // stride + 1


def last_query_blocks(
    seq_len: int,
    stride: int,
    block_len: int,
    window: int,
    visibility: str,
    offset: int,
    block_scope: str = "outside_window",
) -> tuple[int, int]:
    """``(used, ranked)`` at the last query ``t = seq_len - 1`` of an unpadded sequence: the
    blocks it uses (the coverage rule above) and those ``route``/``evict`` may rank (used, less
    the block it closes, which is forced). Both only grow with ``t`` (the ranked count at the
    last query is the maximum too), so ``used == 0`` means no query ever reads a block and
    ``ranked <= top_k`` means no selection ever drops one: the layer is dense attention."""
    d, t = stride, seq_len - 1
    newest = t if visibility == "inclusive" else t - 1
    latest_end = newest - (newest + 1 - offset) % d
    window_start = t - window + 1
    if block_scope == "before_window":
        window_start = _segment_start(window_start, d, offset)
    raw_start = min(window_start, latest_end + 1)
    ends = np.arange(n_blocks(seq_len, d)) * d + offset - 1
    first = np.maximum(ends - block_len + 1, 0)
    used = (ends >= 0) & (ends <= latest_end)
    if block_scope == "outside_window":
        used &= first < raw_start
    elif block_scope == "before_window":
        used &= ends < raw_start
    forced = used & (ends == t)  # only under inclusive visibility can a block end at t
    return int(used.sum()), int(used.sum() - forced.sum())


def _segment_start(pos, d: int, offset):
    """First position of the segment holding ``pos`` (a block boundary): ``pos - phase``."""
    return pos - phase_of(pos, d, offset)


def raw_band_width(
    seq_len: int, stride: int, window: int, block_scope: str = "outside_window"
) -> int:
    """``Wr``: the longest raw span ``t - r_t + 1`` a query can have, capped at the sequence
    (``before_window`` starts the span at a block boundary: up to ``d - 1`` more tokens)."""
    longest = window + stride - 1 if block_scope == "before_window" else window
    return max(1, min(max(longest, stride), seq_len))


def _band_positions(seq_len: int, band: int, device: torch.device) -> Int[Tensor, "pos w"]:
    t = torch.arange(seq_len, device=device)
    return t[:, None] - band + 1 + torch.arange(band, device=device)[None, :]


@dataclass(frozen=True)
class Geometry:
    """Every index and mask a compressed attention layer needs for one forward.

    Shapes: ``slot_pos``/``slot_valid`` ``[batch, kv_head, block, slot]``; ``block_first`` /
    ``block_last`` ``[batch, kv_head, block]``; ``raw_start`` ``[batch, kv_head, pos]``;
    ``block_used`` ``[batch, kv_head, pos, block]``; ``band_valid`` ``[batch, kv_head, pos, w]``.
    """

    stride: int
    block_len: int
    band: int
    slot_pos: Int[Tensor, "batch kv_head block slot"]
    slot_valid: Bool[Tensor, "batch kv_head block slot"]
    block_first: Int[Tensor, "batch kv_head block"]
    block_last: Int[Tensor, "batch kv_head block"]
    raw_start: Int[Tensor, "batch kv_head pos"]
    block_used: Bool[Tensor, "batch kv_head pos block"]
    band_valid: Bool[Tensor, "batch kv_head pos w"]
    key_valid: Bool[Tensor, "batch pos"] | None = None
    #: the attention sink (``sink_tokens``): which keys are sink tokens, and their positions
    #: (``pos`` = the sequence length where a sequence has fewer real tokens: never visible)
    sink: Bool[Tensor, "batch pos"] | None = None
    sink_pos: Int[Tensor, "batch n_sink"] | None = None
    #: every sequence of the batch on the same grid (no per-sequence shift): slots can be
    #: gathered once per KV head instead of per sequence
    shared: bool = False

    @property
    def band_pos(self) -> Int[Tensor, "pos w"]:
        """Absolute key position of raw band slot ``w`` for query ``t`` (may be negative)."""
        return _band_positions(self.raw_start.shape[-1], self.band, self.raw_start.device)


def build_geometry(
    offsets: Int[Tensor, "batch kv_head"],
    seq_len: int,
    stride: int,
    block_len: int,
    window: int,
    visibility: str,
    key_valid: Bool[Tensor, "batch pos"] | None = None,
    block_scope: str = "outside_window",
    local_window: int | None = None,
    sink_tokens: int = 0,
) -> Geometry:
    """Blocks, raw band and the coverage rule of the module docstring, as tensors.
    ``local_window``: a sliding-window layer's span ``S`` (the module docstring's last rule).
    ``sink_tokens``: the first ``N`` real tokens are the sink (read raw by the selecting
    engine): they are no block's real tokens, so a block is scored, used and placed by its
    other tokens and a block of only sink tokens is never used."""
    o = offsets.long()[:, :, None]  # [batch, kv_head, 1]
    slot_pos, slot_valid, last = _block_slots(o, seq_len, stride, block_len, key_valid)
    sink, sink_pos = _sink(offsets.shape[0], seq_len, sink_tokens, key_valid, o.device)
    if sink is not None:
        at = sink[:, None, None, :].expand(-1, o.shape[1], slot_pos.shape[2], -1)
        slot_valid = slot_valid & ~torch.gather(at, -1, slot_pos.clamp(0, seq_len - 1))
    # First real token of a block (a block of only padding gets seq_len: never used).
    first = torch.where(slot_valid, slot_pos, torch.full_like(slot_pos, seq_len)).amin(-1)
    raw_start = _raw_start(o, seq_len, stride, window, visibility, block_scope)
    block_used = _block_used(last, first, slot_valid.any(-1), raw_start, visibility, block_scope)
    if local_window is not None:  # nothing before t - S + 1: whole blocks inside it, raw after
        oldest = torch.arange(seq_len, device=o.device) - local_window + 1  # [pos]
        block_used = block_used & (first[:, :, None, :] >= oldest[:, None])
        raw_start = torch.maximum(raw_start, oldest)
    band = raw_band_width(seq_len, stride, window, block_scope)
    return Geometry(
        stride=stride,
        block_len=block_len,
        band=band,
        slot_pos=slot_pos,
        slot_valid=slot_valid,
        block_first=first,
        block_last=last.expand_as(first),
        raw_start=raw_start,
        block_used=block_used,
        band_valid=_band_valid(raw_start, band, key_valid),
        key_valid=None if key_valid is None else key_valid.bool(),
        sink=sink,
        sink_pos=sink_pos,
        shared=bool((offsets == offsets[:1]).all()),
    )


def _sink(
    batch: int, seq_len: int, n: int, key_valid: Bool[Tensor, "batch pos"] | None, device
) -> tuple[Bool[Tensor, "batch pos"] | None, Int[Tensor, "batch n_sink"] | None]:
    """``(sink, sink_pos)``: the first ``n`` real tokens of each sequence (after its left
    padding), as a key mask and as positions (``seq_len`` where a sequence has fewer)."""
    if not n:
        return None, None
    pos = torch.arange(seq_len, device=device).expand(batch, -1)
    real = torch.ones_like(pos, dtype=torch.bool) if key_valid is None else key_valid.bool()
    sink = real & (real.long().cumsum(-1) <= n)
    first = torch.where(sink, pos, seq_len).sort(-1).values[:, :n]
    return sink, F.pad(first, (0, n - first.shape[1]), value=seq_len)


def _block_slots(
    o: Int[Tensor, "batch kv_head 1"],
    seq_len: int,
    d: int,
    l: int,
    key_valid: Bool[Tensor, "batch pos"] | None,
) -> tuple[
    Int[Tensor, "batch kv_head block slot"],
    Bool[Tensor, "batch kv_head block slot"],
    Int[Tensor, "batch kv_head block"],
]:
    """``(slot_pos, slot_valid, block_last)``: each block's token positions, which of them are
    real tokens (inside the sequence, not padding) and each block's last position."""
    nb = n_blocks(seq_len, d)
    i = torch.arange(nb, device=o.device)
    start = i * d + o - l  # [batch, kv_head, block]
    last = i * d + o - 1
    slot = torch.arange(l, device=o.device)
    slot_pos = start[..., None] + slot  # [batch, kv_head, block, slot]
    in_seq = (slot_pos >= 0) & (slot_pos < seq_len)
    if key_valid is None:
        return slot_pos, in_seq, last
    kv = key_valid.bool()[:, None, None, :].expand(-1, o.shape[1], nb, -1)
    gathered = torch.gather(kv, -1, slot_pos.clamp(0, seq_len - 1))
    return slot_pos, in_seq & gathered, last


def _raw_start(
    o: Int[Tensor, "batch kv_head 1"],
    seq_len: int,
    d: int,
    window: int,
    visibility: str,
    block_scope: str = "outside_window",
) -> Int[Tensor, "batch kv_head pos"]:
    """``r_t = min(t - W + 1, e_t + 1)`` (``before_window``: ``t - W + 1`` moved back to its
    segment's start): where each query's raw span starts."""
    t = torch.arange(seq_len, device=o.device)
    # last token of the latest visible block: block ends e satisfy (e + 1 - o) mod d == 0
    newest = t if visibility == "inclusive" else t - 1
    latest_end = newest - torch.remainder(newest + 1 - o, d)  # [batch, kv_head, pos]
    window_start = t - window + 1
    if block_scope == "before_window":
        window_start = _segment_start(window_start, d, o)
    return torch.minimum(window_start, latest_end + 1)


def _block_used(
    last: Int[Tensor, "batch kv_head block"],
    first: Int[Tensor, "batch kv_head block"],
    has_token: Bool[Tensor, "batch kv_head block"],
    raw_start: Int[Tensor, "batch kv_head pos"],
    visibility: str,
    block_scope: str,
) -> Bool[Tensor, "batch kv_head pos block"]:
    """Which blocks each query reads compressed (the coverage rule's **blocks**)."""
    t = torch.arange(raw_start.shape[-1], device=raw_start.device)
    last_q = last[:, :, None, :]  # [batch, kv_head, 1, block]
    t_q = t[None, None, :, None]
    complete = last_q <= t_q if visibility == "inclusive" else last_q < t_q
    block_used = complete & has_token[:, :, None, :]
    if block_scope == "outside_window":
        block_used = block_used & (first[:, :, None, :] < raw_start[..., None])
    elif block_scope == "before_window":
        block_used = block_used & (last_q < raw_start[..., None])
    return block_used


def _band_valid(
    raw_start: Int[Tensor, "batch kv_head pos"],
    band: int,
    key_valid: Bool[Tensor, "batch pos"] | None,
) -> Bool[Tensor, "batch kv_head pos w"]:
    """Which raw band slots hold a key the query reaches raw (a real token, not padding)."""
    band_pos = _band_positions(raw_start.shape[-1], band, raw_start.device)  # [pos, w]
    band_valid = (band_pos >= 0) & (band_pos[None, None] >= raw_start[..., None])
    if key_valid is not None:
        kvb = key_valid.bool()[:, band_pos.clamp(min=0)]  # [batch, pos, w]
        band_valid = band_valid & kvb[:, None]
    return band_valid
