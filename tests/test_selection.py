"""The selecting designs (``route``, ``quest``, ``kpool``) against a naive per-query reference:
outputs, gradients, overlapping blocks, padding, and the rows path. The reference loops over
(sequence, head, query) with Python sets of token positions: no gathering, no chunking."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hooked, tokens

from phasemech import CompressionConfig, PhaseTransformer

torch.set_num_threads(1)

RG = {"rotary": True, "gqa": True}  # 4 query heads over 2 KV heads


def _block_score(rule: str, q: torch.Tensor, keys: torch.Tensor) -> float:
    """The rule's score of one block (its real keys ``[slot, d]``) for one query ``[d]``."""
    q, keys = q.detach(), keys.detach()  # selection has no gradient
    if rule == "route":
        return float(q @ keys.mean(0))
    if rule == "quest":
        lo, hi = keys.amin(0), keys.amax(0)
        return float(sum(max(q[i] * lo[i], q[i] * hi[i]) for i in range(len(q))))
    return float((keys @ q).max())  # kpool


def _real_slots(geo, s: int, g: int, i: int) -> list[int]:
    pairs = zip(geo.slot_pos[s, g, i].tolist(), geo.slot_valid[s, g, i].tolist(), strict=True)
    return [p for p, ok in pairs if ok]


def naive_z(layer, q, k, v, geo, rule: str, key_valid=None, n_sink: int = 0):
    """``z [batch, pos, head, d]`` by the definition: candidates from the geometry (the coverage
    rule, tested on its own), top-k by the rule's score, attend the union of the kept blocks'
    real tokens and the raw span ``[r_t, t]`` in one softmax. ``rule``: a design's name, or
    ``score(sequence, kv_head, t, block, head=query head)`` for a learned or fixed rule
    (``None``: not ranked; a layer without ``top_k`` keeps every ranked block).
    ``n_sink``: the attention sink, applied here to ``geo``, a grid built WITHOUT it: the first
    ``n_sink`` real tokens leave every block (a block left empty, or under ``outside_window``
    with no token of its own before ``r_t``, is no candidate) and every query reads them."""
    b, seq, h, _ = q.shape
    rep, scope = h // k.shape[2], layer.cfg.compression.block_scope
    out = torch.zeros_like(q)
    for s in range(b):
        real = [j for j in range(seq) if key_valid is None or bool(key_valid[s, j])]
        sink = set(real[:n_sink])
        for head in range(h):
            g = head // rep
            for t in range(seq):
                r = int(geo.raw_start[s, g, t])
                own = {
                    i: [p for p in _real_slots(geo, s, g, i) if p not in sink]
                    for i in geo.block_used[s, g, t].nonzero().flatten().tolist()
                }
                cand = [i for i, o in own.items() if o and (scope != "outside_window" or o[0] < r)]
                forced = [i for i in cand if int(geo.block_last[s, g, i]) == t]
                ranked = []
                for i in cand:
                    if i in forced:
                        continue
                    score = (
                        rule(s, g, t, i, head=head)  # a learned or fixed rule's score
                        if callable(rule)
                        else _block_score(rule, q[s, t, head], k[s, own[i], g])
                    )
                    if score is not None:  # a fixed rule may leave a block unranked
                        ranked.append((score, i))
                kept = [i for _, i in sorted(ranked, reverse=True)[: layer.top_k]] + forced
                toks = {p for i in kept for p in own[i]} | {j for j in sink if j <= t}
                toks |= {j for j in real if max(r, 0) <= j <= t}
                if not toks:  # a masked query row with nothing visible: compared nowhere
                    continue
                idx = torch.tensor(sorted(toks))
                scores = (k[s, idx, g] @ q[s, t, head]) / layer.attn_scale
                out[s, t, head] = torch.softmax(scores, 0) @ v[s, idx, g]
    return out


def _model(rule: str, **comp) -> PhaseTransformer:
    tl_model = make_hooked(**RG, n_layers=1)
    return PhaseTransformer.from_hooked(tl_model, CompressionConfig(rule, **comp)).eval()


