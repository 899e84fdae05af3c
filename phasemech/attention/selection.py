"""The engine shared by the selecting designs (``route``, ``evict``, ``quest``, ``kpool``).

Axes: ``batch, head, kv_head, pos`` (every query), ``row`` (the query rows being computed),
``block``, ``sel`` (a kept block), ``slot``, ``m`` (a kept token: ``sel x slot``), ``w`` (raw band
slot: key ``t - Wr + 1 + w`` for query ``t``), ``d_head``.

For each query row ``t`` a design scores every block (``block_scores``: its own rule, no
gradient); the candidates are the pooled designs' used blocks (``phasemech.core.grid``), less the
block the query closes, which is forced (MoBA keeps the current block). The ``top_k`` best
candidates are kept and the query attends, in ONE softmax, the raw tokens of its kept blocks and
its raw band. A token is counted once: kept-block tokens that the raw band already holds, and
(with overlapping blocks, ``block_len > stride``) tokens an earlier kept block already holds,
are masked. Nothing is compressed: tokens of unkept blocks are dropped on purpose.

The kept tokens are *gathered* (``[row, sel x slot]``), never masked out of a ``[pos, key_pos]``
matrix, and rows run in chunks: a chunk holds ``O(rows x (blocks + top_k x block_len + Wr))``
scores per head, so memory is ``O(T (T/d + k l + W))`` for a forward (``bench/selection.py``).
An unhooked forward attends per tile of rows instead (``phasemech.attention.tiles``: the rows
of a tile share one key list, the union of their kept blocks, each masked to its own
selection; the same outputs, no per-query copy of the keys); the gather is its reference.
With any hook on the scores, selection or pattern attached (analysis, ``run_with_cache``) all
rows run as one chunk so each hook fires once per forward.

Hooks: ``hook_route_scores`` ``[batch, head, pos, block]`` (``-inf`` off the ranked candidates),
``hook_route_selected`` ``[batch, head, pos, block]`` (kept blocks, forced one included; a hook
may change the selection), ``hook_attn_scores`` / ``hook_pattern`` ``[batch, head, pos, m + w]``
(the gathered layout: kept tokens, then the band; hidden entries ``-inf`` / 0) and
``hook_token_pattern`` ``[batch, head, pos, key_pos]``: the same weights on absolute key
positions (exact). The same engine computes any subset of rows (``attend_rows``: patching after
the last layer, and the decode regime's question rows over a KV cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from phasemech.attention.base import DENSE_MAX_POS, CompressedAttentionMixin
from phasemech.attention.rows import at_rows, band_positions, gather_heads, query_rows
from phasemech.attention.tiles import attend_tiles, tiles_serve
from phasemech.core.grid import Geometry

#: query rows per chunk of the engine (bounds the gathered tensors; see the module docstring)
ROW_CHUNK = 256


def top_k_latest(
    gate: Float[Tensor, "... block"], k: int
) -> tuple[Float[Tensor, "... k"], Int[Tensor, "... k"]]:
    """``topk`` with ties at the cut broken toward the later block (a deterministic rule:
    ``topk`` itself breaks ties arbitrarily, and rules such as Quest's bounds tie exactly
    when overlapping blocks share their extreme keys). Rows with a tie at the cut (rare) are
    re-ranked by a stable sort; the rest keep ``topk``'s answer."""
    n = gate.shape[-1]
    if k >= n:
        return gate.topk(k, dim=-1)
    val, top = gate.topk(k + 1, dim=-1)
    cut = val[..., k - 1]
    tied = (cut == val[..., k]) & (cut > float("-inf"))
    val, top = val[..., :k], top[..., :k]
    if bool(tied.any()):
        rows = gate[tied].flip(-1)  # a stable descending sort of the reversed blocks
        order = rows.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        top[tied] = n - 1 - order
        val[tied] = rows.gather(-1, order)
    return val, top


def _band_rows(
    x: Float[Tensor, "batch pos kv_head d"], rows: Int[Tensor, "batch row"], band: int
) -> Float[Tensor, "batch kv_head row w d"]:
    """``x`` at each row's raw band (key ``t - band + 1 + w``; clamped at 0, masked by the
    caller), once per KV head: whole ``[kv_head, d]`` rows of a flat table."""
    b, seq, g, dd = x.shape
    pos = band_positions(rows, band, 1)[:, 0].clamp(0, seq - 1)  # [batch, row, w]
    flat = pos + torch.arange(b, device=pos.device)[:, None, None] * seq
    out = x.reshape(b * seq, g * dd).index_select(0, flat.flatten())
    return out.reshape(*pos.shape, g, dd).permute(0, 3, 1, 2, 4)


