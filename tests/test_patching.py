"""Batched activation patching: equal to TransformerLens' patching, contrasts, attribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_model
from transformer_lens import patching as tl_patching

from phasemech.core.grid import phase_of
from phasemech.data.tasks import MQARTask, generate
from phasemech.interventions.attribution import (
    attribution_by_position,
    attribution_patch,
    compare_attribution,
)
from phasemech.interventions.contrasts import make_contrast, metric_values
from phasemech.interventions.patching import Site, patch_sites
from phasemech.interventions.patching_fast import patch_heads

STRIDE = 4
TASK = MQARTask(vocab_size=32, seq_len=28, n_pairs=3, stride=STRIDE)


@pytest.fixture(scope="module")
def ds():
    return generate(TASK, 12, seed=3, balanced=True)


def model_for(design: str, **kw):
    if design == "none":
        return make_model("none", **kw)
    kw.setdefault("layers", (1,))
    return make_model(design, stride=STRIDE, **kw)


def tl_reference(model, contrast, foil, metric: str, by_pos: bool, site: str = "out"):
    """TransformerLens' own patching on the same pairs (clean cache on the clean grid, the
    corrupted run on the corrupted grid); ``site``: out (``hook_z``), q, k, v or pattern."""
    ar = torch.arange(len(contrast))
    qpos = contrast.corrupted_query_pos

    def fn(logits):
        return metric_values(logits[ar, qpos], contrast.answer, foil, metric).mean()

    with model.shift_grid(contrast.clean_grid):
        _, cache = model.run_with_cache(contrast.clean_tokens)
    patcher = getattr(
        tl_patching, f"get_act_patch_attn_head_{site}_{'by_pos' if by_pos else 'all_pos'}"
    )
    with model.shift_grid(contrast.corrupted_grid):
        return patcher(model, contrast.corrupted_tokens, cache, fn)


@pytest.mark.parametrize(
    "design,kind",
    [
        ("mean", "grid"),
        ("gated", "answer"),
        ("route", "grid"),
        ("mlp", "answer"),
        ("none", "answer"),
    ],
)
@pytest.mark.parametrize("by_pos", [False, True])
def test_equals_transformer_lens_patching(ds, design, kind, by_pos):
    model = model_for(design)
    contrast = make_contrast(ds, kind, stride=STRIDE, n_pairs=12)
    ours = patch_heads(model, contrast, by_pos=by_pos)
    foil = torch.tensor(ours.pairs["foil"].to_numpy())
    ref = tl_reference(model, contrast, foil, "logit_diff", by_pos)
    assert ours.tensor().shape == ref.shape
    torch.testing.assert_close(ours.tensor().float(), ref, atol=1e-5, rtol=0)
    assert ours.n_run > 0


@pytest.mark.parametrize("metric", ["prob", "logprob"])
@pytest.mark.parametrize("design,kind", [("gated", "grid"), ("none", "answer")])
def test_equals_transformer_lens_with_mlps_rotary_and_gqa(ds, metric, design, kind):
    # compressed and dense last layers take the answer-row-only path: both must stay exact
    kw = dict(attn_only=False, rotary=True, gqa=True)
    if design == "none":
        model = make_model("none", **kw)
    else:
        model = make_model(design, stride=STRIDE, layers=(0, 1), **kw)
    shift = 1 if kind == "grid" else None
    contrast = make_contrast(ds, kind, stride=STRIDE, n_pairs=12, shift=shift)
    for by_pos in (False, True):
        ours = patch_heads(model, contrast, metric=metric, by_pos=by_pos)
        foil = torch.tensor(ours.pairs["foil"].to_numpy())
        ref = tl_reference(model, contrast, foil, metric, by_pos)
        torch.testing.assert_close(ours.tensor().float(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["grid", "answer", "content"])
def test_fast_path_equals_hook_path_per_pair(ds, kind):
    model = make_model("gated", stride=STRIDE, layers=(0, 1), attn_only=False)
    contrast = make_contrast(
        ds, kind, stride=STRIDE, n_pairs=12, shift=None if kind == "answer" else 1
    )
    for by_pos in (False, True):
        fast = patch_heads(model, contrast, by_pos=by_pos)
        hooked = patch_sites(model, contrast, site="z", by_pos=by_pos)
        np.testing.assert_allclose(fast.values, hooked.values, atol=2e-5)
        # the fast path also skips last-layer patches away from the answer (closed form)
        assert 0 < fast.n_run <= hooked.n_run


def test_single_head_last_layer_patch_restores_the_clean_run(ds):
    # one head in the compressed last layer carries everything the grid changes
    model = make_model("mean", stride=STRIDE, layers=(1,), n_heads=1, d_head=32)
    contrast = make_contrast(ds, "grid", stride=STRIDE, n_pairs=12)
    res = patch_heads(model, contrast)
    assert np.abs(res.clean - res.corrupted).max() > 1e-3  # the contrast does something
    np.testing.assert_allclose(res.values[1, 0, 0], res.clean, atol=1e-5)
    np.testing.assert_allclose(res.values[0, 0, 0], res.corrupted)  # dense layer 0: no change
    frame = res.frame()
    assert frame.loc[frame.layer == 1, "normalized"].item() == pytest.approx(1.0, abs=1e-4)


def test_positions_after_the_answer_change_nothing(ds):
    model = model_for("gated")
    contrast = make_contrast(ds, "answer", stride=STRIDE, n_pairs=12)
    res = patch_heads(model, contrast, by_pos=True)
    qpos = contrast.corrupted_query_pos.numpy()
    for b in range(len(contrast)):
        after = res.values[:, qpos[b] + 1 :, :, b]
        assert (after == res.corrupted[b]).all()
    # ... and before the corrupted value nothing differs either
    src = contrast.pairs["source_pos"].to_numpy()
    for b in range(len(contrast)):
        assert (res.values[:, : src[b], :, b] == res.corrupted[b]).all()


def test_contrasts_change_only_what_they_say(ds):
    grid = make_contrast(ds, "grid", stride=STRIDE, n_pairs=12, shift=1)
    assert torch.equal(grid.clean_tokens, grid.corrupted_tokens)
    assert (grid.corrupted_grid == 1).all() and (grid.clean_grid == 0).all()
    src = grid.pairs["source_pos"].to_numpy()
    np.testing.assert_array_equal(grid.pairs["phase"], phase_of(src, STRIDE))
    np.testing.assert_array_equal(grid.pairs["corrupted_phase"], (src - 1) % STRIDE)

    content = make_contrast(ds, "content", stride=STRIDE, n_pairs=12, shift=2)
    assert torch.equal(content.corrupted_tokens[:, 2:], content.clean_tokens[:, :-2])
    assert torch.equal(content.corrupted_query_pos, content.query_pos + 2)
    np.testing.assert_array_equal(content.pairs["corrupted_phase"], (src + 2) % STRIDE)

    answer = make_contrast(ds, "answer", stride=STRIDE, n_pairs=12)
    diff = (answer.clean_tokens != answer.corrupted_tokens).nonzero().numpy()
    expected = {(b, s) for b, s in enumerate(src)}
    expected |= {(b, q + 1) for b, q in enumerate(answer.query_pos.numpy())}
    assert {tuple(x) for x in diff} == expected
    assert (answer.foil != answer.answer).all()
    assert (answer.foil >= TASK.vocab_size // 2).all() and (answer.foil < TASK.vocab_size).all()
    assert (answer.answer == answer.clean_tokens[torch.arange(12), torch.tensor(src)]).all()


@pytest.mark.parametrize("kind", ["grid", "answer"])
@pytest.mark.parametrize("site", ["q", "k", "v"])
def test_query_key_value_sites_equal_transformer_lens(ds, site, kind):
    # the generic engine with the per-head vector setter, against TL's own q/k/v patching
    model = make_model("gated", stride=STRIDE, layers=(0, 1), attn_only=False)
    contrast = make_contrast(
        ds, kind, stride=STRIDE, n_pairs=12, shift=1 if kind == "grid" else None
    )
    for by_pos in (False, True):
        ours = patch_sites(model, contrast, site=site, by_pos=by_pos)
        foil = torch.tensor(ours.pairs["foil"].to_numpy())
        ref = tl_reference(model, contrast, foil, "logit_diff", by_pos, site=site)
        torch.testing.assert_close(ours.tensor().float(), ref, atol=2e-5, rtol=0)
        assert ours.n_run > 0


def test_a_site_plugs_in_with_a_setter(ds):
    # a user-defined site (the last query row of the pattern only) runs through the same engine
    calls = []

    def last_row_setter(act, src, rows, b, u, p):
        calls.append(len(rows))
        act[rows, u, -1] = src[b, u, -1]

    site = Site(
        "pattern_last_row",
        ("hook_pattern",),
        last_row_setter,
        lambda ne: ne[..., -1:, :].any(-1),
        answer_contrast_only=True,
    )
    model = model_for("gated")
    contrast = make_contrast(ds, "answer", stride=STRIDE, n_pairs=12)
    got = patch_sites(model, contrast, site=site, layers=[1])
    assert got.site == "pattern_last_row" and sum(calls) == got.n_run > 0
    with pytest.raises(ValueError, match="needs the answer contrast"):
        patch_sites(model, make_contrast(ds, "grid", stride=STRIDE, n_pairs=4), site=site)


def test_compressed_entry_and_pattern_patches_equal_manual_hooks(ds):
    model = model_for("gated")
    contrast = make_contrast(ds, "answer", stride=STRIDE, n_pairs=12)
    kv = patch_sites(model, contrast, site="kv_block")
    pattern = patch_sites(model, contrast, site="pattern")
    foil = torch.tensor(kv.pairs["foil"].to_numpy())
    ar, qpos = torch.arange(12), contrast.corrupted_query_pos
    with model.shift_grid(contrast.clean_grid):
        _, cache = model.run_with_cache(contrast.clean_tokens)

    def run(hooks):
        with (
            torch.no_grad(),
            model.shift_grid(contrast.corrupted_grid),
            model.hooks(fwd_hooks=hooks),
        ):
            logits = model(contrast.corrupted_tokens)
        return metric_values(logits[ar, qpos], contrast.answer, foil, "logit_diff").numpy()

    for unit in range(model.cfg.n_kv_heads):

        def put_kv(act, hook, unit=unit):
            act = act.clone()
            act[:, :, unit] = cache[hook.name][:, :, unit]
            return act

        names = ["blocks.1.attn.hook_k_block", "blocks.1.attn.hook_v_block"]
        np.testing.assert_allclose(
            kv.values[1, 0, unit], run([(n, put_kv) for n in names]), atol=2e-5
        )
    for head in range(model.cfg.n_heads):

        def put_pattern(act, hook, head=head):
            act = act.clone()
            act[:, head] = cache[hook.name][:, head]
            return act

        want = run([("blocks.1.attn.hook_pattern", put_pattern)])
        np.testing.assert_allclose(pattern.values[1, 0, head], want, atol=2e-5)
    assert np.isnan(kv.values[0]).all()  # layer 0 is dense: not patched


def test_by_phase_table(ds):
    model = model_for("mean")
    contrast = make_contrast(ds, "grid", stride=STRIDE, n_pairs=12)
    res = patch_heads(model, contrast)
    table = res.by_phase(n_boot=200)
    assert set(table.phase) <= set(range(STRIDE))
    counts = contrast.pairs["phase"].value_counts()
    for row in table.itertuples():
        assert row.n == counts[row.phase]
        assert row.ci_low - 1e-12 <= row.effect <= row.ci_high + 1e-12
        sel = (contrast.pairs["phase"] == row.phase).to_numpy()
        want = (res.values[int(row.layer), 0, int(row.unit), sel] - res.corrupted[sel]).mean()
        assert row.effect == pytest.approx(want)


def test_attribution_is_exact_where_the_metric_is_linear(ds):
    # no final norm: the logit difference is linear in the last layer's head outputs
    model = model_for("gated", normalization_type=None)
    contrast = make_contrast(ds, "grid", stride=STRIDE, n_pairs=12)
    exact = patch_heads(model, contrast, by_pos=True)
    atp = attribution_patch(model, contrast, batch_size=5)
    np.testing.assert_allclose(atp.values[1], exact.values[1] - exact.corrupted, atol=1e-4)
    assert atp.saturation.shape == (12,) and (atp.saturation <= 1 + 1e-6).all()
    table = compare_attribution(atp, exact)
    overall = table[(table.pairs == "all") & (table.layer == "all")].iloc[0]
    assert overall.pearson_single > 0.99


def test_attribution_differs_from_exact_through_layer_norm(ds):
    model = model_for("gated")
    contrast = make_contrast(ds, "answer", stride=STRIDE, n_pairs=12)
    exact = patch_heads(model, contrast, by_pos=True)
    atp = attribution_patch(model, contrast)
    err = np.abs(atp.values[0] - (exact.values[0] - exact.corrupted)).max()
    assert err > 1e-6  # first order through LN and softmax: not exact, as documented
    where = attribution_by_position(atp, exact, contrast)
    assert where.share_of_error.sum() == pytest.approx(1.0)
    true = exact.values - exact.corrupted
    assert where.n.sum() == int(((true != 0) | (atp.values != 0)).sum())
    # the answer contrast changes nothing before the needle: no patch there to estimate
    assert "before" not in set(where["where"])
    src = contrast.pairs["source_pos"].to_numpy()
    at_source = true[0, src, :, np.arange(12)]  # [pair, head]
    row = where[(where.layer == 0) & (where["where"] == "source")].iloc[0]
    assert row.mean_exact == pytest.approx(at_source[at_source != 0].mean())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kind="nope"), "kind='nope'"),
        (dict(kind="grid", shift=4), "shift=4"),
        (dict(kind="answer", shift=1), "shift=1"),
        (dict(kind="grid", n_pairs=13), "n_pairs=13"),
        (dict(kind="grid", stride=1), "stride=1"),
        (dict(kind="content", shift=30, n_pairs=12), "shift=30"),
    ],
)
def test_bad_contrasts_are_refused(ds, kwargs, match):
    kwargs = {"stride": STRIDE, **kwargs}
    with pytest.raises(ValueError, match=match):
        make_contrast(ds, **kwargs)


def test_bad_patch_requests_are_refused(ds):
    model = model_for("gated")
    grid = make_contrast(ds, "grid", stride=STRIDE, n_pairs=4)
    content = make_contrast(ds, "content", stride=STRIDE, n_pairs=4, shift=1)
    answer = make_contrast(ds, "answer", stride=STRIDE, n_pairs=4)
    with pytest.raises(ValueError, match="metric='acc'"):
        patch_heads(model, grid, metric="acc")
    with pytest.raises(ValueError, match=r"layers=\[2\]"):
        patch_heads(model, grid, layers=[2])
    with pytest.raises(ValueError, match="site='mlp'"):
        patch_sites(model, grid, site="mlp")
    with pytest.raises(ValueError, match=r"layers \[0\] have no compressed entries"):
        patch_sites(model, answer, site="kv_block", layers=[0])
    with pytest.raises(ValueError, match="by_pos=True is invalid"):
        patch_sites(model, answer, site="kv_block", by_pos=True)
    with pytest.raises(ValueError, match="needs the answer contrast"):
        patch_sites(model, content, site="pattern")
    with pytest.raises(ValueError, match="needs the answer contrast"):
        patch_sites(model, grid, site="kv_block")
    with pytest.raises(ValueError, match="max_copies=0"):
        patch_heads(model, grid, max_copies=0)
    with pytest.raises(ValueError, match="max_copies=True"):
        patch_sites(model, grid, max_copies=True)
    with pytest.raises(ValueError, match="needs a model with compressed layers"):
        patch_heads(model_for("none"), grid)
    coarse = make_contrast(ds, "grid", stride=8, n_pairs=4)  # shift 4: no change at stride 4
    with pytest.raises(ValueError, match="multiple of the model's stride 4"):
        patch_heads(model, coarse)
    with pytest.raises(ValueError, match="grid_offset=True"):
        make_contrast(ds, "grid", stride=STRIDE, grid_offset=True)
    with pytest.raises(ValueError, match="n_boot=-1"):
        patch_heads(model, grid).by_phase(n_boot=-1)
    assert patch_heads(model, grid).by_phase(n_boot=0).ci_low.isna().all()


@pytest.mark.parametrize(("design", "site"), [("quest", "kv_block"), ("nsa", "pattern")])
def test_a_site_the_design_never_runs_is_refused(ds, design, site):
    """Patching hooks that never fire would report zero effects: refused instead."""
    model = model_for(design)
    contrast = make_contrast(ds, "answer", stride=4, n_pairs=4, seed=0)
    with pytest.raises(ValueError, match=f"not defined for design '{design}'"):
        patch_sites(model, contrast, site=site)
