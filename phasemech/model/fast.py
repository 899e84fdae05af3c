"""Fast paths for TransformerLens' dense attention and LayerNorm when nothing is hooked.

Axes: ``batch, pos, head, d_head, d_model``.

TransformerLens computes LayerNorm in five elementwise steps (so that ``hook_scale`` and
``hook_normalized`` exist) and dense attention through an explicit score matrix, a causal mask
and a NaN scrub (so that ``hook_attn_scores`` and ``hook_pattern`` exist). In training nothing
is attached to those hooks, and the two cost a small model most of its step time beyond the
plain-PyTorch equivalent (``bench/train_step.py``); a block also normalises its input three
times (once each for Q, K and V). The classes here are TransformerLens'
own modules with one change: in training mode, when none of the hooks that only the slow path
can feed is attached, ``forward`` runs the fused kernel (``F.layer_norm``,
``F.scaled_dot_product_attention``) and feeds every other hook as before (``hook_q``,
``hook_k``, ``hook_v``, ``hook_z`` still
run). With any such hook attached (``run_with_cache``, patching, ablation) the module runs
TransformerLens' own code, unchanged; in eval mode too, so every analysis reads
TransformerLens' exact arithmetic (the fused kernels agree with it to float rounding, ~1e-6,
not bit for bit). A model is switched by swapping module classes in place:
the same parameters, names and hook points.

``use_eval_sdpa`` is the eval-mode counterpart for dense attention only (``Attention`` and
``GroupedQueryAttention``, a KV cache included): the audit's prefill and uncompressed forwards
(``phasemech audit``) run through SDPA while no score, pattern or result hook is attached;
with one attached (the per-head attention read-out) TransformerLens' own forward runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.components import (
    Attention,
    GroupedQueryAttention,
    LayerNorm,
    TransformerBlock,
)
from transformer_lens.components.transformer_block import POST_NORM_ARCHITECTURES as _POST_NORM

from phasemech.attention.projection import fused_qkv


class FastLayerNorm(LayerNorm):
    """``LayerNorm`` with a fused forward in training while ``hook_scale`` and
    ``hook_normalized`` are free."""

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        if (
            not self.training
            or self.hook_scale.has_hooks()
            or self.hook_normalized.has_hooks()
            or self.cfg.dtype not in (torch.float32, torch.float64)
        ):
            return super().forward(x)
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)


def _routed_forward(
    self,
    query_input: Tensor,
    key_input: Tensor,
    value_input: Tensor,
    past_kv_cache_entry=None,
    additive_attention_mask=None,
    attention_mask=None,
    position_bias=None,
) -> Float[Tensor, "batch pos d_model"]:
    """TransformerLens' attention signature: the class's ``_fast`` path where ``_fast_ok``
    allows it, else TransformerLens' own forward (``_tl_forward``)."""
    kw = dict(
        past_kv_cache_entry=past_kv_cache_entry,
        additive_attention_mask=additive_attention_mask,
        attention_mask=attention_mask,
        position_bias=position_bias,
    )
    if not self._fast_ok(kw):
        return self._tl_forward(query_input, key_input, value_input, **kw)
    return self._fast(query_input, key_input, value_input, past_kv_cache_entry)


class FastAttention(Attention):
    """Dense causal ``Attention`` through SDPA in training while its score, pattern and result
    hooks are free."""

    def _fast_ok(self, kw: dict) -> bool:
        return (
            self.training
            and all(kw.get(k) is None for k in kw)
            and _plain_attention(self, ("standard", "shortformer"))
        )

    def _fast(self, query_input, key_input, value_input, past_kv_cache_entry):
        q, k, v = fused_qkv(self, query_input, key_input, value_input)
        z = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=1.0 / self.attn_scale,
        )
        return _project_out(self, z.transpose(1, 2))

    forward = _routed_forward
    _tl_forward = Attention.forward


_QK_NORM_ARCHS = ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")


