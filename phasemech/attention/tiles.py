"""The selecting engine's attention step, per tile of query rows (the fast path of a forward).

Axes: ``batch``, ``head``, ``kv_head``, ``rep`` (query heads per KV head), ``row`` (a chunk's
query rows, consecutive), ``tile`` (``TILE`` consecutive rows), ``c`` (a row inside its tile),
``block``, ``sel`` (a kept block), ``u`` (a block of the tile's union), ``slot``, ``key`` (the
union's tokens, ``u x slot``, then the tile's band span), ``d_head``.

``SelectingAttention._chunk`` gathers each query's own kept tokens: ``[row, sel x slot, d]`` per
query head, a copy of the keys and values per query that dominated a long forward (half of a
layer's time in ``index_select`` and small batched matmuls). Here the rows of a tile, and the
query heads of a KV head, share one key list instead: the union of the blocks any of them kept,
then the tile's band span (``TILE + Wr - 1`` consecutive keys). Neighbouring queries keep many
of the same blocks, so the union is a fraction of ``TILE x rep x sel``; the scores are one
matmul per tile, and each query's own selection is a mask over that list, built from the same
conditions as ``_kept_tokens`` and the band (``tests/test_selection.py`` compares both paths in
float64). MoBA's efficient path and Quest's kernel share keys across queries the same way.

It serves disjoint blocks (``block_len == stride``), unpadded keys and consecutive rows; the
caller keeps the gather for the rest (hooks, overlap, padding, a kept-block bias, the dense
layout of a short training forward) and where a tile's union is so large that its scores
would take more memory than the gathered keys. Hidden keys weigh exactly 0, so outputs equal
the gather's for finite values (a NaN value in a hidden key would spread, as ``0 * NaN``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from phasemech.attention.rows import at_rows, gather_heads
from phasemech.core.grid import Geometry

#: query rows per tile (a smaller tile keeps a smaller union; a larger one, fewer matmuls)
TILE = 16
#: the longest key list served, in multiples of a query's own kept keys (else: the gather)
MAX_SPREAD = 8


def tiles_serve(geo: Geometry, rows: Int[Tensor, "batch row"]) -> bool:
    """Whether ``attend_tiles`` computes these rows exactly as the gather does."""
    unpadded = geo.key_valid is None or bool(geo.key_valid.all())
    if geo.block_len != geo.stride or geo.band < 1 or not unpadded or rows.shape[1] < 2:
        return False
    return bool((rows.diff(dim=1) == 1).all())


def attend_tiles(
    q_rows: Float[Tensor, "batch head row d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    v: Float[Tensor, "batch pos kv_head d_head"],
    geo: Geometry,
    rows: Int[Tensor, "batch row"],
    kept: tuple[Int[Tensor, "batch head row sel"], Bool[Tensor, "batch head row sel"]],
    pattern: Callable[[Tensor, Tensor], Tensor],
) -> Float[Tensor, "batch head row d_head"] | None:
    """``z`` at ``rows``: each query attends its kept blocks' tokens and its raw band in one
    softmax (``pattern(scores, visible)``), over its tile's shared key list. ``None`` when a
    key list is more than ``MAX_SPREAD`` times a query's own keys (the queries of a tile keep
    mostly different blocks: the gather is then faster, and smaller)."""
    b, h, r, dh = q_rows.shape
    g = k.shape[2]
    rep, pad = h // g, -r % TILE
    nt = (r + pad) // TILE
    idx, ok = kept
    if pad:  # the last tile runs on copies of the last row; their outputs are dropped
        rows = torch.cat([rows, rows[:, -1:].expand(-1, pad)], 1)
        q_rows = torch.cat([q_rows, q_rows[:, :, -1:].expand(-1, -1, pad, -1)], 2)
        idx = torch.cat([idx, idx[:, :, -1:].expand(-1, -1, pad, -1)], 2)
        ok = torch.cat([ok, ok.new_zeros(b, h, pad, ok.shape[-1])], 2)
    ublk, seen = _union(idx.view(b, g, rep, nt, TILE, -1), ok, geo.block_used.shape[-1])
    # per query: a score for every key of the list against the gather's m keys; matrix
    # products win while the list is a few times m (SmolLM2: ~4x), lose beyond (queries that
    # keep unrelated blocks, e.g. random weights: ~25x, 2x slower); MAX_SPREAD keeps the
    # gather there, and below d_head x the list's scores never outgrow the gathered keys
    n_sink = 0 if geo.sink_pos is None else geo.sink_pos.shape[1]
    n_keys = ublk.shape[-1] * geo.stride + TILE + geo.band - 1 + n_sink
    n_kept = idx.shape[-1] * geo.stride + n_sink
    if n_keys > min(MAX_SPREAD, dh) * (n_kept + geo.band):
        return None
    keys, visible = _key_list(geo, rows.view(b, nt, TILE), ublk, seen)
    # one key list per KV head: gather_heads with a "head" axis of KV heads
    kt, vt = gather_heads(k, keys), gather_heads(v, keys)  # [batch, kv_head, tile, key, d]
    qt = q_rows.view(b, g, rep, nt, TILE, dh).transpose(2, 3).flatten(3, 4)
    scores = qt @ kt.transpose(-1, -2)  # [batch, kv_head, tile, rep x c, key]
    p = pattern(scores, visible.transpose(2, 3).flatten(3, 4))
    z = (p @ vt).view(b, g, nt, rep, TILE, dh).transpose(2, 3).reshape(b, h, nt * TILE, dh)
    return z[:, :, :r]


def _union(
    idx: Int[Tensor, "batch kv_head rep tile c sel"],
    ok: Bool[Tensor, "batch head row sel"],
    nb: int,
) -> tuple[Int[Tensor, "batch kv_head tile u"], Bool[Tensor, "batch kv_head rep tile c u"]]:
    """The blocks any row or query head of a tile kept (padded to the largest union), and
    which of them each query kept. Counts, not writes, decide: a missing pick may repeat a
    kept block's index (the forced block of a query that closes none)."""
    b, g, rep, nt, c, sel = idx.shape
    hits = ok.to(torch.float32).view(b, g, rep, nt, c, sel)
    flat = (idx.transpose(2, 3).reshape(b, g, nt, -1), hits.transpose(2, 3).reshape(b, g, nt, -1))
    union = hits.new_zeros(b, g, nt, nb).scatter_add_(-1, *flat) > 0
    u = max(1, int(union.sum(-1).max()))
    val, ublk = union.to(torch.uint8).topk(u, dim=-1, sorted=False)
    # each block's place in the union (u: not in it), then each query's picks by place
    place = torch.full_like(union, u, dtype=torch.long).scatter_(
        -1, ublk, torch.arange(u, device=idx.device).expand_as(ublk)
    )
    place = place.masked_fill_(~union, u)
    where = place[:, :, None].expand(-1, -1, rep, -1, -1).gather(-1, idx.flatten(-2))
    picked = hits.new_zeros(b, g, rep, nt, c * (u + 1))
    row = torch.arange(c, device=idx.device).repeat_interleave(sel) * (u + 1)
    picked.scatter_add_(-1, where + row, hits.flatten(-2))
    seen = picked.view(b, g, rep, nt, c, u + 1)[..., :u] > 0
    return ublk, seen & (val > 0)[:, :, None, :, None]


