"""The attention sink (``sink_tokens``) on the selecting designs, against the naive reference
(``test_selection.naive_z``) applied to the grid WITHOUT a sink: the first ``N`` real tokens
leave every block (scores and kept tokens), a block left with no token is no candidate, and
every query reads the sink raw from its position on. Tiles, gather, hooked and training
paths, scattered rows, left padding, causality and the config's refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hooked, tokens
from test_selection import _real_slots, naive_z

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.core.grid import build_geometry

torch.set_num_threads(1)

RG = {"rotary": True, "gqa": True}  # 4 query heads over 2 KV heads
COMPS = [
    dict(stride=4, window=6, top_k=2),
    dict(stride=3, block_len=6, window=0, top_k=2, offsets=(1, 2)),  # overlapping blocks
    dict(stride=4, window=3, top_k=1, visibility="strict", offsets=(0, 3)),
    dict(stride=4, window=5, top_k=2, block_scope="before_window", offsets=(1, 2)),
]


def _model(rule: str, **comp) -> PhaseTransformer:
    tl_model = make_hooked(**RG, n_layers=1)
    return PhaseTransformer.from_hooked(tl_model, CompressionConfig(rule, **comp)).eval()


def _inputs(model, x, attention_mask=None):
    """``(layer, q, k, v, geometry, geometry without the sink, cache)`` of layer 0."""
    _, cache = model.run_with_cache(x, attention_mask=attention_mask)
    attn = model.blocks[0].attn
    q, k = cache["blocks.0.attn.hook_rot_q"], cache["blocks.0.attn.hook_rot_k"]
    v = cache["blocks.0.attn.hook_v"]
    offsets = cache["blocks.0.attn.hook_grid_offset"]
    kv = None if attention_mask is None else attention_mask.bool()
    geo = attn._build_geometry(offsets, x.shape[1], kv)
    geo0 = build_geometry(offsets, x.shape[1], attn.stride, attn.block_len, attn.window,
                          attn.visibility, kv, attn.cfg.compression.block_scope)  # fmt: skip
    return attn, q, k, v, geo, geo0, cache


def _observed_mass(attn, q, k, geo0, n_sink: int):
    """evict's rule by its definition: the dense attention mass that the observation queries
    of a KV group pay to a block's own (non-sink) tokens (unpadded inputs)."""
    w, rep = attn.obs_window, q.shape[2] // k.shape[2]

    def score(s, g, t, i, head):
        own = [j for j in _real_slots(geo0, s, g, i) if j >= n_sink]
        mass = 0.0
        for u in range(max(0, t - w + 1), t + 1):
            for hh in range(g * rep, (g + 1) * rep):
                p = torch.softmax(k[s, : u + 1, g] @ q[s, u, hh] / attn.attn_scale, 0)
                mass += float(sum(p[j] for j in own if j <= u))
        return mass

    return score


@pytest.mark.parametrize("rule", ["route", "quest", "kpool", "evict"])
@pytest.mark.parametrize("comp", COMPS)
@pytest.mark.parametrize("n_sink", [1, 3])
def test_sink_matches_naive_reference(rule, comp, n_sink):
    if rule in ("kpool", "evict") and "block_len" in comp:
        comp = {k: v for k, v in comp.items() if k != "block_len"}
    extra = {"obs_window": 3} if rule == "evict" else {}
    model = _model(rule, sink_tokens=n_sink, **comp, **extra)
    x = tokens(2, 26 if rule == "evict" else 30, seed=5)
    attn, q, k, v, geo, geo0, cache = _inputs(model, x)
    q, k, v = q.double(), k.double(), v.double()
    score = _observed_mass(attn, q, k, geo0, n_sink) if rule == "evict" else rule
    want = naive_z(attn, q, k, v, geo0, score, n_sink=n_sink)
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"].double(), want, atol=1e-5, rtol=0)
    for attn.tiled in (True, False):  # unhooked: the tiles where they serve, and the gather
        z, _ = attn.attend(None, q, k, v, geo)
        torch.testing.assert_close(z, want, atol=1e-10, rtol=0)
    attn.tiled = True
    # the sink bites: without it some query keeps a block holding a sink token
    z0, _ = attn.attend(None, q, k, v, geo0)
    assert (z0 - want).abs().max() > 1e-3


