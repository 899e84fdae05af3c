"""``phase_attention``: attention mass per (layer, head, source phase)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from conftest import make_hooked, make_model, randomize_compressors, tokens

from phasemech import PhaseAttention, phase_attention

STRIDE = 4


def _model(design="gated", **kw):
    kw = dict(dict(stride=STRIDE, window=2, offsets="per_head", gqa=True), **kw)
    model = make_model(design, **kw)
    randomize_compressors(model, seed=5)
    return model


def _rows_sum_to_one(tensor):
    torch.testing.assert_close(tensor.sum(-1), torch.ones(tensor.shape[:-1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("design", ["mean", "gated", "mlp", "route"])
def test_shape_and_rows(design):
    model = _model(design)
    res = phase_attention(model, tokens(3, 30))
    assert isinstance(res, PhaseAttention)
    assert res.tensor.shape == (model.cfg.n_layers, model.cfg.n_heads, STRIDE)
    assert res.kind == "query_mean" and res.pairs is None and res.stride == STRIDE
    _rows_sum_to_one(res.tensor)
    assert (res.counts == 3 * 30).all()
    assert set(res.frame.columns) >= {"layer", "head", "phase", "mass", "n", "exact", "kind"}
    assert res.frame.exact.all() == (design != "mlp")
    assert len(res.frame) == model.cfg.n_layers * model.cfg.n_heads * STRIDE


@pytest.mark.parametrize("design", ["mean", "route"])
def test_tokens_path_equals_cache_path(design):
    model = _model(design, layers=(1,))  # layer 0 dense: hook_pattern, reference grid
    x = tokens(2, 26)
    res = phase_attention(model, x)
    model.set_use_token_pattern(True)
    _, cache = model.run_with_cache(x)
    res_cache = phase_attention(model, cache=cache)
    torch.testing.assert_close(res.tensor, res_cache.tensor, atol=1e-6, rtol=0)
    assert torch.equal(res.counts, res_cache.counts)
    pd.testing.assert_frame_equal(res.frame, res_cache.frame)
    # by hand: layer 1 head 3, query mean of the token pattern grouped by that head's phase
    tp = cache["blocks.1.attn.hook_token_pattern"]
    off = cache["blocks.1.attn.hook_grid_offset"]  # [batch, kv_head]
    h, g = 3, 3 // (model.cfg.n_heads // model.cfg.n_kv_heads)
    by_hand = torch.zeros(STRIDE)
    for b in range(2):
        for k in range(26):
            by_hand[(k - int(off[b, g])) % STRIDE] += tp[b, h, :, k].sum()
    torch.testing.assert_close(res.tensor[1, h], by_hand / (2 * 26), atol=1e-5, rtol=0)
    # dense layer 0: hook_pattern on the reference grid (offset 0)
    pat = cache["blocks.0.attn.hook_pattern"]
    dense = torch.stack([pat[..., p::STRIDE].sum(-1).mean((0, 2)) for p in range(STRIDE)], -1)
    torch.testing.assert_close(res.tensor[0], dense, atol=1e-5, rtol=0)


def test_cache_without_token_pattern_raises():
    model = _model("mean")
    _, cache = model.run_with_cache(tokens(1, 10), names_filter=lambda n: "token" not in n)
    with pytest.raises(ValueError, match="set_use_token_pattern"):
        phase_attention(model, cache=cache)


def test_pair_mode_by_hand():
    model = _model("gated")
    model.set_use_token_pattern(True)
    x = tokens(3, 30)
    qp = torch.tensor([[29, 20, 15], [12, 12, 28], [7, 25, 25]])
    kp = torch.tensor([[3, 20, 4], [5, 9, 0], [7, 1, 17]])
    res = phase_attention(model, x, query_pos=qp, key_pos=kp)
    assert res.kind == "pair"
    _, cache = model.run_with_cache(x)
    n_heads, group = model.cfg.n_heads, model.cfg.n_heads // model.cfg.n_kv_heads
    for layer in range(model.cfg.n_layers):
        tp = cache[f"blocks.{layer}.attn.hook_token_pattern"]
        off = cache[f"blocks.{layer}.attn.hook_grid_offset"]
        for h in range(n_heads):
            sums, counts = [0.0] * STRIDE, [0] * STRIDE
            for b in range(3):
                for q, k in zip(qp[b].tolist(), kp[b].tolist(), strict=True):
                    phase = (k - int(off[b, h // group])) % STRIDE
                    sums[phase] += float(tp[b, h, q, k])
                    counts[phase] += 1
            for phi in range(STRIDE):
                assert int(res.counts[layer, h, phi]) == counts[phi]
                got = float(res.tensor[layer, h, phi])
                if counts[phi] == 0:
                    assert math.isnan(got)
                else:
                    assert got == pytest.approx(sums[phi] / counts[phi], abs=1e-6)
    # one row per (layer, head, sequence, pair) with the raw mass
    pairs = res.pairs
    assert len(pairs) == model.cfg.n_layers * n_heads * qp.numel()
    sel = (pairs.layer == 1) & (pairs["head"] == 2) & (pairs.sequence == 2) & (pairs.pair == 1)
    row = pairs[sel]
    tp1 = cache["blocks.1.attn.hook_token_pattern"]
    assert row.mass.item() == pytest.approx(float(tp1[2, 2, 25, 1]), abs=1e-6)
    assert (row.query_pos.item(), row.key_pos.item()) == (25, 1)


def test_pair_mode_single_pair_per_sequence_and_nan():
    model = _model("mean", offsets="aligned", gqa=False)
    x = tokens(2, 20)
    res = phase_attention(model, x, query_pos=torch.tensor([19, 18]), key_pos=[4, 8])
    # both targets have phase 0 on the aligned grid: the other phases have no pair
    assert (res.counts[..., 0] == 2).all() and (res.counts[..., 1:] == 0).all()
    assert torch.isnan(res.tensor[..., 1:]).all()
    assert torch.isfinite(res.tensor[..., 0]).all()


def test_pair_mode_errors():
    model = _model("mean")
    x = tokens(2, 20)
    with pytest.raises(ValueError, match="after its query"):
        phase_attention(model, x, query_pos=[3, 4], key_pos=[5, 1])
    with pytest.raises(ValueError, match="needs query_pos"):
        phase_attention(model, x, key_pos=[5, 1])
    with pytest.raises(ValueError, match="key_pos"):
        phase_attention(model, x, query_pos=[10, 10], key_pos=[20, 1])
    with pytest.raises(ValueError, match="batch=2"):
        phase_attention(model, x, query_pos=[10, 10, 10], key_pos=[1, 1, 1])
    with pytest.raises(ValueError, match="exactly one"):
        phase_attention(model)
    with pytest.raises(ValueError, match="reference_offset"):
        phase_attention(model, x, reference_offset=STRIDE)
    with pytest.raises(ValueError, match="layers"):
        phase_attention(model, x, layers=[2])


def test_reference_offset_relabels_per_head_phases():
    model = _model("mean", gqa=False)  # per_head offsets 0, 1, 2, 3
    x = tokens(2, 28)
    own = phase_attention(model, x)
    ref0 = phase_attention(model, x, reference_offset=0)
    assert not torch.allclose(own.tensor, ref0.tensor)
    # head h has offset h: its own phase phi is reference phase (phi + h) mod d
    for h in range(4):
        torch.testing.assert_close(
            ref0.tensor[:, h], torch.roll(own.tensor[:, h], shifts=h, dims=-1), atol=1e-6, rtol=0
        )
    ref1 = phase_attention(model, x, reference_offset=1)
    torch.testing.assert_close(ref1.tensor, torch.roll(ref0.tensor, -1, -1), atol=1e-6, rtol=0)
    # head 0 has offset 0: its own grid is reference grid 0
    torch.testing.assert_close(own.tensor[:, 0], ref0.tensor[:, 0], atol=0, rtol=0)


def test_shift_grid_moves_phase_labels():
    model = _model("mean", gqa=False, offsets="aligned")
    x = tokens(2, 24)
    with model.shift_grid(1):
        shifted = phase_attention(model, x)  # labels from hook_grid_offset (offset 1)
        ref1 = phase_attention(model, x, reference_offset=1)
        ref0 = phase_attention(model, x, reference_offset=0)
    torch.testing.assert_close(shifted.tensor, ref1.tensor, atol=1e-6, rtol=0)
    # the labels really moved: on the aligned grid the same masses are rolled by one phase
    torch.testing.assert_close(ref0.tensor.roll(-1, dims=-1), ref1.tensor, atol=1e-6, rtol=0)
    assert not torch.allclose(ref0.tensor, ref1.tensor)
    # and the same tokens on a shifted grid are a different computation
    assert not torch.allclose(model(x), _run_shift(model, x, 1))


def _run_shift(model, x, k):
    with model.shift_grid(k):
        return model(x)


def _fake_phase0_cache(model, batch=2, seq=16, offset=0):
    """A head that attends only to phase-0 tokens, uniformly."""
    cache = {}
    for layer in range(model.cfg.n_layers):
        keys = torch.arange(seq)
        phase0 = ((keys - offset) % STRIDE == 0)[None, :] & (keys[None, :] <= keys[:, None])
        m = phase0.float()
        rows = m.sum(-1, keepdim=True)
        # a query with no phase-0 token in its past attends to itself only (phase != 0)
        m = torch.where(rows > 0, m / rows.clamp(min=1), torch.eye(seq))
        cache[f"blocks.{layer}.attn.hook_token_pattern"] = m.expand(
            batch, model.cfg.n_heads, seq, seq
        )
        cache[f"blocks.{layer}.attn.hook_grid_offset"] = torch.full(
            (batch, model.cfg.n_kv_heads), offset
        )
    return cache


def test_fake_cache_phase0_head():
    model = _model("mean", gqa=False, offsets="aligned")
    res = phase_attention(model, cache=_fake_phase0_cache(model))
    expected = torch.zeros(STRIDE)
    expected[0] = 1.0
    for layer in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            torch.testing.assert_close(res.tensor[layer, h], expected, atol=1e-6, rtol=0)
    # the model's own offset (read from the cache) is honoured (queries 0, 1 have no phase-0
    # token before them on a grid of offset 2: skip them)
    later = list(range(2, 16))
    res2 = phase_attention(model, cache=_fake_phase0_cache(model, offset=2), query_pos=later)
    torch.testing.assert_close(res2.tensor, res.tensor, atol=1e-6, rtol=0)
    # on another reference grid the same mass lands on phase 2
    res3 = phase_attention(
        model, cache=_fake_phase0_cache(model, offset=2), query_pos=later, reference_offset=0
    )
    torch.testing.assert_close(res3.tensor, res.tensor.roll(2, -1), atol=1e-6, rtol=0)
    # one query position only
    res4 = phase_attention(model, cache=_fake_phase0_cache(model), query_pos=[9])
    assert (res4.counts == 2).all() and (res4.tensor[..., 0] == 1).all()


def test_attention_mask_skips_padding_queries():
    model = _model("gated")
    x = tokens(2, 20)
    mask = torch.ones_like(x)
    mask[0, :6] = 0
    res = phase_attention(model, x, attention_mask=mask)
    _rows_sum_to_one(res.tensor)
    assert (res.counts == 2 * 20 - 6).all()
    alone = phase_attention(model, x[1:])
    both = phase_attention(model, x[:1, 6:])
    # padded sequence 0 equals its unpadded self (grid anchored at the first real token)
    expected = (alone.tensor * 20 + both.tensor * 14) / 34
    torch.testing.assert_close(res.tensor, expected, atol=1e-5, rtol=0)


def test_layers_subset_and_table():
    model = _model("gated")
    res = phase_attention(model, tokens(2, 20), layers=[1])
    assert res.tensor.shape == (1, model.cfg.n_heads, STRIDE)
    table = res.table()
    assert list(table.index) == [f"L1H{h}" for h in range(model.cfg.n_heads)]
    assert list(table.columns) == list(range(STRIDE))
    full = phase_attention(model, tokens(2, 20))
    t1 = full.table(layer=1)
    assert t1.shape == (model.cfg.n_heads, STRIDE)
    torch.testing.assert_close(torch.tensor(t1.values, dtype=torch.float32), full.tensor[1])
    torch.testing.assert_close(res.tensor[0], full.tensor[1], atol=1e-6, rtol=0)
    assert full.table().shape == (model.cfg.n_layers * model.cfg.n_heads, STRIDE)


def test_plain_hooked_transformer():
    model = make_hooked()
    with pytest.raises(ValueError, match="stride"):
        phase_attention(model, tokens(1, 12))
    res = phase_attention(model, tokens(2, 12), stride=3)
    assert res.tensor.shape == (2, 4, 3)
    _rows_sum_to_one(res.tensor)


def test_pair_table_keeps_empty_phases():
    """Phases without any pair stay in the table as NaN columns (head x phase, always)."""
    model = _model("mean", offsets="aligned", gqa=False)
    res = phase_attention(model, tokens(2, 20), query_pos=torch.tensor([19, 18]), key_pos=[4, 8])
    table = res.table()
    assert table.shape == (model.cfg.n_layers * model.cfg.n_heads, STRIDE)
    assert list(table.columns) == list(range(STRIDE))
    assert table[0].notna().all() and table[[1, 2, 3]].isna().all().all()


def test_layers_order_and_duplicates():
    """``tensor`` rows follow ``layers`` in the order given; repeated layers are rejected."""
    model = _model("mean")
    x = tokens(2, 20)
    full = phase_attention(model, x)
    rev = phase_attention(model, x, layers=[1, 0])
    torch.testing.assert_close(rev.tensor, full.tensor.flip(0), atol=1e-6, rtol=0)
    assert torch.equal(rev.counts, full.counts.flip(0))
    with pytest.raises(ValueError, match="repeats"):
        phase_attention(model, x, layers=[0, 0])
