"""``partition`` (head-partitioned history) against the selecting designs' naive per-query
reference under its fixed rule (the blocks a head owns), and the property that defines it:
beyond the window, every past token is read by exactly one head."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hooked, raises_naming, tokens
from test_selection import naive_z

from phasemech import CompressionConfig, PhaseTransformer


def owned_blocks(h: int, geo):
    """The fixed rule: head ``head`` ranks (score 0) the blocks ``i`` with
    ``(i - first) mod H == head``, ``first`` the first block with a real token, and no other."""

    def score(s, g, t, i, head):
        first = int(geo.slot_valid[s, g].any(-1).int().argmax())
        return 0.0 if (i - first) % h == head else None

    return score


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
    rule = owned_blocks(q.shape[2], geo)
    want = naive_z(attn, q.double(), k.double(), v.double(), geo, rule, key_valid=mask.bool())
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
