"""``dsa``: GLM-5.3's DeepSeek-Sparse-Attention with the k-pool indexer (a learned selector).

Axes: ``batch, pos, key_pos, head, kv_head, idx`` (an indexer head), ``row``, ``block`` (a pool
of ``d`` tokens on the grid), ``slot``, ``d_head``. A small indexer scores the pools; the main
attention reads the raw tokens of the ``top_k`` best pools with the raw band (the window, or
only the query's own pool's tail at ``W = 0``) and the pool the query closes, through the
selecting designs' engine (:mod:`phasemech.attention.selection`). From the layer input ``x``::

    q_i(t) = x_t W_iq[i],   w_i(t) = x_t W_iw[i],   k(j) = x_j W_ik     (rotated, with RoPE)
    k_pool(b) = sum_{j in b} softmax_j(x_j W_ig + B[slot(j)]) k(j)     gated pooling
    score(t, b) = sum_i w_i(t) ReLU(q_i(t) . k_pool(b))

``B [slot]`` is the indexer's learned intra-pool position bias: literally a phase preference.
One score per query serves every head (the real indexer picks tokens for all heads of MLA).

Selection has no gradient, so the indexer is trained by one of (``indexer_train``):

* ``"kl"`` (DSA): an auxiliary loss ``KL(p_main || softmax(score))`` over a set of each query's
  pools, ``p_main`` the main attention's mass on each pool (each head's attention restricted
  to the set and renormalised, summed over the heads, renormalised; detached); computed in
  training mode only and collected by
  :meth:`phasemech.model.transformer.PhaseTransformer.auxiliary_loss`. The set follows DSA's
  two stages: during the dense warm-up (``selection_warmup``: every pool is read) it is every
  ranked candidate; in the sparse stage it is the ``top_k`` pools the indexer selected, so the
  indexer learns to order what it keeps (at ``top_k = 1`` the term is zero there);
* ``"end_to_end"`` (phasemech's own option, not DSA's): a straight-through path: each kept
  token's attention logit gets ``score - score.detach()`` (zero, so the forward is unchanged),
  so the main loss reaches the indexer through the pools it kept.

One departure from DSA: its dense warm-up freezes a pretrained model and trains the indexer
alone; from scratch there is no trained model to freeze, so the warm-up trains the whole model
densely while the KL (on a detached input) trains the indexer beside it.

The indexer reads the layer input, which a KV cache does not keep: no decode regime.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from jaxtyping import Bool, Float, Int
from torch import Tensor

from phasemech.attention.rows import query_rows
from phasemech.attention.selection import SelectingAttention, top_k_latest
from phasemech.core.grid import Geometry


class DSAAttention(SelectingAttention):
    design = "dsa"

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        comp = self.cfg.compression
        self.indexer_train: str = comp.indexer_train
        m, dh, n_idx, sl = self.cfg.d_model, self.cfg.d_head, comp.index_heads, self.block_len
        std = self.cfg.initializer_range if self.cfg.initializer_range > 0 else 0.02
        gen = self._generator()

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter((torch.randn(shape, generator=gen) * std).to(self.cfg.dtype))

        self.W_iq = param(n_idx, m, dh)  # indexer queries
        self.W_ik = param(m, dh)  # the one indexer key (shared by the indexer heads)
        self.W_iw = param(m, n_idx)  # per-query head weights
        self.W_ig = param(m)  # the pooling gate
        self.pool_bias = nn.Parameter(torch.zeros(sl, dtype=self.cfg.dtype))
        #: the last training forward's KL term (``indexer_train="kl"``), else ``None``
        self.aux_loss: Tensor | None = None
        self._summary: tuple[Tensor, Tensor, Tensor] | None = None  # handed to the selection

    # ------------------------------------------------------------------ the indexer
    def indexer(
        self, x: Float[Tensor, "batch pos d_model"], geo: Geometry
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(k_pool [batch, kv_head, block, d_head], q [batch, pos, idx, d_head],
        w [batch, pos, idx])``: the pooled indexer keys on each KV head's grid, and every
        position's indexer queries and head weights."""
        if x.ndim == 4:  # split-QKV input: the indexer reads the first KV head's copy
            x = x[:, :, 0]
        q = torch.einsum("bpm,imd->bpid", x, self.W_iq.to(x.dtype))
        k = torch.einsum("bpm,md->bpd", x, self.W_ik.to(x.dtype))[:, :, None]
        if self.cfg.positional_embedding_type == "rotary":
            q, k = self.apply_rotary(q, 0, None), self.apply_rotary(k, 0, None)
        g = geo.slot_pos.shape[1]
        z = (x @ self.W_ig.to(x.dtype))[:, :, None, None].expand(-1, -1, g, 1)
        logits = self._gather_slots(z, geo)[..., 0] + self.pool_bias.to(x.dtype)
        valid = geo.slot_valid
        alpha = torch.softmax(logits.masked_fill(~valid, torch.finfo(x.dtype).min), -1) * valid
        self.hook_block_weights(alpha)  # [batch, kv_head, block, slot]
        slots = self._gather_slots(k.expand(-1, -1, g, -1), geo)  # [batch, kv_head, block, slot, d]
        k_pool = torch.einsum("bgns,bgnsd->bgnd", alpha, slots)
        w = torch.einsum("bpm,mi->bpi", x, self.W_iw.to(x.dtype))
        return k_pool, q, w

    def index_scores(
        self, summary: tuple[Tensor, Tensor, Tensor], rows: Int[Tensor, "batch row"]
    ) -> Float[Tensor, "batch kv_head row block"]:
        """``sum_i w_i(t) ReLU(q_i(t) . k_pool(b))`` at the query rows."""
        k_pool, q, w = summary
        q_rows = query_rows(q, rows)  # [batch, idx, row, d]
        w_rows = query_rows(w[..., None], rows)[..., 0]  # [batch, idx, row]
        dots = torch.einsum("bird,bgnd->bgirn", q_rows, k_pool).relu()
        return torch.einsum("bgirn,bir->bgrn", dots, w_rows)

    # ------------------------------------------------------------------ the engine's interface
    def block_summary(self, x, k, v, geo):
        if x is None:
            raise ValueError("dsa's indexer needs the layer input")
        if self._summary is not None:  # this forward's KL pass computed it already
            summary, self._summary = self._summary, None
            return summary
        return self.indexer(x, geo)

    def block_scores(self, summary, q, rows, k, geo):
        return self._repeat_kv(self.index_scores(summary, rows), 1)

    def kept_logit_bias(self, raw_gate: Tensor, idx: Tensor) -> Tensor | None:
        if self.indexer_train != "end_to_end" or not torch.is_grad_enabled():
            return None
        kept = raw_gate.gather(-1, idx)  # [batch, head, row, sel]
        return (kept - kept.detach()).masked_fill(~torch.isfinite(kept), 0.0)

    def attend(self, x, q, k, v, geo):
        self.aux_loss = None
        if self.training and self.indexer_train == "kl" and torch.is_grad_enabled():
            # the KL trains the indexer alone (DSA): its input is detached, and the selection
            # (no gradient) reuses the same indexer pass
            self._summary = self.indexer(x.detach(), geo)
            self.aux_loss = self.indexer_kl(self._summary, q, k, geo)
        return super().attend(x, q, k, v, geo)

    def kl_pools(
        self, score: Float[Tensor, "batch kv_head pos block"], geo: Geometry
    ) -> Bool[Tensor, "batch kv_head pos block"]:
        """The pools each query's KL covers: its ranked candidates (the block it closes is kept
        anyway, unranked) during the dense warm-up, or in DSA's sparse stage the ``top_k`` of
        them the indexer selected, by the engine's own rule (ties to the later pool)."""
        t = torch.arange(score.shape[2], device=score.device)
        closes = geo.block_last[:, :, None, :] == t[:, None]  # [batch, kv_head, pos, block]
        cand = geo.block_used & ~closes
        if self.keep_all:
            return cand
        n = score.shape[-1]
        ranked = score.detach().masked_fill(~cand, float("-inf"))
        val, top = top_k_latest(ranked, min(self.n_keep(n), n))
        return cand & torch.zeros_like(cand).scatter(-1, top, val > float("-inf"))

    def indexer_kl(
        self,
        summary: tuple[Tensor, Tensor, Tensor],
        q: Float[Tensor, "batch pos head d_head"],
        k: Float[Tensor, "batch pos kv_head d_head"],
        geo: Geometry,
    ) -> Tensor:
        """``KL(p_main || softmax(score))`` over each query's :meth:`kl_pools`, averaged over
        the unmasked queries that have one: DSA's indexer loss. ``p_main``: each head's
        attention restricted to those pools and renormalised (DSA's main attention reads only
        its set), summed over the KV group's heads and renormalised."""
        seq = q.shape[1]
        rows = torch.arange(seq, device=q.device).expand(q.shape[0], -1)
        score = self.index_scores(summary, rows)  # [batch, kv_head, pos, block]
        cand = self.kl_pools(score, geo)
        with torch.no_grad():
            t = torch.arange(seq, device=q.device)
            qh, kh = q.transpose(1, 2), self._repeat_kv(k.transpose(1, 2), 1)
            visible = (t[None, :] <= t[:, None]).expand(q.shape[0], 1, -1, -1)
            if geo.key_valid is not None:
                visible = visible & geo.key_valid[:, None, None, :]
            p = self._row_pattern(qh @ kh.transpose(-1, -2), visible)  # [b, h, pos, key]
            a = self._blocks_to_tokens(geo.slot_valid.to(p.dtype), geo, seq)  # [b, g, n, key]
            # [batch, kv_head, rep, pos, block]: each head's mass on its pools, renormalised
            per_head = p.unflatten(1, (cand.shape[1], -1)) @ a.transpose(-1, -2)[:, :, None]
            per_head = per_head * cand[:, :, None]
            per_head = per_head / per_head.sum(-1, keepdim=True).clamp(min=1e-30)
            mass = per_head.sum(2)
            total = mass.sum(-1, keepdim=True)
            target = mass / total.clamp(min=1e-30)
            rows_ok = cand.any(-1) & (total[..., 0] > 0)
            if geo.key_valid is not None:  # a masked query is no training row
                rows_ok &= geo.key_valid[:, None, :]
        # a finite fill: rows without a candidate stay finite (they are dropped below)
        logp = torch.log_softmax(score.masked_fill(~cand, torch.finfo(score.dtype).min), -1)
        kl = (target * (target.clamp(min=1e-30).log() - logp.masked_fill(~cand, 0.0))).sum(-1)
        return kl[rows_ok].mean() if bool(rows_ok.any()) else score.sum() * 0.0
