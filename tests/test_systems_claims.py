"""The claims report's systems section on a hand-made sweep summary: the gap rule against the
dense control, systems that never converged, steps to 0.95 and the weak phase's server."""

from __future__ import annotations

import json

from phasemech.experiments.claims.systems import claim_systems, systems_table


def _summary() -> dict:
    conv, rows = [], []
    for design, steps, acc, gap in (
        ("none", (200, 300, 200), 0.99, (0.001, -0.002, 0.004)),
        ("nsa", (400, 500, None), 0.98, (0.05, 0.02, 0.08)),
        ("dsa", (None, None, None), None, None),
    ):
        for seed, s in enumerate(steps):
            ok = s is not None
            conv.append(dict(name=f"{design}_s{seed}", design=design, stride=4, heads=2,
                             seq_len=64, seed=seed, steps_to_95=s, converged=ok))  # fmt: skip
        if acc is not None:
            rows.append(dict(design=design, stride=4, heads=2, seq_len=64, seed="pooled",
                             targets="all", step="final", accuracy=acc, debiased_gap=gap[0],
                             debiased_lo=gap[1], debiased_hi=gap[2]))  # fmt: skip
    return {"convergence": conv, "rows": rows, "matched": []}


def _interventions() -> dict:
    return {"models": [dict(model="nsa_d4_h2_T64_s0", design="nsa", stride=4, heads=2,
                            weak_phase=3, weak_phase_server="branch_cmp/zero L1.0",
                            weak_phase_drop_pts=-42.0, weak_phase_server_mean_drop_pts=-12.0,
                            weak_phase_server_p_holm=0.001)]}  # fmt: skip


def test_systems_table_applies_the_gap_rule():
    t = systems_table(_summary(), _interventions()).set_index("design")
    assert bool(t.loc["nsa", "has_gap"]) and not bool(t.loc["none", "has_gap"])
    assert t.loc["dsa", "converged"] == 0 and not bool(t.loc["dsa", "has_gap"])
    assert t.loc["nsa", "steps"] == "400, 500, never"
    assert t.loc["nsa", "server"].startswith("phase 3: branch_cmp/zero L1.0 (-42 pts there")


def test_claim_systems_reads_the_recorded_files(tmp_path):
    assert "Verdict: not measured" in claim_systems(tmp_path)
    (tmp_path / "phase_sweep_systems.json").write_text(json.dumps(_summary()))
    text = claim_systems(tmp_path)
    assert "the ablations are not recorded" in text
    assert "| dsa |" in text and "none converged: no gap" in text
    assert "a phase gap beyond the dense control in nsa" in text
    assert "never converged (no evidence either way): dsa" in text
    (tmp_path / "interventions_systems.json").write_text(json.dumps(_interventions()))
    assert "branch_cmp/zero L1.0" in claim_systems(tmp_path)


def test_recorded_fixes_runs_are_listed(tmp_path):
    (tmp_path / "phase_sweep_systems.json").write_text(json.dumps(_summary()))
    fx = {"comparison": [dict(fix="staggered_head", baseline="aligned", targets="all",
                              gap_baseline=0.007, gap_other=0.001, reduction=0.9,
                              reduction_lo=-0.45, reduction_hi=1.65, accuracy_diff=-0.001,
                              meets_goal=False),
                         dict(fix="staggered_head", baseline="aligned", targets="far",
                              gap_baseline=0.0, gap_other=0.0, reduction=float("nan"),
                              reduction_lo=float("nan"), reduction_hi=float("nan"),
                              accuracy_diff=0.0, meets_goal=False)]}  # fmt: skip
    (tmp_path / "fixes_systems_csa.json").write_text(json.dumps(fx))
    text = claim_systems(tmp_path)
    assert "Offset fixes on `csa` at T = 64" in text and "T = 128 (" not in text
    assert "staggered_head: gap 0.007 -> 0.001, cut 90% [-45%, 165%]" in text
    assert text.count("staggered_head") == 1  # the far-target row is not listed
    # a baseline without a gap has no cut (JSON null where the run recorded NaN)
    fx["comparison"][0].update(gap_baseline=-0.0, reduction=None, reduction_lo=None,
                               reduction_hi=None)  # fmt: skip
    (tmp_path / "fixes_systems_csa.json").write_text(json.dumps(fx))
    assert "cut n/a (no baseline gap to cut), accuracy -0.001" in claim_systems(tmp_path)
    (tmp_path / "fixes_systems_csa_T128.json").write_text(json.dumps(fx))
    text = claim_systems(tmp_path)
    assert ("Offset fixes on `csa` at T = 128 (`analyses/results/fixes_systems_csa_T128.json`, "
            "`phasemech run fixes --profile systems_csa_T128`)") in text  # fmt: skip


def _rotary(csa_gap: tuple[float, float, float]) -> dict:
    s = _summary()
    for r in s["rows"] + s["convergence"]:
        r["design"] = {"nsa": "csa", "dsa": "hca"}.get(r["design"], r["design"])
    csa = next(r for r in s["rows"] if r["design"] == "csa")
    csa.update(debiased_gap=csa_gap[0], debiased_lo=csa_gap[1], debiased_hi=csa_gap[2])
    return s


