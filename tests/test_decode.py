"""The decode regime (prefill with full attention, then rows read the compressed KV cache)
against the trained regime's full forward where they must agree, and against step-by-step
generation. Tiny rotary GQA models."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hooked, tokens

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.interventions.prompts import expanded_cache, plain_cache
from phasemech.model.decode import check_regime, needed_queries, prefill, read_rows

torch.set_num_threads(1)

COMPS = {
    "mean": dict(stride=4, window=4),
    "mlp": dict(stride=4, window=4),
    "route": dict(stride=4, window=3, top_k=1),
    "quest": dict(stride=3, block_len=6, window=0, top_k=2),
    "kpool": dict(stride=4, window=5, top_k=2, offsets=(1, 3)),
    "evict": dict(stride=4, window=4, top_k=1, obs_window=5),
}


def _pair(design: str, n_layers: int):
    tl_model = make_hooked(rotary=True, gqa=True, n_layers=n_layers, attn_only=False)
    comp = CompressionConfig(design, **COMPS[design])
    model = PhaseTransformer.from_hooked(tl_model, comp).eval()
    if design == "mlp":  # a compressor that is not the mean
        with torch.no_grad():
            for b in model.blocks:
                b.attn.compress_k[2].weight.normal_(0, 0.3)
    return tl_model.eval(), model


def _resid(model, x):
    with torch.inference_mode():
        return model(x, stop_at_layer=model.cfg.n_layers)


@pytest.mark.parametrize("design", list(COMPS))
def test_one_layer_decode_equals_the_full_forward(design):
    """One layer: the prefill's keys (and queries) are the same under both regimes, so the
    rows after the prefill must equal the compressed model's full forward there."""
    tl_model, model = _pair(design, n_layers=1)
    x = tokens(1, 40, seed=3)
    p = 23
    cache = prefill(tl_model, x[:, :p], keep_queries=needed_queries(model))
    got = read_rows(model, cache, x[:, p:])
    want = _resid(model, x)[:, p:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(want, _resid(tl_model, x)[:, p:], atol=1e-4)  # compression bites


@pytest.mark.parametrize("design", list(COMPS))
def test_copies_of_one_prefill_read_it_once(design):
    """Patching batches copies of one frozen prefill (expanded views). Its keys are rotated
    once and kept on the entry; the prefill's unknown queries are never read (NaN there
    changes nothing); each copy's rows equal the full forward of its own sequence."""
    tl_model, model = _pair(design, n_layers=1)
    for block in model.blocks:
        block.attn.unknown_query = float("nan")
    p = 23
    x = tokens(3, 40, seed=3)
    x[1:, :p] = x[0, :p]  # one document, three continuations
    shared = expanded_cache(plain_cache(prefill(tl_model, x[:1, :p], needed_queries(model))), 3)
    want = _resid(model, x)[:, p:]
    for _ in range(2):  # the second forward reads the rotation the first one kept
        torch.testing.assert_close(read_rows(model, shared, x[:, p:]), want, atol=1e-5, rtol=0)
    assert shared.entries[0].rotated_keys.stride(0) == 0  # one copy rotated, not three


@pytest.mark.parametrize("design", list(COMPS))
def test_chunk_equals_step_by_step_generation(design):
    """All rows after the prefill in one forward == one row at a time with the cache growing
    (what decoding does), on a 2-layer model; the frozen prefill is left as it was."""
    tl_model, model = _pair(design, n_layers=2)
    x = tokens(1, 36, seed=5)
    p = 20
    cache = prefill(tl_model, x[:, :p], keep_queries=needed_queries(model))
    keys_before = cache.entries[1].past_keys.clone()
    chunk = read_rows(model, cache, x[:, p:])
    assert torch.equal(cache.entries[1].past_keys, keys_before)
    cache.unfreeze()
    steps = torch.cat([read_rows(model, cache, x[:, t : t + 1]) for t in range(p, 36)], 1)
    torch.testing.assert_close(chunk, steps, atol=1e-5, rtol=0)
    assert cache.entries[0].past_keys.shape[1] == 36


@pytest.mark.parametrize("design", ["route", "mean"])
def test_decode_after_one_token_is_the_trained_regime(design):
    """A one-token prefill has nothing to compress: decode == trained at every depth."""
    tl_model, model = _pair(design, n_layers=2)
    x = tokens(2, 30, seed=1)
    cache = prefill(tl_model, x[:, :1])
    torch.testing.assert_close(read_rows(model, cache, x[:, 1:]), _resid(model, x)[:, 1:],
                               atol=1e-5, rtol=0)  # fmt: skip


def test_shortformer_decode_reads_key_and_value_inputs():
    """Shortformer adds positions to keys and values, not queries: the cached rows must use
    the layer's key/value inputs (one layer: decode equals the full forward)."""
    tl_model = make_hooked(n_layers=1, positional_embedding_type="shortformer").eval()
    model = PhaseTransformer.from_hooked(tl_model, CompressionConfig("route", stride=4, window=3,
                                                                     top_k=1)).eval()  # fmt: skip
    x = tokens(1, 40, seed=3)
    got = read_rows(model, prefill(tl_model, x[:, :23]), x[:, 23:])
    torch.testing.assert_close(got, _resid(model, x)[:, 23:], atol=1e-5, rtol=0)


def test_null_rows_equal_the_dense_forward():
    tl_model, _ = _pair("mean", n_layers=2)
    x = tokens(2, 30, seed=2)
    cache = prefill(tl_model, x[:, :18])
    torch.testing.assert_close(read_rows(tl_model, cache, x[:, 18:]), _resid(tl_model, x)[:, 18:],
                               atol=1e-5, rtol=0)  # fmt: skip


def test_refusals():
    tl_model, model = _pair("evict", n_layers=1)
    x = tokens(1, 30, seed=2)
    cache = prefill(tl_model, x[:, :20])  # no queries kept: evict cannot observe the prefill
    with pytest.raises(ValueError, match="observation query 16 is in the prefill"):
        read_rows(model, cache, x[:, 20:])
    gated = PhaseTransformer.from_hooked(tl_model, CompressionConfig("gated", stride=4)).eval()
    with pytest.raises(NotImplementedError, match="'gated' cannot read a KV cache"):
        read_rows(gated, prefill(tl_model, x[:, :20]), x[:, 20:])
    with pytest.raises(ValueError, match="regime='prefill' is invalid"):
        check_regime("prefill")


def test_eval_sdpa_equals_transformer_lens():
    """The audit's SDPA dense attention (eval, cache included) equals TransformerLens' own,
    and steps aside when a pattern hook is attached."""
    from phasemech.model.fast import EvalSDPAGroupedQueryAttention, use_eval_sdpa

    tl_model, _ = _pair("mean", n_layers=2)
    x = tokens(2, 30, seed=4)
    want = _resid(tl_model, x)
    cache_tl = prefill(tl_model, x[:, :17])
    rows_tl = read_rows(tl_model, cache_tl, x[:, 17:])
    assert use_eval_sdpa(tl_model) == 2
    assert isinstance(tl_model.blocks[0].attn, EvalSDPAGroupedQueryAttention)
    torch.testing.assert_close(_resid(tl_model, x), want, atol=1e-5, rtol=0)
    rows = read_rows(tl_model, prefill(tl_model, x[:, :17]), x[:, 17:])
    torch.testing.assert_close(rows, rows_tl, atol=1e-5, rtol=0)
    _, cache = tl_model.run_with_cache(x, names_filter="blocks.1.attn.hook_pattern")
    assert cache["blocks.1.attn.hook_pattern"].shape == (2, 4, 30, 30)
