"""The ``phasemech explain`` page: its figures from the tables, and the page in a real browser
(Playwright driving /usr/bin/chromium; skipped where either is missing)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from browser import browser, cell_xy, page_data
from test_audit_html import _js_fixed3

from phasemech.viz.explain import explain_figures, write_explain_html

D, LAYERS, HEADS = 4, 3, 2


def _tables() -> dict[str, pd.DataFrame]:
    rng = np.random.default_rng(0)
    prompts = pd.DataFrame(
        dict(
            prompt_id=range(8),
            group_id=np.repeat([0, 1], 4),
            phase=np.tile(range(D), 2),
            design_correct=[1, 0, 1, 1, 1, 0, 0, 1],
            null_correct=1,
        )  # fmt: skip
    )
    grid = pd.MultiIndex.from_product([range(LAYERS), range(D)], names=["layer", "phase"])
    recall = grid.to_frame(index=False).assign(recall=rng.uniform(size=len(grid)), rank=3.0)
    oracle = []
    for scope, form, rows in [("none", "add", "answer"), ("all", "add", "answer"),
                              ("all", "replace", "after"), ("layer 1", "replace", "after"),
                              ("layer 2", "replace", "after")]:  # fmt: skip
        for p in range(D):
            a = rng.uniform()
            oracle.append(dict(scope=scope, form=form, rows=rows, phase=p, accuracy=a,
                               ci_low=a - 0.1, ci_high=a + 0.1, unforced=0.5))  # fmt: skip
    abl = []
    for mode in ("zero", "mean"):
        for layer in range(LAYERS):
            for h in range(HEADS):
                for p in range(D):
                    e = rng.normal()
                    abl.append(
                        dict(
                            mode=mode,
                            metric="logit_diff",
                            layer=layer,
                            unit=h,
                            phase=p,
                            effect=e,
                            ci_low=e - 0.2,
                            ci_high=e + 0.3,
                        )
                    )
    abl += [dict(r, metric="accuracy") for r in abl[:8]]  # another metric: not drawn
    patch = []
    for site in ("head", "atp"):
        for layer in range(LAYERS):
            for h in range(HEADS):
                e = 0.9 if (site, layer, h) == ("head", 2, 1) else rng.uniform(-0.2, 0.3)
                patch.append(dict(site=site, layer=layer, head=h, effect=e, ci_low=e - 0.1,
                                  ci_high=e + 0.1))  # fmt: skip
    for site in ("resid", "selection"):
        for layer in [*range(LAYERS), -1] if site == "selection" else range(LAYERS):
            patch.append(dict(site=site, layer=layer, head=-1, effect=0.3, ci_low=0.1, kept=2.0,
                              ci_high=0.5))  # fmt: skip
    att = pd.MultiIndex.from_product(
        [["null", "design"], range(LAYERS), range(HEADS), range(D)],
        names=["setting", "layer", "head", "phase"],
    ).to_frame(index=False)
    att["mass"] = rng.uniform(size=len(att))
    frames = dict(oracle=oracle, ablation=abl, patching=patch)
    return dict(prompts=prompts, selection_recall=recall, head_attention=att,
                **{k: pd.DataFrame(v) for k, v in frames.items()})  # fmt: skip


def _summary() -> dict:
    return dict(config=dict(setting="route_d4_w16_k1", regime="decode", context=1024,
                            contents=2, task="passkey", seed=0),
                model="smollm2-135m", accuracy_by_phase=[1.0, 0.0, 0.5, 1.0],
                null_by_phase=[1.0] * 4, contrast_phases=[0, 1], n_pairs=2, n_prompts=8,
                atp_check=dict(n=6, pearson_r=0.5, max_abs_gap=0.2, overlap=4))  # fmt: skip


def test_figures_follow_the_tables():
    t = _tables()
    figs = explain_figures(t)
    assert set(figs) == {"selection", "oracle", "oracle_layers", "ablation", "patching",
                         "patching_layers"}  # fmt: skip
    z = np.array(figs["ablation"].data[0].z)
    assert z.shape == (LAYERS * HEADS, D)  # heads x phase, the logit_diff metric only
    want = t["ablation"].query("mode == 'zero' and metric == 'logit_diff' and layer == 1 "
                               "and unit == 0").sort_values("phase").effect  # fmt: skip
    np.testing.assert_allclose(z[2], want)
    assert list(figs["oracle_layers"].data[0].y) == [1, 2]
    names = [tr.name for tr in figs["oracle"].data if tr.mode == "lines+markers"]
    assert names[:2] == ["null", "design (unforced)"] and len(names) == 4
    # a missing table drops its figures; a bad one is refused in one line
    less = explain_figures({k: v for k, v in t.items() if k not in ("oracle", "patching")})
    assert set(less) == {"selection", "ablation"}
    with pytest.raises(ValueError, match="ablation lacks column") as err:
        explain_figures(dict(t, ablation=t["ablation"].drop(columns="ci_low")))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="prompts"):
        explain_figures({k: v for k, v in t.items() if k != "prompts"})


def test_explain_page_in_a_real_browser(tmp_path):
    path = write_explain_html(tmp_path / "explain.html", _tables(), _summary())
    data = page_data(path.read_text())
    h = data["heads"]
    with browser(path, "#ablation-plot .main-svg", 1400) as (page, errors):
        for plot in ("selection", "oracle", "oracle_layers", "ablation", "patching",
                     "patching_layers"):  # fmt: skip
            assert page.locator(f"#{plot}-plot .main-svg").count() > 0
        assert page.text_content("#head-title") == h["initial"] == "L2H1"  # best exact patch
        assert "0.900" in page.text_content("#head-patch")
        # click a cell of the ablation heatmap: the panel follows, numbers from the data
        target = 3
        x, y = cell_xy(page, "ablation-plot", target, 2)
        page.mouse.click(x, y)
        label = h["labels"][target]
        page.wait_for_function(
            "l => document.getElementById('head-title').textContent === l", arg=label
        )
        rows = [r.split("\t") for r in page.inner_text("#head-numbers").strip().splitlines()[1:]]
        assert len(rows) == D
        for p, cells in enumerate(rows):
            z = h["zero"]
            want = f"{_js_fixed3(z['effect'][target][p])} [{_js_fixed3(z['ci_low'][target][p])}"
            assert cells[1].startswith(want)
            assert cells[3] == _js_fixed3(h["attention_null"][target][p])
            assert cells[4] == _js_fixed3(h["attention_design"][target][p])
        # the patching heatmap (x head, y layer) picks heads too
        x, y = cell_xy(page, "patching-plot", 1, 0)
        page.mouse.click(x, y)
        page.wait_for_function("() => document.getElementById('head-title').textContent === 'L1H0'")
        assert "φ1 design" in page.text_content("#summary")
        page.screenshot(path=str(tmp_path / "explain.png"), full_page=True)
    assert errors == []
    assert (tmp_path / "explain.png").stat().st_size > 10_000
