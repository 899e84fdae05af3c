"""The explanation's summary findings and the claims report's real-model part of section 3."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from test_explain_html import _tables

from phasemech.experiments.claims.specialisation import real_model_lines
from phasemech.experiments.explain.summary import atp_check, findings


def _spec() -> pd.DataFrame:
    rows = []
    for metric in ("accuracy", "logit_diff"):
        for layer in range(3):
            for unit in range(2):
                dep = (layer, unit) == (2, 0)
                stats = (-0.3, 0.5, 0.4, 0.001, 0.006) if dep else (-0.01, 0.05, 0.02, 0.6, 1.0)
                keys = ("overall", "si", "phase_range", "p_perm", "p_holm")
                rows.append(
                    dict(
                        metric=metric,
                        mode="zero",
                        layer=layer,
                        unit=unit,
                        served_phase=1,
                        **dict(zip(keys, stats, strict=True)),
                    )
                )
    return pd.DataFrame(rows)


def _summary(f: dict) -> dict:
    return dict(config=dict(setting="route_d4_w16_k1", regime="decode", context=1024,
                            contents=50, stride=4), model="smollm2-135m", n_prompts=200,
                accuracy_by_phase=[0.7, 0.3, 0.6, 0.8], null_by_phase=[1.0] * 4,
                contrast_phases=[3, 1], n_pairs=40, findings=f)  # fmt: skip


def test_findings_and_the_real_model_claim(tmp_path):
    t = _tables() | {"ablation_specialization": _spec()}
    t["oracle"]["null"] = 1.0
    t["oracle"]["displaced_sink"] = 0.25
    t["oracle"]["broken"] = 1  # one right answer lost per phase
    f = findings(t, n_layers=3)
    assert [b["layers"] for b in f["selection_bands"]] == ["0-0", "1-1", "2-2"]
    assert f["top_patching"][0] == dict(layer=2, head=1, effect=0.9, ci_low=0.8, ci_high=1.0)
    assert [h["layer"] for h in f["phase_dependent_heads"]] == [2] and f["n_heads_tested"] == 6
    assert f["selection_patching"][0]["layer"] in range(-1, 3)
    assert {(o["scope"], o["form"], o["rows"]) for o in f["oracle"]} == {
        ("none", "add", "answer"),
        ("all", "add", "answer"),
        ("all", "replace", "after"),
    }
    lines, verdict = real_model_lines(tmp_path)
    assert "Open" in verdict and "not measured yet" in lines[0]
    # record a run: its numbers and the verdict follow
    f["oracle"].append(dict(f["oracle"][1], form="replace", accuracy=[1.0, 0.9, 1.0, 1.0],
                            unforced=[0.7, 0.2, 0.6, 0.7]))  # fmt: skip
    (tmp_path / "explain_route.json").write_text(json.dumps(_summary(f)))
    lines, verdict = real_model_lines(tmp_path)
    text = "\n".join(lines)
    assert "0.70 / 0.30 / 0.60 / 0.80" in text and "1.00 / 0.90 / 1.00 / 1.00" in text
    assert "25% of the displaced picks" in text and "L2H1 0.90" in text
    assert "it lost 4 of the design's right answers" in text
    assert "range goes from 0.50 to 0.10: the selection is most of the weak spot" in text
    assert "1 of 6 heads phase-dependent (L2H0 serves phase 1)" in text
    # 6 heads x zero and mean ablation at the config's 1000 permutations: 12 / 1001 < 0.05
    assert "smallest Holm p this test can reach is 12/1001 = 0.012" in text
    assert "**Not testable post hoc**: no head of smollm2-135m was trained" in verdict
    assert "**supported post hoc**" in verdict and "`route_d4_w16_k1` (decode)" in verdict
    f["phase_dependent_heads"] = []
    (tmp_path / "explain_route.json").write_text(json.dumps(_summary(f)))
    assert "**not supported** post hoc" in real_model_lines(tmp_path)[1]
    # a setting that did not ablate is named, and counts neither way
    g = {k: v for k, v in f.items() if k not in ("phase_dependent_heads", "n_heads_tested")}
    (tmp_path / "explain_trained.json").write_text(json.dumps(_summary(g)))
    lines, verdict = real_model_lines(tmp_path)
    assert "Zero ablation: not run in this setting." in "\n".join(lines)
    assert "in 1 of the 1 settings that ablated every head" in verdict
    (tmp_path / "explain_route.json").unlink()
    assert "no recorded setting ablated heads" in real_model_lines(tmp_path)[1]


def test_atp_check_compares_with_the_exact_result():
    p = _tables()["patching"]
    chk = atp_check(p, top=3)
    atp = p[p.site == "atp"].set_index(["layer", "head"]).effect
    exact = p[p.site == "head"].set_index(["layer", "head"]).effect
    picked = atp.abs().nlargest(3).index
    assert chk["n"] == 3
    assert chk["max_abs_gap"] == np.abs(atp[picked] - exact[picked]).max()
    assert chk["overlap"] == len(set(picked) & set(exact.abs().nlargest(3).index))
    assert atp_check(p[p.site != "atp"]) is None


def test_patching_without_a_gap_is_nan_and_said(tmp_path):
    """Pairs whose clean side scores no better than the corrupted one: the normalised effects
    are NaN, never a number, and the summary says why; a skipped head oracle is said too."""
    from types import SimpleNamespace

    from phasemech.experiments.explain.summary import skip_lines
    from phasemech.experiments.explain.tables import patching_table

    sides = dict(clean_prompt={"phase": 3}, corrupted_prompt={"phase": 1})
    pairs = [dict(sides, clean=c, corrupted=x, heads=[[x + 0.1, x]], resid=[x])
             for c, x in [(1.0, 2.0), (0.5, 0.5)]]  # fmt: skip
    table = patching_table(pairs, n_boot=10, seed=0)
    assert len(table) == 3 and table.effect.isna().all() and table.raw.notna().all()
    # every row names its contrast; pairs of two contrasts are two tables, never one
    assert (table.clean_phase == 3).all() and (table.corrupted_phase == 1).all()
    other = [dict(p, corrupted_prompt={"phase": 2}) for p in pairs]
    with pytest.raises(ValueError, match="expected one contrast"):
        patching_table(pairs + other, n_boot=10, seed=0)
    frame = pd.DataFrame([dict(clean=p["clean"], corrupted=p["corrupted"]) for p in pairs])
    cfg = SimpleNamespace(analyses=("oracle", "ablation"))
    lines = skip_lines(cfg, {"patching_pairs": frame})
    assert len(lines) == 2 and "top heads was not run" in lines[0]
    assert "no gap to normalise by" in lines[1]
    good = [dict(p, clean=p["corrupted"] + 1.0) for p in pairs]
    assert patching_table(good, n_boot=10, seed=0).effect.notna().all()
    # nothing is ranked by a NaN (pandas' nlargest keeps NaN rows) and the summary is JSON
    from phasemech.core.io import json_safe
    from phasemech.experiments.explain.summary import head_lines, layer_lines

    atp = table[table.site == "head"].assign(site="atp", effect=1.0)
    t = {"patching": pd.concat([table, atp], ignore_index=True)}
    text = "\n".join(layer_lines(t) + head_lines(t))
    assert text.count("no normalised effect to rank") == 2 and "nan" not in text
    assert atp_check(t["patching"]) is None
    f = findings(t, n_layers=2)
    assert f["top_patching"] == [] and json.dumps(json_safe(f), allow_nan=False)
    from phasemech.experiments.claims.specialisation import explain_run_lines

    said = "\n".join(explain_run_lines("explain_x", _summary(f))[0])
    assert "Patching phase 3 into phase 1 (40 pairs): the clean phase's" in said


def test_layer_bands_are_named_by_the_selecting_layers_they_hold():
    rec = pd.DataFrame(
        [dict(layer=layer, phase=p, recall=0.5, rank=2.0) for layer in (1, 3, 5) for p in range(4)]
    )
    f = findings({"selection_recall": rec}, n_layers=6)
    assert [b["layers"] for b in f["selection_bands"]] == ["1-1", "3-3", "5-5"]
