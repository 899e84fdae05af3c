"""The fused training paths (``phasemech.model.fast``) compute what TransformerLens' modules
compute, feed the hooks they keep, and step aside whenever a hook needs the slow path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformer_lens.components import Attention, LayerNorm

from phasemech.core.config import CompressionConfig
from phasemech.data.tasks import MQARTask, training_batch
from phasemech.measure.readout import answer_logits
from phasemech.model import fast
from phasemech.model.fast import FastAttention, FastBlock, FastLayerNorm
from phasemech.training.config import ModelSpec, TrainConfig


def _model(design: str = "gated", offsets: str = "aligned", attn_only: bool = True):
    cfg = TrainConfig(
        task=MQARTask(vocab_size=32, seq_len=32, n_pairs=4, stride=4),
        model=ModelSpec(d_model=32, n_heads=2, attn_only=attn_only),
        compression=CompressionConfig(design, stride=4, layers=(1,), offsets=offsets),
        seed=1,
    )
    return cfg.build_model(), training_batch(cfg.task, 8, 0, 0)


def _loss_and_grads(model, batch):
    tokens, qp, ans = batch
    model.zero_grad()
    loss = F.cross_entropy(answer_logits(model, tokens, qp).flatten(0, 1), ans.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _slow(model):
    """Force TransformerLens' own code: a no-op hook on every score/pattern/LN hook."""
    names = ("hook_pattern", "hook_scale", "hook_normalized")
    return model.hooks(fwd_hooks=[(lambda n: n.endswith(names), lambda t, hook: t)])


def test_modules_are_swapped_in_place():
    model, _ = _model()
    assert type(model.blocks[0].attn) is FastAttention  # the dense layer
    assert type(model.blocks[1]) is FastBlock
    assert type(model.blocks[0].ln1) is FastLayerNorm and type(model.ln_final) is FastLayerNorm
    assert isinstance(model.blocks[0].attn, Attention) and isinstance(model.ln_final, LayerNorm)
    assert "blocks.0.attn.hook_pattern" in model.hook_dict


@pytest.mark.parametrize(
    "design, offsets, attn_only",
    [("none", "aligned", True), ("gated", "aligned", True), ("mean", "aligned", True),
     ("mlp", "aligned", True), ("gated", "per_head", True), ("mean", "random", True),
     ("gated", "aligned", False)],
)  # fmt: skip
def test_fast_training_step_equals_the_hooked_path(design, offsets, attn_only):
    """Fused LN, QKV and SDPA, one ln1 per block, the dense short-context layout of compressed
    layers and the shared-grid slot gather, against TransformerLens' modules and the banded
    layout (hooked)."""
    model, batch = _model(design, offsets, attn_only)
    model.train()
    torch.manual_seed(0)  # random offsets: the same draw on both paths
    loss_fast, grads_fast = _loss_and_grads(model, batch)
    torch.manual_seed(0)
    with _slow(model):
        loss_slow, grads_slow = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss_fast, loss_slow, atol=1e-5, rtol=1e-5)
    for name, g in grads_slow.items():
        torch.testing.assert_close(grads_fast[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_fast_path_runs_only_in_training_without_hooks(monkeypatch):
    calls = []
    real = fast.F.scaled_dot_product_attention
    monkeypatch.setattr(
        fast.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    model, (tokens, _, _) = _model()
    model.train()
    model(tokens)
    assert len(calls) == 1  # the one dense layer
    with _slow(model):
        model(tokens)
    model.eval()
    model(tokens)
    assert len(calls) == 1  # hooked, and eval mode: TransformerLens' own path


def test_kept_hooks_still_fire_on_the_fast_path():
    model, (tokens, _, _) = _model()
    model.train()
    seen = []
    hooks = [("blocks.0.attn.hook_z", lambda t, hook: seen.append(t.shape) or t * 0)]
    with model.hooks(fwd_hooks=hooks):
        out = model(tokens)
    assert seen == [torch.Size([8, 32, 2, 16])]
    # zeroing z changed the output: the hook's return value is used
    assert not torch.allclose(out, model(tokens))


@pytest.mark.parametrize("design", ["gated", "mean"])
def test_dense_layout_respects_padding(design):
    """A left-padded batch in training mode: the dense layout masks pad keys as the band does."""
    model, (tokens, _, _) = _model(design)
    model.train()
    mask = torch.ones_like(tokens)
    mask[:3, :5] = 0  # three sequences left-padded by 5
    fast_out = model(tokens, attention_mask=mask)
    with _slow(model):
        slow_out = model(tokens, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(fast_out[real], slow_out[real], atol=1e-5, rtol=1e-5)


def test_training_projects_qkv_once_per_layer(monkeypatch):
    """One ln1 per block hands attention one tensor, so Q/K/V take the fused projection instead
    of TransformerLens' three; hooks on q, k and v still see their tensors."""
    from transformer_lens.components.abstract_attention import AbstractAttention

    calls = []
    real = AbstractAttention.calculate_qkv_matrices
    monkeypatch.setattr(
        AbstractAttention, "calculate_qkv_matrices", lambda *a: calls.append(1) or real(*a)
    )
    model, (tokens, _, _) = _model()
    model.train()
    seen = []
    names = ("hook_q", "hook_k", "hook_v")
    with model.hooks(fwd_hooks=[(lambda n: n.endswith(names), lambda t, hook: seen.append(t))]):
        model(tokens)
    assert calls == [] and len(seen) == 6
    model.eval()
    model(tokens)
    assert len(calls) == 2  # eval: TransformerLens' projections, one call per layer