def _layer_inputs(model, x, attention_mask=None):
    """Post-RoPE ``q, k``, ``v`` and the geometry of layer 0 for input ``x``."""
    _, cache = model.run_with_cache(x, attention_mask=attention_mask)
    attn = model.blocks[0].attn
    q, k = cache["blocks.0.attn.hook_rot_q"], cache["blocks.0.attn.hook_rot_k"]
    v = cache["blocks.0.attn.hook_v"]
    offsets = cache["blocks.0.attn.hook_grid_offset"]
    kv = None if attention_mask is None else attention_mask.bool()
    return attn, q, k, v, attn._geometry(offsets, x.shape[1], kv), cache


COMPS = [
    dict(stride=4, window=6, top_k=2),
    dict(stride=3, block_len=6, window=0, top_k=2, offsets=(1, 2)),  # overlapping blocks
    dict(stride=4, window=3, top_k=1, visibility="strict", offsets=(0, 3)),
    # the candidate-set fix: raw span from a block boundary, only blocks wholly before it
    dict(stride=4, window=5, top_k=2, block_scope="before_window", offsets=(1, 2)),
]


@pytest.mark.parametrize("rule", ["route", "quest", "kpool"])
@pytest.mark.parametrize("comp", COMPS)
def test_matches_naive_reference(rule, comp):
    if rule == "kpool" and "block_len" in comp:
        comp = {k: v for k, v in comp.items() if k != "block_len"}  # kpool's pools are disjoint
    model = _model(rule, **comp)
    x = tokens(2, 30, seed=5)
    attn, q, k, v, geo, cache = _layer_inputs(model, x)
    want = naive_z(attn, q.double(), k.double(), v.double(), geo, rule)
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"].double(), want, atol=1e-5, rtol=0)
    # selection bites: some query ranks more candidates than it keeps
    ranked = cache["blocks.0.attn.hook_route_scores"].isfinite().sum(-1)
    assert (ranked > attn.top_k).any()
    assert cache["blocks.0.attn.hook_route_selected"].sum(-1).max() <= attn.top_k + 1


@pytest.mark.parametrize("rule", ["route", "quest", "kpool"])
def test_gradients_match_naive_reference(rule):
    """Gradients through the kept tokens equal the reference's (selection has none)."""
    overlap = {} if rule == "kpool" else {"block_len": 6}
    model = _model(rule, stride=3, window=2, top_k=2, **overlap)
    x = tokens(1, 20, seed=2)
    attn, q, k, v, geo, _ = _layer_inputs(model, x)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    z, _ = attn.attend(None, q, k, v, geo)
    ref = naive_z(attn, q, k, v, geo, rule)
    w = torch.randn_like(z, generator=torch.Generator().manual_seed(0))
    g_ours = torch.autograd.grad((z * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=0)


@pytest.mark.parametrize("rule", ["route", "quest", "kpool"])
@pytest.mark.parametrize("overlap", [False, True])
def test_left_padding_is_invisible(rule, overlap):
    """Left padding: the padded sequence's outputs equal the unpadded one's on real tokens,
    and the layer equals the reference with the padding hidden."""
    if rule == "kpool" and overlap:
        pytest.skip("kpool's pools are disjoint")
    comp = dict(stride=3, block_len=7, offsets=(1, 2)) if overlap else dict(stride=4)
    model = _model(rule, window=4, top_k=1, **comp)
    x = tokens(1, 24, seed=3)
    pad = 5
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(x)], 1)
    torch.testing.assert_close(
        model(padded, attention_mask=mask)[:, pad:], model(x), atol=1e-5, rtol=0
    )
    attn, q, k, v, geo, cache = _layer_inputs(model, padded, attention_mask=mask)
    want = naive_z(attn, q.double(), k.double(), v.double(), geo, rule, key_valid=mask.bool())
    got = cache["blocks.0.attn.hook_z"].double()
    torch.testing.assert_close(got[:, pad:], want[:, pad:], atol=1e-5, rtol=0)


