"""TransformerLens tools keep working on compressed models (hook_z keeps TL's shape)."""

import pytest
import torch
from conftest import make_model
from transformer_lens import patching

from phasemech import PhaseTransformer


def _model(design: str) -> PhaseTransformer:
    kw = dict(n_ctx=20, d_vocab=12, n_heads=2, d_model=16, seed=1)
    return make_model(design, stride=3, window=3, **kw)


@pytest.mark.parametrize("design", ["mean", "gated", "route"])
def test_stock_head_patching_runs_and_matches_manual_patch(design):
    model = _model(design)
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 12, (2, 20), generator=gen)
    corrupt = torch.randint(0, 12, (2, 20), generator=gen)
    _, clean_cache = model.run_with_cache(clean)

    def metric(logits):
        return logits[:, -1, 0].mean()

    out = patching.get_act_patch_attn_head_out_all_pos(model, corrupt, clean_cache, metric)
    assert out.shape == (2, 2)

    # manual: patch head 1 of layer 1's hook_z with the clean value
    def hook(z, hook):
        z[:, :, 1] = clean_cache["blocks.1.attn.hook_z"][:, :, 1]
        return z

    manual = metric(model.run_with_hooks(corrupt, fwd_hooks=[("blocks.1.attn.hook_z", hook)]))
    assert torch.allclose(out[1, 1], manual, atol=1e-6)


def test_attn_result_and_head_stacking():
    model = _model("gated")
    model.set_use_attn_result(True)
    tokens = torch.randint(0, 12, (2, 20))
    logits, cache = model.run_with_cache(tokens)
    result = cache["blocks.1.attn.hook_result"]
    assert result.shape == (2, 20, 2, 16)
    out = cache["blocks.1.hook_attn_out"]
    torch.testing.assert_close(result.sum(-2) + model.blocks[1].attn.b_O, out)
    stacked = cache.stack_head_results(layer=-1)
    assert stacked.shape == (4, 2, 20, 16)


def test_names_filter_and_start_at_layer():
    model = _model("mean")
    tokens = torch.randint(0, 12, (2, 20))
    logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("resid_pre"))
    assert all(k.endswith("resid_pre") for k in cache.keys())
    again = model(cache["blocks.1.hook_resid_pre"], start_at_layer=1)
    torch.testing.assert_close(again, logits)


def test_cache_options_remove_batch_dim_and_pos_slice():
    model = make_model("gated", stride=3, window=3, n_ctx=20, d_vocab=12, gqa=True)
    tokens = torch.randint(0, 12, (1, 20))
    _, full = model.run_with_cache(tokens)
    _, single = model.run_with_cache(tokens, remove_batch_dim=True)
    for name in ("hook_grid_offset", "hook_k_block", "hook_block_weights", "hook_z"):
        key = f"blocks.1.attn.{name}"
        torch.testing.assert_close(single[key], full[key][0])
    _, last = model.run_with_cache(tokens, pos_slice=-1)
    # position-free hooks keep every axis; positional ones keep the last position only
    for name in ("hook_grid_offset", "hook_k_block", "hook_v_block", "hook_block_weights"):
        key = f"blocks.1.attn.{name}"
        torch.testing.assert_close(last[key], full[key])
    torch.testing.assert_close(last["blocks.1.attn.hook_z"], full["blocks.1.attn.hook_z"][:, -1:])
