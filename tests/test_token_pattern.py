"""``hook_token_pattern``: attention per source token, exact where the design allows it."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, randomize_compressors, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from phasemech import CompressionConfig
from phasemech.attention import CompressedAttentionMixin

CASES = {
    "aligned": dict(stride=3, window=2),
    "per_head": dict(stride=4, window=5, offsets="per_head"),
    "overlap": dict(stride=3, block_len=5, window=0, offsets="per_head"),
    "strict": dict(stride=2, block_len=3, window=1, visibility="strict"),
    "gqa": dict(stride=3, block_len=4, window=4, offsets="per_head", gqa=True),
    "rotary_gqa": dict(stride=5, window=3, offsets=(1, 3), gqa=True, rotary=True),
    "split_qkv_gqa": dict(
        stride=3, window=2, offsets="per_head", gqa=True, use_split_qkv_input=True
    ),
}


def _model(design, case, **extra):
    kw = dict(CASES[case], **extra)
    if design == "route":
        kw.setdefault("top_k", 2)
    model = make_model(design, **kw)
    randomize_compressors(model, seed=2)
    model.set_use_token_pattern(True)
    return model


def _check_rows_sum_to_one(tp, query_ok=None):
    sums = tp.sum(-1)
    if query_ok is None:
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)
    else:
        ok = query_ok[:, None, :].expand_as(sums)
        torch.testing.assert_close(sums[ok], torch.ones_like(sums[ok]), atol=1e-5, rtol=0)
        assert (sums[~ok] == 0).all()


def _z_from_token_pattern(cache, layer, n_heads):
    tp = cache[f"blocks.{layer}.attn.hook_token_pattern"]
    v = cache[f"blocks.{layer}.attn.hook_v"]  # [batch, pos, kv_head, d_head]
    v = torch.repeat_interleave(v, n_heads // v.shape[2], dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", tp, v)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("design", ["mean", "gated", "route", "dsa", "partition"])
def test_token_pattern_reproduces_z(design, case):
    model = _model(design, case)
    x = tokens(2, 40, seed=5)
    _, cache = model.run_with_cache(x)
    for layer in range(model.cfg.n_layers):
        attn = model.blocks[layer].attn
        assert attn.token_pattern_exact
        tp = cache[f"blocks.{layer}.attn.hook_token_pattern"]
        assert tp.shape == (2, model.cfg.n_heads, 40, 40)
        assert (tp >= 0).all()
        assert (tp.triu(1) == 0).all()  # never the future
        _check_rows_sum_to_one(tp)
        z = cache[f"blocks.{layer}.attn.hook_z"]
        torch.testing.assert_close(
            _z_from_token_pattern(cache, layer, model.cfg.n_heads), z, atol=1e-5, rtol=0
        )


@settings(max_examples=25, deadline=None)
@given(
    design=st.sampled_from(["mean", "gated", "route"]),
    d=st.integers(1, 6),
    extra=st.integers(0, 3),
    window=st.integers(0, 10),
    visibility=st.sampled_from(["inclusive", "strict"]),
    offsets=st.sampled_from(["aligned", "per_layer", "per_head", 1]),
    gqa=st.booleans(),
    rotary=st.booleans(),
    seq=st.integers(1, 40),
    pad=st.integers(0, 6),
)
def test_token_pattern_exact_hypothesis(
    design, d, extra, window, visibility, offsets, gqa, rotary, seq, pad
):
    offsets = offsets if not isinstance(offsets, int) else min(offsets, d - 1)
    comp = CompressionConfig(
        design, stride=d, block_len=d + extra, window=window, visibility=visibility, offsets=offsets
    )
    model = make_model(compression=comp, gqa=gqa, rotary=rotary)
    randomize_compressors(model, seed=d)
    model.set_use_token_pattern(True)
    x = tokens(2, seq, seed=seq)
    mask = torch.ones_like(x)
    mask[0, : min(pad, seq)] = 0
    _, cache = model.run_with_cache(x, attention_mask=mask)
    for layer in range(model.cfg.n_layers):
        tp = cache[f"blocks.{layer}.attn.hook_token_pattern"]
        _check_rows_sum_to_one(tp, mask.bool())
        z = cache[f"blocks.{layer}.attn.hook_z"]
        torch.testing.assert_close(
            _z_from_token_pattern(cache, layer, model.cfg.n_heads), z, atol=1e-5, rtol=0
        )


def test_score_hook_can_mask_more():
    """A hook that sets scores to -inf removes those entries; a fully masked query gives zero
    output and no NaN."""
    model = make_model("gated", stride=3, window=2)
    model.set_use_token_pattern(True)

    def mask_all_but(value, hook):
        value = value.clone()
        value[:, 0, 10:] = float("-inf")  # head 0 sees nothing from query 10 on
        return value

    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_attn_scores", mask_all_but)]):
        logits, cache = model.run_with_cache(tokens(1, 20))
    assert torch.isfinite(logits).all()
    assert (cache["blocks.0.attn.hook_pattern"][0, 0, 10:] == 0).all()
    assert (cache["blocks.0.attn.hook_z"][0, 10:, 0] == 0).all()
    assert (cache["blocks.0.attn.hook_token_pattern"][0, 0, 10:] == 0).all()
    _check_rows_sum_to_one(cache["blocks.0.attn.hook_token_pattern"][:, 1:])


@pytest.mark.parametrize("case", ["per_head", "overlap", "gqa"])
@pytest.mark.parametrize(("design", "gate"), [("mlp", "scalar"), ("gated", "channel")])
def test_approximate_token_pattern_flagged_and_normalised(design, gate, case):
    model = _model(design, case, gate=gate)
    x = tokens(2, 30, seed=6)
    _, cache = model.run_with_cache(x)
    for layer in range(model.cfg.n_layers):
        assert model.blocks[layer].attn.token_pattern_exact is False
        tp = cache[f"blocks.{layer}.attn.hook_token_pattern"]
        assert (tp >= 0).all() and (tp.triu(1) == 0).all()
        _check_rows_sum_to_one(tp)


def test_gated_channel_flag_is_per_instance():
    scalar = _model("gated", "aligned")
    channel = _model("gated", "aligned", gate="channel")
    assert scalar.blocks[0].attn.token_pattern_exact is True
    assert channel.blocks[0].attn.token_pattern_exact is False


# ----------------------------------------------------------------- computed only when asked
@pytest.fixture
def unband_calls(monkeypatch):
    calls = []
    original = CompressedAttentionMixin._unband

    def counting(p):
        calls.append(p.shape)
        return original(p)

    monkeypatch.setattr(CompressedAttentionMixin, "_unband", staticmethod(counting))
    return calls


@pytest.mark.parametrize("design", ["mean", "gated", "mlp"])
def test_token_pattern_not_computed_by_default(design, unband_calls, monkeypatch):
    model = make_model(design, stride=3)
    assert model.cfg.use_token_pattern is False
    attribution = []
    if design == "mlp":
        cls = type(model.blocks[0].attn)
        original = cls.block_attribution
        monkeypatch.setattr(
            cls, "block_attribution", lambda *a: attribution.append(1) or original(*a)
        )
    x = tokens(1, 20)
    model(x)
    assert unband_calls == [] and attribution == []

    # run_with_cache filtered away from the token pattern: not computed, nothing breaks
    logits, cache = model.run_with_cache(x, names_filter=lambda n: "token_pattern" not in n)
    assert unband_calls == []
    assert not any("token_pattern" in k for k in cache.keys())
    assert "blocks.0.attn.hook_z" in cache
    torch.testing.assert_close(logits, model(x), atol=0, rtol=0)

    # a hook on it switches it on, for that layer only
    seen = []
    model.run_with_hooks(
        x, fwd_hooks=[("blocks.1.attn.hook_token_pattern", lambda v, hook: seen.append(v.shape))]
    )
    assert seen == [(1, model.cfg.n_heads, 20, 20)]
    assert len(unband_calls) == 1
    if design == "mlp":
        assert attribution == [1]

    # the flag switches it on everywhere
    unband_calls.clear()
    model.set_use_token_pattern(True)
    model(x)
    assert len(unband_calls) == model.cfg.n_layers
    model.set_use_token_pattern(False)
    model(x)
    assert len(unband_calls) == model.cfg.n_layers


def test_route_token_pattern_only_when_asked():
    model = make_model("route", stride=3)
    seen = []
    hook = ("blocks.0.attn.hook_token_pattern", lambda v, hook: seen.append(1))
    model.run_with_hooks(tokens(1, 20), fwd_hooks=[hook])
    assert seen == [1]
    # hooks removed, flag off: not wanted (attend returns no token pattern)
    assert not model.blocks[0].attn._token_pattern_wanted()
    model.set_use_token_pattern(True)
    assert model.blocks[0].attn._token_pattern_wanted()


# ----------------------------------------------------------------- padding and NaN
PAD_CASES = {
    "aligned": dict(stride=3, window=2),
    "overlap_per_head": dict(stride=4, block_len=6, window=0, offsets="per_head"),
    "gqa_rotary": dict(stride=3, window=4, gqa=True, rotary=True, offsets="per_head"),
    "strict_mlp_blocks": dict(
        stride=2, block_len=3, window=1, visibility="strict", attn_only=False
    ),
}


def _left_padded(seq=28, pads=(0, 5, 11, 27)):
    x = tokens(len(pads), seq, seed=9)
    mask = torch.ones_like(x)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        x[b, :p] = 0  # pad id: any valid id
    return x, mask


@pytest.mark.parametrize("case", PAD_CASES)
@pytest.mark.parametrize("design", ["mean", "gated", "mlp", "route", "dsa"])
def test_left_padding_no_nan(design, case):
    model = _model_pad(design, case)
    model.train()  # gradients too
    x, mask = _left_padded()
    logits, cache = model.run_with_cache(x, attention_mask=mask)
    assert torch.isfinite(logits).all()
    for name, value in cache.items():
        if value.is_floating_point():
            assert not torch.isnan(value).any(), name
    for layer in range(model.cfg.n_layers):
        tp = cache[f"blocks.{layer}.attn.hook_token_pattern"]
        _check_rows_sum_to_one(tp, mask.bool())
        assert (tp * (1 - mask)[:, None, None, :] == 0).all()  # padding is never attended
        scores = cache[f"blocks.{layer}.attn.hook_attn_scores"]
        assert not torch.isnan(scores).any()
    loss = model(x, attention_mask=mask, return_type="loss")
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


def _model_pad(design, case):
    kw = dict(PAD_CASES[case])
    model = make_model(design, **kw)
    randomize_compressors(model, seed=3)
    model.set_use_token_pattern(True)
    return model


@pytest.mark.parametrize("case", PAD_CASES)
@pytest.mark.parametrize(
    "design", ["mean", "gated", "mlp", "route", "nsa", "dsa", "csa", "hca", "partition"]
)
def test_left_padding_matches_unpadded(design, case):
    """The grid is anchored at the first real token: padding changes nothing at real tokens."""
    model = _model_pad(design, case)
    seq = 28
    x, mask = _left_padded(seq)
    logits, cache = model.run_with_cache(x, attention_mask=mask)
    for b in range(x.shape[0]):
        p = int((mask[b] == 0).sum())
        if p == seq:
            continue
        alone, cache1 = model.run_with_cache(x[b : b + 1, p:])
        torch.testing.assert_close(logits[b : b + 1, p:], alone, atol=1e-5, rtol=0)
        for layer in range(model.cfg.n_layers):
            name = f"blocks.{layer}.attn.hook_token_pattern"
            torch.testing.assert_close(
                cache[name][b, :, p:, p:], cache1[name][0], atol=1e-5, rtol=0
            )


def test_padding_only_blocks_and_empty_queries():
    """A query that is itself padding sees nothing: zero pattern, zero z, no NaN."""
    model = make_model("gated", stride=4, window=0)
    model.set_use_token_pattern(True)
    x, mask = _left_padded(20, pads=(13,))
    _, cache = model.run_with_cache(x, attention_mask=mask)
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert (pattern[0, :, :13] == 0).all()
    assert (cache["blocks.0.attn.hook_z"][0, :13] == 0).all()
    weights = cache["blocks.0.attn.hook_block_weights"]
    assert torch.isfinite(weights).all()
    assert (weights.sum(-1)[0] <= 1 + 1e-6).all()


def test_mask_as_float_or_bool():
    model = make_model("mean", stride=3)
    x, mask = _left_padded(20, pads=(4, 0))
    ref = model(x, attention_mask=mask)
    torch.testing.assert_close(model(x, attention_mask=mask.bool()), ref, atol=0, rtol=0)
