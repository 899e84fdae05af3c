"""``csa`` / ``hca`` (DeepSeek-V4's compressors) against a naive per-block loop written from
the definition: entries (pre- and post-RoPE), gradients, and the layer's one softmax."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, raises_naming, randomize_compressors, tokens

from phasemech import CompressionConfig


def _rotate_at(attn, x: torch.Tensor, p: int) -> torch.Tensor:
    """TransformerLens' own rotary applied to ``x [d_head]`` as if it sat at position ``p``."""
    seq = torch.zeros(1, p + 1, 1, x.shape[-1], dtype=x.dtype)
    seq = seq.index_put((torch.tensor([0]), torch.tensor([p]), torch.tensor([0])), x[None])
    return attn.apply_rotary(seq, 0, None)[0, p, 0]


def _naive_entries(attn, x, content, g, o, which: str, pre_rope: bool):
    """Entries ``[block, d_head]`` of KV head ``g`` (offset ``o``) of one sequence: block i
    holds positions [i*d + o - l, i*d + o - 1]; per channel, softmax over the real slots of
    ``x_j W_z[series] + B[slot]``; content ``c_j P[series]``; RMSNorm; times ``w``."""
    d, ln, seq = attn.stride, attn.block_len, x.shape[0]
    w_z, proj, bias, weight = (getattr(attn, f"{n}_{which}") for n in ("W_z", "P", "B", "w"))
    out = []
    for i in range(seq // d + 1):
        pos = [i * d + o - ln + j for j in range(ln)]
        real = [j for j, p in enumerate(pos) if 0 <= p < seq]
        if not real:
            out.append(torch.zeros(content.shape[-1]))
            continue
        logits = torch.stack([x[pos[j]] @ w_z[g, j // d] + bias[g, j] for j in real])
        alpha = torch.softmax(logits, 0)  # [slot, d_head]: per channel
        c = torch.stack([content[pos[j], g] @ proj[g, j // d] for j in real])
        pooled = (alpha * c).sum(0)
        entry = pooled / (pooled.pow(2).mean() + 1e-6).sqrt() * weight[g]
        if pre_rope:
            entry = _rotate_at(attn, entry, max(i * d + o - d, 0))
        out.append(entry)
    return torch.stack(out)


CASES = {
    "csa_pre": ("csa", dict(stride=4, window=4, rotary=True, offsets="per_head", gqa=True)),
    "csa_post": ("csa", dict(stride=3, window=2, rotary=True, pool_rope="post")),
    "csa_three_series": ("csa", dict(stride=2, block_len=6, window=3)),
    "hca_pre": ("hca", dict(stride=8, window=4, rotary=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_entries_equal_the_naive_loop(case):
    design, kw = CASES[case]
    model = make_model(design, **kw)
    randomize_compressors(model, seed=3)
    x_tok = tokens(1, 26, seed=4)
    _, cache = model.run_with_cache(x_tok)
    attn = model.blocks[0].attn
    x = cache["blocks.0.ln1.hook_normalized"][0]
    pre = attn.pool_rope == "pre" and model.cfg.positional_embedding_type == "rotary"
    k = cache["blocks.0.attn.hook_k" if pre or "rotary" not in kw else "blocks.0.attn.hook_rot_k"]
    v = cache["blocks.0.attn.hook_v"][0]
    offsets = cache["blocks.0.attn.hook_grid_offset"][0]
    got_k = cache["blocks.0.attn.hook_k_block"][0]  # [block, kv_head, d_head]
    got_v = cache["blocks.0.attn.hook_v_block"][0]
    for g in range(k.shape[2]):
        o = int(offsets[g])
        want_k = _naive_entries(attn, x, k[0], g, o, "K", pre)
        want_v = _naive_entries(attn, x, v, g, o, "V", False)
        n = got_k.shape[0]
        torch.testing.assert_close(got_k[:, g], want_k[:n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got_v[:, g], want_v[:n], atol=1e-5, rtol=1e-4)


def test_the_layer_is_one_softmax_over_entries_and_window():
    """z from the entries and the raw window by the definition (block_scope="all": every
    complete block, the window included)."""
    model = make_model("csa", stride=4, window=5)
    randomize_compressors(model, seed=1)
    _, cache = model.run_with_cache(tokens(1, 22, seed=2))
    attn = model.blocks[0].attn
    q, k, v = (cache[f"blocks.0.attn.hook_{n}"][0] for n in "qkv")
    kb, vb = cache["blocks.0.attn.hook_k_block"][0], cache["blocks.0.attn.hook_v_block"][0]
    z = cache["blocks.0.attn.hook_z"][0]
    d = attn.stride
    for t in range(22):
        blocks = [i for i in range(kb.shape[0]) if 0 <= i * d - 1 <= t]  # complete, real
        raw = list(range(max(0, min(t - attn.window + 1, t - (t + 1) % d + 1)), t + 1))
        for h in range(q.shape[1]):
            keys = torch.cat([kb[blocks, h], k[raw, h]])
            vals = torch.cat([vb[blocks, h], v[raw, h]])
            p = torch.softmax(keys @ q[t, h] / attn.attn_scale, 0)
            torch.testing.assert_close(z[t, h], p @ vals, atol=1e-5, rtol=1e-4)


def test_entry_gradients_equal_the_naive_loop():
    model = make_model("csa", stride=3, window=2, rotary=True)
    randomize_compressors(model, seed=5)
    attn = model.blocks[0].attn
    _, cache = model.run_with_cache(tokens(1, 14, seed=1))
    x = cache["blocks.0.ln1.hook_normalized"].detach()
    k_rot = cache["blocks.0.attn.hook_rot_k"].detach()
    k_pre = cache["blocks.0.attn.hook_k"][0].detach()
    v = cache["blocks.0.attn.hook_v"].detach()
    geo = attn._geometry(cache["blocks.0.attn.hook_grid_offset"], 14, None)
    got, _, _ = attn.pool(x, k_rot, v, geo)  # [batch, kv_head, block, d]
    want = torch.stack([_naive_entries(attn, x[0], k_pre, g, 0, "K", True) for g in range(4)])
    w = torch.randn_like(want)
    params = [attn.W_z_K, attn.P_K, attn.B_K, attn.w_K]
    n = got.shape[2]
    g_got = torch.autograd.grad((got[0] * w[:, :n]).sum(), params)
    g_want = torch.autograd.grad((want[:, :n] * w[:, :n]).sum(), params)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_pre_and_post_rope_pooling_differ_only_with_rotary():
    x = tokens(2, 24)
    pre = make_model("csa", stride=4, window=4, rotary=True)
    post = make_model("csa", stride=4, window=4, rotary=True, pool_rope="post")
    post.load_state_dict(pre.state_dict())
    assert not torch.allclose(pre(x), post(x))
    # without rotary the two are one design
    a, b = make_model("csa", stride=4, window=4), make_model("csa", stride=4, window=4,
                                                             pool_rope="post")  # fmt: skip
    torch.testing.assert_close(a(x), b(x), atol=0, rtol=0)


def test_config_defaults_and_errors():
    csa, hca = CompressionConfig("csa", stride=4), CompressionConfig("hca", stride=16)
    assert (csa.block_len, csa.block_scope, csa.pool_rope) == (8, "all", "pre")
    assert (hca.block_len, hca.block_scope) == (16, "all")
    raises_naming("block_len", 6, design="csa", stride=4, block_len=6)
    raises_naming("pool_rope", "pre", design="mean", pool_rope="pre")
    raises_naming("pool_rope", "mid", design="hca", pool_rope="mid")
    assert "pool_rope" not in CompressionConfig("gated").to_dict()
