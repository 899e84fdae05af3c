"""Visibility, block scope, dtypes, cache behaviour and padded phase labels."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DESIGNS,
    full_window_scope,
    make_hooked,
    make_model,
    one_branch,
    randomize_compressors,
    tokens,
)

from phasemech import CompressionConfig, PhaseTransformer, phase_attention
from phasemech.core.grid import build_geometry


@pytest.mark.parametrize("design", ["mean", "gated", "mlp"])
def test_strict_and_inclusive_differ_without_overlap(design):
    """At l = d with W = 0 a query in the last slot of its block reads that block compressed
    (inclusive: an empty tail, as in GLM-5.3's k-pool) or raw (strict)."""
    x = tokens(seq=32)
    outs = {}
    for vis in ("inclusive", "strict"):
        model = make_model(design, stride=4, window=0, visibility=vis)
        randomize_compressors(model)
        outs[vis] = model(x)
    last_slot = torch.arange(3, 32, 4)
    assert not torch.allclose(outs["inclusive"][:, last_slot], outs["strict"][:, last_slot])
    # layer 0 differs only at last slots; with two layers the difference spreads onwards,
    # but positions 0..2 (no complete block yet under either rule) are identical
    torch.testing.assert_close(outs["inclusive"][:, :3], outs["strict"][:, :3])


def test_inclusive_last_slot_has_empty_tail():
    off = torch.zeros(1, 1, dtype=torch.long)
    geo = build_geometry(off, 16, 4, 4, 0, "inclusive")
    t = 7  # last slot of block [4, 7]
    assert not geo.band_valid[0, 0, t].any()
    used = torch.nonzero(geo.block_used[0, 0, t]).flatten().tolist()
    assert used == [1, 2]  # blocks ending at 3 and 7
    strict = build_geometry(off, 16, 4, 4, 0, "strict")
    assert strict.band_valid[0, 0, t].sum() == 4 and strict.block_used[0, 0, t].sum() == 1


@pytest.mark.parametrize("design", ["mean", "gated", "mlp"])
def test_block_scope_all_keeps_blocks_inside_the_window(design):
    """DeepSeek-V4 style: compressed entries of every complete block plus the raw window."""
    model_out = make_model(design, stride=4, window=8)
    model_all = make_model(design, stride=4, window=8, block_scope="all")
    x = tokens(seq=24)
    model_all.set_use_token_pattern(True)
    _, cache = model_all.run_with_cache(x)
    pattern = cache["blocks.0.attn.hook_pattern"]
    # query 23 sees all 6 complete blocks (ends 3, 7, ..., 23) under "all"
    assert int((pattern[..., : 24 // 4 + 1] > 0)[0, 0, 23].sum()) == 6
    assert not torch.allclose(model_out(x), model_all(x))
    tp = cache["blocks.0.attn.hook_token_pattern"]
    torch.testing.assert_close(tp.sum(-1), torch.ones_like(tp.sum(-1)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("design", DESIGNS)
def test_half_precision_models_run(design, dtype):
    hooked = make_hooked(dtype=dtype)
    comp = CompressionConfig(design, stride=4, window=24, **full_window_scope(design))
    model = PhaseTransformer.from_hooked(hooked, comp)
    one_branch(model, 2)  # nsa: its window branch alone
    model.set_use_token_pattern(True)
    x = tokens(seq=24)
    logits, cache = model.run_with_cache(x)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert cache["blocks.1.attn.hook_token_pattern"].dtype == dtype
    # a window covering the sequence equals the dense model up to half-precision rounding
    torch.testing.assert_close(logits.float(), hooked(x).float(), atol=3e-2, rtol=3e-2)
    short = PhaseTransformer.from_hooked(hooked, CompressionConfig(design, stride=4, window=4))
    assert torch.isfinite(short(x).float()).all()


def test_run_with_cache_skips_token_pattern_unless_asked():
    model = make_model("mlp", stride=4)
    x = tokens()
    _, cache = model.run_with_cache(x)
    assert "blocks.0.attn.hook_token_pattern" not in cache
    assert "blocks.0.attn.hook_z" in cache
    _, cache = model.run_with_cache(x, names_filter=lambda n: n.endswith("token_pattern"))
    assert cache["blocks.0.attn.hook_token_pattern"].shape == (2, 4, 24, 24)
    model.set_use_token_pattern(True)
    _, cache = model.run_with_cache(x)
    assert "blocks.1.attn.hook_token_pattern" in cache


def test_reference_grid_is_anchored_at_the_first_real_token():
    """Left padding must not relabel phases, on dense layers and on the reference grid."""
    model = make_model("mean", stride=4, window=4, layers=(1,))
    x = tokens(batch=1, seq=20)
    pad = 3
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(x)], dim=1)
    plain = phase_attention(model, x)
    shifted = phase_attention(model, padded, attention_mask=mask)
    torch.testing.assert_close(shifted.tensor, plain.tensor, atol=1e-5, rtol=0)
    ref_plain = phase_attention(model, x, reference_offset=1)
    ref_shifted = phase_attention(model, padded, attention_mask=mask, reference_offset=1)
    torch.testing.assert_close(ref_shifted.tensor, ref_plain.tensor, atol=1e-5, rtol=0)


def test_route_refuses_block_scope_all():
    with pytest.raises(ValueError, match="block_scope"):
        CompressionConfig("route", block_scope="all")


@pytest.mark.parametrize("vis", ["inclusive", "strict"])
def test_route_always_keeps_the_current_block(vis):
    """MoBA: the query's own block is always attended, even when it closes that block
    (inclusive, W = 0: nothing is left raw) and top-k would rank other blocks higher."""
    model = make_model("route", stride=4, window=0, visibility=vis, top_k=1)
    model.set_use_token_pattern(True)
    x = tokens(seq=32)
    _, cache = model.run_with_cache(x)
    for layer in range(2):
        pattern = cache[f"blocks.{layer}.attn.hook_token_pattern"]  # [.., pos, key_pos]
        self_mass = pattern.diagonal(dim1=-2, dim2=-1)
        assert (self_mass > 0).all()
        if vis == "inclusive":
            selected = cache[f"blocks.{layer}.attn.hook_route_selected"]
            # query 15 closes block 4 (tokens 12..15): forced, plus one ranked block
            assert selected[:, :, 15, 4].all()
            assert (selected[:, :, 15].sum(-1) == 2).all()


def test_route_reads_the_same_tokens_under_both_visibility_rules():
    """Route never compresses: forcing the closed current block makes inclusive and strict
    reach the same tokens (the pooled designs differ, see above)."""
    x = tokens(seq=32)
    a = make_model("route", stride=4, window=0, visibility="inclusive", top_k=1)(x)
    b = make_model("route", stride=4, window=0, visibility="strict", top_k=1)(x)
    torch.testing.assert_close(a, b)