class FastBlock(TransformerBlock):
    """A pre-norm ``TransformerBlock`` that normalises its input once for Q, K and V in training
    (TransformerLens applies ``ln1`` three times, to three copies of the same residual; the
    results are equal, and one tensor lets attention fuse its Q/K/V projection). Every block
    hook still runs; with a hook on ``ln1``, in eval mode or for any other block layout,
    TransformerLens' own forward runs."""

    def _fast_ok(self, shortformer_pos_embed, past_kv_cache_entry) -> bool:
        c = self.cfg
        return (
            self.training
            and shortformer_pos_embed is None
            and past_kv_cache_entry is None
            and not c.use_attn_in
            and not c.use_split_qkv_input
            and not c.parallel_attn_mlp
            and not c.use_normalization_before_and_after
            and c.original_architecture not in _POST_NORM
            and not any(h.has_hooks() for h in self.ln1.modules() if hasattr(h, "has_hooks"))
        )

    def forward(
        self, resid_pre, shortformer_pos_embed=None, past_kv_cache_entry=None, attention_mask=None
    ) -> Float[Tensor, "batch pos d_model"]:
        if not self._fast_ok(shortformer_pos_embed, past_kv_cache_entry):
            return super().forward(
                resid_pre, shortformer_pos_embed, past_kv_cache_entry, attention_mask
            )
        resid_pre = self.hook_resid_pre(resid_pre)
        x = self.ln1(resid_pre)
        attn_out = self.hook_attn_out(self.attn(x, x, x, attention_mask=attention_mask))
        if self.cfg.attn_only:
            return self.hook_resid_post(resid_pre + attn_out)
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_in = self.hook_mlp_in(resid_mid.clone()) if self.cfg.use_hook_mlp_in else resid_mid
        return self.hook_resid_post(resid_mid + self.apply_mlp(self.ln2(mlp_in)))


def use_fast_modules(model: nn.Module) -> int:
    """Swap every plain ``LayerNorm``, dense ``Attention`` and ``TransformerBlock`` for its fast
    subclass, in place (same parameters and hooks); the number of modules swapped."""
    n = 0
    for module in model.modules():
        if type(module) is LayerNorm:
            module.__class__ = FastLayerNorm
            n += 1
        elif type(module) is Attention:
            module.__class__ = FastAttention
            n += 1
        elif type(module) is TransformerBlock:
            module.__class__ = FastBlock
            n += 1
    return n


def _plain_attention(self, positional: tuple[str, ...]) -> bool:
    """Nothing reads the scores, pattern or per-head result, and no attention feature that
    SDPA's plain causal softmax would miss (a sliding window, soft-cap, sinks, QK-norm, log-n
    scaling, ...)."""
    c = self.cfg
    return (
        getattr(self, "attn_type", "global") != "local"
        and not self.hook_attn_scores.has_hooks()
        and not self.hook_pattern.has_hooks()
        and not self.hook_result.has_hooks()
        and not c.use_attn_result
        and c.positional_embedding_type in positional
        and (self._attention_dir_override or c.attention_dir) == "causal"
        and c.attn_scores_soft_cap <= 0
        and not c.use_attention_sinks
        and not c.use_qk_norm
        and not getattr(c, "use_logn_attn", False)
        and c.clip_qkv is None
        and not c.load_in_4bit
        and c.original_architecture not in _QK_NORM_ARCHS
    )


def _project_out(
    self, z: Float[Tensor, "batch pos head d_head"]
) -> Float[Tensor, "batch pos d_model"]:
    """``hook_z`` then the output projection, as one matmul over heads."""
    z = self.hook_z(z)
    w = self.W_O.reshape(-1, self.W_O.shape[-1]).T  # [d_model, head * d_head]
    return F.linear(z.reshape(z.shape[0], z.shape[1], -1), w, self.b_O)


def _sdpa_ok(self, kw: dict) -> bool:
    mask = kw["attention_mask"]
    return (
        not self.training
        and kw["additive_attention_mask"] is None
        and kw["position_bias"] is None
        and (mask is None or bool(mask.bool().all()))
        and _plain_attention(self, ("standard", "shortformer", "rotary"))
    )


