"""Phase-resolved ablation (``phasemech.interventions.ablation``) on tiny random models: exactness
of each ablation against hand-written hooks, cleanup, the effects table and the specialization
test."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_model, randomize_compressors
from datasets import Dataset

import phasemech.interventions.ablation as ab
import phasemech.interventions.specialization as sp
from phasemech.core.grid import n_blocks
from phasemech.data.tasks import MQARTask, generate, to_tensors
from phasemech.interventions.ablation import ablate, ablation
from phasemech.interventions.specialization import rank_heads, specialization
from phasemech.measure.readout import answer_logits

torch.set_num_threads(1)

STRIDE = 4
TASK = MQARTask(vocab_size=36, seq_len=24, n_pairs=3, stride=STRIDE)  # model d_vocab 37, n_ctx 48


@pytest.fixture(scope="module")
def ds() -> Dataset:
    return generate(TASK, 16, seed=0, balanced=True)  # 4 contents x 4 prefixes


def _model(design: str = "mean", **kw):
    model = make_model(design, stride=STRIDE, **kw)
    if design == "gated":
        randomize_compressors(model, seed=3, scale=2.0)
    return model


def _logprob(model, data: Dataset, hooks=()) -> np.ndarray:
    """Answer log-probabilities per target (row-major: sequence, then target)."""
    tokens, qp, ans = to_tensors(data)
    with torch.no_grad(), model.hooks(fwd_hooks=list(hooks)):
        logits = answer_logits(model, tokens, qp)
    return logits.log_softmax(-1).gather(-1, ans[..., None])[..., 0].flatten().numpy()


def _unit(res, component: str, mode: str, layer: int, unit: int) -> pd.DataFrame:
    t = res.targets
    keep = (t.component == component) & (t["mode"] == mode) & (t.layer == layer) & (t.unit == unit)
    return t[keep]


def _n_hooks(model) -> int:
    return sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in model.hook_dict.values())


# ---------------------------------------------------------------------------------- head


@pytest.mark.parametrize("design", ["none", "mean"])
def test_head_zero_equals_manual_hook(ds, design):
    model = _model(design)
    res = ablate(model, ds, modes=("zero",), n_boot=0)
    for layer, head in [(0, 1), (1, 3)]:

        def zero(z, hook, head=head):
            z[:, :, head] = 0.0
            return z

        want = _logprob(model, ds, [(f"blocks.{layer}.attn.hook_z", zero)])
        got = _unit(res, "head", "zero", layer, head)
        np.testing.assert_allclose(got.logprob.to_numpy(), want, atol=1e-5, rtol=0)
        assert not np.allclose(got.logprob_base.to_numpy(), want, atol=1e-4)  # it did something
    assert _n_hooks(model) == 0


def test_resample_and_mean_deterministic_and_not_zero(ds):
    model = _model("mean")
    kw = dict(layers=[1], n_boot=0)
    a = ablate(model, ds, seed=0, **kw)
    b = ablate(model, ds, seed=0, **kw)
    c = ablate(model, ds, seed=5, **kw)
    pd.testing.assert_frame_equal(a.targets, b.targets)
    by_mode = {m: a.targets[a.targets["mode"] == m].logprob.to_numpy() for m in ab.DEFAULT_MODES}
    assert not np.allclose(by_mode["mean"], by_mode["zero"])
    assert not np.allclose(by_mode["resample"], by_mode["zero"])
    assert not np.allclose(by_mode["resample"], by_mode["mean"])
    other = c.targets[c.targets["mode"] == "resample"].logprob.to_numpy()
    assert not np.allclose(other, by_mode["resample"])  # another seed, other donors
    same = c.targets[c.targets["mode"] == "mean"].logprob.to_numpy()
    np.testing.assert_array_equal(same, by_mode["mean"])  # mean does not depend on the seed


def test_reference_of_the_same_sequence_gives_zero_effect(ds):
    # ds of one distinct sequence, reference = ds: its mean and every donor are that sequence
    one = ds.select([5] * 4)
    model = _model("mean")
    res = ablate(
        model, one, reference=one, components=("head", "blocks"), modes=("mean", "resample")
    )
    t = res.targets
    np.testing.assert_allclose(t.logprob, t.logprob_base, atol=1e-6, rtol=0)
    np.testing.assert_allclose(t.logit_diff, t.logit_diff_base, atol=1e-5, rtol=0)
    assert set(t.component) == {"head", "blocks"} and set(t["mode"]) == {"mean", "resample"}


@pytest.mark.parametrize("gqa", [False, True])
def test_blocks_resample_equals_manual_patch(ds, gqa):
    # a one-sequence reference: every donor is that sequence, so resample = patch in its entries
    model = _model("gated", gqa=gqa)
    ref = ds.select([9])
    res = ablate(model, ds, reference=ref, components="blocks", modes=("resample",), n_boot=0)
    assert set(res.targets.unit) == set(range(model.cfg.n_kv_heads))
    _, cache = model.run_with_cache(to_tensors(ref)[0])
    layer, g = 1, 1

    def patch(name):
        def hook(x, hook):
            x[:, :, g] = cache[f"blocks.{layer}.attn.{name}"][:, :, g]
            return x

        return (f"blocks.{layer}.attn.{name}", hook)

    want = _logprob(model, ds, [patch("hook_k_block"), patch("hook_v_block")])
    got = _unit(res, "blocks", "resample", layer, g)
    assert (got.unit_kind == "kv_head").all()
    np.testing.assert_allclose(got.logprob.to_numpy(), want, atol=1e-5, rtol=0)
    assert np.abs(got.logprob - got.logprob_base).max() > 1e-4


# ---------------------------------------------------------------------------------- blocks / raw


def test_blocks_need_compressed_layers(ds):
    with pytest.raises(ValueError, match="layer 0 is dense"):
        ablate(_model("mean", layers=(1,)), ds, components="blocks", modes="mask", layers=[0])
    with pytest.raises(ValueError, match="'none'"):
        ablate(_model("none"), ds, components="blocks", modes="mask")
    # default layers: only the compressed one
    res = ablate(_model("mean", layers=(1,)), ds, components="blocks", modes="mask", n_boot=0)
    assert set(res.targets.layer) == {1}


def test_blocks_unused_when_window_covers_sequence(ds):
    wide = _model("mean", window=24)  # sequences of 24: every past token raw, no block used
    res = ablate(wide, ds, components="blocks", modes=("mask", "mean", "resample"), n_boot=0)
    t = res.targets
    for m in ab.METRICS:
        np.testing.assert_array_equal(t[m].to_numpy(), t[f"{m}_base"].to_numpy())
    narrow = ablate(_model("mean"), ds, components="blocks", modes="mask", n_boot=0).targets
    assert (narrow.logprob != narrow.logprob_base).any()  # with blocks in use, masking bites


@pytest.mark.parametrize("component", ["raw", "blocks"])
def test_mask_zeroes_the_heads_columns(ds, component):
    model = _model("gated")
    tokens = to_tensors(ds)[0][:4]
    layer, head = 1, 2
    name = f"blocks.{layer}.attn.hook_pattern"
    nb = n_blocks(tokens.shape[1], STRIDE)
    with ablation(model, component, "mask", layer, head):
        _, cache = model.run_with_cache(tokens, names_filter=name)
    _, base = model.run_with_cache(tokens, names_filter=name)
    pat, ref = cache[name], base[name]
    cols = slice(nb, None) if component == "raw" else slice(None, nb)
    keep = slice(None, nb) if component == "raw" else slice(nb, None)
    assert ref[:, head, :, cols].abs().sum() > 0
    assert (pat[:, head, :, cols] == 0).all()
    assert pat[:, head, :, keep].abs().sum() > 0  # the head still reads the other part
    others = [h for h in range(model.cfg.n_heads) if h != head]
    torch.testing.assert_close(pat[:, others], ref[:, others])
    # ablate() runs exactly this ablation
    res = ablate(model, ds, components=component, modes="mask", layers=[layer], n_boot=0)
    with ablation(model, component, "mask", layer, head):
        want = _logprob(model, ds)
    got = _unit(res, component, "mask", layer, head).logprob.to_numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_route_blocks_mask(ds):
    model = _model("route", window=0, top_k=1)
    tokens = to_tensors(ds)[0]
    layer, head = 1, 1
    name = f"blocks.{layer}.attn.hook_route_selected"
    _, base = model.run_with_cache(tokens, names_filter=name)
    with ablation(model, "blocks", "mask", layer, head):
        _, cache = model.run_with_cache(tokens, names_filter=name)
    assert base[name][:, head].any()
    assert not cache[name][:, head].any()
    others = [h for h in range(model.cfg.n_heads) if h != head]
    assert torch.equal(cache[name][:, others], base[name][:, others])
    res = ablate(model, ds, components="blocks", modes="mask", n_boot=0)
    t = _unit(res, "blocks", "mask", layer, head)
    assert np.abs(t.logprob - t.logprob_base).max() > 1e-4
    with pytest.raises(ValueError, match="'raw'.*'route'"):
        ablate(model, ds, components="raw", modes="mask")
    with pytest.raises(ValueError, match="no requested mode applies to component 'blocks'"):
        ablate(model, ds, components="blocks", modes=("mean",))
    # requested modes a component lacks are dropped for it: route's blocks run "mask" only
    both = ablate(model, ds, components="blocks", modes=("mask", "mean"), n_boot=2)
    assert set(both.targets["mode"].astype(str)) == {"mask"}


# ---------------------------------------------------------------------------------- phase_bias


def test_phase_bias_zero_restores_and_leaves_no_hooks(ds, monkeypatch):
    model = _model("gated")
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = ablate(model, ds, components=("head", "phase_bias"), modes=("zero",), n_boot=0)
    assert _n_hooks(model) == 0
    for n, p in model.named_parameters():
        assert torch.equal(p, saved[n]), n
    # by hand: zero phase_bias[g] of layer 0
    bias = model.blocks[0].attn.phase_bias
    with torch.no_grad():
        bias[3] = 0.0
    want = _logprob(model, ds)
    with torch.no_grad():
        bias.copy_(saved["blocks.0.attn.phase_bias"])
    got = _unit(res, "phase_bias", "zero", 0, 3)
    np.testing.assert_allclose(got.logprob.to_numpy(), want, atol=1e-5, rtol=0)
    assert np.abs(got.logprob - got.logprob_base).max() > 1e-4

    # an exception in the middle of a phase_bias run (and of the context manager itself)
    real = ab.answer_logits

    def failing(m, tokens, qp):
        if (m.blocks[1].attn.phase_bias[2] == 0).all():
            raise RuntimeError("boom")
        return real(m, tokens, qp)

    monkeypatch.setattr(ab, "answer_logits", failing)
    model.train()
    with pytest.raises(RuntimeError, match="boom"):
        ablate(model, ds, components=("head", "phase_bias"), modes=("zero",), batch_size=4)
    assert model.training  # mode restored too
    model.eval()
    with pytest.raises(KeyError):
        with ablation(model, "phase_bias", "zero", 1, 0):
            assert (model.blocks[1].attn.phase_bias[0] == 0).all()
            raise KeyError("inside")
    assert _n_hooks(model) == 0
    for n, p in model.named_parameters():
        assert torch.equal(p, saved[n]), n


# ---------------------------------------------------------------------------------- effects


def test_effects_table(ds):
    model = _model("mean")
    res = ablate(model, ds, modes=("zero", "mean"), n_boot=300, seed=1)
    t, e = res.targets, res.effects
    n_units = model.cfg.n_layers * model.cfg.n_heads * 2
    assert len(t) == n_units * 16 * TASK.n_pairs
    assert len(e) == n_units * len(ab.METRICS) * STRIDE
    assert isinstance(t.component.dtype, pd.CategoricalDtype) and t.accuracy.dtype == np.int8
    for metric in ab.METRICS:
        diff = t.assign(d=t[metric].astype(float) - t[f"{metric}_base"].astype(float))
        g = diff.groupby([*ab.UNIT_KEYS, "phase"], observed=True)
        want = pd.DataFrame(
            {
                "effect": g.d.mean(),
                "n": g.size(),
                "baseline": g[f"{metric}_base"].mean(),
                "ablated": g[metric].mean(),
            }
        ).reset_index()
        got = e[e.metric == metric].merge(want, on=[*ab.UNIT_KEYS, "phase"], suffixes=("", "_w"))
        assert len(got) == len(want) == n_units * STRIDE
        for col in ("effect", "baseline", "ablated"):
            np.testing.assert_allclose(got[col], got[f"{col}_w"], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(got.n, got.n_w)
        assert (got.ci_low <= got.effect + 1e-9).all() and (got.effect <= got.ci_high + 1e-9).all()
    lp = e[e.metric == "logprob"]
    assert (lp.ci_high - lp.ci_low).max() > 0  # real intervals, not points
    # tensor(): [layer, unit, phase] of the same numbers
    tens = res.tensor("logprob", "head", "mean")
    assert tens.shape == (model.cfg.n_layers, model.cfg.n_heads, STRIDE)
    row = e[(e.metric == "logprob") & (e["mode"] == "mean") & (e.layer == 1) & (e.unit == 2)]
    np.testing.assert_allclose(tens[1, 2], row.sort_values("phase").effect.to_numpy())
    with pytest.raises(ValueError, match="'raw'"):
        res.tensor("logprob", "raw", "mask")


def test_tensor_nan_on_dense_layers_and_save(ds, tmp_path):
    model = _model("mean", layers=(1,))
    res = ablate(model, ds, components="blocks", modes="mask", n_boot=50)
    tens = res.tensor("accuracy", "blocks", "mask")
    assert np.isnan(tens[0]).all() and not np.isnan(tens[1]).any()
    res.save(tmp_path / "out")
    for f in ("targets", "effects", "specialization"):
        assert (tmp_path / "out" / f"{f}.parquet").is_file()
    back = ab.AblationResult.load(tmp_path / "out")
    pd.testing.assert_frame_equal(back.effects, res.effects)
    assert back.stride == res.stride and back.design == "mean"


# ---------------------------------------------------------------------------------- specialization


def _synthetic(seed: int, n_groups: int = 30, n_targets: int = 2) -> pd.DataFrame:
    """Balanced targets: every (group, target) block holds each phase once. Unit 0 is hurt only
    at phase 2, unit 1 by the same amount at every phase, unit 2 not at all."""
    rng = np.random.default_rng(seed)
    g, t, ph = np.meshgrid(
        np.arange(n_groups), np.arange(n_targets), np.arange(STRIDE), indexing="ij"
    )
    g, t, ph = g.ravel(), t.ravel(), ph.ravel()
    n = len(g)
    frames = []
    for unit, shift in enumerate([-1.0 * (ph == 2), np.full(n, -0.5), np.zeros(n)]):
        base = rng.normal(0, 1, n)
        frames.append(
            pd.DataFrame(
                {
                    "component": "head",
                    "mode": "zero",
                    "layer": 0,
                    "unit": unit,
                    "seq_id": g * STRIDE + ph,
                    "group_id": g,
                    "target": t,
                    "phase": ph,
                    "depth": rng.uniform(0, 1, n).round(2),
                    "logprob_base": base,
                    "logprob": base + shift + (rng.normal(0, 0.2, n) if unit < 2 else 0.0),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def test_specialization_planted_phase():
    df = _synthetic(0)
    sp = specialization(df, metric="logprob", n_perm=200, seed=0, stride=STRIDE)
    assert list(sp.unit) == [0, 1, 2] and (sp.null == "within_block").all()
    planted, flat, none = (sp.iloc[i] for i in range(3))
    assert planted.served_phase == 2 and planted.si > 0.8
    assert planted.p_perm == pytest.approx(1 / 201) and planted["rank"] == 1
    assert planted.phase_range == pytest.approx(1.0, abs=0.15)
    assert flat.si < 0.05 and flat.overall == pytest.approx(-0.5, abs=0.1)
    assert none.si == 0 and none.p_perm == 1 and none.stat == 0
    assert (sp.p_holm >= sp.p_perm).all()
    assert pd.isna(none.served_phase)  # no negative effect: serves no phase
    # the same from rank_heads, sorted by rank
    ranked = rank_heads(df, metric="logprob", n_perm=200, stride=STRIDE)
    assert ranked.unit.iloc[0] == 0 and list(ranked["rank"]) == [1, 2, 3]


def test_floor_effect_is_told_apart_from_opening_a_weak_spot():
    # intact accuracy 1, 1, 1, 0.4 by phase; unit 0 wipes out every phase (a floor effect),
    # unit 1 removes phase 1 only (it opens a weak spot there)
    df = _synthetic(0).query("unit < 2").copy()
    base = np.where(df.phase == 3, (df.group_id % 5 < 2).astype(float), 1.0)
    df["accuracy_base"] = base
    df["accuracy"] = np.where(df.unit == 0, 0.0, np.where(df.phase == 1, 0.0, base))
    sp = specialization(df, metric="accuracy", n_perm=100, seed=0, stride=STRIDE)
    floor, opener = sp.iloc[0], sp.iloc[1]
    assert floor.base_range == pytest.approx(0.6) and floor.ablated_range == 0
    assert floor.phase_range == pytest.approx(0.6)  # mirrors the intact profile
    assert opener.served_phase == 1 and opener.ablated_range == pytest.approx(1.0)
    assert opener.ablated_range > opener.base_range


def test_within_block_null_removes_content_variance():
    # large per-(group, target) offsets, a small phase-2 effect: only a paired (within-block)
    # null sees it; shuffling phases across blocks would drown it in the offsets
    df = _synthetic(2).query("unit == 2").copy()
    rng = np.random.default_rng(0)
    offset = rng.normal(0, 3.0, (df.group_id.max() + 1, df.target.max() + 1))
    df["logprob"] += offset[df.group_id, df.target] - 0.3 * (df.phase == 2)
    sp = specialization(df, metric="logprob", n_perm=200, stride=STRIDE).iloc[0]
    assert sp.null == "within_block" and sp.p_perm == pytest.approx(1 / 201)
    assert sp.served_phase == 2


def test_specialization_null_is_calibrated():
    p = [
        specialization(_synthetic(s), metric="logprob", n_perm=100, seed=s, stride=STRIDE)
        .query("unit == 1")
        .p_perm.iloc[0]
        for s in range(20)
    ]
    assert np.mean(np.asarray(p) > 0.05) >= 0.8


def test_specialization_unbalanced_uses_depth_bins():
    df = _synthetic(1)
    df = df[~((df.group_id == 0) & (df.phase == 1))]  # block (0, *) loses a phase
    sp = specialization(df, metric="logprob", n_perm=100, stride=STRIDE)
    assert (sp.null == "depth_quintile").all()
    assert sp.iloc[0].served_phase == 2


def test_block_permutations_keep_each_blocks_phases():
    rng = np.random.default_rng(0)
    strata = np.repeat(np.arange(10), 4)[rng.permutation(40)]
    labels = rng.integers(0, STRIDE, 40)
    perm = sp._permuted_labels(labels, strata, 50, rng)
    assert perm.shape == (50, 40)
    for row in perm:
        for s in range(10):
            assert sorted(row[strata == s]) == sorted(labels[strata == s])
    assert (perm != labels).any(1).mean() > 0.9  # they do move


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(components=("heads",)), "'heads'"),
        (dict(modes=("ablate",)), "'ablate'"),
        (
            dict(components=("raw",), modes=("zero",)),
            "no requested mode applies to component 'raw'",
        ),
        (dict(components=("head",), modes=("mask",)), "component 'head'.*allows"),
        (dict(layers=[0, 5]), "layer 5"),
        (dict(layers=[1.0]), "layer 1.0"),
        (dict(stride="4"), "stride='4'"),
        (dict(stride=2.5), "stride=2.5"),
        (dict(grid_offset=0.5), "grid_offset=0.5"),
        (dict(components=("phase_bias",), modes=("zero",)), "'mean'"),
        (dict(n_boot=-1), "n_boot=-1"),
    ],
)
def test_bad_inputs(ds, kw, match, monkeypatch):
    # every check happens before any forward
    monkeypatch.setattr(ab, "answer_logits", lambda *a: pytest.fail("ran a forward"))
    with pytest.raises(ValueError, match=match):
        ablate(_model("mean"), ds, **kw)


def test_mean_needs_a_reference(ds):
    bare = Dataset.from_list(ds.to_list())  # no task in the description
    model = _model("mean")
    with pytest.raises(ValueError, match="reference"):
        ablate(model, bare, modes=("mean",))
    ablate(model, bare, modes=("zero",), layers=[0], n_boot=0, progress=True)  # zero needs none
    with pytest.raises(ValueError, match="metric 'loss'"):
        specialization(_synthetic(0), metric="loss")


# ---------------------------------------------------------------------------------- systems


def test_nsa_branch_ablation_equals_a_zero_gate_by_hand(ds):
    model = _model("nsa")
    randomize_compressors(model, seed=3)
    res = ablate(model, ds, components=("branch_cmp", "branch_slc", "branch_win"), n_boot=0)
    assert _n_hooks(model) == 0
    assert set(res.targets.component.astype(str)) == {"branch_cmp", "branch_slc", "branch_win"}
    for branch, name in enumerate(("branch_cmp", "branch_slc", "branch_win")):

        def close(gates, hook, branch=branch):
            gates = gates.clone()
            gates[:, :, 2, branch] = 0.0
            return gates

        want = _logprob(model, ds, [("blocks.1.attn.hook_branch_gate", close)])
        got = _unit(res, name, "zero", 1, 2)
        np.testing.assert_allclose(got.logprob.to_numpy(), want, atol=1e-5, rtol=0)
        assert np.abs(got.logprob - got.logprob_base).max() > 1e-4


def test_csa_slot_bias_ablation_zeroes_both_biases_and_restores(ds):
    model = _model("csa", window=4)
    randomize_compressors(model, seed=3, scale=2.0)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = ablate(model, ds, components="phase_bias", modes="zero", n_boot=0)
    for n, p in model.named_parameters():
        assert torch.equal(p, saved[n]), n
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.B_K[1], attn.B_V[1] = 0.0, 0.0
    want = _logprob(model, ds)
    got = _unit(res, "phase_bias", "zero", 0, 1)
    np.testing.assert_allclose(got.logprob.to_numpy(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("design", "component", "match"),
    [("nsa", "raw", "branch_cmp"), ("nsa", "blocks", "branch_cmp"), ("mean", "branch_win", "nsa"),
     ("partition", "phase_bias", "learned intra-block bias")],
)  # fmt: skip
def test_components_a_design_lacks_are_refused(ds, design, component, match):
    with pytest.raises(ValueError, match=match):
        ablate(_model(design), ds, components=component, n_boot=0)


def test_default_components_per_design():
    from phasemech.interventions.ablation_plan import components_for

    assert components_for("nsa") == ("head", "branch_cmp", "branch_slc", "branch_win")
    assert components_for("partition") == ("head", "blocks")
    assert components_for("dsa") == ("head", "blocks", "phase_bias")
    assert components_for("csa") == ("head", "blocks", "raw", "phase_bias")
    assert components_for("mlp") == ("head", "blocks", "raw")


def test_dsa_pool_bias_ablation_is_one_unit_and_restores(ds):
    model = _model("dsa", window=4)
    randomize_compressors(model, seed=3, scale=2.0)
    saved = model.blocks[1].attn.pool_bias.detach().clone()
    res = ablate(model, ds, components="phase_bias", modes="zero", n_boot=0)
    assert set(res.targets.unit) == {0}
    assert torch.equal(model.blocks[1].attn.pool_bias, saved)
    with torch.no_grad():
        model.blocks[1].attn.pool_bias.zero_()
    want = _logprob(model, ds)
    np.testing.assert_allclose(_unit(res, "phase_bias", "zero", 1, 0).logprob, want, atol=1e-5)
