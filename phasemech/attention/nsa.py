"""``nsa``: Native Sparse Attention's three branches, mixed per head by sigmoid gates (NSA, 2025).

Axes: ``batch, pos`` (query), ``key_pos``, ``head``, ``kv_head``, ``block`` (a compressed entry
of the grid: stride ``d``, length ``l``), ``sel`` (a selection block of length ``l'``),
``branch`` (``cmp, slc, win``), ``d_head``. For query ``t`` of head ``h``::

    o_t = sum_c g_c * Attn(q_t, K_c, V_c),   c in {cmp, slc, win}
    g = sigmoid(x_t W_branch[h] + b_branch[h])     one gate per head and branch, from the input
    g = sigmoid(SiLU(x_t W_gate_in + b_gate_in) W_branch[h] + b_branch[h])   (``gate_hidden``)

* **compressed** (``cmp``): the ``mlp`` design's compressor (an MLP over each flattened block
  of ``l`` of the branch's post-RoPE keys / values every ``d`` tokens, with intra-block
  position embeddings),
  attended over every complete block (``block_scope="all"``; NSA has no exclusion, the window
  is a branch of its own). A query with no complete block yet gets a zero output.
* **selection** (``slc``): selection blocks of ``l'`` tokens on the same grid offset, block
  ``j`` covering ``[j*l' + o - l', j*l' + o - 1]``. A block's importance is the compressed
  branch's attention on the compressed blocks that share a token with it, summed over the query
  heads of a KV group (NSA's shared selection under GQA). The initial block (the first holding
  a real token) and the two local ones (the query's own and the one before) are forced; the
  ``top_k`` most important of the rest are added (ties to the later block). The query attends
  the selected blocks' tokens up to itself, with the branch's own keys and values. Selection
  has no gradient.
* **window** (``win``): the raw window ``[r_t, t]`` of :mod:`phasemech.core.grid`: ``W`` tokens,
  stretched back to the query's incomplete block.

Each branch has its own softmax, so a token can be reached by two branches. As in NSA each
branch has its own keys and values (against shortcut learning between branches): the compressed
and selection branches project theirs from the layer input (``W_K_branch``, ``W_V_branch``
``[branch, kv_head, d_model, d_head]``, keys rotated with RoPE), the window uses the layer's own
(TransformerLens' ``W_K``, ``W_V``). A gate is one linear map and a sigmoid by default; NSA's
paper says "an MLP and sigmoid activation" without the MLP's size, which ``gate_hidden = n``
gives (one hidden layer of ``n`` SiLU units shared by the heads). Hooks:
``hook_branch_gate`` ``[batch, pos, head, branch]``, ``hook_branch_z``
``[batch, pos, head, branch, d_head]`` (each branch's output before its gate, so an output
splits exactly into branches), ``hook_cmp_pattern`` ``[batch, head, pos, block]``,
``hook_route_scores`` ``[batch, head, pos, sel]`` (importance, ``-inf`` off the ranked
candidates), ``hook_route_selected`` ``[batch, head, pos, sel]`` (a hook may change the
selection), ``hook_slc_pattern`` and ``hook_win_pattern`` ``[batch, head, pos, key_pos]``.
``hook_token_pattern`` is ``g_cmp p_cmp A + g_slc p_slc + g_win p_win``: an approximation (the
MLP's ``A`` is a gradient attribution, and the gates do not sum to one), so
``token_pattern_exact`` is ``False``.

Every branch is computed on ``[pos, key_pos]`` (``O(T^2)`` memory, as dense attention): NSA is
a trained design for the from-scratch lab, where contexts are short. It does not read a KV cache
(its gates and selection would need the prefill's queries).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities.activation_functions import apply_softcap

from phasemech.attention.mlp import MLPCompressorAttention
from phasemech.attention.rows import masked_softmax
from phasemech.attention.selection import top_k_latest
from phasemech.core.grid import Geometry

BRANCHES = ("cmp", "slc", "win")
#: local selection blocks forced per query: its own and the one before (NSA forces 2)
N_LOCAL = 2


class NSAAttention(MLPCompressorAttention):
    design = "nsa"
    token_pattern_exact = False

    def __init__(self, cfg, attn_type: str = "global", layer_id: int | None = None):
        super().__init__(cfg, attn_type, layer_id)
        comp = self.cfg.compression
        self.select_len: int = comp.select_len
        self.top_k: int = comp.top_k
        h, m = self.cfg.n_heads, self.cfg.d_model
        std = self.cfg.initializer_range if self.cfg.initializer_range > 0 else 0.02
        gen = self._generator()
        #: the gate MLP's hidden width (None: one linear map from the input)
        self.gate_hidden: int | None = comp.gate_hidden
        if self.gate_hidden is not None:
            n = self.gate_hidden
            self.W_gate_in = nn.Parameter(
                (torch.randn(m, n, generator=gen) * std).to(self.cfg.dtype)
            )
            self.b_gate_in = nn.Parameter(torch.zeros(n, dtype=self.cfg.dtype))
        gate_in = m if self.gate_hidden is None else self.gate_hidden  # what W_branch reads
        self.W_branch = nn.Parameter(
            (torch.randn(h, gate_in, len(BRANCHES), generator=gen) * std).to(self.cfg.dtype)
        )
        self.b_branch = nn.Parameter(torch.zeros(h, len(BRANCHES), dtype=self.cfg.dtype))
        # NSA gives each branch its own keys and values (against shortcut learning between
        # branches): the compressed and selection branches project their own from the input,
        # the window reads the layer's (TransformerLens') keys and values
        g, dh = self.n_kv_heads, self.cfg.d_head
        shape = (2, g, m, dh)  # [branch (cmp, slc), kv_head, d_model, d_head]
        self.W_K_branch = nn.Parameter((torch.randn(shape, generator=gen) * std).to(self.cfg.dtype))
        self.W_V_branch = nn.Parameter((torch.randn(shape, generator=gen) * std).to(self.cfg.dtype))
        self.hook_branch_gate = HookPoint()  # [batch, pos, head, branch]
        self.hook_branch_z = HookPoint()  # [batch, pos, head, branch, d_head]
        self.hook_cmp_pattern = HookPoint()  # [batch, head, pos, block]
        self.hook_route_scores = HookPoint()  # [batch, head, pos, sel]
        self.hook_route_selected = HookPoint()  # [batch, head, pos, sel]
        self.hook_slc_pattern = HookPoint()  # [batch, head, pos, key_pos]
        self.hook_win_pattern = HookPoint()  # [batch, head, pos, key_pos]

    # ------------------------------------------------------------------ pieces
    def branch_gates(self, x: Tensor) -> Float[Tensor, "batch pos head branch"]:
        """``sigmoid(x W_branch + b_branch)`` per query head, ``x`` first through the hidden
        layer with ``gate_hidden`` (split-QKV input: head ``h`` reads its KV head's copy)."""
        if self.gate_hidden is not None:
            x = F.silu(x @ self.W_gate_in.to(x.dtype) + self.b_gate_in.to(x.dtype))
        w = self.W_branch.to(x.dtype)
        if x.ndim == 4:
            x = self._repeat_kv(x, 2)
            logits = torch.einsum("bphm,hmc->bphc", x, w)
        else:
            logits = torch.einsum("bpm,hmc->bphc", x, w)
        return torch.sigmoid(logits + self.b_branch.to(x.dtype))

    def branch_kv(
        self, x: Tensor, branch: int, key_valid: Tensor | None
    ) -> tuple[
        Float[Tensor, "batch pos kv_head d_head"], Float[Tensor, "batch pos kv_head d_head"]
    ]:
        """The keys (rotated, with RoPE, at TransformerLens' positions) and values of branch
        ``branch`` (0: compressed, 1: selection), projected from the layer input."""
        eq = "bpgm,gmd->bpgd" if x.ndim == 4 else "bpm,gmd->bpgd"
        k = torch.einsum(eq, x, self.W_K_branch[branch].to(x.dtype))
        v = torch.einsum(eq, x, self.W_V_branch[branch].to(x.dtype))
        if self.cfg.positional_embedding_type == "rotary":
            mask = None if key_valid is None else key_valid.long()
            k = self.apply_rotary(k, 0, mask)
        return k, v

    def _softmax(
        self, scores: Float[Tensor, "... key"], visible: Bool[Tensor, "... key"]
    ) -> Float[Tensor, "... key"]:
        """TransformerLens' scale and soft-cap, then a softmax over visible keys (zero rows
        where nothing is visible)."""
        scores = apply_softcap(scores / self.attn_scale, self.cfg.attn_scores_soft_cap)
        return masked_softmax(scores, visible)

    def selection_blocks(
        self, geo: Geometry, seq: int
    ) -> tuple[Int[Tensor, "batch kv_head key_pos"], int]:
        """The selection block of every position (``floor((j - o) / l') + 1``) and their count."""
        origin = geo.block_last[:, :, :1] + 1  # [batch, kv_head, 1]: the grid offset o
        pos = torch.arange(seq, device=origin.device)
        sel = torch.div(pos - origin, self.select_len, rounding_mode="floor") + 1
        return sel, -(-seq // self.select_len) + 1

    def importance(
        self,
        p_cmp: Float[Tensor, "batch head pos block"],
        geo: Geometry,
        sel_of: Int[Tensor, "batch kv_head key_pos"],
        n_sel: int,
    ) -> Float[Tensor, "batch kv_head pos sel"]:
        """Compressed attention carried to the selection blocks that share a token with each
        compressed block, summed over a KV group's query heads."""
        b, g, nb, _ = geo.slot_pos.shape
        seq = sel_of.shape[-1]
        held = geo.slot_pos.clamp(0, seq - 1)
        owner = sel_of.gather(-1, held.flatten(2)).reshape(held.shape)  # [b, g, block, slot]
        share = p_cmp.new_zeros(b, g, nb, n_sel)
        share.scatter_add_(-1, owner, geo.slot_valid.to(p_cmp.dtype))
        share = share.clamp(max=1)  # 1 where they share a real token
        group = p_cmp.unflatten(1, (g, -1)).sum(2)  # [batch, kv_head, pos, block]
        return group @ share

    def select(
        self,
        score: Float[Tensor, "batch kv_head pos sel"],
        sel_of: Int[Tensor, "batch kv_head key_pos"],
        key_valid: Tensor | None,
    ) -> Bool[Tensor, "batch head pos sel"]:
        """Forced blocks plus the ``top_k`` best ranked candidates (through the hooks)."""
        b, g, seq, n_sel = score.shape
        j = torch.arange(n_sel, device=score.device)
        real = torch.ones(b, seq, dtype=torch.bool, device=score.device)
        if key_valid is not None:
            real = key_valid.to(score.device)
        # the first real token of each selection block (seq: none); a candidate once it is <= t
        pos = torch.arange(seq, device=score.device).expand(b, g, seq)
        first = torch.full((b, g, n_sel), seq, dtype=torch.long, device=score.device)
        first = first.scatter_reduce(
            -1, sel_of, torch.where(real[:, None], pos, seq), "amin", include_self=True
        )
        t = torch.arange(seq, device=score.device)
        open_ = first[:, :, None, :] <= t[:, None]  # [batch, kv_head, pos, sel]
        own = sel_of[:, :, :, None]  # the query's own selection block
        initial = (first < seq).int().argmax(-1)[:, :, None, None]
        forced = (j == initial) | ((j <= own) & (j > own - N_LOCAL))
        forced &= open_
        ranked = score.masked_fill(~open_ | forced, float("-inf"))
        ranked = self.hook_route_scores(self._repeat_kv(ranked, 1))  # a hook may re-rank
        val, top = top_k_latest(ranked, min(self.top_k, n_sel))
        chosen = torch.zeros_like(ranked, dtype=torch.bool).scatter(-1, top, val > float("-inf"))
        return self.hook_route_selected(chosen | self._repeat_kv(forced, 1))

    # ------------------------------------------------------------------ forward
    def attend(self, x, q, k, v, geo):
        if x is None:
            raise ValueError("nsa's branch gates need the layer input")
        seq = q.shape[1]
        k_c, v_c = self.branch_kv(x, 0, geo.key_valid)  # the compressed branch's own K and V
        k_blk, v_blk, weights = self.pool(x, k_c, v_c, geo)  # [batch, kv_head, block, d_head]
        k_blk = self.hook_k_block(k_blk.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        v_blk = self.hook_v_block(v_blk.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        qh = q.transpose(1, 2)  # [batch, head, pos, d]
        kh = self._repeat_kv(k.transpose(1, 2), 1)
        vh = self._repeat_kv(v.transpose(1, 2), 1)
        # compressed branch
        s_cmp = qh @ self._repeat_kv(k_blk, 1).transpose(-1, -2)
        p_cmp = self.hook_cmp_pattern(self._softmax(s_cmp, self._repeat_kv(geo.block_used, 1)))
        z_cmp = p_cmp @ self._repeat_kv(v_blk, 1)
        # selection branch: which blocks, from the compressed attention (no gradient)
        sel_of, n_sel = self.selection_blocks(geo, seq)
        score = self.importance(p_cmp.detach(), geo, sel_of, n_sel)
        chosen = self.select(score, sel_of, geo.key_valid)  # [batch, head, pos, sel]
        k_s, v_s = self.branch_kv(x, 1, geo.key_valid)  # the selection branch's own K and V
        s_slc = qh @ self._repeat_kv(k_s.transpose(1, 2), 1).transpose(-1, -2)
        t = torch.arange(seq, device=q.device)
        causal = t[None, :] <= t[:, None]
        if geo.key_valid is not None:
            causal = causal & geo.key_valid[:, None, None, :].to(causal.device)
        sel_keys = self._repeat_kv(sel_of, 1)[:, :, None, :].expand(-1, -1, seq, -1)
        slc_vis = chosen.gather(-1, sel_keys) & causal
        p_slc = self.hook_slc_pattern(self._softmax(s_slc, slc_vis))
        z_slc = p_slc @ self._repeat_kv(v_s.transpose(1, 2), 1)
        # window branch: the layer's own keys and values
        win_vis = causal & (t[None, :] >= self._repeat_kv(geo.raw_start, 1)[..., None])
        p_win = self.hook_win_pattern(self._softmax(qh @ kh.transpose(-1, -2), win_vis))
        branch_z = torch.stack([z_cmp, z_slc, p_win @ vh], -2)  # [b, h, pos, branch, d]
        branch_z = self.hook_branch_z(branch_z.transpose(1, 2))
        gates = self.hook_branch_gate(self.branch_gates(x))  # [batch, pos, head, branch]
        z = (gates[..., None] * branch_z).sum(-2)
        token_pattern = None
        if self._token_pattern_wanted():
            if weights is None:
                weights = self.block_attribution(x, k_c, v_c, geo)
            a = self._repeat_kv(self._blocks_to_tokens(weights, geo, seq), 1)
            gh = gates.permute(0, 2, 1, 3)[..., None]  # [batch, head, pos, branch, 1]
            token_pattern = gh[..., 0, :] * (p_cmp @ a) + gh[..., 1, :] * p_slc
            token_pattern = token_pattern + gh[..., 2, :] * p_win
        return z, token_pattern

    def attend_many(self, x, q, k, v, geo, rows):
        """Every row is computed (the branches are ``[pos, key_pos]`` anyway); ``rows`` are
        read out of the result."""
        z, token_pattern = self.attend(x, q, k, v, geo)
        ar = torch.arange(q.shape[0], device=q.device)[:, None]
        if token_pattern is not None:
            token_pattern = token_pattern.transpose(1, 2)[ar, rows].transpose(1, 2)
        return z[ar, rows], token_pattern