@pytest.mark.parametrize("rule", ["route", "quest"])
def test_sink_rows_padding_and_training(rule):
    """Scattered rows equal the full forward there; left padding is invisible (the sink is
    the first REAL tokens); the training forward's dense layout attends the same tokens."""
    model = _model(rule, stride=3, window=4, top_k=1, offsets=(1, 2), sink_tokens=2)
    x = tokens(1, 24, seed=3)
    attn, q, k, v, geo, geo0, _ = _inputs(model, x)
    full, _ = attn.attend(None, q, k, v, geo)
    rows = torch.tensor([[0, 1, 5, 17, 23]])
    part, _ = attn.attend_many(None, q, k, v, geo, rows)
    torch.testing.assert_close(part, full[:, rows[0]], atol=1e-6, rtol=0)
    pad = 5
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(x)], 1)
    torch.testing.assert_close(
        model(padded, attention_mask=mask)[:, pad:], model(x), atol=1e-5, rtol=0
    )
    attn, q, k, v, geo, geo0, cache = _inputs(model, padded, attention_mask=mask)
    want = naive_z(attn, q.double(), k.double(), v.double(), geo0, rule, mask.bool(), n_sink=2)
    got = cache["blocks.0.attn.hook_z"].double()
    torch.testing.assert_close(got[:, pad:], want[:, pad:], atol=1e-5, rtol=0)
    model.train()
    trained = model(x)
    model.eval()
    torch.testing.assert_close(trained, model(x), atol=1e-5, rtol=0)


def test_sink_is_causal():
    """A change at a later token changes nothing before it, the sink included."""
    model = _model("route", stride=4, window=4, top_k=1, sink_tokens=3)
    x = tokens(1, 32, seed=7)
    y = x.clone()
    y[0, 20:] = (y[0, 20:] + 1) % model.cfg.d_vocab
    torch.testing.assert_close(model(x)[:, :20], model(y)[:, :20], atol=1e-6, rtol=0)


