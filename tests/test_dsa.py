"""``dsa`` (GLM-5.3's k-pool indexer) against a naive reference: the indexer's pool scores by
their definition, then the selecting designs' naive attention; its KL objective against a
loop; the straight-through option."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_hooked, raises_naming, tokens
from test_selection import _real_slots, naive_z

from phasemech import CompressionConfig, PhaseTransformer

RG = {"rotary": True, "gqa": True}


def _model(**comp) -> PhaseTransformer:
    model = PhaseTransformer.from_hooked(
        make_hooked(**RG, n_layers=1), CompressionConfig("dsa", **comp)
    ).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a non-zero position bias, so slots are told apart
        bias = model.blocks[0].attn.pool_bias
        bias.copy_(torch.randn(bias.shape, generator=gen))
        model.blocks[0].attn.W_ig.mul_(20.0)
    return model


def naive_index(attn, x, geo):
    """``score(s, g, t, i)`` from the definition (no gradient: selection has none)."""

    def score(s, g, t, i, head=None):
        with torch.no_grad():
            return float(_index_score(attn, x.detach(), geo, s, g, t, i))

    return score


def _inputs(model, x, attention_mask=None):
    _, cache = model.run_with_cache(x, attention_mask=attention_mask)
    attn = model.blocks[0].attn
    kv = None if attention_mask is None else attention_mask.bool()
    geo = attn._geometry(cache["blocks.0.attn.hook_grid_offset"], x.shape[1], kv)
    parts = [cache[f"blocks.0.{n}"] for n in ("ln1.hook_normalized", "attn.hook_rot_q",
                                               "attn.hook_rot_k", "attn.hook_v")]  # fmt: skip
    return attn, geo, cache, parts


@pytest.mark.parametrize(
    "comp",
    [dict(stride=4, window=6, top_k=2), dict(stride=3, window=0, top_k=1, offsets=(1, 2))],
)
def test_dsa_matches_the_naive_reference(comp):
    model = _model(**comp)
    x_tok = tokens(2, 30, seed=5)
    attn, geo, cache, (x, q, k, v) = _inputs(model, x_tok)
    want = naive_z(attn, q.double(), k.double(), v.double(), geo, naive_index(attn, x, geo))
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"].double(), want, atol=1e-5, rtol=0)
    ranked = cache["blocks.0.attn.hook_route_scores"].isfinite().sum(-1)
    assert (ranked > attn.top_k).any()  # selection bites
    # one indexer score per query serves every head
    scores = cache["blocks.0.attn.hook_route_scores"]
    torch.testing.assert_close(scores[:, 0], scores[:, 1])


def test_dsa_left_padding_matches_the_reference():
    model = _model(stride=4, window=4, top_k=1)
    x = tokens(1, 24, seed=3)
    pad = 5
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(x)], 1)
    torch.testing.assert_close(
        model(padded, attention_mask=mask)[:, pad:], model(x), atol=1e-5, rtol=0
    )


def _naive_kl(attn, x, q, k, geo, key_valid=None, top_k=None) -> torch.Tensor:
    """The KL term by loops: each head's attention mass per ranked candidate pool (not the
    pool the query closes: it is kept unranked) renormalised over those pools, summed over a
    KV group's heads and renormalised,
    against the indexer's softmax over those candidates; masked queries left out. With
    ``top_k`` (DSA's sparse stage) the candidates are only the ``top_k`` best-scored ones."""
    b, seq, h, _ = q.shape
    g_n = k.shape[2]
    rep = h // g_n
    terms = []
    for s in range(b):
        for g in range(g_n):
            for t in range(seq):
                cand = geo.block_used[s, g, t].nonzero().flatten().tolist()
                cand = [i for i in cand if int(geo.block_last[s, g, i]) != t]
                if top_k is not None:  # the best-scored, ties to the later pool
                    with torch.no_grad():
                        sc = {i: float(_index_score(attn, x, geo, s, g, t, i)) for i in cand}
                    cand = sorted(sorted(cand, key=lambda i: (sc[i], i))[-top_k:])
                if not cand or (key_valid is not None and not key_valid[s, t]):
                    continue
                mass = torch.zeros(len(cand))
                keys = [j for j in range(t + 1) if key_valid is None or key_valid[s, j]]
                for r in range(rep):  # each head's attention on the pools, renormalised
                    p = torch.softmax((k[s, keys, g] @ q[s, t, g * rep + r]) / attn.attn_scale, 0)
                    on = dict(zip(keys, p, strict=True))
                    head = torch.stack([sum(on[j] for j in _real_slots(geo, s, g, i))
                                        for i in cand])  # fmt: skip
                    mass += head / head.sum()
                target = mass / mass.sum()
                score = torch.stack([_index_score(attn, x, geo, s, g, t, i) for i in cand])
                logp = torch.log_softmax(score, 0)
                terms.append((target * (target.log() - logp)).sum())
    return torch.stack(terms).mean()


def _index_score(attn, x, geo, s, g, t, i):
    """One pool's score by its definition: softmax-gated pooling of the indexer keys over the
    pool's real tokens, then ``sum_i w_i ReLU(q_i . k_pool)`` (differentiable: the KL trains
    the indexer)."""
    slots = _real_slots(geo, s, g, i)
    index = [geo.slot_pos[s, g, i].tolist().index(p) for p in slots]
    kx = attn.apply_rotary((x[s : s + 1] @ attn.W_ik)[:, :, None], 0, None)[0, :, 0]
    qx = attn.apply_rotary(torch.einsum("bpm,imd->bpid", x[s : s + 1], attn.W_iq), 0, None)[0]
    logits = torch.stack([x[s, p] @ attn.W_ig + attn.pool_bias[j]
                          for p, j in zip(slots, index, strict=True)])  # fmt: skip
    k_pool = torch.softmax(logits, 0) @ kx[slots]
    return (x[s, t] @ attn.W_iw * (qx[t] @ k_pool).relu()).sum()


@pytest.mark.parametrize(
    ("masked", "stage"), [(False, "warmup"), (True, "warmup"), (False, "sparse"), (True, "sparse")]
)
def test_dsa_kl_equals_the_loop(masked, stage):
    """Warm-up (every block read): the KL covers every ranked candidate; sparse stage: only
    the ``top_k`` pools the indexer selected (DSA's two stages)."""
    model = _model(stride=4, window=4, top_k=2)
    x_tok = tokens(1, 24, seed=1)
    mask = torch.ones_like(x_tok)
    if masked:
        mask[0, [2, 9, 10]] = 0  # hidden keys, and hidden queries that are no training row
    attn, geo, _, (x, q, k, _) = _inputs(model, x_tok, attention_mask=mask)
    model.train()
    attn.keep_all = stage == "warmup"
    got = attn.indexer_kl(attn.indexer(x, geo), q, k, geo)
    top_k = None if stage == "warmup" else attn.top_k
    want = _naive_kl(attn, x, q, k, geo, key_valid=mask.bool() if masked else None, top_k=top_k)
    if stage == "sparse":  # the selection bites: fewer pools than the warm-up's term covers
        attn.keep_all = True
        assert not torch.isclose(got, attn.indexer_kl(attn.indexer(x, geo), q, k, geo))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    params = [attn.W_iq, attn.W_ik, attn.W_iw, attn.W_ig, attn.pool_bias, attn.W_Q]
    grads = torch.autograd.grad(got, params, allow_unused=True)
    want_grads = torch.autograd.grad(want, params[:-1])
    for a, b in zip(grads[:-1], want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert grads[-1] is None  # the target is the main attention, detached


def test_dsa_kl_trains_only_the_indexer():
    """DSA: the KL term reaches the indexer's parameters and nothing upstream or beside it;
    a training forward leaves it for the trainer, an eval forward leaves nothing."""
    model = PhaseTransformer.from_hooked(
        make_hooked(**RG, n_layers=2), CompressionConfig("dsa", stride=4, window=4, layers=(1,))
    ).train()
    x = tokens(2, 24, seed=1)
    model(x)
    model.auxiliary_loss().backward()
    indexer = ("W_iq", "W_ik", "W_iw", "W_ig", "pool_bias")
    for name, p in model.named_parameters():
        grad = 0.0 if p.grad is None else float(p.grad.abs().sum())
        assert (grad > 0) == name.endswith(indexer), name
    model.eval()
    model(x)
    assert model.auxiliary_loss() is None


def test_dsa_end_to_end_keeps_the_forward_and_trains_the_indexer():
    kl, e2e = _model(stride=4, window=4, top_k=1), _model(stride=4, window=4, top_k=1,
                                                          indexer_train="end_to_end")  # fmt: skip
    x = tokens(2, 24, seed=4)
    # float64: the straight-through bias (zero) takes the gather, the KL model the tiles
    torch.testing.assert_close(kl.double()(x), e2e.double()(x), atol=1e-12, rtol=0)
    e2e.float().train()
    e2e(x, return_type="loss").backward()
    assert e2e.auxiliary_loss() is None
    attn = e2e.blocks[0].attn
    for p in (attn.W_iq, attn.W_ik, attn.W_iw, attn.W_ig, attn.pool_bias):
        assert p.grad is not None and p.grad.abs().sum() > 0
    kl.train()
    kl(x, return_type="loss").backward()  # without its KL term the indexer gets nothing
    assert kl.blocks[0].attn.W_iq.grad is None or kl.blocks[0].attn.W_iq.grad.abs().sum() == 0


def test_dsa_config_errors_name_the_value():
    raises_naming("indexer_train", "sgd", design="dsa", indexer_train="sgd")
    raises_naming("index_heads", 0, design="dsa", index_heads=0)
    raises_naming("index_heads", 2, design="route", index_heads=2)
    raises_naming("block_len", 8, design="dsa", stride=4, block_len=8)
    comp = CompressionConfig("dsa")
    assert (comp.index_heads, comp.indexer_train) == (2, "kl")
    assert CompressionConfig.from_dict(comp.to_dict()) == comp


def test_keep_every_block_is_dense_attention_and_is_restored():
    """DSA's dense warm-up: every candidate pool kept, so the layer is dense attention."""
    hooked = make_hooked(**RG, n_layers=2)
    model = PhaseTransformer.from_hooked(hooked, CompressionConfig("dsa", stride=4, window=2))
    x = tokens(2, 30, seed=1)
    assert not torch.allclose(model(x), hooked(x), atol=1e-4)
    with model.keep_every_block():
        torch.testing.assert_close(model(x), hooked(x), atol=1e-5, rtol=1e-5)
    assert not any(getattr(b.attn, "keep_all", False) for b in model.blocks)
    with model.keep_every_block(False):
        assert not torch.allclose(model(x), hooked(x), atol=1e-4)


def test_selection_warmup_trains_dense_then_sparse(tmp_path, monkeypatch):
    """The trainer keeps every block for the first selection_warmup steps only; the field
    stays out of the config dict when 0 (old cache keys hold)."""
    from phasemech.data.tasks import MQARTask
    from phasemech.training import trainer
    from phasemech.training.config import ModelSpec, TrainConfig

    cfg = TrainConfig(
        task=MQARTask(vocab_size=16, seq_len=32, n_pairs=3, stride=4),
        model=ModelSpec(n_layers=2, d_model=16, n_heads=2),
        compression=CompressionConfig("dsa", stride=4, window=4, layers=(1,)),
        steps=4, eval_every=2, eval_sequences=8, selection_warmup=2,
    )  # fmt: skip
    assert "selection_warmup" not in TrainConfig().to_dict()
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    seen = []
    real = trainer.answer_logits

    def spy(model, tokens, qp):
        if model.training:
            seen.append(model.blocks[1].attn.keep_all)
        return real(model, tokens, qp)

    monkeypatch.setattr(trainer, "answer_logits", spy)
    trainer.train(cfg, tmp_path / "run", progress=False)
    assert seen == [True, True, False, False]
    # the early stop waits for the sparse steps, even with a perfect score from the start
    seen.clear()
    monkeypatch.setattr(trainer, "held_out_accuracy", lambda *a, **k: (1.0, [1.0] * 4, 0.0))
    easy = dataclasses.replace(cfg, target_accuracy=0.99, steps=6)
    result = trainer.train(easy, tmp_path / "easy", progress=False)
    assert result.step == 4 and seen == [True, True, False, False]


@pytest.mark.parametrize("ties", [False, True])
def test_dsa_kl_pools_are_the_pools_the_engine_keeps(ties):
    """The sparse stage's KL covers exactly the ranked pools the attention reads (the engine's
    ``hook_route_selected`` less any forced closing pool), ties included (zero indexer queries
    score every pool 0: both break ties toward the later pool)."""
    model = _model(stride=4, window=4, top_k=2, offsets="per_head")
    if ties:
        with torch.no_grad():
            model.blocks[0].attn.W_iq.zero_()
    x_tok = tokens(2, 28, seed=6)
    mask = torch.ones_like(x_tok)
    mask[1, :3] = 0  # left padding
    attn, geo, cache, _ = _inputs(model, x_tok, attention_mask=mask)
    rep = model.cfg.n_heads // geo.block_used.shape[1]
    scores = cache["blocks.0.attn.hook_route_scores"][:, ::rep]  # one KV head's queries agree
    got = attn.kl_pools(scores, geo)
    kept = cache["blocks.0.attn.hook_route_selected"][:, ::rep]
    t = torch.arange(x_tok.shape[1])
    closes = geo.block_last[:, :, None, :] == t[:, None]
    assert torch.equal(got, kept & ~closes)
    assert bool(got.any()) and bool((geo.block_used & ~closes & ~got).any())  # selection bites