def test_the_variants_are_tabled_and_contrasted(tmp_path):
    (tmp_path / "phase_sweep_systems.json").write_text(json.dumps(_summary()))
    assert "own variants" not in claim_systems(tmp_path)
    (tmp_path / "phase_sweep_systems_rotary.json").write_text(
        json.dumps(_rotary((0.05, 0.02, 0.08)))
    )
    text = claim_systems(tmp_path)
    pre = "| rotary, pooled pre-RoPE |"
    assert f"{pre} csa | 4 | 2 of 3 | 0.980 | 0.050 [0.020, 0.080]" in text
    assert f"{pre} hca | 4 | 0 of 3 | - | none converged: no gap |" in text
    assert "Contrasts" not in text  # nothing to set it against yet
    post = _rotary((0.004, -0.001, 0.01))
    post["profile"] = {"positional": "rotary", "design_options": {"csa": {"pool_rope": "post"}}}
    (tmp_path / "phase_sweep_systems_rotary_post.json").write_text(json.dumps(post))
    text = claim_systems(tmp_path)
    assert "rotary, pooled post-RoPE (rotary positions; csa pool_rope=post)" in text
    assert "| rotary, pooled post-RoPE | csa | 4 | 2 of 3 | 0.980 | 0.004 [-0.001, 0.010]" in text
    assert (
        "Contrasts: `csa` rotary, pooled pre-RoPE: gap larger than rotary, pooled "
        "post-RoPE's (CIs disjoint)."
    ) in text  # fmt: skip (hca never converged)
    server = _interventions()
    server["models"][0].update(design="csa", model="csa_d4_h2_T64_s0")
    (tmp_path / "interventions_systems_rotary.json").write_text(json.dumps(server))
    text = claim_systems(tmp_path)
    assert "ablations `interventions_systems_rotary.json`" in text
    assert text.endswith("; among the variants, a gap beyond the dense control in csa (rotary, "
                         "pooled pre-RoPE).")  # fmt: skip
    pre_csa = next(ln for ln in text.splitlines() if ln.startswith(f"{pre} csa |"))
    assert pre_csa.endswith("phase 3: branch_cmp/zero L1.0 (-42 pts there, -12 at the other "
                            "phases; phase-dependent) [csa_d4_h2_T64_s0] |")  # fmt: skip
    # nsa's MLP gate is set against the main sweep's (linear-gate) nsa
    gate = _summary()
    next(r for r in gate["rows"] if r["design"] == "nsa").update(
        debiased_gap=0.002, debiased_lo=-0.001, debiased_hi=0.004
    )
    (tmp_path / "phase_sweep_systems_nsa_mlp_gate.json").write_text(json.dumps(gate))
    text = claim_systems(tmp_path)
    assert "| an MLP gate (32 SiLU units) | nsa | 4 | 2 of 3 |" in text
    assert ("`nsa` an MLP gate (32 SiLU units): gap smaller than the main sweep's (CIs "
            "disjoint)") in text  # fmt: skip
    assert "| an MLP gate (32 SiLU units) | dsa |" not in text  # only the variant's systems
    # a variant recorded before any model finished is left out, not a crash
    (tmp_path / "phase_sweep_systems_nsa_mlp_gate.json").write_text(json.dumps({"rows": []}))
    assert "an MLP gate" not in claim_systems(tmp_path)


def test_the_t128_sweep_joins_the_table(tmp_path):
    """Where ``phase_sweep_systems_T128.json`` is recorded its settings are rows of their own
    (against their own T's dense control), and the verdict names each system's context."""
    (tmp_path / "phase_sweep_systems.json").write_text(json.dumps(_summary()))
    long = _summary()
    for r in long["rows"] + long["convergence"]:
        r["seq_len"] = 128
    nsa = next(r for r in long["rows"] if r["design"] == "nsa")
    nsa.update(debiased_gap=0.001, debiased_lo=-0.002, debiased_hi=0.003)  # no gap at T = 128
    (tmp_path / "phase_sweep_systems_T128.json").write_text(json.dumps(long))
    (tmp_path / "interventions_systems.json").write_text(json.dumps(_interventions()))
    t = systems_table(_summary(), _interventions())
    assert list(t.seq_len) == [64, 64, 64]
    text = claim_systems(tmp_path)
    assert "phase_sweep_systems_T128.json" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| nsa |")]
    assert len(rows) == 2 and "| 128 |" in rows[1]
    assert "branch_cmp/zero L1.0" in rows[0] and "branch_cmp" not in rows[1]  # T = 64's model
    assert "a phase gap beyond the dense control in nsa (T = 64);" in text
    long_inter = _interventions()
    long_inter["models"][0].update(model="nsa_d4_h2_T128_s0", weak_phase_server="slc L1.1")
    (tmp_path / "interventions_systems_T128.json").write_text(json.dumps(long_inter))
    text = claim_systems(tmp_path)
    assert (
        "ablations `analyses/results/interventions_systems.json` (`phasemech run interventions "
        "--profile systems`) and `analyses/results/interventions_systems_T128.json` (`phasemech "
        "run interventions --profile systems_T128`)" in text
    )
    rows = [ln for ln in text.splitlines() if ln.startswith("| nsa |")]
    assert "slc L1.1" in rows[1] and "slc L1.1" not in rows[0]
    assert "never converged (no evidence either way): dsa (T = 64), dsa (T = 128)" in text