def test_sink_config():
    """0 is no sink (the config and its cache key of before); other designs refuse it."""
    assert CompressionConfig("route", sink_tokens=0) == CompressionConfig("route")
    assert "sink_tokens" not in CompressionConfig("route").to_dict()
    assert CompressionConfig("quest", sink_tokens=4).to_dict()["sink_tokens"] == 4
    for bad, match in [
        (dict(design="mean", sink_tokens=2), "only designs"),
        (dict(design="nsa", sink_tokens=2), "only designs"),
        (dict(design="route", sink_tokens=-1), "int >= 0"),
        (dict(design="route", sink_tokens=True), "int >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            CompressionConfig(**bad)


def test_sink_on_dsa_and_its_straight_through_bias():
    """``dsa`` ranks by its indexer (pooled over each block's non-sink tokens): the engine
    attends what the reference attends given those scores; the end-to-end bias (one per kept
    block, none on the sink) trains through the dense layout."""
    model = _model("dsa", stride=4, window=4, top_k=1, sink_tokens=2, indexer_train="end_to_end")
    x = tokens(1, 30, seed=4)
    attn, q, k, v, geo, geo0, cache = _inputs(model, x)
    scores = cache["blocks.0.attn.hook_route_scores"].double()

    def rule(s, g, t, i, head):
        return float(scores[s, head, t, i])

    want = naive_z(attn, q.double(), k.double(), v.double(), geo0, rule, n_sink=2)
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"].double(), want, atol=1e-5, rtol=0)
    alpha = cache["blocks.0.attn.hook_block_weights"]  # no pooling weight on a sink token
    assert float(alpha[geo.slot_pos.clamp(min=0) < 2].abs().sum()) == 0.0
    model.train()
    loss = model(x, return_type="loss")
    loss.backward()
    grad = model.blocks[0].attn.W_iq.grad
    assert grad is not None and bool(grad.isfinite().all()) and float(grad.abs().sum()) > 0


@pytest.mark.parametrize("design", ["route", "evict"])
def test_sink_in_the_decode_regime(design):
    """Rows that read a prefill's cache: one layer equals the full forward there (the prefill's
    keys are the same in both regimes); two layers, one chunk equals step-by-step decoding."""
    from phasemech.model.decode import needed_queries, prefill, read_rows

    extra = {"obs_window": 5} if design == "evict" else {}
    comp = CompressionConfig(design, stride=4, window=3, top_k=1, sink_tokens=2, **extra)
    x, p = tokens(1, 40, seed=3), 23
    for n_layers in (1, 2):
        dense = make_hooked(rotary=True, gqa=True, n_layers=n_layers, attn_only=False).eval()
        model = PhaseTransformer.from_hooked(dense, comp).eval()
        cache = prefill(dense, x[:, :p], keep_queries=needed_queries(model))
        with torch.inference_mode():
            got = read_rows(model, cache, x[:, p:])
            if n_layers == 1:
                want = model(x, stop_at_layer=1)[:, p:]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
                continue
            cache.unfreeze()
            steps = [read_rows(model, cache, x[:, t : t + 1]) for t in range(p, 40)]
        torch.testing.assert_close(got, torch.cat(steps, 1), atol=1e-5, rtol=0)


def test_sink_in_the_audit():
    """``--sink-tokens``: named in the setting, counted in the budget, kept by every fix;
    no sink leaves the audit's cache key as it was; a design without a ranking refuses."""
    from phasemech.experiments.audit.config import AuditConfig

    a = AuditConfig.of(designs=("route", "mean"), sink_tokens=4, top_k=1, variants=("aligned",
                    "per_head", "topk_x2"))  # fmt: skip
    names = [n for n, _ in a.settings()]
    assert names == ["null", "route_d4_w16_k1_s4", "route_d4_w16_k1_s4_per_head",
                     "route_d4_w16_k2_s4_topk_x2", "mean_d4_w16",
                     "mean_d4_w16_per_head"]  # fmt: skip
    assert all(c.sink_tokens == 4 for n, c in a.settings() if n.startswith("route"))
    assert a.setting_meta()["route_d4_w16_k1_s4"]["budget"] == {1024: 4 + 16 + 4}
    assert AuditConfig.of(sink_tokens=0).to_dict() == AuditConfig().to_dict()
    assert "sink_tokens" not in AuditConfig().to_dict()
    with pytest.raises(ValueError, match="applies to none of designs"):
        AuditConfig.of(designs=("mean",), sink_tokens=2)


def test_sink_fixes_table(tmp_path):
    """``analyses/sink_fixes.py`` joins two fixes audits on (context, design, fix), keeps only
    the pairs both scored and lists the fixes the sink audit says meet the goal."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analyses"))
    import sink_fixes

    def record(fix, verdict, reduction):
        return dict(context=1024, design="route", fix=fix, accuracy_baseline=0.6,
                    gap_baseline=0.35, reduction=reduction, reduction_lo=0.2, reduction_hi=0.9,
                    accuracy_diff=0.01, accuracy_diff_lo=-0.005, accuracy_diff_hi=0.03,
                    budget=52, budget_baseline=52, verdict=verdict)  # fmt: skip

    plain = [record("per_head", "does not meet it", -0.5), record("random", "does not", 0.1)]
    sink = [record("per_head", "meets the goal", 0.8), record("overlap", "meets the goal", 0.9)]
    paths = []
    for name, recs in (("plain", plain), ("sink", sink)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"fixes": recs}))
    joined = sink_fixes.side_by_side(*(sink_fixes.fixes_frame(p) for p in paths))
    assert joined.fix.tolist() == ["per_head"]
    assert sink_fixes.meeting(joined) == ["route/per_head at T=1024"]
    out = tmp_path / "t.md"
    assert sink_fixes.main([str(paths[0]), str(paths[1]), "--out", str(out)]) == 0
    text = out.read_text()
    assert "-50% [+20%, +90%]" in text and "+80% [+20%, +90%]" in text
    assert text.strip().endswith("route/per_head at T=1024")
