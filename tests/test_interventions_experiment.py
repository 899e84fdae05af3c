"""The interventions experiment end to end on the launcher at its tiny profile (embedded Ray):
the phase sweep's tiny models trained, every analysis of each, the tables and summaries, and a
rerun that computes nothing."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from phasemech.experiments.experiment import Done, run_experiment
from phasemech.experiments.interventions.jobs import InterventionJob, intervention_jobs
from phasemech.experiments.interventions.profiles import OUT_DIR, PROFILES
from phasemech.experiments.interventions.study import INTERVENTIONS, detailed
from phasemech.experiments.sweep.jobs import train_jobs
from phasemech.experiments.sweep.profiles import PROFILES as SWEEP_PROFILES

MODELS = ["none_d4_h2_T32_s0", "gated_d4_h2_T32_s0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of the tiny profile in one folder: the second finds every job cached."""
    root = tmp_path_factory.mktemp("runs")
    first = run_experiment(INTERVENTIONS, "tiny", root, num_cpus=2, progress=False)
    second = run_experiment(INTERVENTIONS, "tiny", root, num_cpus=2, progress=False)
    return first, second


def test_train_jobs_are_the_phase_sweeps():
    """Same keys as the sweep's train jobs: a run in the sweep's folder reuses its models."""
    sweep = {j.key for j in train_jobs(SWEEP_PROFILES["tiny"])}
    assert {j.key for j in train_jobs(PROFILES["tiny"])} == sweep
    default = train_jobs(PROFILES["default"])
    assert len(default) == 8 and INTERVENTIONS.folders["default"] == "phase_sweep_default"
    assert {j.key for j in default} <= {j.key for j in train_jobs(SWEEP_PROFILES["default"])}
    assert detailed([f"m{i}" for i in range(3)]) == {"m0", "m1", "m2"}
    # the old script's sizes: 1024 test sequences, 256 pairs, 1000 draws, seed 0
    fake = {"curve": [], "heldout_accuracy": 1.0}
    done = Done(jobs={j.key: j for j in default}, results={j.key: fake for j in default})
    sizes = {(j.sequences, j.pairs, j.n_boot, j.n_perm, j.seed, j.test_seed)
             for j in intervention_jobs(PROFILES["default"], done)}  # fmt: skip
    assert sizes == {(1024, 256, 1000, 1000, 0, 777)}


def test_converged_profile_reads_the_converged_sweeps_models():
    """The search stage's jobs are the converged sweep's (one cache); only models that reached
    the pooling threshold, seed 0, get analysed."""
    from phasemech.experiments.sweep.jobs import search_jobs

    ours, sweep = PROFILES["converged"], SWEEP_PROFILES["converged"]
    assert {j.key for j in search_jobs(ours, Done())} == {j.key for j in search_jobs(sweep, Done())}
    assert INTERVENTIONS.folders["converged"] == "phase_sweep_converged"
    jobs = [j for j in search_jobs(ours, Done()) if j.train.lr == 3e-3][:2]
    curve = [{"step": 100, "accuracy": 0.99}]
    done = Done(
        jobs={j.key: j for j in jobs},
        results={
            jobs[0].key: {"curve": curve, "heldout_accuracy": 0.99},
            jobs[1].key: {"curve": [], "heldout_accuracy": 0.4},  # never converged
        },
    )
    assert [j.train for j in intervention_jobs(ours, done)] == [jobs[0]]


def test_tiny_run_writes_every_table(runs):
    first, _ = runs
    assert not first.failures and first.ran == 4 and first.cached == 0
    out = first.folder / OUT_DIR
    overview = pd.read_parquet(out / "overview.parquet")
    assert list(overview["model"]) == MODELS
    assert overview["accuracy"].between(0, 1).all()
    assert overview["phase_range_pts"].between(0, 100).all()
    assert overview["probe_accuracy"].between(0, 1).all()
    assert (overview["probe_chance"] == 0.25).all()  # stride 4
    assert list(overview["design"]) == ["none", "gated"] and (overview["stride"] == 4).all()
    clusters = pd.read_parquet(out / "head_clusters.parquet")
    assert len(clusters) == 2 * 2 * 2  # models x layers x heads, all at stride 4
    summary = json.loads((out / "summary.json").read_text())
    assert [m["model"] for m in summary["models"]] == MODELS
    assert summary["profile"]["sequences"] == 32 and summary["profile"]["pairs"] == 8
    text = (out / "summary.md").read_text()
    for section in ("## Overview", "### Ablation", "### Activation patching", "### Attribution"):
        assert section in text
    assert all(f"## {m}" in text for m in MODELS) and "## Head clusters" in text