def test_ties_go_to_the_later_block():
    """Quest's bounds tie exactly when overlapping blocks share their extreme keys: the later
    block wins, as in the reference, whatever ``topk`` would pick."""
    from phasemech.attention.selection import top_k_latest

    gate = torch.tensor([[3.0, 5.0, 1.0, 5.0, 5.0, float("-inf")]])
    val, idx = top_k_latest(gate, 2)
    assert sorted(idx[0].tolist()) == [3, 4] and val[0].tolist() == [5.0, 5.0]
    val, idx = top_k_latest(gate, 4)
    assert sorted(idx[0].tolist()) == [0, 1, 3, 4]
    model = _model("quest", stride=3, block_len=7, window=2, top_k=1, offsets=(1, 2))
    x = tokens(2, 30, seed=5)
    attn, q, k, v, geo, cache = _layer_inputs(model, x)
    want = naive_z(attn, q.double(), k.double(), v.double(), geo, "quest")
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"].double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rule", ["route", "quest", "kpool", "evict"])
def test_rows_equal_the_full_forward(rule):
    """Any subset of rows (scattered, one per sequence, or a consecutive run) computes what the
    full forward computes there; small chunks change nothing."""
    extra = {"obs_window": 3} if rule == "evict" else {}
    model = _model(rule, stride=4, window=5, top_k=2, **extra)
    x = tokens(2, 40, seed=8)
    attn, q, k, v, geo, cache = _layer_inputs(model, x)
    z_full = cache["blocks.0.attn.hook_z"]  # [batch, pos, head, d]
    rows = torch.tensor([[3, 17, 39], [0, 22, 30]])
    z, _ = attn.attend_many(None, q, k, v, geo, rows)
    ar = torch.arange(2)[:, None]
    torch.testing.assert_close(z, z_full[ar, rows], atol=1e-5, rtol=0)
    run = torch.arange(25, 40).expand(2, -1)
    z, _ = attn.attend_many(None, q, k, v, geo, run)
    torch.testing.assert_close(z, z_full[:, 25:], atol=1e-5, rtol=0)
    attn.row_chunk = lambda seq: 7  # chunks of 7 rows
    z, _ = attn.attend(None, q, k, v, geo)
    torch.testing.assert_close(z, z_full, atol=1e-5, rtol=0)


def test_kpool_refuses_overlapping_pools():
    with pytest.raises(ValueError, match="block_len=8 is invalid"):
        CompressionConfig("kpool", stride=4, block_len=8)


def test_quest_bound_is_an_upper_bound():
    """Quest's score is never below any real key's ``q . k`` in the block."""
    model = _model("quest", stride=4, window=4, top_k=1)
    x = tokens(1, 32, seed=1)
    attn, q, k, v, geo, _ = _layer_inputs(model, x)
    rows = torch.arange(32)[None]
    bound = attn.block_scores(attn.block_summary(None, k, v, geo), q, rows, k, geo)
    best = attn._slot_scores(q, rows, k, geo).amax(-1)  # kpool's score: the best real key
    has = geo.slot_valid.any(-1)[:, :, None, :].repeat_interleave(2, 1).expand_as(bound)
    assert (bound[has] >= best[has] - 1e-5).all()
    assert (bound[has] > best[has] + 1e-3).any()  # and not trivially equal


@pytest.mark.parametrize("design", ["route", "quest", "kpool", "evict", "dsa", "partition"])
@pytest.mark.parametrize("padded", [False, True])
def test_training_dense_path_equals_the_gathered_engine(design, padded):
    """Training at short context lays the kept tokens out as a mask over every key (no
    gathers); outputs and gradients equal the gathered engine's (what eval runs)."""
    extra = {"indexer_train": "end_to_end"} if design == "dsa" else {}
    top_k = {} if design == "partition" else {"top_k": 2}
    model = _model(design, stride=4, window=3, offsets=(1, 2), **top_k, **extra)
    x = tokens(2, 30, seed=7)
    mask = torch.ones_like(x)
    if padded:
        mask[0, :6] = 0
    grads = []
    for train in (False, True):
        model.train(train)
        model.zero_grad()
        out = model(x, attention_mask=mask)
        (out[mask.bool()] * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None}))  # fmt: skip
    (eval_out, eval_g), (train_out, train_g) = grads
    keep = mask.bool()
    torch.testing.assert_close(train_out[keep], eval_out[keep], atol=1e-5, rtol=1e-5)
    assert eval_g.keys() == train_g.keys()
    for name, g in eval_g.items():
        torch.testing.assert_close(train_g[name], g, atol=1e-5, rtol=1e-4, msg=name)


