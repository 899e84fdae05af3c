"""``evict`` (ChunkKV chunk eviction): causality, dense limit, a brute-force reference of the
scores / selection / pattern, ``from_hooked`` on rotary GQA models, ``forward_rows`` and config
errors. Tiny models only (2-core CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_hooked, tokens
from conftest import raises_naming as _raises

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.attention import ChunkEvictAttention, CompressedAttentionMixin
from phasemech.core.config import DEFAULT_OBS_WINDOW, DEFAULT_TOP_K
from phasemech.core.grid import n_blocks

torch.set_num_threads(1)

RG = {"rotary": True, "gqa": True}  # rotary + grouped-query attention (4 heads, 2 KV heads)


def _evict(tl_model, **comp) -> PhaseTransformer:
    return PhaseTransformer.from_hooked(tl_model, CompressionConfig("evict", **comp)).eval()


# ---------------------------------------------------------------------------- causality
@pytest.mark.parametrize("comp", [dict(stride=4, window=4, top_k=1, obs_window=3),
                                  dict(stride=3, block_len=5, window=0, top_k=2, obs_window=8,
                                       visibility="strict", offsets=(1, 2))])  # fmt: skip
def test_causal(comp):
    tl_model = make_hooked(**RG)
    model = _evict(tl_model, **comp)
    x = tokens(2, 32, seed=4)
    base = model(x)
    gen = torch.Generator().manual_seed(7)
    for t in (0, 5, 13, 22, 30):
        y = x.clone()
        y[:, t + 1 :] = torch.randint(0, model.cfg.d_vocab, y[:, t + 1 :].shape, generator=gen)
        torch.testing.assert_close(model(y)[:, : t + 1], base[:, : t + 1], atol=1e-6, rtol=0)
    # and eviction really happens: not the dense model
    assert not torch.allclose(base, tl_model(x), atol=1e-3)


# ---------------------------------------------------------------------------- dense limit
VARIANTS = {
    "plain": {},
    "rotary_gqa": RG,
    "rotary_gqa_mlp": {**RG, "attn_only": False},
    "ungrouped_gqa": {"gqa": True, "ungroup_grouped_query_attention": True},
    "shortformer_softcap": {
        "positional_embedding_type": "shortformer",
        "attn_scores_soft_cap": 5.0,
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_keeping_every_chunk_is_dense(variant):
    """``top_k`` >= the number of candidates of every query of the sequence: nothing is
    evicted, so the model is TL's. (At ``n_ctx`` = 48 the last queries have 11 candidates, so
    ``top_k`` = 10 is allowed; a ``top_k`` that keeps everything at ``n_ctx`` is refused.)"""
    tl_model = make_hooked(**VARIANTS[variant])
    seq = 40  # the last query has 9 candidate blocks
    comp = dict(stride=4, window=6, obs_window=5, top_k=10)
    model = _evict(tl_model, **comp)
    x = tokens(2, seq, seed=2)
    logits, cache = model.run_with_cache(x)
    torch.testing.assert_close(logits, tl_model(x), atol=1e-5, rtol=0)
    # blocks are in play: some queries have finite scores for several candidates
    scores = cache["blocks.0.attn.hook_route_scores"]
    assert torch.isfinite(scores).sum(-1).max() >= 5
    # with a small top_k the same model evicts and differs
    small = _evict(tl_model, **{**comp, "top_k": 1})
    assert not torch.allclose(small(x), logits, atol=1e-3)


def test_keeping_every_chunk_is_dense_with_left_padding():
    tl_model = make_hooked(**RG)
    model = _evict(tl_model, stride=4, window=4, obs_window=3, top_k=8)  # 11 at n_ctx = 48
    x = tokens(2, 30, seed=5)  # at most 7 candidates
    mask = torch.ones_like(x)
    mask[0, :7] = 0
    ours, theirs = model(x, attention_mask=mask), tl_model(x, attention_mask=mask)
    torch.testing.assert_close(ours[:, 7:], theirs[:, 7:], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- brute force
def _blocks(seq: int, d: int, l: int, o: int, nb: int) -> list[list[int]]:
    """Tokens of block ``i``: ``[i*d + o - l, i*d + o - 1]`` clipped to ``[0, seq)``."""
    return [[j for j in range(i * d + o - l, i * d + o) if 0 <= j < seq] for i in range(nb)]


def _reference(dense_p, dense_s, seq, d, l, w, vis, offs, top_k, obs, n_kv):
    """Plain-loop scores, selection and final pattern from the dense model's patterns
    (``dense_p``) and scaled scores (``dense_s``), both ``[batch, head, pos, key_pos]``."""
    b, h = dense_p.shape[:2]
    rep = h // n_kv
    nb = n_blocks(seq, d)
    scores = torch.full((b, h, seq, nb), -math.inf, dtype=torch.float64)
    selected = torch.zeros(b, h, seq, nb, dtype=torch.bool)
    pattern = torch.zeros(b, h, seq, seq, dtype=torch.float64)
    margins = []
    for bi in range(b):
        for g in range(n_kv):
            blocks = _blocks(seq, d, l, offs[g], nb)
            heads = range(g * rep, (g + 1) * rep)
            for t in range(seq):
                seen = [
                    i
                    for i, toks in enumerate(blocks)
                    if toks and (toks[-1] <= t if vis == "inclusive" else toks[-1] < t)
                ]
                last = max((blocks[i][-1] for i in seen), default=-1)
                r_t = min(t - w + 1, last + 1)
                cand = [i for i in seen if blocks[i][0] < r_t]
                forced = [i for i in cand if blocks[i][-1] == t]
                ranked = {}
                for i in cand:
                    if i in forced:
                        continue
                    ranked[i] = sum(
                        float(dense_p[bi, hh, u, j])
                        for u in range(max(0, t - obs + 1), t + 1)
                        for hh in heads
                        for j in blocks[i]
                    )
                order = sorted(ranked, key=lambda i: -ranked[i])
                keep = set(order[:top_k]) | set(forced)
                if len(order) > top_k:
                    margins.append(ranked[order[top_k - 1]] - ranked[order[top_k]])
                visible = set(range(max(r_t, 0), t + 1))
                for i in keep:
                    visible |= set(blocks[i])
                cols = sorted(visible)
                for hh in heads:
                    for i, s in ranked.items():
                        scores[bi, hh, t, i] = s
                    for i in keep:
                        selected[bi, hh, t, i] = True
                    row = dense_s[bi, hh, t, cols].double()
                    pattern[bi, hh, t, cols] = torch.softmax(row, -1)
    return scores, selected, pattern, margins


@pytest.mark.parametrize(
    "comp",
    [
        dict(stride=4, window=6, top_k=2, obs_window=5),
        dict(stride=3, block_len=5, window=0, top_k=1, obs_window=4, offsets=(2, 1)),
        dict(stride=4, window=3, top_k=3, obs_window=1, visibility="strict", offsets=(0, 3)),
    ],
)
def test_matches_brute_force(comp):
    tl_model = make_hooked(**RG)
    model = _evict(tl_model, layers=(1,), **comp)
    route = PhaseTransformer.from_hooked(
        tl_model,
        CompressionConfig(
            "route", **{k: v for k, v in comp.items() if k != "obs_window"}, layers=(1,)
        ),
    ).eval()
    seq = 26
    x = tokens(2, seq, seed=9)
    attn = "blocks.1.attn."
    _, dense = tl_model.run_with_cache(x)
    model.set_use_token_pattern(True)
    _, ours = model.run_with_cache(x)
    _, routed = route.run_with_cache(x)
    c = model.cfg.compression
    offs = [int(o) for o in ours[attn + "hook_grid_offset"][0]]
    scores, selected, pattern, margins = _reference(
        dense[attn + "hook_pattern"],
        dense[attn + "hook_attn_scores"],
        seq,
        c.stride,
        c.block_len,
        c.window,
        c.visibility,
        offs,
        c.top_k,
        c.obs_window,
        model.cfg.n_kv_heads,
    )
    got_scores = ours[attn + "hook_route_scores"]
    # the ranked candidates are route's (finite scores), and so is the forced current block
    route_scores, route_sel = (
        routed[attn + "hook_route_scores"],
        routed[attn + "hook_route_selected"],
    )
    assert torch.equal(torch.isfinite(got_scores), torch.isfinite(route_scores))
    got_sel = ours[attn + "hook_route_selected"]
    forced = got_sel & ~torch.isfinite(got_scores)
    assert torch.equal(forced, route_sel & ~torch.isfinite(route_scores))
    assert torch.equal(torch.isfinite(got_scores), torch.isfinite(scores))
    finite = torch.isfinite(scores)
    assert finite.any()
    torch.testing.assert_close(got_scores.double()[finite], scores[finite], atol=1e-5, rtol=0)
    # selection: exact unless two scores tie within float noise (none here, checked)
    assert min(margins) > 1e-5
    assert torch.equal(got_sel, selected)
    # the pattern on absolute key positions (the hook's own layout is the gathered one)
    token_pattern = ours[attn + "hook_token_pattern"]
    torch.testing.assert_close(token_pattern.double(), pattern, atol=1e-5, rtol=0)
    gathered = ours[attn + "hook_pattern"]  # [batch, head, pos, kept tokens + band]
    torch.testing.assert_close(gathered.sum(-1), token_pattern.sum(-1))
    # the layer's output is its pattern applied to the raw values
    v = model.blocks[1].attn._repeat_kv(ours[attn + "hook_v"], 2)
    z = torch.einsum("bhqk,bkhd->bqhd", token_pattern, v)
    torch.testing.assert_close(ours[attn + "hook_z"], z, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- from_hooked
def test_from_hooked_rotary_gqa():
    tl_model = make_hooked(**RG, attn_only=False)
    comp = CompressionConfig("evict", stride=4, window=16, top_k=4, obs_window=8)
    model = PhaseTransformer.from_hooked(tl_model, comp).eval()
    assert model.cfg.compression == comp and model.compressor_keys == set()
    assert all(isinstance(b.attn, ChunkEvictAttention) for b in model.blocks)
    assert all(type(b.attn).__name__ == "ChunkEvictAttentionGQA" for b in model.blocks)
    assert all(isinstance(b.attn, CompressedAttentionMixin) for b in model.blocks)
    assert model.blocks[0].attn.design == "evict" and model.blocks[0].attn.obs_window == 8
    ours = model.state_dict()
    for name, p in tl_model.state_dict().items():
        torch.testing.assert_close(ours[name], p, atol=0, rtol=0, msg=name)
    x = tokens(2, 48, seed=1)
    logits, cache = model.run_with_cache(x)
    assert torch.isfinite(logits).all()
    sel = cache["blocks.0.attn.hook_route_selected"]
    assert sel.shape == (2, model.cfg.n_heads, 48, n_blocks(48, 4))
    assert sel.sum(-1).max() <= 4 + 1  # top_k plus the forced block
    # selection is shared by the query heads of a KV group
    assert torch.equal(sel[:, 0], sel[:, 1]) and torch.equal(sel[:, 2], sel[:, 3])
    assert "blocks.0.attn.hook_k_block" not in cache  # no block keys: eviction uses none
    # training works: gradients flow through the kept tokens, not the selection
    model.train()
    loss = model(x, return_type="loss")
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_forward_rows_matches_forward():
    tl_model = make_hooked(**RG)
    model = _evict(tl_model, stride=4, window=5, top_k=2, obs_window=6, offsets=(1, 3))
    x = tokens(3, 30, seed=11)
    _, cache = model.run_with_cache(x)
    rows = torch.tensor([29, 12, 3])
    ar = torch.arange(3)
    for layer in range(model.cfg.n_layers):
        inp = cache[f"blocks.{layer}.ln1.hook_normalized"]
        out = model.blocks[layer].attn.forward_rows(inp, rows)
        torch.testing.assert_close(
            out, cache[f"blocks.{layer}.hook_attn_out"][ar, rows], atol=1e-5, rtol=0
        )


# ---------------------------------------------------------------------------- config


def test_config_defaults_and_roundtrip():
    c = CompressionConfig("evict")
    assert (c.top_k, c.obs_window) == (DEFAULT_TOP_K, DEFAULT_OBS_WINDOW) == (2, 8)
    c = CompressionConfig("evict", stride=4, window=32, top_k=4, obs_window=8)
    assert CompressionConfig.from_dict(c.to_dict()) == c
    assert CompressionConfig("route").obs_window is None
    assert CompressionConfig.from_dict({"design": "route", "top_k": 3}).obs_window is None


@pytest.mark.parametrize("design", ["none", "mean", "gated", "mlp", "route"])
def test_obs_window_needs_evict(design):
    msg = _raises("obs_window", 4, design=design, obs_window=4)
    assert design in msg and "evict" in msg


@pytest.mark.parametrize("obs_window", [0, -2, 1.5, "8", True])
def test_evict_bad_obs_window(obs_window):
    _raises("obs_window", obs_window, design="evict", obs_window=obs_window)


@pytest.mark.parametrize("top_k", [0, -1, 2.5, "3"])
def test_evict_bad_top_k(top_k):
    msg = _raises("top_k", top_k, design="evict", top_k=top_k)
    assert "evict" in msg


@pytest.mark.parametrize("design", ["mean", "gated", "mlp"])
def test_top_k_still_refused_elsewhere(design):
    msg = _raises("top_k", 2, design=design, top_k=2)
    assert design in msg and "evict" in msg


def test_evict_refuses_block_scope_all():
    msg = _raises("block_scope", "all", design="evict", block_scope="all")
    assert "evict" in msg


@pytest.mark.parametrize("offset, seq", [(0, 17), (1, 20), (3, 26)])
def test_block_mass_fold_equals_the_slot_gather(offset, seq):
    """Blocks that tile the keys on one grid are summed by folding the keys: bit for bit the
    slot gather's sums; other grids (overlap, per-head offsets) keep the gather."""
    from phasemech.attention.selection import tiled_slots
    from phasemech.core.grid import build_geometry

    def _block_mass(dense, geo):  # what evict sums: each block's slots, 0 on missing ones
        slots = tiled_slots(dense, geo, 0.0)
        return None if slots is None else slots.sum(-1)

    geo = build_geometry(torch.full((2, 2), offset), seq, 4, 4, 3, "inclusive")
    gen = torch.Generator().manual_seed(offset)
    dense = torch.softmax(torch.randn(2, 4, 5, seq, generator=gen), -1)
    dense[..., seq // 2 :] = 0.0  # masked keys, as a causal row has them
    nb, sl = geo.slot_pos.shape[2:]
    pos = geo.slot_pos.clamp(0, seq - 1).repeat_interleave(2, 1).reshape(2, 4, 1, nb * sl)
    held = dense.gather(-1, pos.expand(-1, -1, 5, -1)).reshape(2, 4, 5, nb, sl)
    want = (held * geo.slot_valid.repeat_interleave(2, 1)[:, :, None]).sum(-1)
    assert torch.equal(_block_mass(dense, geo), want)
    assert _block_mass(dense, build_geometry(torch.zeros(2, 2), seq, 4, 5, 3, "inclusive")) is None
    per_head = torch.tensor([[0, 1], [0, 1]])
    assert _block_mass(dense, build_geometry(per_head, seq, 4, 4, 3, "inclusive")) is None
