"""The ``phasemech audit`` page: its three figures, the self-contained HTML and the page in a
real browser (Playwright driving /usr/bin/chromium; skipped where either is missing)."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from browser import browser, cell_xy, page_data

from phasemech.viz.audit import audit_figures, render_audit, write_audit_html

D, LAYERS, HEADS, DEPTHS = 4, 3, 2, (0.0, 0.5, 1.0)
SETTINGS = ("mean d=4", "gated d=4")


def _frames(settings=SETTINGS):
    """Synthetic audit frames: null + ``settings``, stride 4, 3 layers x 2 heads, 3 depths;
    the compressed settings lose phases far from 0, the null is flat."""
    rng = np.random.default_rng(0)
    pp, dp, hp = [], [], []
    for k, s in enumerate(("null", *settings)):
        for p in range(D):
            acc = 0.9 if s == "null" else 0.9 - 0.15 * p * (k + 1) / 2
            pp.append(dict(setting=s, phase=p, n=40, accuracy=acc, boot_lo=acc - 0.05,
                           boot_hi=acc + 0.05))  # fmt: skip
            for depth in DEPTHS:
                dp.append(dict(setting=s, depth=depth, phase=p, n=10, accuracy=acc - 0.1 * depth))
            for layer in range(LAYERS):
                for head in range(HEADS):
                    mass = round(float(rng.uniform(0.0, 0.5)), 4)
                    hp.append(dict(setting=s, layer=layer, head=head, phase=p, mass=mass))
    return pd.DataFrame(pp), pd.DataFrame(dp), pd.DataFrame(hp)


def _summary(settings=SETTINGS) -> dict:
    entries = [
        dict(
            setting=s,
            description=f"{s} on layers 4-20",
            accuracy=0.7,
            acc_by_phase=[0.9, 0.8, float("nan"), 0.6],
            debiased_gap=0.3,
            gap_lo=0.2,
            gap_hi=0.4,
            p_perm=0.001,
            p_cochran=0.002,
            average_claim=f"{s}: mean accuracy 0.70, within 0.2 of the null",
        )
        for s in settings
    ]
    return dict(title="audit <test>", model="tiny", task="kv", regime="decode", context=512,
                stride=D, contents=8, settings=entries)  # fmt: skip


# --------------------------------------------------------------------------- figures


def test_audit_figures_shapes():
    pp, dp, hp = _frames()
    figs = audit_figures(pp, dp, hp, D, "gated d=4")
    assert set(figs) == {"accuracy", "depth", "heads"}
    assert all(isinstance(f, go.Figure) for f in figs.values())
    acc = figs["accuracy"].data  # band, line, mean for the setting then the null
    assert len(acc) == 6 and [t.name for t in acc[1::3]] == ["gated d=4", "null"]
    assert list(acc[1].x) == list(range(D)) and acc[4].line.color == "#000000"
    np.testing.assert_allclose(acc[4].y, [0.9] * D)
    depth = figs["depth"].data
    assert len(depth) == 2 and all(np.shape(t.z) == (len(DEPTHS), D) for t in depth)
    assert list(depth[0].y) == ["0", "0.5", "1"]
    want = dp[(dp.setting == "gated d=4") & (dp.depth == 0.5)].sort_values("phase").accuracy
    np.testing.assert_allclose(depth[0].z[1], want)
    (heads,) = figs["heads"].data
    assert np.shape(heads.z) == (LAYERS * HEADS, D) and np.shape(heads.customdata) == heads.z.shape
    assert list(heads.y) == [f"L{a}H{b}" for a in range(LAYERS) for b in range(HEADS)]
    at = (hp.layer == 2) & (hp["head"] == 1) & (hp.phase == 3)  # hp.head is a method
    cell, null = hp[at & (hp.setting == "gated d=4")], hp[at & (hp.setting == "null")]
    assert heads.z[5][3] == cell.mass.item() and heads.customdata[5][3] == null.mass.item()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda pp, dp, hp: (pp.drop(columns="boot_hi"), dp, hp), "lacks column(s) ['boot_hi']"),
        (lambda pp, dp, hp: (pp[pp.setting != "null"], dp, hp), "no setting 'null'"),
        (lambda pp, dp, hp: (pp, dp[dp.setting != "mean d=4"], hp), "lacks setting(s)"),
        (lambda pp, dp, hp: (pp.assign(phase=pp.phase + 1), dp, hp), "has phase 4"),
        (lambda pp, dp, hp: (pp, dp.assign(depth=dp.depth * 2), hp), "depth 2.0"),
        (lambda pp, dp, hp: (pp, dp, pd.concat([hp, hp.iloc[:1]])), "two rows for"),
    ],
)
def test_bad_frames_are_one_line_errors(change, message):
    frames = change(*_frames())
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        audit_figures(*frames, D, "mean d=4")
    assert "\n" not in str(err.value)


def test_bad_setting_and_summary():
    frames = _frames()
    for bad in ("null", "route d=8"):
        with pytest.raises(ValueError, match="setting="):
            audit_figures(*frames, D, bad)
    with pytest.raises(ValueError, match="is not one of"):
        render_audit(*frames, _summary(), setting="nope")
    summary = _summary()
    del summary["settings"][1]["p_cochran"]
    with pytest.raises(ValueError, match=re.escape("lacks key(s) ['p_cochran']")):
        render_audit(*frames, summary)
    with pytest.raises(ValueError, match="regime='live'"):
        render_audit(*frames, dict(_summary(), regime="live"))
    with pytest.raises(ValueError, match="no entry for setting 'gated d=4'"):
        render_audit(*frames, _summary(SETTINGS[:1]))


# --------------------------------------------------------------------------- the page


def test_page_is_self_contained_and_carries_its_data(tmp_path):
    from plotly.offline import get_plotlyjs

    frames = _frames()
    out = write_audit_html(tmp_path / "sub" / "audit.html", *frames, _summary(), "gated d=4")
    page = out.read_text()
    assert not re.search(r"<script[^>]+src=", page) and "<link" not in page
    js = get_plotlyjs()
    assert js[1000:3000] in page and js[-2000:] in page
    assert "<title>audit &lt;test&gt;</title>" in page
    data = page_data(page)
    assert data["stride"] == D and data["initial"] == 1 and data["meta"]["context"] == 512
    assert [s["name"] for s in data["settings"]] == list(SETTINGS)
    s = data["settings"][1]
    assert s["summary"]["acc_by_phase"][2] is None  # NaN as null: strict JSON
    assert s["summary"]["average_claim"] == _summary()["settings"][1]["average_claim"]
    assert s["heads"]["labels"][5] == "L2H1" and len(s["heads"]["mass"][5]) == D
    assert set(s["figures"]) == {"accuracy", "depth", "heads"}
    assert data["null_accuracy"] == pytest.approx(0.9)
    assert out.stat().st_mode & 0o777 != 0o600  # a plain file, not the temp file's mode


def test_a_setting_name_cannot_break_the_page():
    evil = "</script><!--<script>alert(1)//"
    pp, dp, hp = _frames((evil,))
    page = render_audit(pp, dp, hp, _summary((evil,)))
    block = page.split('id="phasemech-data">')[1].split("</script>")[0]
    assert "<" not in block
    assert page_data(f'id="phasemech-data">{block}</script>')["settings"][0]["name"] == evil
    assert page.count("</script>") == 3  # plotly.js, data, page script


# --------------------------------------------------------------------------- the browser


def _js_fixed3(v: float | None) -> str:
    """``v.toFixed(3)`` as the browser writes it (ties away from zero on the binary value)."""
    if v is None:
        return "–"
    from decimal import ROUND_HALF_UP, Decimal

    return str(Decimal(v).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))


def test_audit_page_in_a_real_browser(tmp_path):
    page_path = write_audit_html(tmp_path / "audit.html", *_frames(), _summary())
    data = page_data(page_path.read_text())
    with browser(page_path, "#heads-plot .main-svg", 1400) as (page, errors):
        for plot in ("accuracy-plot", "depth-plot", "heads-plot", "head-plot"):
            assert page.locator(f"#{plot} .main-svg").count() > 0
        assert page.locator("#heads-plot .hm").count() == 1  # the heatmap itself is drawn
        assert page.locator("#depth-plot .hm").count() == 2
        assert page.is_visible("#setting") and page.input_value("#setting") == "0"
        assert "what an average" in page.text_content("#claim").lower()
        s = data["settings"][0]
        before = page.text_content("#head-title")
        assert before == s["heads"]["initial"]
        target = next(i for i, lab in enumerate(s["heads"]["labels"]) if lab != before)
        label = s["heads"]["labels"][target]
        x, y = cell_xy(page, "heads-plot", target, 2)
        page.mouse.move(x, y)
        page.mouse.click(x, y)
        page.wait_for_function(
            "label => document.getElementById('head-title').textContent === label", arg=label
        )
        rows = [r.split("\t") for r in page.inner_text("#head-numbers").strip().splitlines()[1:]]
        assert len(rows) == D
        for p, cells in enumerate(rows):
            assert cells[0] == str(p)
            assert cells[1] == _js_fixed3(s["heads"]["null_mass"][target][p])
            assert cells[2] == _js_fixed3(s["heads"]["mass"][target][p])
        assert page.get_attribute('#head-numbers tr[data-phase="2"]', "class") == "hl"
        assert page.is_visible("#head-panel")
        # another setting: strip, figures and panel follow, the inspected head is kept
        page.select_option("#setting", "1")
        page.wait_for_function(
            "name => document.getElementById('summary').textContent.includes(name)",
            arg=SETTINGS[1],
        )
        title = page.evaluate("document.getElementById('heads-plot')._fullLayout.title.text")
        assert SETTINGS[1] in title and page.text_content("#head-title") == label
        z = page.evaluate("document.getElementById('heads-plot').calcdata[0][0].z")
        np.testing.assert_allclose(z, data["settings"][1]["heads"]["mass"])
        cells = page.inner_text('#head-numbers tr[data-phase="1"]').split("\t")
        assert cells[2] == _js_fixed3(data["settings"][1]["heads"]["mass"][target][1])
        page.screenshot(path=str(tmp_path / "audit.png"), full_page=True)
    assert errors == []
    assert (tmp_path / "audit.png").stat().st_size > 10_000


def test_one_setting_hides_the_picker(tmp_path):
    pp, dp, hp = _frames(SETTINGS[:1])
    page_path = write_audit_html(tmp_path / "audit.html", pp, dp, hp, _summary(SETTINGS[:1]))
    with browser(page_path, "#heads-plot .main-svg", 1400) as (page, errors):
        assert not page.is_visible("#setting")
        assert page.text_content("#head-title").startswith("L")
        assert "φ2 –" in page.text_content("#summary")  # a NaN phase accuracy shown as "–"
    assert errors == []