def _sdpa_fast(self, query_input, key_input, value_input, past_kv_cache_entry):
    """Eval-mode SDPA, a KV cache's past included (rotary at the right positions, GQA)."""
    q, k, v = self.calculate_qkv_matrices(query_input, key_input, value_input)
    past = 0 if past_kv_cache_entry is None else past_kv_cache_entry.past_keys.shape[1]
    if past_kv_cache_entry is not None:
        k, v = past_kv_cache_entry.append(k, v)
    if self.cfg.positional_embedding_type == "rotary":
        q = self.hook_rot_q(self.apply_rotary(q, past, None))
        k = self.hook_rot_k(self.apply_rotary(k, 0, None))
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rep = qh.shape[1] // kh.shape[1]
    if rep > 1:  # grouped-query attention: head i reads KV head i // rep
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    n, total = qh.shape[2], kh.shape[2]
    mask = None  # no past: plain causal; with a past, row i sees keys <= past + i
    if past:
        keys = torch.arange(total, device=qh.device)
        mask = keys[None, :] <= past + torch.arange(n, device=qh.device)[:, None]
    z = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=not past, scale=1.0 / self.attn_scale
    )
    return _project_out(self, z.transpose(1, 2))


class EvalSDPAAttention(Attention):
    """Dense causal ``Attention`` through SDPA in eval mode (a KV cache included) while nothing
    reads its scores or pattern: what an audit's prefill and uncompressed forwards need. Any
    score/pattern/result hook, a padding mask or an unusual attention feature falls back to
    TransformerLens' own forward."""

    _fast_ok = _sdpa_ok
    _fast = _sdpa_fast
    forward = _routed_forward
    _tl_forward = Attention.forward


class EvalSDPAGroupedQueryAttention(GroupedQueryAttention):
    """``EvalSDPAAttention`` for grouped-query attention (head ``i`` reads KV head ``i // rep``)."""

    _fast_ok = _sdpa_ok
    _fast = _sdpa_fast
    forward = _routed_forward
    _tl_forward = GroupedQueryAttention.forward


def use_eval_sdpa(model: nn.Module) -> int:
    """Swap every plain dense ``Attention`` / ``GroupedQueryAttention`` (compressed layers are
    left alone) for its eval-mode SDPA subclass, in place; the number swapped."""
    n = 0
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = EvalSDPAAttention
            n += 1
        elif type(module) is GroupedQueryAttention:
            module.__class__ = EvalSDPAGroupedQueryAttention
            n += 1
    return n


#: weights TransformerLens transposes (``.T.contiguous()``) before each ``F.linear``
_TRANSPOSED = ("W_U", "W_gate", "W_in", "W_out")
#: attention weights it rearranges ``head d_model d_head -> (head d_head) d_model`` per call
_HEAD_MAJOR = ("W_Q", "W_K", "W_V", "_W_K", "_W_V")


def linear_layout(model: nn.Module) -> int:
    """Store, in place, the weights TransformerLens copies into ``F.linear``'s layout on every
    forward (the unembedding and a gated MLP's matrices: ``W.T.contiguous()``; the Q/K/V
    projections: a rearrange) already in that layout, so the per-call copy is a view. Same
    values, same shapes and names, the same contiguous operand reaches ``F.linear``: outputs
    are bit for bit the same. On SmolLM2 the unembedding's copy alone is 113 MB per forward.
    Returns the number of tensors moved."""
    n = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name in _TRANSPOSED and p.ndim == 2 and not p.T.is_contiguous():
                p.data = p.data.T.contiguous().T
            elif name in _HEAD_MAJOR and p.ndim == 3 and not p.transpose(1, 2).is_contiguous():
                p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)
            else:
                continue
            n += 1
    return n


__all__ = [
    "EvalSDPAAttention",
    "EvalSDPAGroupedQueryAttention",
    "FastAttention",
    "FastBlock",
    "FastLayerNorm",
    "linear_layout",
    "use_eval_sdpa",
    "use_fast_modules",
]