CHUNK_COMPS = {
    "plain": dict(stride=4, window=5, top_k=2, offsets=(1, 3)),
    "strict": dict(stride=4, window=3, top_k=1, visibility="strict", offsets=(0, 3)),
    "before_window": dict(stride=4, window=5, top_k=2, block_scope="before_window"),
    "overlap": dict(stride=3, block_len=6, window=0, top_k=2, offsets=(1, 2)),
}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("comp", CHUNK_COMPS)
@pytest.mark.parametrize("rule", ["route", "quest", "kpool", "evict", "partition"])
def test_chunks_score_only_the_blocks_they_reach(rule, comp, padded):
    """An unhooked forward in small chunks scores, for each chunk, only the blocks its rows
    can reach (early chunks fewer; ``partition``, whose budget is a share of all blocks, every
    block), and computes what the one-chunk hooked forward computes (float64: a near-tie
    cannot flip between the two), with and without left padding."""
    if comp == "overlap" and rule in ("kpool", "partition"):
        pytest.skip("disjoint pools only")
    extra = {"obs_window": 3} if rule == "evict" else {}
    grid = dict(CHUNK_COMPS[comp])
    if rule == "partition":  # its budget is its share of the blocks, not a top-k
        grid.pop("top_k")
    model = _model(rule, **grid, **extra).double()
    x, mask = tokens(2, 40, seed=8), None
    if padded:
        mask = torch.ones_like(x)
        mask[1, :5] = 0
    attn, q, k, v, geo, cache = _layer_inputs(model, x, attention_mask=mask)
    n_blocks = geo.block_used.shape[-1]
    seen = []
    scores = attn.block_scores

    def spy(summary, q, rows, k, geo):
        out = scores(summary, q, rows, k, geo)
        seen.append(out.shape[-1])
        return out

    attn.block_scores = spy
    attn.row_chunk = lambda seq: 7
    z, _ = attn.attend(None, q, k, v, geo)
    if rule == "partition":
        assert set(seen) == {n_blocks}
    else:
        assert min(seen) < n_blocks and seen == sorted(seen), seen
    real = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(z[real], cache["blocks.0.attn.hook_z"][real], atol=1e-12, rtol=0)
    if rule in ("route", "quest", "kpool"):  # the reference's rules
        want = naive_z(attn, q, k, v, geo, rule, key_valid=None if mask is None else mask.bool())
        torch.testing.assert_close(z[real], want[real], atol=1e-12, rtol=0)


TILE_COMPS = {
    **{name: c for name, c in CHUNK_COMPS.items() if name != "overlap"},
    "no_window": dict(stride=4, window=0, top_k=3, offsets=(2, 1)),
}


