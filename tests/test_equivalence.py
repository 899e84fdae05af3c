"""Compression that compresses nothing is TransformerLens' own attention, to float rounding."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DESIGNS,
    N_CTX,
    full_window_scope,
    make_hooked,
    make_model,
    one_branch,
    tl_fields,
    tokens,
)
from transformer_lens import HookedTransformer, HookedTransformerConfig

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.attention import CompressedAttentionMixin
from phasemech.core.config import LOCAL_DESIGNS
from phasemech.model.transformer import quiet_tl_deprecation

VARIANTS = {
    "plain": {},
    "rotary": {"rotary": True},
    "gqa": {"gqa": True},
    "mlp_blocks": {"attn_only": False},
    "rotary_gqa_mlp": {"rotary": True, "gqa": True, "attn_only": False},
    "split_qkv_gqa": {"gqa": True, "use_split_qkv_input": True},
    "attn_result": {"use_attn_result": True},
    "ungrouped_gqa": {"gqa": True, "ungroup_grouped_query_attention": True},
    # OLMo-2's QK-norm over whole projected vectors and OLMo's clip, before rotary
    "olmo_qk_norm_clip": {
        "rotary": True,
        "normalization_type": "RMS",
        "original_architecture": "Olmo2ForCausalLM",
        "clip_qkv": 0.05,
    },
    # Gemma-2's alternation: a sliding-window layer (6 keys) is compressed with its window or,
    # in the designs that do not compose with one, left dense
    "local_global": {"use_local_attn": True, "window_size": 6, "attn_types": ["global", "local"]},
    "shortformer_softcap": {
        "positional_embedding_type": "shortformer",
        "attn_scores_soft_cap": 5.0,
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_design_none_is_hooked_transformer(variant):
    kw = VARIANTS[variant]
    ours = make_model("none", **kw)
    with quiet_tl_deprecation():
        theirs = HookedTransformer(HookedTransformerConfig(**tl_fields(**kw))).eval()
    assert not any(isinstance(b.attn, CompressedAttentionMixin) for b in ours.blocks)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for name, p in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], p, atol=0, rtol=0, msg=name)
    x = tokens(2, 20)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("design", DESIGNS)
def test_full_window_equals_hooked_transformer(design, variant):
    """On sequences no longer than the window every past token is raw and no block is used.
    (``window >= n_ctx`` itself is refused: such a model could never compress.)"""
    kw = VARIANTS[variant]
    # float64: the designs sum the same terms in another order, and float32 rounding of that
    # order depends on the CPU's kernels (1.1e-6 on one machine, under 1e-6 on another)
    tl_model = make_hooked(dtype=torch.float64, **kw)
    # (at n_ctx the last queries do read blocks: enough for route to rank more than top_k)
    block_len = {"kpool": 3, "dsa": 3, "hca": 3, "csa": 6}.get(design, 4)  # disjoint pools, series
    # a sliding-window layer composes with the designs that read the shared geometry alone
    layers = (0,) if variant == "local_global" and design not in LOCAL_DESIGNS else None
    comp = CompressionConfig(
        design,
        stride=3,
        block_len=block_len,
        window=N_CTX - 12,
        layers=layers,
        **full_window_scope(design),
    )
    model = PhaseTransformer.from_hooked(tl_model, comp).eval()
    one_branch(model, 2)  # nsa: its window branch alone (its other branches are its own)
    compressed = [isinstance(b.attn, CompressedAttentionMixin) for b in model.blocks]
    assert compressed == ([True, False] if layers else [True, True])
    x = tokens(2, N_CTX - 12, seed=1)
    expected = tl_model(x)
    logits, cache = model.run_with_cache(x)
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, expected, atol=1e-12, rtol=0)
    # the parameterised designs' compressors exist but are unused here
    for i in range(model.cfg.n_layers):
        assert cache[f"blocks.{i}.attn.hook_z"].shape[2] == model.cfg.n_heads
    # the TL model itself is untouched
    torch.testing.assert_close(tl_model(x), expected, atol=0, rtol=0)


@pytest.mark.parametrize("design", DESIGNS)
def test_from_hooked_keeps_weights_and_hooks(design):
    tl_model = make_hooked(gqa=True)
    model = PhaseTransformer.from_hooked(tl_model, CompressionConfig(design, stride=4))
    ours = model.state_dict()
    for name, p in tl_model.state_dict().items():
        torch.testing.assert_close(ours[name], p, atol=0, rtol=0, msg=name)
    names = set(model.hook_dict)
    assert set(tl_model.hook_dict) <= names
    for hook in ("hook_grid_offset", "hook_k_block", "hook_token_pattern", "hook_pattern"):
        assert f"blocks.0.attn.{hook}" in names


def test_uncompressed_layers_are_untouched():
    """``layers=(1,)``: layer 0 stays TL's module; its activations match the TL model."""
    tl_model = make_hooked()
    model = PhaseTransformer.from_hooked(tl_model, CompressionConfig("mean", stride=2, layers=(1,)))
    assert not isinstance(model.blocks[0].attn, CompressedAttentionMixin)
    assert isinstance(model.blocks[1].attn, CompressedAttentionMixin)
    x = tokens(1, 30)
    _, ours = model.run_with_cache(x)
    _, theirs = tl_model.run_with_cache(x)
    torch.testing.assert_close(
        ours["blocks.0.hook_resid_post"], theirs["blocks.0.hook_resid_post"], atol=1e-6, rtol=0
    )
    # and the compressed layer really does differ (stride 2, window 4 < 30 tokens)
    assert not torch.allclose(ours["blocks.1.attn.hook_z"], theirs["blocks.1.attn.hook_z"])


def test_stride_one_mean_equals_dense():
    """Stride 1 mean pooling: every block is one token, so attention is dense attention."""
    tl_model = make_hooked(rotary=True, gqa=True)
    for vis in ("inclusive", "strict"):
        comp = CompressionConfig("mean", stride=1, window=0, visibility=vis)
        model = PhaseTransformer.from_hooked(tl_model, comp)
        x = tokens(2, 25, seed=3)
        torch.testing.assert_close(model(x), tl_model(x), atol=1e-5, rtol=0)
