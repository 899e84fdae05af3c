"""``partition`` (head-partitioned history) against a naive per-query reference, and the
property that defines it: beyond the window, every past token is read by exactly one head."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hooked, raises_naming, tokens
from test_selection import _real_slots

from phasemech import CompressionConfig, PhaseTransformer


def naive_partition_z(layer, q, k, v, geo, key_valid=None):
    """Head ``h`` attends the real tokens of the candidate blocks ``i`` with
    ``(i - first) mod H == h`` (``first``: the first block with a real token), the block the
    query closes, and its raw span, in one softmax."""
    b, seq, h, _ = q.shape
    rep = h // k.shape[2]
    out = torch.zeros_like(q)
    for s in range(b):
        for head in range(h):
            g = head // rep
            for t in range(seq):
                cand = geo.block_used[s, g, t].nonzero().flatten().tolist()
                first = min(
                    i for i in range(geo.slot_valid.shape[2]) if geo.slot_valid[s, g, i].any()
                )
                own = [i for i in cand if (i - first) % h == head]
                kept = own + [i for i in cand if int(geo.block_last[s, g, i]) == t]
                toks = {p for i in kept for p in _real_slots(geo, s, g, i)}
                toks |= set(range(max(int(geo.raw_start[s, g, t]), 0), t + 1))
                if key_valid is not None:
                    toks = {p for p in toks if key_valid[s, p]}
                if not toks:
                    continue
                idx = torch.tensor(sorted(toks))
                scores = (k[s, idx, g] @ q[s, t, head]) / layer.attn_scale
                out[s, t, head] = torch.softmax(scores, 0) @ v[s, idx, g]
    return out


def _model(**comp):
    tl_model = make_hooked(rotary=True, gqa=True, n_layers=1)
    return PhaseTransformer.from_hooked(tl_model, CompressionConfig("partition", **comp)).eval()


@pytest.mark.parametrize(
    "comp",
    [dict(stride=4, window=6), dict(stride=3, window=0, offsets=(1, 2), visibility="strict")],
)
@pytest.mark.parametrize("padded", [False, True])
def test_partition_matches_the_naive_reference(comp, padded):
    model = _model(**comp)
    x = tokens(2, 34, seed=5)
    mask = torch.ones_like(x)
    if padded:
        mask[0, :5] = 0
    _, cache = model.run_with_cache(x, attention_mask=mask)
    attn = model.blocks[0].attn
    q, k = cache["blocks.0.attn.hook_rot_q"], cache["blocks.0.attn.hook_rot_k"]
    v = cache["blocks.0.attn.hook_v"]
    geo = attn._geometry(cache["blocks.0.attn.hook_grid_offset"], 34, mask.bool())
    want = naive_partition_z(attn, q.double(), k.double(), v.double(), geo, mask.bool())
    got = cache["blocks.0.attn.hook_z"].double()
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)


def test_every_far_token_is_read_by_exactly_one_head():
    model = _model(stride=4, window=4)
    model.set_use_token_pattern(True)
    _, cache = model.run_with_cache(tokens(1, 40, seed=1))
    tp = cache["blocks.0.attn.hook_token_pattern"][0]  # [head, pos, key_pos]
    t = 39
    readers = (tp[:, t, :] > 0).sum(0)  # heads that read each key
    far = 39 - 4 - 4  # well before the window and the query's own block
    assert (readers[:far] == 1).all(), readers
    assert (readers[t - 3 :] == 4).all()  # the window: every head


def test_partition_takes_no_top_k():
    raises_naming("top_k", 2, design="partition", top_k=2)
