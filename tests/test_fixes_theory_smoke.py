"""The fixes and theory-vs-trained experiments end to end on the launcher at their tiny
profiles, and the report's readers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from phasemech.cli import app
from phasemech.experiments import experiment
from phasemech.experiments.claims.converged import TABLES
from phasemech.experiments.claims.fixes import claim_fixes, fix_runs, fixes_training_lines
from phasemech.experiments.claims.from_scratch import converged_sweep_lines
from phasemech.experiments.claims.sources import Sources, load_json
from phasemech.experiments.claims.specialisation import converged_interventions
from phasemech.experiments.claims.theory import theory_run_lines
from phasemech.experiments.experiment import ExperimentRun, run_experiment
from phasemech.experiments.showcase.panels import find_runs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "analyses" / "results"
CLAIMS = ROOT / "phasemech" / "experiments" / "claims"


def _run(name: str, runs: Path) -> ExperimentRun:
    """The experiment's tiny profile on the module's embedded Ray (no progress board: an
    actor of its own)."""
    done = run_experiment(experiment(name), "tiny", runs, progress=False)
    assert not done.failures, done.failures[0].error
    return done


def _cli(name: str, runs: Path) -> str:
    """``phasemech run NAME --profile tiny`` in this process; its output on one line."""
    cmd = ["run", name, "--profile", "tiny", "--runs", str(runs), "--num-cpus", "2"]
    res = CliRunner().invoke(app, cmd)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_fixes_tiny_trains_every_fix_and_compares_with_its_baseline(tmp_path, embedded_ray):
    run = _run("fixes", tmp_path)
    out = tmp_path / "fixes_tiny"
    assert run.folder == out
    summary = json.loads((out / "summary.json").read_text())
    fixes = {r["fix"] for r in summary["results"]}
    assert fixes == {
        "aligned",
        "staggered_head",
        "random_offset",
        "jittered_data",
        "aligned_3layer",
        "staggered_layer",
    }
    pairs = {(r["fix"], r["baseline"]) for r in summary["comparison"]}
    assert ("staggered_layer", "aligned_3layer") in pairs and ("random_offset", "aligned") in pairs
    assert all(r["n_boot"] == 50 for r in summary["comparison"])
    assert summary["profile"]["steps"] == 20 and summary["goal_reduction"] == 0.7
    assert "meets goal" in (out / "summary.md").read_text()
    # equal budget: every fix at every evaluation (10, 20), beside its named baseline
    budget = pd.read_parquet(out / "budget.parquet")
    assert set(budget["step"]) == {10, 20} and len(budget) == 12
    row = budget[(budget["fix"] == "random_offset") & (budget["step"] == 20)].iloc[0]
    assert row["baseline"] == "aligned" and 0 <= row["raw_gap"] <= 1 and row["seeds"] == 1
    # convergence per fix x seed, and each fix beside its baseline at equal accuracy
    conv = pd.read_parquet(out / "convergence.parquet").set_index("fix")
    assert len(conv) == 6 and (conv["budget"] == 20).all() and (conv["step"] == 20).all()
    assert (conv["converged"] == conv["steps_to_95"].notna()).all()
    matched = pd.read_parquet(out / "matched.parquet")
    assert set(matched["fix"]) == fixes and (matched["n"] >= 1).all()
    # one seed, evaluations at steps 10 and 20: each fix has 2 evaluations over its bands
    assert (matched.groupby("fix")["n"].sum() == 2).all()
    own = matched[matched["fix"] == "random_offset"].merge(
        matched[matched["fix"] == "aligned"], on="band", suffixes=("", "_a")
    )
    assert len(own) and np.allclose(own["baseline_raw_gap"], own["raw_gap_a"])
    assert matched[matched["fix"] == "aligned"]["baseline_raw_gap"].isna().all()
    text = (out / "summary.md").read_text()
    assert "## Convergence" in text and "## At equal accuracy" in text
    aligned_row = next(line for line in text.splitlines() if line.startswith("| aligned | -"))
    assert "nan" not in aligned_row and " / " not in aligned_row  # no baseline to set beside
    assert (run.ran, run.cached) == (12, 0)  # 6 models (one seed), 6 statistics jobs
    # the grids really differ: per-layer staggering shifts the third layer's grid
    run = next(r for r in find_runs(out) if r.name == "staggered_layer_s0")
    cfg = json.loads((run / "train_config.json").read_text())
    assert cfg["compression"]["offsets"] == "per_layer" and cfg["model"]["n_layers"] == 3
    # jittered training data, scored on the plain task like every other fix
    jit = next(r for r in find_runs(out) if r.name == "jittered_data_s0")
    assert json.loads((jit / "train_config.json").read_text())["task"]["jitter"] == 1
    # a rerun (the CLI's) trains nothing: every job is cached
    assert "fixes (tiny): 0 jobs run, 12 cached" in _cli("fixes", tmp_path)


def test_theory_trained_tiny_maps_gated_models_onto_the_theory(tmp_path, embedded_ray):
    _run("theory_trained", tmp_path)
    out = tmp_path / "theory_trained_tiny"
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(m["heads"] for m in summary["models"]) == [2, 4]
    for m in summary["models"]:
        assert len(m["acc_by_phase"]) == len(m["predicted_accuracy"]) == 4
        assert len(m["assignment"]) == m["heads"]
        assert len(m["theory_covered"]) == 2  # the tiny profile's theory seeds
    assert summary["profile"]["stride"] == 4
    w = pd.read_parquet(out / "weights.parquet")
    assert set(w["heads"]) == {2, 4} and (w["layer"] == 1).all()


def test_theory_search_reuses_the_recipe_runs_and_keeps_each_h_budget():
    """The converged profiles search rates on seed 0; the recipe's rate keeps its plain name
    (so its runs are the ones a profile without a search trains), other rates are named."""
    from phasemech.experiments.experiment import Done
    from phasemech.experiments.theory_trained.jobs import search_jobs, seed_jobs
    from phasemech.experiments.theory_trained.profiles import PROFILES

    jobs = search_jobs(PROFILES["converged"], Done())
    names = {j.name: j.train for j in jobs}
    assert set(names) == {f"gated_h{h}_s0{s}" for h in (2, 4, 8) for s in ("", "_lr0.001")}
    assert names["gated_h8_s0"].lr == 3e-3 and names["gated_h8_s0_lr0.001"].lr == 1e-3
    assert all(c.steps == 8000 and c.seed == 0 for c in names.values())
    # without a search every seed trains at the recipe's rate on its H's own budget
    default = {j.name: j.train.steps for j in search_jobs(PROFILES["default"], Done())}
    assert default == {f"gated_h{h}_s{s}": 4000 if h == 8 else 2000 for h in (2, 4, 8)
                       for s in (0, 1)}  # fmt: skip
    assert seed_jobs(PROFILES["default"], Done()) == []


def test_theory_models_are_d_head_16_at_d4_and_wider_at_d8():
    from phasemech.experiments.theory_trained.jobs import make_jobs
    from phasemech.experiments.theory_trained.profiles import PROFILES, train_config

    for h in (2, 4, 8):
        d4 = train_config(h, 0, PROFILES["converged"]).model
        d8 = train_config(h, 0, PROFILES["converged_d8"]).model
        assert (d4.d_model, d4.n_heads, d4.d_head) == (64, h, 16)
        assert (d8.d_model, d8.n_heads, d8.d_head) == (128, h, 32)
    # the d = 4 runs keep the cache keys they were recorded under
    jobs = make_jobs(PROFILES["converged"], None, (0,))
    assert jobs[0].name == "gated_h2_s0" and jobs[0].key == "3d3182e301c3ca96"


def test_report_states_each_theory_runs_width():
    recorded = json.loads((RESULTS / "theory_trained_converged.json").read_text())
    assert "d_model" not in recorded["profile"]  # recorded before the summary stated it
    text = "\n".join(theory_run_lines("converged", recorded))
    assert "d_model 64, d_head 16," in text
    wide = {**recorded, "profile": {**recorded["profile"], "d_model": 128, "d_head": 32}}
    assert "d_model 128, d_head 32," in "\n".join(theory_run_lines("converged_d8", wide))


def test_report_reads_json_results_never_markdown():
    for path in [ROOT / "analyses" / "report.py", *sorted(CLAIMS.glob("*.py"))]:
        text = path.read_text()
        assert '.md"' not in text.replace('"REPORT.md"', "") and "md_table" not in text, path
    sweep = load_json(RESULTS / "phase_sweep_default.json")
    rows = [r for r in sweep["rows"] if r["targets"] == "all"]
    assert rows and {"design", "debiased_gap", "null_p95", "acc_by_phase"} <= set(rows[0])
    assert all(r["debiased_lo"] <= r["debiased_gap"] <= r["debiased_hi"] for r in rows)
    pre = load_json(RESULTS / "pretrained_default.json")
    assert {r["setting"] for r in pre["rows"]} >= {"null"}


def test_fixes_profile_names_a_fix_without_its_baseline():
    from dataclasses import replace

    from phasemech.experiments.fixes.jobs import train_jobs
    from phasemech.experiments.fixes.profiles import PROFILES, train_config
    from phasemech.measure.learning import PLATEAU_EXIT, off_plateau

    base = PROFILES["tiny"]
    lonely = replace(base, extra=(("fixes", ("staggered_head",)), ("jitter", 1)))
    with pytest.raises(ValueError, match="needs its baseline 'aligned'"):
        train_jobs(lonely)
    with pytest.raises(ValueError, match="fix='shuffled' is invalid"):
        train_config("shuffled", 0, base)
    assert off_plateau(PLATEAU_EXIT) and not off_plateau(0.21)


def test_fixes_profiles_decide_early_stopping():
    """The budget profiles train every step; the converged one stops at its target."""
    from phasemech.experiments.fixes.profiles import PROFILES, train_config

    for name, want in (("default", None), ("long", None), ("converged", 0.99)):
        cfg = train_config("aligned", 0, PROFILES[name])
        assert cfg.target_accuracy == want, name


def _fixes_summary(fix_acc: list[float], reduction: float, meets: bool) -> dict:
    """A recorded fixes summary with one fix whose seeds reach ``fix_acc``."""
    rows = []
    for fix, accs in (("aligned", [0.6, 0.5, 0.55]), ("random_offset", fix_acc)):
        rows.append(
            {
                "fix": fix,
                "seed": "pooled",
                "targets": "all",
                "accuracy": float(np.mean(accs)),
                "acc_by_phase": [0.5, 0.4],
                "debiased_gap": 0.1,
                "debiased_lo": 0.05,
                "debiased_hi": 0.15,
            }
        )
        rows += [
            {"fix": fix, "seed": str(s), "targets": "all", "accuracy": a}
            for s, a in enumerate(accs)
        ]
    cmp = {
        "fix": "random_offset",
        "baseline": "aligned",
        "targets": "all",
        "gap_baseline": 0.2,
        "gap_other": 0.2 * (1 - reduction),
        "reduction": reduction,
        "reduction_lo": reduction - 0.1,
        "reduction_hi": reduction + 0.1,
        "accuracy_diff": 0.0,
        "accuracy_diff_lo": -0.005 if meets else -0.3,
        "accuracy_diff_hi": 0.005,
        "meets_goal": meets,
    }
    profile = {"design": "mean", "stride": 2, "heads": 2, "seq_len": 16, "seeds": [0, 1, 2]}
    profile |= {"steps": 100, "test_sequences": 8}
    return {
        "profile": profile,
        "goal_reduction": 0.7,
        "noninferiority": 0.01,
        "plateau_exit": 0.3,
        "results": rows,
        "comparison": [cmp],
    }


def test_report_calls_a_fix_whose_models_never_learned_no_fix(tmp_path):
    src = Sources(pd.DataFrame(), [], {}, {}, "cmd", results=tmp_path)
    assert "**Open**" in claim_fixes(src)
    stuck = _fixes_summary([0.21, 0.2, 0.35], reduction=0.9, meets=False)
    (tmp_path / "fixes_default.json").write_text(json.dumps(stuck))
    text = claim_fixes(src)
    assert "2 of 3 seeds below 0.3 accuracy" in text and "costs mean accuracy" in text
    assert "1 of 3 seeds left the loss plateau" in text and "**Goal not met**" in text
    assert "every seed left the loss plateau for 0 of 1 fixes" in text
    assert "3 of 3 baseline seeds" not in text  # the baseline (0.5-0.6) left the plateau
    good = _fixes_summary([0.6, 0.58, 0.61], reduction=0.8, meets=True)
    (tmp_path / "fixes_long.json").write_text(json.dumps(good))
    text = claim_fixes(src)
    assert "**Goal met** by random_offset (long)" in text
    assert "(long, 100 steps): every seed left the loss plateau for 1 of 1 fixes" in text
    assert "significantly narrower for 1 (random_offset)" in text
    assert text.index("Profile default") < text.index("Profile long")
    assert fix_runs(tmp_path)[-1][0] == "long"
    # the converged profile counts a seed at its min_accuracy, the baseline's seeds too
    conv = _fixes_summary([0.99, 0.98, 0.97], reduction=0.8, meets=False)
    conv["profile"]["min_accuracy"] = 0.95
    (tmp_path / "fixes_converged.json").write_text(json.dumps(conv))
    text = claim_fixes(src)
    assert "3 of 3 seeds converged (accuracy >= 0.95)" in text
    assert "3 of 3 baseline seeds below 0.95 accuracy" in text  # aligned: 0.5-0.6
    assert "(converged, 100 steps): every seed converged for 1 of 1 fixes" in text
    assert "its baseline converged (held-out accuracy >= 0.95)" in text


def test_report_reads_every_converged_sweep_profile_as_one_table(tmp_path):
    src = Sources(pd.DataFrame(), [], {}, {}, "cmd", results=tmp_path)
    lines, verdict = converged_sweep_lines(src)
    assert verdict is None and "phase_sweep_converged.json` is missing" in lines[0]
    recorded = json.loads((RESULTS / "phase_sweep_converged.json").read_text())
    d8 = {t: [{**r, "stride": 8} for r in recorded[t]] for t in TABLES}
    (tmp_path / "phase_sweep_converged_d8.json").write_text(json.dumps(d8))
    text = "\n".join(converged_sweep_lines(src)[0])
    assert "phase_sweep_converged_d8.json" in text and "phase_sweep_converged.json`" not in text
    assert "| mean | 8 | 2 | 64 | 64 | 3 of 3 |" in text and "| mean | 4 | 2 | 64 |" not in text
    (tmp_path / "phase_sweep_converged.json").write_text(json.dumps(recorded))
    lines, verdict = converged_sweep_lines(src)
    text = "\n".join(lines)
    assert "| mean | 8 | 2 | 64 | 64 | 3 of 3 |" in text
    assert "| mean | 4 | 2 | 64 | 64 | 3 of 3 |" in text
    assert text.index("phase_sweep_converged.json") < text.index("phase_sweep_converged_d8")
    assert "mean d=4 H=2 T=64" in verdict and "mean d=8 H=2 T=64" in verdict
    # the wide d = 8 profile is the same settings at d_model 128: rows of their own
    (tmp_path / "phase_sweep_converged_d8_wide.json").write_text(json.dumps(d8))
    text = "\n".join(converged_sweep_lines(src)[0])
    assert "| mean | 8 | 2 | 64 | 128 | 3 of 3 |" in text
    assert "| mean | 8 | 2 | 64 | 64 | 3 of 3 |" in text


def test_report_sets_each_fix_beside_its_baseline_along_training():
    conv = [{"fix": f, "seed": s, "steps_to_95": v}
            for f, vals in (("aligned", (2000, 3000, None)), ("staggered_head", (600, 800, 700)))
            for s, v in enumerate(vals)]  # fmt: skip
    matched = [
        {"fix": "aligned", "baseline": None, "band": "0.9-0.99", "raw_gap": 0.04, "n": 10},
        {"fix": "staggered_head", "baseline": "aligned", "band": "0.9-0.99", "raw_gap": 0.02,
         "n": 5},
        {"fix": "random_offset", "baseline": "aligned", "band": "0.6-0.9", "raw_gap": 0.1,
         "n": 5},
    ]  # fmt: skip
    conv += [{"fix": "random_offset", "seed": 0, "steps_to_95": None}]
    lines = fixes_training_lines({"convergence": conv, "matched": matched})
    text = "\n".join(lines)
    assert (
        "- staggered_head vs aligned: steps to 0.95 median 700 (3 of 3 seeds) vs median "
        "2500 (2 of 3 seeds); raw gap at accuracy 0.9-0.99 0.020 vs 0.040 (5 vs 10" in text
    )
    assert "random_offset vs aligned: steps to 0.95 never (1)" in text
    assert "no evaluations of both at accuracy 0.9-0.99" in text
    assert "aligned vs" not in text  # the baseline itself has none
    assert fixes_training_lines({"convergence": conv}) == []  # older recordings


def test_report_merges_the_converged_interventions_of_every_profile(tmp_path):
    src = Sources(pd.DataFrame(), [], {}, {}, "cmd", results=tmp_path)
    assert converged_interventions(src) is None
    recorded = json.loads((RESULTS / "interventions_converged.json").read_text())
    (tmp_path / "interventions_converged.json").write_text(json.dumps(recorded))
    n4 = len(recorded["models"])
    _, lines4, _ = converged_interventions(src)
    d8 = {**recorded, "models": [{**m, "model": m["model"].replace("d4", "d8"), "stride": 8}
                                  for m in recorded["models"]]}  # fmt: skip
    d8["models"][0] = {**d8["models"][0], "phase_dependent_heads": 3}  # a dense control's head
    (tmp_path / "interventions_converged_d8.json").write_text(json.dumps(d8))
    header, lines, verdict = converged_interventions(src)
    assert len(lines4) == n4 and len(lines) == 2 * n4
    assert "interventions_converged.json" in header and "interventions_converged_d8" in header
    comp = [m for m in recorded["models"] if m["design"] != "none"]
    sig, dense = sum(m["phase_dependent_heads"] > 0 for m in comp), n4 - len(comp)
    # each d is judged against its own dense controls
    assert f"d = 4: {sig} of {len(comp)} converged compressed models" in verdict
    assert f"d = 8: {sig} of {len(comp)} converged compressed models" in verdict
    assert f"0 of {dense} dense controls" in verdict and f"1 of {dense} dense" in verdict
    # the wide d = 8 run states its width: its models are judged against its own controls
    wide = {**d8, "profile": {**d8["profile"], "d_model": 128}, "models": recorded["models"]}
    wide["models"] = [{**m, "stride": 8} for m in recorded["models"]]
    (tmp_path / "interventions_converged_d8_wide.json").write_text(json.dumps(wide))
    header, lines, verdict = converged_interventions(src)
    assert len(lines) == 3 * n4 and "interventions_converged_d8_wide" in header
    assert f"d = 8 d_model=128: {sig} of {len(comp)} converged compressed" in verdict
    assert f"d = 8: {sig} of {len(comp)} converged compressed models" in verdict
