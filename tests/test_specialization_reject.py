"""The specialisation test can reject at explain's size: ``n_perm="auto"`` (draws sized to the
number of units, sequential stopping) finds a planted phase-specific unit among 540 with Holm
p < 0.01, where the fixed 1000 draws cannot go below 540 / 1001; the blocked ANOVA beside it
agrees; both stay at the nominal rate on null units; the stated floors are the true ones."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_model
from scipy.stats import spearmanr

import phasemech.interventions.specialization as sp
from phasemech.data.tasks import MQARTask, generate
from phasemech.interventions.ablation import ablate
from phasemech.measure.stats.anova import blocked_phase_anova

torch.set_num_threads(1)
D = 4


def _frame(effects: np.ndarray, contents: int, metric: str, seed: int = 0) -> pd.DataFrame:
    """Explain's shape: ``effects[unit, prompt]`` on ``contents x D`` prompts (one target
    each, every content at every phase), units as heads ``(layer, unit)`` in two modes."""
    rng = np.random.default_rng(seed)
    n_units, n = effects.shape
    group, phase = np.repeat(np.arange(contents), D), np.tile(np.arange(D), contents)
    base = rng.normal(1.0, 1.0, n) if metric != "accuracy" else (rng.random(n) < 0.8) * 1.0
    half = n_units // 2
    return pd.DataFrame(
        dict(
            component="head",
            mode=np.repeat(np.where(np.arange(n_units) < half, "zero", "mean"), n),
            layer=np.repeat(np.arange(n_units) % half // 9, n),
            unit=np.repeat(np.arange(n_units) % 9, n),
            seq_id=np.tile(np.arange(n), n_units),
            group_id=np.tile(group, n_units),
            target=0,
            phase=np.tile(phase, n_units),
            depth=np.tile(rng.uniform(0, 1, n).round(2), n_units),
            **{f"{metric}_base": np.tile(base, n_units), metric: (base + effects).ravel()},
        )
    )


def _accuracy_540(seed: int = 0) -> pd.DataFrame:
    """540 units x 200 prompts of accuracy: each unit flips 5% of answers; unit 0 also removes
    the answer at phase 2 for 70% of the prompts the intact model answers."""
    rng = np.random.default_rng(seed)
    df = _frame(np.zeros((540, 200)), 50, "accuracy", seed)
    base = df.accuracy_base.to_numpy()
    flip = rng.random(len(df)) < 0.05
    acc = np.where(flip, 1 - base, base)
    planted = (df.index < 200) & (df.phase == 2) & (rng.random(len(df)) < 0.7)
    df["accuracy"] = np.where(planted, 0.0, acc)
    return df


def _unit0(s: pd.DataFrame) -> pd.Series:
    return s[(s["mode"] == "zero") & (s.layer == 0) & (s.unit == 0)].iloc[0]


def test_a_planted_unit_is_found_among_540_and_the_old_floor_is_stated():
    df = _accuracy_540()
    auto = sp.specialization(df, "accuracy", n_perm="auto", seed=0, stride=D)
    r = _unit0(auto)
    assert r.p_holm < 0.01 and r.p_anova_holm < 0.01
    assert r.served_phase == 2 and r["rank"] == 1
    assert ((auto.p_holm < 0.05) == (auto.index == r.name)).all()  # nothing else
    n_max = sp.auto_draws(540)
    assert (auto.p_floor == 1 / (n_max + 1)).all()
    assert auto.p_holm_floor.max() == pytest.approx(540 / (n_max + 1))
    assert auto.p_holm_floor.max() <= sp.AUTO_HOLM_FLOOR
    assert auto.n_perm.max() <= n_max and auto.n_perm.median() < 200  # the nulls stop early
    # the fixed 1000 draws: Holm over 540 units cannot go below 540 / 1001, and says so
    fixed = sp.specialization(df, "accuracy", n_perm=1000, seed=0, stride=D)
    assert _unit0(fixed).p_holm == pytest.approx(540 / 1001)
    assert np.allclose(fixed.p_holm_floor, 540 / 1001)
    assert (fixed.n_perm == 1000).all()


def test_null_units_reject_at_the_nominal_rate_and_the_anova_agrees():
    rng = np.random.default_rng(1)
    contents = 30
    block = rng.normal(0, 2.0, (300, contents))  # content effects the blocks must absorb
    eff = np.repeat(block, D, axis=1) + rng.normal(0, 1, (300, contents * D))
    eff[0] += -2.0 * (np.tile(np.arange(D), contents) == 1)  # one planted unit, phase 1
    s = sp.specialization(_frame(eff, contents, "logit_diff"), "logit_diff", n_perm="auto")
    planted, null = _unit0(s), s.drop(index=_unit0(s).name)
    assert planted.p_holm < 0.01 and planted.p_anova_holm < 0.01 and planted.served_phase == 1
    for col in ("p_perm", "p_anova"):  # 299 units: 0.05 +- ~4.5 sd bounds
        assert 0.005 <= (null[col] < 0.05).mean() <= 0.12, col
    assert spearmanr(null.p_perm, null.p_anova).statistic > 0.85
    assert (null.p_holm >= 0.05).all() and (null.p_anova_holm >= 0.05).all()


def test_sequential_p_is_h_over_draws_or_runs_to_the_most_draws():
    rng = np.random.default_rng(2)
    eff = rng.normal(0, 1, (20, 40))
    eff[:3] -= 2.0 * (np.tile(np.arange(D), 10) == 0)  # three clear units
    df = _frame(eff, 10, "logit_diff")
    s = sp.specialization(df, "logit_diff", n_perm="auto", seed=5)
    n_max = sp.auto_draws(20)
    stopped = s.n_perm < n_max
    assert stopped.sum() >= 15 and (~stopped).sum() >= 3
    assert np.allclose(s.p_perm[stopped] * s.n_perm[stopped], sp.STOP_EXCEEDANCES)
    assert (s.p_perm[~stopped] >= 1 / (n_max + 1)).all()
    again = sp.specialization(df, "logit_diff", n_perm="auto", seed=5)
    pd.testing.assert_frame_equal(s, again)  # deterministic from the seed


def test_few_relabellings_floor_the_exact_test():
    # 3 contents at stride 2: |G| = 2^3 = 8 relabellings, so p >= 1/8 whatever the draws
    rng = np.random.default_rng(3)
    rows = []
    for unit in range(4):
        for g in range(3):
            for ph in range(2):
                score = dict(logprob_base=0.0, logprob=-3.0 * ph + rng.normal(0, 0.1))
                rows.append(dict(component="head", mode="zero", layer=0, unit=unit,
                                 seq_id=2 * g + ph, group_id=g, target=0, phase=ph, depth=0.5,
                                 **score))  # fmt: skip
    s = sp.specialization(pd.DataFrame(rows), "logprob", n_perm="auto", stride=2)
    assert np.allclose(s.p_floor, 1 / 8) and np.allclose(s.p_holm_floor, 0.5)
    assert (s.p_perm >= 1 / 8 - 1e-12).all()


def test_blocked_anova_matches_statsmodels():
    import statsmodels.formula.api as smf
    from statsmodels.stats.anova import anova_lm

    rng = np.random.default_rng(4)
    block, phase = np.repeat(np.arange(6), 4), np.tile(np.arange(4), 6)
    keep = np.ones(24, bool)
    keep[[1, 9]] = False  # unbalanced: sequential sums of squares
    y = rng.normal(0, 1, (2, 24)) + 0.8 * (phase == 3)
    f, p, (df1, df2) = blocked_phase_anova(y[:, keep], phase[keep], block[keep], 4)
    for u in range(2):
        frame = pd.DataFrame(dict(y=y[u, keep], b=block[keep], ph=phase[keep]))
        table = anova_lm(smf.ols("y ~ C(b) + C(ph)", frame).fit())
        assert f[u] == pytest.approx(table.loc["C(ph)", "F"])
        assert p[u] == pytest.approx(table.loc["C(ph)", "PR(>F)"])
    assert (df1, df2) == (3, 22 - 6 - 3)


def test_lab_model_planted_unit_among_its_real_units():
    # every unit of a tiny lab model is real; one head's logprob is replaced by its intact
    # value everywhere but at phase 1, where 70% of targets lose 3 nats (removed there only)
    task = MQARTask(vocab_size=36, seq_len=24, n_pairs=3, stride=D)
    ds = generate(task, 64, seed=0, balanced=True)
    res = ablate(make_model("mean", stride=D), ds, components=("head", "blocks"), n_boot=0)
    t = res.targets.copy()
    rng = np.random.default_rng(0)
    one = (t.component == "head") & (t["mode"] == "zero") & (t.layer == 0) & (t.unit == 0)
    hit = one & (t.phase == 1) & (rng.random(len(t)) < 0.7)
    t.loc[one, "logprob"] = np.where(hit[one], t.loc[one, "logprob_base"] - 3.0,
                                     t.loc[one, "logprob_base"])  # fmt: skip
    s = sp.specialization(t, "logprob", n_perm="auto", stride=D)
    m = len(s)
    assert m >= 12
    r = _unit0(s[s.component == "head"])
    assert r.p_holm < 0.01 and r.served_phase == 1 and r["rank"] == 1
    assert r.p_anova_holm < 0.01
    # the lab's fixed 1000 draws: floor m / 1001
    fixed = sp.specialization(t, "logprob", n_perm=1000, stride=D)
    assert fixed.p_holm_floor.min() == pytest.approx(min(1.0, m / 1001))


def test_a_dense_lab_model_rejects_no_more_than_the_nominal_rate():
    # the null setting: no compression, so nothing depends on the needle's phase
    task = MQARTask(vocab_size=36, seq_len=24, n_pairs=3, stride=D)
    ds = generate(task, 64, seed=1, balanced=True)
    res = ablate(make_model("none", stride=D), ds, components=("head",), n_boot=0)
    for metric in ("logprob", "accuracy"):
        s = sp.specialization(res, metric, n_perm="auto")
        assert len(s) >= 16
        # at most the upper end of a 95% binomial interval around 5% of the units
        assert (s.p_perm < 0.05).sum() <= 3 and (s.p_anova < 0.05).sum() <= 3, metric
        assert (s.p_holm >= 0.05).all()


@pytest.mark.parametrize("bad", ["many", 0, 2.5, None])
def test_bad_n_perm(bad):
    with pytest.raises(ValueError, match="n_perm"):
        sp.specialization(_accuracy_540().head(800), "accuracy", n_perm=bad, stride=D)


def test_pages_state_the_smallest_attainable_holm_p():
    from test_explain_html import _tables

    from phasemech.experiments.explain.summary import findings, head_lines
    from phasemech.viz.explain import render_explain

    rng = np.random.default_rng(6)
    eff = rng.normal(0, 1, (12, 40))
    frames = [_frame(eff, 10, m).assign(target=0) for m in ("accuracy", "logit_diff")]
    spec = pd.concat(
        [sp.specialization(f, m, n_perm="auto", stride=D) for f, m in
         zip(frames, ("accuracy", "logit_diff"), strict=True)],
        ignore_index=True,
    )  # fmt: skip
    floor = f"{spec.p_holm_floor.min():.2g}"
    assert floor == f"{12 / (sp.auto_draws(12) + 1):.2g}"
    t = _tables() | {"ablation_specialization": spec}
    t["oracle"]["null"], t["oracle"]["displaced_sink"], t["oracle"]["broken"] = 1.0, 0.0, 0
    text = "\n".join(head_lines(t))
    assert "Holm over 12 units" in text and f"Holm p {floor}" in text
    f = findings(t, n_layers=3)
    assert f["p_holm_floor"] == pytest.approx(spec.p_holm_floor.min())
    page = render_explain(t, dict(config={}, findings=f))
    assert "sum-phase-test" in page and f"Holm p {floor}" in page
    # a table from before p_floor says that it cannot tell
    old = spec.drop(columns=["p_floor", "p_holm_floor", "n_perm"])
    assert "not recorded" in sp.floor_note(old)


def test_explain_tests_with_auto_and_keeps_its_keys():
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.jobs import explain_jobs

    cfg, fixed = ExplainConfig(), ExplainConfig(auto_perm=False, n_perm=500)
    assert cfg.perm_draws == "auto" and fixed.perm_draws == 500
    assert "auto_perm" not in cfg.to_dict() and cfg.to_dict()["n_perm"] == 1000
    assert fixed.to_dict()["auto_perm"] is False
    # the tables run the test: neither field reaches a job's key
    assert explain_jobs(cfg, "observe", [0])[0].key == explain_jobs(fixed, "observe", [0])[0].key