@pytest.mark.parametrize("comp", TILE_COMPS)
@pytest.mark.parametrize("rule", ["route", "quest", "kpool", "evict", "partition"])
def test_tiles_attend_what_the_gather_attends(rule, comp, monkeypatch):
    """The fast path (one key list per tile of rows, ``phasemech.attention.tiles``) computes
    the per-query gather's output (float64), in chunks that end mid-tile, with the query heads
    of a KV head on different grid offsets; a padded batch, which it does not serve, takes the
    gather."""
    import phasemech.attention.selection as sel

    calls, tiles = [], sel.attend_tiles
    monkeypatch.setattr(sel, "attend_tiles", lambda *a: calls.append(1) or tiles(*a))
    extra = {"obs_window": 3} if rule == "evict" else {}
    grid = dict(TILE_COMPS[comp])
    if rule == "partition":
        grid.pop("top_k")
    model = _model(rule, **grid, **extra).double()
    attn, q, k, v, geo, cache = _layer_inputs(model, tokens(2, 45, seed=3))
    attn.row_chunk = lambda seq: 20
    z, _ = attn.attend(None, q, k, v, geo)
    assert len(calls) == 3  # every chunk, the last one a partial tile
    attn.tiled = False
    want, _ = attn.attend(None, q, k, v, geo)
    torch.testing.assert_close(z, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(z, cache["blocks.0.attn.hook_z"], atol=1e-12, rtol=0)
    mask = torch.ones(2, 45, dtype=torch.long)
    mask[0, :4] = 0
    attn.tiled, calls[:] = True, []
    model(tokens(2, 45, seed=3), attention_mask=mask)
    assert not calls


@pytest.mark.parametrize("rule", ["route", "quest", "evict"])
def test_tiles_on_shifted_grids_local_layers_and_gradients(rule, monkeypatch):
    """The tiles equal the gather (outputs and the gradients to q, k, v; float64) with each
    sequence and KV head on its own offset, on a sliding-window layer's geometry, keeping
    every block, under an all-ones mask; a tile whose key list would outgrow the gathered
    keys falls back to the gather."""
    import phasemech.attention.selection as sel
    import phasemech.attention.tiles as tiles
    from phasemech.core.grid import build_geometry

    served, real = [], sel.attend_tiles
    monkeypatch.setattr(sel, "attend_tiles", lambda *a: served.append(real(*a)) or served[-1])
    extra = {"obs_window": 3} if rule == "evict" else {}
    model = _model(rule, stride=4, window=5, top_k=2, **extra).double()
    attn, q, k, v, _, _ = _layer_inputs(model, tokens(2, 45, seed=5))
    attn.row_chunk = lambda seq: 22
    offsets = torch.tensor([[1, 3], [2, 0]])

    def both(geo, tiled: bool = True) -> None:
        outs = []
        for attn.tiled in (True, False):
            qkv = [t.detach().requires_grad_() for t in (q, k, v)]
            z, _ = attn.attend(None, *qkv, geo)
            outs.append((z, *torch.autograd.grad(z.square().sum(), qkv)))
        assert served and all((z is not None) == tiled for z in served)
        served.clear()
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)

    both(attn._geometry(offsets, 45, None))
    both(build_geometry(offsets, 45, 4, 4, 5, "inclusive", local_window=9))
    both(attn._geometry(offsets, 45, torch.ones(2, 45, dtype=torch.bool)))
    attn.keep_all = True
    both(attn._geometry(offsets, 45, None))
    attn.keep_all = False
    monkeypatch.setattr(tiles, "TILE", 256)  # key lists longer than d_head x the kept keys
    both(attn._geometry(offsets, 45, None), tiled=False)


@pytest.mark.parametrize("offsets", ["aligned", "per_layer"])
def test_layers_share_one_geometry(monkeypatch, offsets):
    """Layers on one grid build its geometry once per forward, and again only for a new grid
    or length; padded inputs are never cached. Outputs equal those with nothing cached."""
    import phasemech.attention.base as base

    built, build = [], base.build_geometry

    def counting(*args, **kw):
        built.append(args[1])
        return build(*args, **kw)

    base._GEO_CACHE.clear()
    tl_model = make_hooked(**RG, n_layers=3)
    comp = CompressionConfig("route", stride=4, window=3, top_k=1, offsets=offsets)
    model = PhaseTransformer.from_hooked(tl_model, comp).eval()
    x = tokens(2, 30, seed=4)
    with torch.no_grad():
        uncached = []
        for _ in range(2):  # nothing cached: every layer builds its own
            base._GEO_CACHE.clear()
            monkeypatch.setattr(base, "_GEO_CACHE_SIZE", 0)
            uncached.append(model(x))
        monkeypatch.setattr(base, "_GEO_CACHE_SIZE", 4)
        monkeypatch.setattr(base, "build_geometry", counting)
        first, again = model(x), model(x)
        grids = 1 if offsets == "aligned" else 3  # per_layer: layers 0..2 on 3 offsets of 4
        assert len(built) == grids
        model(x[:, :20])
        assert len(built) == 2 * grids
        mask = torch.ones_like(x)
        model(x, attention_mask=mask)
        assert len(built) == 2 * grids + 3
    torch.testing.assert_close(first, uncached[0], atol=0, rtol=0)
    torch.testing.assert_close(again, uncached[0], atol=0, rtol=0)
