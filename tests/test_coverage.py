"""The coverage rule of ``phasemech.core.grid`` against a brute-force Python reference.

For every query ``t`` the geometry gives a raw set (band slots with ``band_valid``, mapped to
absolute positions by ``geo.band_pos``) and a block set (``slot_pos`` of used blocks'
valid slots). The rule: their union is exactly the real tokens ``0..t``, they overlap in at most
``l - 1`` tokens, the raw set is ``[r_t, t]`` and every used block is complete.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasemech.core.grid import (
    build_geometry,
    last_query_blocks,
    n_blocks,
    phase_of,
    raw_band_width,
)

VIS = ("inclusive", "strict")


def ref_latest_end(t: int, d: int, o: int, vis: str) -> int:
    """Last token of the latest block visible to ``t``, by enumerating block ends."""
    newest = t if vis == "inclusive" else t - 1
    return max(e for e in range(-2 * d - 1, newest + 1) if (e + 1 - o) % d == 0)


def ref_raw_start(t: int, d: int, w: int, o: int, vis: str, scope: str = "outside_window") -> int:
    """The window, extended back to just after the latest visible block (``before_window``:
    first back to the start of the segment holding its first token)."""
    start = t - w + 1
    if scope == "before_window":
        while (start - o) % d:
            start -= 1
    return max(0, min(start, ref_latest_end(t, d, o, vis) + 1))


def geometry_sets(geo, b: int, g: int, t: int) -> tuple[set[int], set[int], list[int]]:
    band_pos = geo.band_pos[t]
    raw = {int(p) for p, ok in zip(band_pos, geo.band_valid[b, g, t], strict=True) if ok}
    used = [int(i) for i in torch.nonzero(geo.block_used[b, g, t]).flatten()]
    via_blocks: set[int] = set()
    for i in used:
        for p, ok in zip(geo.slot_pos[b, g, i], geo.slot_valid[b, g, i], strict=True):
            if ok:
                via_blocks.add(int(p))
    return raw, via_blocks, used


def check_geometry(
    seq: int,
    d: int,
    l: int,
    w: int,
    vis: str,
    offsets: list[int],
    key_valid: torch.Tensor | None = None,
    scope: str = "outside_window",
) -> None:
    """Brute-force every (sequence, head, query) of one geometry. ``offsets`` is one kv_head
    per entry; ``key_valid`` ``[batch, seq]`` (batch 1 when None)."""
    batch = 1 if key_valid is None else key_valid.shape[0]
    off = torch.tensor(offsets, dtype=torch.long)[None].expand(batch, -1)
    geo = build_geometry(off, seq, d, l, w, vis, key_valid, scope)
    nb = n_blocks(seq, d)
    assert geo.slot_pos.shape == (batch, len(offsets), nb, l)
    assert geo.band == raw_band_width(seq, d, w, scope)
    for b, (g, o) in itertools.product(range(batch), enumerate(offsets)):
        real = [True] * seq if key_valid is None else [bool(x) for x in key_valid[b]]
        # every block's slots are exactly its positions, valid where real and in the sequence
        for i in range(nb):
            last = i * d + o - 1
            expect = list(range(last - l + 1, last + 1))
            assert geo.slot_pos[b, g, i].tolist() == expect
            valid = [0 <= p < seq and real[p] for p in expect]
            assert geo.slot_valid[b, g, i].tolist() == valid
        for t in range(seq):
            raw, blk, used = geometry_sets(geo, b, g, t)
            past = {j for j in range(t + 1) if real[j]}
            r_t = ref_raw_start(t, d, w, o, vis, scope)
            ctx = f"T={seq} d={d} l={l} W={w} {vis} {scope} o={o} b={b} t={t}"
            # (a) no hole, nothing from the future, no padding
            assert raw | blk == past, f"{ctx}: missing {past - raw - blk}, extra {raw | blk - past}"
            # (b) at most l - 1 tokens reached both ways (all of the window may be, with "all")
            bound = {"outside_window": l - 1, "before_window": 0, "all": w}[scope]
            assert len(raw & blk) <= bound, f"{ctx}: overlap {sorted(raw & blk)}"
            if scope == "before_window" and w >= 1 and t - w + 1 >= d:
                assert w <= t - r_t + 1 <= w + d - 1, f"{ctx}: raw span {t - r_t + 1}"
                assert phase_of(r_t, d, o) == 0, f"{ctx}: raw span starts off a boundary"
            # (c) the raw set is [r_t, t] (minus padding)
            assert raw == {j for j in range(r_t, t + 1) if real[j]}, f"{ctx}: raw {sorted(raw)}"
            # everything after the latest visible block (the own incomplete block) is raw
            assert r_t <= max(0, ref_latest_end(t, d, o, vis) + 1)
            if vis == "strict":  # strict: the query's whole segment (from its phase) is raw
                assert r_t <= max(0, t - phase_of(t, d, o))
            # (d) used blocks: complete under the visibility rule, with a real token before r_t
            for i in used:
                last = i * d + o - 1
                assert last <= t if vis == "inclusive" else last < t, f"{ctx}: block {i}"
                toks = [p for p in range(last - l + 1, last + 1) if 0 <= p < seq and real[p]]
                assert toks, f"{ctx}: block {i} holds only padding"
                if scope == "outside_window":
                    assert min(toks) < r_t, f"{ctx}: block {i} lies inside the raw window"
                if scope == "before_window":
                    assert last < r_t, f"{ctx}: block {i} is partly raw"
            # and the rule is exactly that (no useful candidate is skipped)
            expect_used = []
            for i in range(nb):
                last = i * d + o - 1
                toks = [p for p in range(last - l + 1, last + 1) if 0 <= p < seq and real[p]]
                visible = last <= t if vis == "inclusive" else last < t
                scoped = {"all": True, "outside_window": bool(toks) and min(toks) < r_t,
                          "before_window": last < r_t}[scope]  # fmt: skip
                if visible and toks and scoped:
                    expect_used.append(i)
            assert used == expect_used, f"{ctx}: used {used} != {expect_used}"


GRID = [
    (d, l, w, vis)
    for d in range(1, 6)
    for l in range(d, d + 3)
    for w in sorted({0, 1, max(d - 1, 0), d, d + 1, 2 * d, 3 * d + 1})
    for vis in VIS
]


SCOPES = ["outside_window", "before_window", "all"]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("d", range(1, 6))
def test_coverage_grid(d, scope):
    """All offsets at once (one kv_head each), T = 30, many block lengths and windows."""
    for dd, l, w, vis in GRID:
        if dd == d:
            check_geometry(30, d, l, w, vis, list(range(d)), scope=scope)


@settings(max_examples=40, deadline=None)
@given(
    seq=st.integers(1, 30),
    d=st.integers(1, 7),
    extra=st.integers(0, 4),
    w=st.integers(0, 14),
    vis=st.sampled_from(VIS),
    data=st.data(),
)
def test_coverage_hypothesis(seq, d, extra, w, vis, data):
    offsets = data.draw(st.lists(st.integers(0, d - 1), min_size=1, max_size=3))
    scope = data.draw(st.sampled_from(SCOPES))
    check_geometry(seq, d, d + extra, w, vis, offsets, scope=scope)


@settings(max_examples=30, deadline=None)
@given(
    seq=st.integers(1, 24),
    d=st.integers(1, 6),
    extra=st.integers(0, 3),
    w=st.integers(0, 10),
    vis=st.sampled_from(VIS),
    data=st.data(),
)
def test_coverage_with_padding(seq, d, extra, w, vis, data):
    """Arbitrary padding masks (left padding and holes): padding never reachable, blocks of
    only padding never used, every real past token still reached."""
    offsets = data.draw(st.lists(st.integers(0, d - 1), min_size=1, max_size=2))
    rows = data.draw(
        st.lists(st.lists(st.booleans(), min_size=seq, max_size=seq), min_size=1, max_size=2)
    )
    n_left = data.draw(st.integers(0, seq))
    rows.append([False] * n_left + [True] * (seq - n_left))  # a left-padded row
    scope = data.draw(st.sampled_from(SCOPES))
    check_geometry(seq, d, d + extra, w, vis, offsets, torch.tensor(rows), scope)


def test_padding_only_blocks_never_used():
    seq, d = 16, 4
    kv = torch.ones(1, seq, dtype=torch.bool)
    kv[0, :9] = False  # blocks 0..2 ([-4,-1], [0,3], [4,7]) hold no real token; block 3
    # ([8, 11]) holds one
    geo = build_geometry(torch.zeros(1, 1, dtype=torch.long), seq, d, d, 0, "inclusive", kv)
    assert not geo.block_used[0, 0, :, :3].any()
    assert (geo.block_first[0, 0, :3] == seq).all()
    assert geo.block_used[0, 0, 12:, 3].all()  # queries 12.. reach token 8 through block 3
    check_geometry(seq, d, d, 0, "inclusive", [0], kv)


def _naive_sets(geo, t: int, w: int, vis: str) -> set[int]:
    """Naive rule: raw = [t-W+1, t], blocks = complete blocks ending before t-W+1."""
    raw = set(range(max(0, t - w + 1), t + 1))
    blk: set[int] = set()
    last = geo.block_last[0, 0]
    for i in range(last.shape[0]):
        ok = last[i] <= t if vis == "inclusive" else last[i] < t
        if ok and last[i] < t - w + 1:
            pairs = zip(geo.slot_pos[0, 0, i], geo.slot_valid[0, 0, i], strict=True)
            blk |= {int(p) for p, v in pairs if v}
    return raw | blk


def test_naive_rule_leaves_holes():
    """The naive rule misses up to d - 1 tokens; so the hole check above is not vacuous."""
    seq, d, w = 20, 4, 2
    geo = build_geometry(torch.zeros(1, 1, dtype=torch.long), seq, d, d, w, "inclusive")
    holes = {t: set(range(t + 1)) - _naive_sets(geo, t, w, "inclusive") for t in range(seq)}
    assert holes[6] == {4}  # raw [5, 6], block [0, 3]: token 4 reached by neither path
    assert max(len(h) for h in holes.values()) == d - 1
    # same geometry, phasemech's rule: no hole
    for t in range(seq):
        raw, blk, _ = geometry_sets(geo, 0, 0, t)
        assert raw | blk == set(range(t + 1))

    # across a grid of configs the naive rule fails somewhere for every stride > 1
    for d in range(2, 6):
        found = False
        for w, o in itertools.product(range(0, 2 * d + 2), range(d)):
            g = build_geometry(torch.tensor([[o]]), seq, d, d, w, "inclusive")
            if any(set(range(t + 1)) - _naive_sets(g, t, w, "inclusive") for t in range(seq)):
                found = True
                break
        assert found, d


def test_raw_band_is_wide_enough_and_never_past_t():
    for seq, d, w in itertools.product([1, 5, 17], [1, 3, 8], [0, 2, 9, 40]):
        off = torch.arange(d)[None]
        geo = build_geometry(off, seq, d, d, w, "inclusive")
        bp = geo.band_pos
        assert (bp <= torch.arange(seq)[:, None]).all()
        assert (bp[:, -1] == torch.arange(seq)).all()  # last band slot is the query itself
        assert not geo.band_valid[..., bp < 0].any()


@settings(max_examples=300, deadline=None)
@given(
    seq=st.integers(1, 30),
    d=st.integers(1, 6),
    extra=st.integers(0, 3),
    w=st.integers(0, 34),
    vis=st.sampled_from(VIS),
    scope=st.sampled_from(SCOPES),
    data=st.data(),
)
def test_last_query_blocks_is_the_maximum_over_every_query(seq, d, extra, w, vis, scope, data):
    """The closed form the config guard uses (``last_query_blocks``) against the full geometry:
    the most blocks any query uses, and the most it may rank (used less the forced block)."""
    o = data.draw(st.integers(0, d - 1))
    geo = build_geometry(torch.tensor([[o]]), seq, d, d + extra, w, vis, None, scope)
    used = geo.block_used[0, 0]  # [pos, block]
    t = torch.arange(seq)[:, None]
    forced = used & (geo.block_last[0, 0][None, :] == t)
    want = (int(used.sum(-1).max()), int((used & ~forced).sum(-1).max()))
    assert last_query_blocks(seq, d, d + extra, w, vis, o, scope) == want


@settings(max_examples=300, deadline=None)
@given(
    seq=st.integers(1, 30),
    d=st.integers(1, 5),
    extra=st.integers(0, 2),
    w=st.integers(0, 20),
    s=st.integers(1, 24),
    vis=st.sampled_from(VIS),
    scope=st.sampled_from(SCOPES[:2]),
    data=st.data(),
)
def test_a_sliding_window_layer_reads_only_its_window(seq, d, extra, w, s, vis, scope, data):
    """``local_window = S``: against the global geometry, by brute force. The raw span is the
    global one cut at ``t - S + 1``; the used blocks are the global ones lying wholly in
    ``[t - S + 1, t]``; a token of the sliding window reached by neither path lies in a block
    that straddles its start; with ``W >= S`` the layer reads exactly its sliding window raw."""
    o = data.draw(st.integers(0, d - 1))
    off, l = torch.tensor([[o]]), d + extra
    glob = build_geometry(off, seq, d, l, w, vis, None, scope)
    loc = build_geometry(off, seq, d, l, w, vis, None, scope, local_window=s)
    slots = [_slots(loc, i) for i in range(loc.slot_pos.shape[2])]
    for t in range(seq):
        oldest = max(0, t - s + 1)
        raw_g, _, used_g = geometry_sets(glob, 0, 0, t)
        raw, blk, used = geometry_sets(loc, 0, 0, t)
        assert raw == {j for j in raw_g if j >= oldest}
        assert used == [i for i in used_g if min(slots[i]) >= t - s + 1]
        assert raw | blk <= set(range(oldest, t + 1))
        for j in set(range(oldest, t + 1)) - raw - blk:  # lost only to a straddling block
            assert any(j in slots[i] and min(slots[i]) < t - s + 1 for i in used_g)
        if w >= s:
            assert raw == set(range(oldest, t + 1)) and not used


def _slots(geo, i: int) -> list[int]:
    pairs = zip(geo.slot_pos[0, 0, i], geo.slot_valid[0, 0, i], strict=True)
    return [int(p) for p, ok in pairs if ok]