def grouped_scores(
    q: Float[Tensor, "batch head row d"], keys: Float[Tensor, "batch kv_head n d"]
) -> Float[Tensor, "batch head row n"]:
    """``q @ keys^T``, each query head against its KV head's keys: a KV group's heads are
    folded into the rows, so the keys are never repeated per query head."""
    b, h, r, d = q.shape
    g = keys.shape[1]
    return (q.reshape(b, g, h // g * r, d) @ keys.transpose(-1, -2)).reshape(b, h, r, -1)


def sub_geometry(geo: Geometry, batch: int | None, blocks: slice) -> Geometry:
    """``geo`` for the first ``batch`` sequences (``None``: all) and some blocks."""
    b = slice(None, batch)
    return dataclasses.replace(
        geo,
        slot_pos=geo.slot_pos[b, :, blocks],
        slot_valid=geo.slot_valid[b, :, blocks],
        block_first=geo.block_first[b, :, blocks],
        block_last=geo.block_last[b, :, blocks],
        raw_start=geo.raw_start[b],
        block_used=geo.block_used[b, ..., blocks],
        band_valid=geo.band_valid[b],
        key_valid=None if geo.key_valid is None else geo.key_valid[b],
        sink=None if geo.sink is None else geo.sink[b],
        sink_pos=None if geo.sink_pos is None else geo.sink_pos[b],
    )


def tiled_slots(
    x: Float[Tensor, "batch head row key_pos"], geo: Geometry, fill: float
) -> Float[Tensor, "batch head row block slot"] | None:
    """``x`` at every block slot when the blocks tile the keys back to back on one grid
    (``block_len == stride``, the same offset in every sequence and KV head, no padding): the
    keys are padded with ``fill`` (or cropped) to the blocks' span and folded, the values a slot
    gather reads, without the gather and the mask. ``None`` otherwise."""
    if geo.key_valid is not None or geo.sink is not None or geo.block_len != geo.stride:
        return None
    pos = geo.slot_pos
    first, span = int(pos[0, 0, 0, 0]), pos.shape[2] * pos.shape[3]
    regular = first + torch.arange(span, device=pos.device).view(pos.shape[2:])
    if not bool((pos == regular).all()):
        return None
    padded = F.pad(x, (-first, first + span - x.shape[-1]), value=fill)
    return padded.unflatten(-1, pos.shape[2:])


class SelectingAttention(CompressedAttentionMixin):
    """Top-k block selection over raw tokens; a design implements ``block_scores`` (and, when
    it scores from per-block statistics, ``block_summary``)."""

    design = "abstract-select"

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        self.top_k: int = self.cfg.compression.top_k
        #: keep every candidate (``PhaseTransformer.keep_every_block``: a dense warm-up)
        self.keep_all = False
        self.hook_route_scores = HookPoint()  # [batch, head, pos, block]
        self.hook_route_selected = HookPoint()  # [batch, head, pos, block] (bool)

    # ------------------------------------------------------------------ design interface
    #: the block axis of ``block_summary``'s tensors (``None``: the summary is never split by
    #: block; see ``_shared_summary``)
    summary_block_dim: int | None = None

    def block_summary(self, x: Tensor | None, k: Tensor, v: Tensor, geo: Geometry) -> Any:
        """What the rule needs per block, computed once per forward (default: nothing). A
        tensor (or tuple of tensors) with a block axis should name it in
        ``summary_block_dim``."""
        return None

    def block_scores(
        self,
        summary: Any,
        q: Float[Tensor, "batch pos head d_head"],
        rows: Int[Tensor, "batch row"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
    ) -> Float[Tensor, "batch head row block"]:
        """Score of every block for every query row (no gradient; masked by the engine)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ entry points
    def attend(self, x, q, k, v, geo):
        rows = torch.arange(q.shape[1], device=q.device).expand(q.shape[0], -1)
        z, token_pattern = self.attend_many(x, q, k, v, geo, rows)
        return z, token_pattern

    def attend_many(
        self,
        x: Tensor | None,
        q: Float[Tensor, "batch pos head d_head"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        v: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
        rows: Int[Tensor, "batch row"],
    ) -> tuple[Float[Tensor, "batch row head d_head"], Tensor | None]:
        """``z`` at the given query rows (and the token pattern there when wanted)."""
        summary = self._shared_summary(x, k, v, geo)
        hooks = (self.hook_route_scores, self.hook_route_selected)
        hooked = any(hp.has_hooks() for hp in (*hooks, self.hook_attn_scores, self.hook_pattern))
        n = rows.shape[1]
        chunk = n if hooked else self.row_chunk(k.shape[1])
        zs, tps = [], []
        for s in range(0, n, chunk):
            z, tp = self._chunk(summary, q, k, v, geo, rows[:, s : s + chunk], hooked)
            zs.append(z)
            tps.append(tp)
        token_pattern = None if tps[0] is None else torch.cat(tps, dim=2)
        return torch.cat(zs, dim=2).transpose(1, 2), token_pattern

    def _shared_summary(self, x: Tensor | None, k: Tensor, v: Tensor, geo: Geometry) -> Any:
        """``block_summary``; over copies of one prefill (``shared_prefix``, the decode regime's
        patching batches) the blocks wholly inside it are summarised for one copy only and the
        rest per copy: summarising a long prefill once per copy dominated those forwards."""
        dim, prefix = self.summary_block_dim, self.shared_prefix
        hooked = self.hook_k_block.has_hooks() or self.hook_block_weights.has_hooks()
        if dim is None or not prefix or k.shape[0] == 1 or not geo.shared or hooked:
            return self.block_summary(x, k, v, geo)
        # leading blocks that end inside the prefix (one grid: batch row 0 stands for all)
        same = int((geo.block_last[0] < prefix).all(0).long().cumprod(0).sum())
        if not same:
            return self.block_summary(x, k, v, geo)
        one = None if x is None else x[:1]
        head = self.block_summary(one, k[:1], v[:1], sub_geometry(geo, 1, slice(0, same)))
        tail = self.block_summary(x, k, v, sub_geometry(geo, None, slice(same, None)))

        def join(a: Tensor, b: Tensor) -> Tensor:
            return torch.cat([a.expand(b.shape[0], *a.shape[1:]), b], dim)

        if isinstance(head, tuple):
            return tuple(join(a, b) for a, b in zip(head, tail, strict=True))
        return join(head, tail)

    #: unhooked chunks rank only the blocks their rows reach (``_reachable``); off for a
    #: design whose budget depends on the number of blocks (``partition``)
    ranks_reachable = True
    #: unhooked forwards attend per tile of rows (``phasemech.attention.tiles``); off: the
    #: per-query gather (the reference the tests compare it with)
    tiled = True

    def row_chunk(self, seq: int) -> int:
        """Rows per chunk (a design whose scores touch every key uses smaller chunks)."""
        return ROW_CHUNK

    def n_keep(self, n_blocks: int) -> int:
        """Ranked blocks kept per query (``top_k``; a design with a fixed rule overrides it)."""
        return self.top_k

    # ------------------------------------------------------------------ the engine
    def kept_logit_bias(
        self,
        raw_gate: Float[Tensor, "batch head row block"],
        idx: Int[Tensor, "batch head row sel"],
    ) -> Float[Tensor, "batch head row sel"] | None:
        """A bias added to the attention logits of each kept block's tokens (default none; a
        learned selector uses it for a straight-through gradient)."""
        return None

    def _reachable(
        self, summary: Any, k: Tensor, geo: Geometry, rows: Int[Tensor, "batch row"]
    ) -> tuple[Any, Tensor, Geometry]:
        """``(summary, k, geo)`` cut to the blocks and keys the chunk's rows can reach: block
        ``i`` ends at ``i*d + o - 1``, so rows up to ``t`` rank blocks ``i <= (t + 1 - o) / d``
        and read keys up to ``t``. Causal chunks early in a sequence then score a fraction of
        the blocks (half of the block scores of a forward, summed over its chunks) and rank
        and copy no ``-inf`` beyond them. The same blocks rank, so the same ones are kept."""
        nb, t = geo.block_used.shape[-1], int(rows.max())
        o = int(geo.block_last[..., 0].min()) + 1
        reach = max(1, min(nb, (t + 1 - o) // geo.stride + 1))
        if reach == nb or not self.ranks_reachable:
            return summary, k, geo
        dim = self.summary_block_dim
        if summary is not None and dim is None:
            return summary, k, geo
        if isinstance(summary, tuple):
            summary = tuple(s.narrow(dim, 0, reach) for s in summary)
        elif summary is not None:
            summary = summary.narrow(dim, 0, reach)
        sub = sub_geometry(geo, None, slice(0, reach))
        if geo.key_valid is not None:  # the key axis is cut too (a padded batch)
            sub = dataclasses.replace(sub, key_valid=geo.key_valid[:, : t + 1])
        if geo.sink is not None:
            sub = dataclasses.replace(sub, sink=geo.sink[:, : t + 1])
        return summary, k[:, : t + 1], sub

    def _chunk(self, summary, q, k, v, geo, rows, hooked: bool):
        if not (hooked or self._token_pattern_wanted()):  # hooks see every block and key
            summary, k, geo = self._reachable(summary, k, geo, rows)
            v = v[:, : k.shape[1]]
        raw_gate = self.block_scores(summary, q, rows, k, geo)  # [batch, head, row, block]
        gate = raw_gate.detach()
        cand = at_rows(geo.block_used, rows)  # [batch, kv_head, row, block]
        fidx, fok = self._forced(geo, rows, cand)  # [batch, head, row, 1]
        gate = self.hook_route_scores(self._ranked(gate, cand, fidx, fok))
        idx, ok = self._select(gate, fidx, fok)  # [batch, head, row, sel]
        bias = self.kept_logit_bias(raw_gate, idx)  # [batch, head, row, sel] or None
        q_rows = query_rows(q, rows)  # [batch, head, row, d]
        dense = self.training and not hooked and k.shape[1] <= DENSE_MAX_POS
        plain = not (hooked or dense or bias is not None or self._token_pattern_wanted())
        if plain and self.tiled and tiles_serve(geo, rows):  # one key list per tile of rows
            z = attend_tiles(q_rows, k, v, geo, rows, (idx, ok), self._row_pattern)
            if z is not None:
                return z, None
        pos, keep = self._kept_tokens(idx, ok, geo, rows, k.shape[1])  # [b, h, row, m]
        if bias is not None and geo.block_len > geo.stride:
            # _kept_tokens re-sorts overlapping blocks: the bias would land on the wrong ones
            raise NotImplementedError(f"{self.design}: a kept-block bias needs disjoint blocks")
        if bias is not None:  # one bias per kept block, on each of its slots (none on a sink)
            bias = bias.repeat_interleave(geo.block_len, -1)
            bias = F.pad(bias, (0, pos.shape[-1] - bias.shape[-1]))
        band_ok = self._repeat_kv(at_rows(geo.band_valid, rows), 1)  # [batch, head, row, w]
        if dense:
            return self._attend_dense(q_rows, k, v, geo, rows, (pos, keep, bias, band_ok))
        visible = torch.cat([keep, band_ok], -1)
        # kept tokens differ per query head; the band is a KV head's: read it once per group
        kb, vb = _band_rows(k, rows, geo.band), _band_rows(v, rows, geo.band)  # [b, g, r, w, d]
        g = kb.shape[1]
        qg = q_rows.unflatten(1, (g, -1))  # [batch, kv_head, rep, row, d]
        scores = torch.cat([
            torch.einsum("bhrd,bhrmd->bhrm", q_rows, gather_heads(k, pos)),
            torch.einsum("bgtrd,bgrwd->bgtrw", qg, kb).flatten(1, 2),
        ], -1)  # fmt: skip
        m = pos.shape[-1]
        if bias is not None:
            scores = scores + F.pad(bias, (0, scores.shape[-1] - m))
        pattern = self._pattern(scores, visible) if hooked else self._row_pattern(scores, visible)
        z = torch.einsum("bhrm,bhrmd->bhrd", pattern[..., :m], gather_heads(v, pos))
        band_p = pattern[..., m:].unflatten(1, (g, -1))
        z = z + torch.einsum("bgtrw,bgrwd->bgtrd", band_p, vb).flatten(1, 2)
        token_pattern = None
        if self._token_pattern_wanted():
            all_pos = torch.cat([pos, band_positions(rows, geo.band, self.cfg.n_heads)], -1)
            token_pattern = pattern.new_zeros(*pattern.shape[:3], k.shape[1])
            token_pattern.scatter_add_(-1, all_pos.clamp(0, k.shape[1] - 1), pattern * visible)
        return z, token_pattern

    def _attend_dense(
        self,
        q_rows: Float[Tensor, "batch head row d_head"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        v: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
        rows: Int[Tensor, "batch row"],
        kept: tuple[Tensor, Tensor, Tensor | None, Tensor],
    ) -> tuple[Float[Tensor, "batch head row d_head"], Tensor | None]:
        """The same softmax with the kept tokens and the band laid out on every key position
        (a mask over ``[row, key_pos]``): at training's short contexts two matmuls beat the
        gathers of ``[row, m, d_head]`` per head, which dominate a step (``bench/selection_train
        .py``: a lab step 2.6-6.3x faster at T = 64)."""
        pos, keep, bias, band_ok = kept
        b, h, r, _ = q_rows.shape
        seq, g = k.shape[1], k.shape[2]
        # kept-block tokens and the band are disjoint (the engine masks their overlap): a union
        where = torch.cat([pos, band_positions(rows, geo.band, h)], -1).clamp(0, seq - 1)
        hits = torch.cat([keep, band_ok], -1).to(q_rows.dtype)
        visible = q_rows.new_zeros(b, h, r, seq).scatter_add_(-1, where, hits) > 0
        qg = q_rows.unflatten(1, (g, -1))  # [batch, kv_head, rep, row, d]
        scores = (qg @ k.permute(0, 2, 3, 1)[:, :, None]).flatten(1, 2)  # [b, h, row, key_pos]
        if bias is not None:
            scores = scores + scores.new_zeros(scores.shape).scatter_add(
                -1, pos.clamp(0, seq - 1), bias * keep
            )
        pattern = self._row_pattern(scores, visible)
        z = (pattern.unflatten(1, (g, -1)) @ v.transpose(1, 2)[:, :, None]).flatten(1, 2)
        return z, pattern if self._token_pattern_wanted() else None

    def _forced(
        self,
        geo: Geometry,
        rows: Int[Tensor, "batch row"],
        cand: Bool[Tensor, "batch kv_head row block"],
    ) -> tuple[Int[Tensor, "batch head row 1"], Bool[Tensor, "batch head row 1"]]:
        """The block each query closes (forced, as MoBA keeps the current block) and whether
        it is a candidate. Block ``i`` ends at ``i*d + o - 1``, so the query's own block is
        ``(t + 1 - o) / d`` when that divides: found in ``O(rows)``, not by a scan of blocks."""
        origin = geo.block_last[:, :, :1] + 1  # [batch, kv_head, 1]: o
        end = rows[:, None, :] + 1 - origin  # [batch, kv_head, row]
        idx = torch.div(end, geo.stride, rounding_mode="floor").clamp(
            0, geo.block_used.shape[-1] - 1
        )
        used = cand.gather(-1, idx[..., None])[..., 0]
        ok = (torch.remainder(end, geo.stride) == 0) & used
        return self._repeat_kv(idx, 1)[..., None], self._repeat_kv(ok, 1)[..., None]

    def _ranked(
        self,
        gate: Float[Tensor, "batch head row block"],
        cand: Bool[Tensor, "batch kv_head row block"],
        fidx: Int[Tensor, "batch head row 1"],
        fok: Bool[Tensor, "batch head row 1"],
    ) -> Float[Tensor, "batch head row block"]:
        """The gate with ``-inf`` off the ranked candidates (used blocks, less the forced one);
        the candidate mask is broadcast over a KV head's query heads, never repeated."""
        b, h, r, nb = gate.shape
        g = cand.shape[1]
        gate = gate.reshape(b, g, h // g, r, nb).masked_fill(~cand[:, :, None], float("-inf"))
        gate = gate.reshape(b, h, r, nb)
        own = gate.gather(-1, fidx)  # gate is masked_fill's fresh copy: written in place
        return gate.scatter_(-1, fidx, own.masked_fill(fok, float("-inf")))

    def _select(
        self,
        gate: Float[Tensor, "batch head row block"],
        fidx: Int[Tensor, "batch head row 1"],
        fok: Bool[Tensor, "batch head row 1"],
    ) -> tuple[Int[Tensor, "batch head row sel"], Bool[Tensor, "batch head row sel"]]:
        """Kept block indices (top-k of the gate, then the forced block) and which are real."""
        n = gate.shape[-1]
        val, top = top_k_latest(gate, n if self.keep_all else min(self.n_keep(n), n))
        idx = torch.cat([top, fidx], -1)
        ok = torch.cat([val > float("-inf"), fok], -1)
        if not self.hook_route_selected.has_hooks():
            return idx, ok
        # the selection as a mask, through the hook (an ablation may change it), and back
        mask = gate.new_zeros(gate.shape).scatter_add(-1, idx, ok.to(gate.dtype)) > 0
        mask = self.hook_route_selected(mask)
        n_max = max(1, int(mask.sum(-1).max()))
        val, idx = mask.to(gate.dtype).topk(n_max, dim=-1)
        return idx, val > 0

    def _kept_tokens(
        self,
        idx: Int[Tensor, "batch head row sel"],
        ok: Bool[Tensor, "batch head row sel"],
        geo: Geometry,
        rows: Int[Tensor, "batch row"],
        seq: int,
    ) -> tuple[Int[Tensor, "batch head row m"], Bool[Tensor, "batch head row m"]]:
        """Positions of the kept blocks' tokens and which to attend: real tokens (in the
        sequence, not padding, not the sink), not already in the raw band, not already in a
        kept block; then the sink's tokens, each attended from its position on until the raw
        band reaches it."""
        d, length = geo.stride, geo.block_len
        # block i of offset o covers [i*d + o - l, i*d + o - 1]; block_last[..., 0] = o - 1
        origin = self._repeat_kv(geo.block_last[:, :, :1] + 1, 1)[..., None]  # [b, h, 1, 1]
        if length > d:  # overlapping blocks: sort, so a token's first holder is the earlier one
            idx = torch.where(ok, idx, -1)
            idx, order = idx.sort(-1)
            ok = ok.gather(-1, order)
        start = idx * d + origin - length  # [batch, head, row, sel]
        slot = torch.arange(length, device=idx.device)
        pos = start[..., None] + slot  # [batch, head, row, sel, slot]
        # causal even under a hooked selection: nothing after the query
        keep = ok[..., None] & (pos >= 0) & (pos <= rows[:, None, :, None, None])
        raw_start = self._repeat_kv(at_rows(geo.raw_start, rows), 1)  # [batch, head, row]
        keep &= pos < raw_start[..., None, None]
        if length > d:
            prev_last = torch.where(ok, idx * d + origin - 1, -1)[..., :-1]
            prev_last = torch.cat([torch.full_like(idx[..., :1], -1), prev_last], -1)
            keep &= pos > prev_last[..., None]
        b = torch.arange(pos.shape[0], device=pos.device)[:, None, None, None, None]
        if geo.key_valid is not None:
            keep &= geo.key_valid[b, pos.clamp(0, seq - 1)]
        if geo.sink is None:
            return pos.flatten(-2), keep.flatten(-2)
        keep &= ~geo.sink[b, pos.clamp(0, seq - 1)]
        sink = geo.sink_pos[:, None, None, :].expand(*idx.shape[:3], -1)  # [b, h, row, n]
        seen = (sink <= rows[:, None, :, None]) & (sink < raw_start[..., None])
        return torch.cat([pos.flatten(-2), sink], -1), torch.cat([keep.flatten(-2), seen], -1)

    # ------------------------------------------------------------------ shared by rules
    def _block_key_scores(
        self,
        k_blk: Float[Tensor, "batch kv_head block d_head"],
        q: Float[Tensor, "batch pos head d_head"],
        rows: Int[Tensor, "batch row"],
    ) -> Float[Tensor, "batch head row block"]:
        """``q_t . K_b`` for per-block keys (route's mean key)."""
        return grouped_scores(query_rows(q, rows), k_blk)

    def _slot_scores(
        self,
        q: Float[Tensor, "batch pos head d_head"],
        rows: Int[Tensor, "batch row"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
    ) -> Float[Tensor, "batch head row block slot"]:
        """``q_t . k_j`` for every slot of every block (``-inf`` on missing slots)."""
        scores = grouped_scores(query_rows(q, rows), k.transpose(1, 2))  # [b, h, row, key_pos]
        return self._at_slots(scores, geo, float("-inf"))

    def _at_slots(
        self, x: Float[Tensor, "batch head row key_pos"], geo: Geometry, fill: float
    ) -> Float[Tensor, "batch head row block slot"]:
        """``x`` at every slot of every block, ``fill`` on missing slots."""
        tiled = tiled_slots(x, geo, fill)
        if tiled is not None:
            return tiled
        b, h, r, seq = x.shape
        nb, sl = geo.slot_pos.shape[2:]
        slot_pos = self._repeat_kv(geo.slot_pos.clamp(0, seq - 1), 1).reshape(b, h, 1, nb * sl)
        per_slot = x.gather(-1, slot_pos.expand(-1, -1, r, -1)).reshape(b, h, r, nb, sl)
        return per_slot.masked_fill(~self._repeat_kv(geo.slot_valid, 1)[:, :, None], fill)
