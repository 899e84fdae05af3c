"""The ``mlp`` compressor against a naive per-block loop, and its start as mean pooling."""

from __future__ import annotations

import torch
from conftest import make_model, randomize_compressors, tokens


def _naive_blocks(attn, k: torch.Tensor, v: torch.Tensor, seq: int, d: int):
    """Block i of the aligned grid covers positions [i*d - d, i*d - 1]: mean of its real tokens
    plus the MLP over the flattened slots (missing slots zero, position embeddings added)."""
    b, _, g, dh = k.shape
    n_blocks = seq // d + 1
    out_k = torch.zeros(b, g, n_blocks, dh)
    out_v = torch.zeros(b, g, n_blocks, dh)
    for i in range(n_blocks):
        pos = [i * d - d + j for j in range(d)]
        for gi in range(g):
            for x, pe, mlp, out in ((k, attn.pos_embed_k, attn.compress_k, out_k),
                                    (v, attn.pos_embed_v, attn.compress_v, out_v)):  # fmt: skip
                slots = torch.zeros(b, d, dh)
                real = [j for j, p in enumerate(pos) if 0 <= p < seq]
                for j in real:
                    slots[:, j] = x[:, pos[j], gi] + pe[gi, j]
                mean = torch.stack([x[:, pos[j], gi] for j in real]).mean(0) if real else 0
                out[:, gi, i] = mean + mlp(slots.flatten(1))
    return out_k, out_v


def test_mlp_blocks_equal_the_naive_loop():
    model = make_model("mlp", stride=4, window=4)
    randomize_compressors(model)
    x = tokens(seq=20)
    _, cache = model.run_with_cache(x)
    attn = model.blocks[0].attn
    k, v = cache["blocks.0.attn.hook_k"], cache["blocks.0.attn.hook_v"]
    want_k, want_v = _naive_blocks(attn, k, v, 20, 4)
    got_k = cache["blocks.0.attn.hook_k_block"].permute(0, 2, 1, 3)  # [b, g, block, d]
    got_v = cache["blocks.0.attn.hook_v_block"].permute(0, 2, 1, 3)
    n = got_k.shape[2]
    torch.testing.assert_close(got_k, want_k[:, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v, want_v[:, :, :n], atol=1e-5, rtol=1e-5)


def test_mlp_starts_as_mean_pooling():
    """The output layer starts at zero: a fresh mlp model computes what mean pooling does."""
    x = tokens(seq=20)
    mlp, mean = make_model("mlp", stride=4, window=4), make_model("mean", stride=4, window=4)
    shared = {k: w for k, w in mlp.state_dict().items() if k in mean.state_dict()}
    mean.load_state_dict(shared)
    torch.testing.assert_close(mlp(x), mean(x), atol=1e-5, rtol=1e-5)