def _key_list(
    geo: Geometry,
    rows: Int[Tensor, "batch tile c"],
    ublk: Int[Tensor, "batch kv_head tile u"],
    seen: Bool[Tensor, "batch kv_head rep tile c u"],
) -> tuple[Int[Tensor, "batch kv_head tile key"], Bool[Tensor, "batch kv_head rep tile c key"]]:
    """Key positions of each tile (union tokens, then the band span) and which each query
    attends: a kept block's token that is real, not after the query and not in its raw band
    (``_kept_tokens``' rule), and the query's own band slots (``band_valid``)."""
    d, wr = geo.stride, geo.band
    b, g, nt, u = ublk.shape
    row = rows[:, None, None, :, :, None]  # [batch, 1, 1, tile, c, 1]
    origin = geo.block_last[:, :, :1, None] + 1  # [batch, kv_head, 1, 1]: o
    upos = ((ublk * d + origin - d)[..., None] + torch.arange(d, device=ublk.device)).flatten(-2)
    raw_start = at_rows(geo.raw_start, rows.flatten(1)).view(b, g, 1, nt, -1, 1)
    up = upos[:, :, None, :, None]  # [batch, kv_head, 1, tile, 1, u x slot]
    kept = seen.repeat_interleave(d, -1) & (up >= 0) & (up <= row) & (up < raw_start)
    if geo.sink is not None:  # a block's sink tokens are read as the sink (below), once
        flat = upos.clamp(0, geo.sink.shape[1] - 1).flatten(1)
        kept &= ~geo.sink.gather(1, flat).view_as(upos)[:, :, None, :, None]
    span = torch.arange(TILE + wr - 1, device=ublk.device)
    bpos = rows[:, :, :1] - wr + 1 + span  # [batch, tile, span]
    w = bpos[:, None, None, :, None, :] - row + wr - 1  # band slot of each key, per row
    band_ok = at_rows(geo.band_valid, rows.flatten(1)).view(b, g, 1, nt, TILE, wr)
    inside = (w >= 0) & (w < wr)
    band = inside & band_ok.gather(-1, w.clamp(0, wr - 1).expand(-1, g, -1, -1, -1, -1))
    keys = torch.cat([upos, bpos[:, None].expand(-1, g, -1, -1)], -1)
    visible = torch.cat([kept, band.expand(-1, -1, seen.shape[2], -1, -1, -1)], -1)
    if geo.sink_pos is None:
        return keys, visible
    sink = geo.sink_pos[:, None, None, None, None, :]  # [batch, 1, 1, 1, 1, n]
    seen_sink = (sink <= row) & (sink < raw_start)  # until the raw band reaches it
    keys = torch.cat([keys, geo.sink_pos[:, None, None].expand(-1, g, nt, -1)], -1)
    return keys, torch.cat([visible, seen_sink.expand(-1, -1, seen.shape[2], -1, -1, -1)], -1)
