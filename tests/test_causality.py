"""No compressed design lets a query see the future, or a token that ``attention_mask`` hides
(at any position, not only left padding), whatever the grid."""

from __future__ import annotations

import torch
from conftest import D_VOCAB, make_model, randomize_compressors
from hypothesis import given, settings
from hypothesis import strategies as st

from phasemech import CompressionConfig
from phasemech.core.config import DESIGNS, SELECTING_DESIGNS, TOP_K_DESIGNS

N_LAYERS = 2


@st.composite
def configs(draw):
    design = draw(st.sampled_from([d for d in DESIGNS if d != "none"]))
    d = draw(st.integers(1, 6))
    gqa = draw(st.booleans())
    n_kv = 2 if gqa else 4
    mode = draw(st.sampled_from(["aligned", "per_layer", "per_head", "random", "explicit"]))
    if mode == "explicit":
        shape = draw(st.sampled_from(["kv", "layer_kv"]))
        row = st.lists(st.integers(0, d - 1), min_size=n_kv, max_size=n_kv).map(tuple)
        if shape == "kv":
            offsets = draw(row)
        else:
            offsets = tuple(draw(row) for _ in range(N_LAYERS))
    else:
        offsets = mode
    comp = CompressionConfig(
        design,
        stride=d,
        block_len=d * draw(st.integers(1, 2))
        if design in ("csa", "hca")
        else d + (0 if design in ("kpool", "dsa") else draw(st.integers(0, 3))),
        window=draw(st.integers(0, 12)),
        visibility=draw(st.sampled_from(["inclusive", "strict"])),
        offsets=offsets,
        top_k=draw(st.integers(1, 3)) if design in TOP_K_DESIGNS else None,
        obs_window=draw(st.integers(1, 10)) if design == "evict" else None,
        gate=draw(st.sampled_from(["scalar", "channel"])) if design == "gated" else "scalar",
        eval_offset=draw(st.integers(0, d - 1)) if mode == "random" else 0,
        layers=draw(st.sampled_from([None, (1,), (0, 1)])),
        block_scope="outside_window"
        if design in SELECTING_DESIGNS
        else draw(st.sampled_from(["outside_window", "all"])),
        select_len=d * draw(st.integers(1, 3)) if design == "nsa" else None,
        gate_hidden=draw(st.sampled_from([None, 5])) if design == "nsa" else None,
        indexer_train=draw(st.sampled_from(["kl", "end_to_end"])) if design == "dsa" else None,
        pool_rope=draw(st.sampled_from(["pre", "post"])) if design in ("csa", "hca") else None,
    )
    rotary = draw(st.booleans())
    return comp, gqa, rotary


def _run(model, x, seed, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model(x, **kwargs)


@settings(max_examples=40, deadline=None)
@given(cfg=configs(), data=st.data())
def test_future_tokens_never_change_the_past(cfg, data):
    comp, gqa, rotary = cfg
    model = make_model(compression=comp, gqa=gqa, rotary=rotary, n_layers=N_LAYERS)
    randomize_compressors(model, seed=1)
    seq = data.draw(st.integers(2, 40))
    t = data.draw(st.integers(0, seq - 2))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, D_VOCAB, (2, seq), generator=gen)
    y = x.clone()
    y[:, t + 1 :] = torch.randint(0, D_VOCAB, (2, seq - t - 1), generator=gen)
    y[:, t + 1] = (x[:, t + 1] + 1) % D_VOCAB  # certainly a change
    for train in (False, True) if comp.offsets == "random" else (False,):
        model.train(train)
        a, b = _run(model, x, seed), _run(model, y, seed)
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-5, rtol=0)
    model.eval()


def test_random_offsets_draws_match_under_seed():
    """The seed trick above really fixes the offsets (else the test could pass vacuously
    or fail spuriously)."""
    model = make_model("mean", stride=5, window=0, offsets="random").train()
    x = torch.randint(0, D_VOCAB, (3, 30), generator=torch.Generator().manual_seed(0))
    grabbed = []
    hook = ("blocks.0.attn.hook_grid_offset", lambda v, hook: grabbed.append(v.clone()))
    for _ in range(2):
        torch.manual_seed(123)
        model.run_with_hooks(x, fwd_hooks=[hook])
    assert torch.equal(grabbed[0], grabbed[1])


def test_causality_sanity_future_does_change_future():
    """Changing token t+1 does change logits at t+1 (so the comparison has teeth)."""
    model = make_model("mean", stride=3, window=2)
    x = torch.randint(0, D_VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % D_VOCAB
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=1e-5, rtol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-5)


@settings(max_examples=80, deadline=None)
@given(cfg=configs(), dense=st.integers(0, 5).map(lambda i: i == 0), data=st.data())
def test_masked_tokens_never_change_unmasked_positions(cfg, dense, data):
    """Tokens hidden by ``attention_mask`` anywhere in the sequence (the middle, the start, the
    end, runs of them) change no logit at an unmasked position, for every design and the dense
    model (TransformerLens' own attention)."""
    comp, gqa, rotary = cfg
    comp = CompressionConfig("none") if dense else comp
    model = make_model(compression=comp, gqa=gqa, rotary=rotary, n_layers=N_LAYERS)
    randomize_compressors(model, seed=2)
    seq = data.draw(st.integers(2, 40))
    hidden = data.draw(
        st.lists(st.lists(st.booleans(), min_size=seq, max_size=seq), min_size=2, max_size=2)
    )
    mask = 1 - torch.tensor(hidden, dtype=torch.long)  # [batch, pos]: 0 where hidden
    if mask.all():
        mask[0, data.draw(st.integers(0, seq - 1))] = 0
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, D_VOCAB, (2, seq), generator=gen)
    y = torch.where(
        mask.bool(), x, (x + torch.randint(1, D_VOCAB, x.shape, generator=gen)) % D_VOCAB
    )
    for train in (False, True) if comp.offsets == "random" else (False,):
        model.train(train)
        a = _run(model, x, seed, attention_mask=mask)
        b = _run(model, y, seed, attention_mask=mask)
        keep = mask.bool()
        assert torch.isfinite(a[keep]).all() and torch.isfinite(b[keep]).all()
        torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=0)
    model.eval()


def test_evict_masked_middle_token_regression():
    """The issue's case: ``evict`` scored chunks with the masked token's own query, so the
    logits after a masked middle token moved with it."""
    from phasemech import PhaseTransformer, PhaseTransformerConfig

    cfg = PhaseTransformerConfig(
        n_layers=2, d_model=64, n_heads=4, d_head=16, n_ctx=256, d_vocab=64, attn_only=True,
        act_fn=None, seed=0,
        compression=CompressionConfig("evict", stride=4, window=8, layers=(1,), top_k=2),
    )  # fmt: skip
    model = PhaseTransformer(cfg).eval()
    x = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    mask[0, 20] = 0
    y = x.clone()
    y[0, 20] = (y[0, 20] + 1) % 64
    a, b = _run(model, x, None, attention_mask=mask), _run(model, y, None, attention_mask=mask)
    assert not torch.allclose(a[0, 20], b[0, 20])  # the masked position itself does change
    torch.testing.assert_close(a[0, 21:], b[0, 21:], atol=1e-6, rtol=0)