def test_tiny_results_are_sane(runs):
    first, _ = runs
    results = first.done.of(InterventionJob)
    assert len(results) == 2
    for job, result in results:
        info, tables = result["info"], result["tables"]
        assert info["model"] == job.train.name and info["ablation_s"] > 0
        effects = pd.DataFrame(tables["effects"])
        assert effects["effect"].between(-1, 1).all()
        assert set(effects["phase"]) == {0, 1, 2, 3}
        # the dense control has no grid contrast and no compressed parts
        if info["design"] == "none":
            assert set(tables["patches"]) == {"answer"} and not tables["sites"]
            assert set(effects["component"]) == {"head"}
        else:
            assert set(tables["patches"]) == {"grid", "answer"}
            assert set(tables["sites"]) == {"kv_block", "pattern"}
            assert {"blocks", "raw", "phase_bias"} <= set(effects["component"])
        # detailed tables stay in the job's own folder
        work = first.folder / "jobs" / "work" / job.key / job.train.name
        assert (work / "ablate" / "effects.parquet").is_file()
        assert (work / "info.json").is_file()
        sites = work / "patch_answer_kv_block" / "effects.parquet"
        assert sites.is_file() == (info["design"] != "none")


def test_rerun_computes_nothing(runs):
    first, second = runs
    assert not second.failures and second.ran == 0 and second.cached == 4
    assert second.summary["models"] == first.summary["models"]


def test_weak_phase_server_names_the_unit_serving_the_weak_phase_specifically():
    from phasemech.experiments.interventions.summary import weak_phase_server

    rows = []
    # the head costs more at the weak phase than the branch does, but as much everywhere
    for comp, unit, effects in (("head", 0, [-0.6, -0.6, -0.6]), ("branch_win", 1, [0, -0.5, 0])):
        for phase, eff in enumerate(effects):
            base = [0.9, 0.6, 0.9][phase]  # phase 1 is the intact model's weak phase
            rows.append(dict(component=comp, mode="zero", layer=1, unit=unit, phase=phase,
                             baseline=base, ablated=base + eff, effect=eff))  # fmt: skip
    acc = pd.DataFrame(rows)
    spec = pd.DataFrame([dict(component="head", mode="zero", layer=1, unit=0, p_holm=0.5),
                         dict(component="branch_win", mode="zero", layer=1, unit=1,
                              p_holm=0.01)])  # fmt: skip
    got = weak_phase_server(acc, spec)
    assert got["weak_phase"] == 1
    assert got["weak_phase_server"] == "branch_win/zero L1.1"
    assert got["weak_phase_drop_pts"] == pytest.approx(-50.0)
    assert got["weak_phase_server_mean_drop_pts"] == pytest.approx(0.0)  # at the other phases
    assert got["weak_phase_server_p_holm"] == 0.01


@pytest.mark.parametrize("name", ["default", "converged", "converged_d8", "converged_d8_wide",
                                  "systems", "systems_T128", "systems_rotary",
                                  "systems_rotary_post", "systems_nsa_mlp_gate"])  # fmt: skip
def test_each_sweep_profile_runs_in_its_sweeps_folder(name):
    """An interventions profile on a sweep's models runs in that sweep's folder, so it reads
    the trained models from their cache instead of training them again."""
    from phasemech.experiments.sweep.jobs import search_jobs

    assert INTERVENTIONS.folders[name] == f"phase_sweep_{name}"
    ours, sweep = PROFILES[name], SWEEP_PROFILES[name]
    mine = {j.key for j in search_jobs(ours, Done())}
    assert mine and mine <= {j.key for j in search_jobs(sweep, Done())}  # default: a subset
