"""The real-model study family end to end on the bundled SmolLM2, at short contexts: an audit
and an explanation (with the attention sink) through the launcher, each writing every table and
page and rerunning from its cache, and the audit as a registered experiment through
``phasemech run``. One embedded Ray of one CPU serves the module, so its one worker loads the
model once for every study (the real-model worker is shared by the studies' jobs)."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
from browser import page_data

from phasemech.experiments.audit.config import AuditConfig
from phasemech.experiments.audit.study import run_audit
from phasemech.experiments.explain.config import ExplainConfig
from phasemech.experiments.explain.run import run_explain

LAYERS = (4, 5)  # two compressed layers: the pipeline, not the findings (cheap forwards)


@pytest.fixture(scope="module", autouse=True)
def one_ray():
    from phasemech.experiments.ray_connect import ray_connected

    with ray_connected(None, 1):
        yield


def _mtimes(folder):
    return {p: p.stat().st_mtime_ns for p in (folder / "jobs").glob("*.json")}


def test_audit_end_to_end_and_cached_rerun(tmp_path):
    a = AuditConfig.of(designs=("route", "mean", "partition"), contexts=(128,), contents=1,
                       regime="decode", layers=LAYERS, n_boot=20, n_perm=20)  # fmt: skip
    out = tmp_path / "audit"
    summary = run_audit(a, out, progress=False)
    for name in ("targets", "per_phase", "depth_phase", "head_phase", "summary"):
        assert len(pd.read_parquet(out / f"{name}.parquet"))
    t = pd.read_parquet(out / "targets.parquet")
    settings = ["mean_d4_w16", "null", "partition_d4_w16", "route_d4_w16_k8"]
    assert sorted(t.setting.unique()) == settings
    assert sorted(t.phase.unique()) == [0, 1, 2, 3] and len(t) == 4 * 4
    # partition's budget is one head's share of SmolLM2's 9 query heads, not a top-k
    from phasemech.experiments.probe.config import kv_budget

    budget = {r["setting"]: r["budget"] for r in summary["rows"]}
    assert budget["partition_d4_w16"] == kv_budget(a.compression("partition"), 128, 9) < 128
    assert [r["setting"] for r in summary["rows"]][0] == "null"
    text = (out / "summary.md").read_text()
    assert "decode regime" in text and "route_d4_w16_k8" in text
    page = (out / "audit.html").read_text()
    assert "phasemech-data" in page and "<script src=" not in page
    config = json.loads((out / "summary.json").read_text())["config"]
    assert config["regime"] == "decode" and config["designs"] == ["route", "mean", "partition"]
    # a rerun, even with other statistics sizes, reads every job from the cache
    jobs = _mtimes(out)
    assert len(jobs) >= 1
    again = run_audit(dataclasses.replace(a, n_boot=30), out, progress=False)
    assert _mtimes(out) == jobs
    assert [r["accuracy"] for r in again["rows"]] == [r["accuracy"] for r in summary["rows"]]


def test_explain_with_a_sink_end_to_end_and_cached_rerun(tmp_path):
    """Every analysis but the ablation (270 heads x 2 per prompt, left to the in-process job
    test of ``test_explain.py``) on a setting with a 4-token sink, the audit's flag."""
    cfg = ExplainConfig.of(design="route", top_k=1, layers=LAYERS, context=128, contents=1,
                           sink_tokens=4, contrast_phases=(3, 0), per_layer_oracle=False,
                           top_heads=2, n_boot=20, n_perm=20,
                           analyses=("selection", "oracle", "patching"))  # fmt: skip
    out = tmp_path / "explain"
    summary = run_explain(cfg, out, progress=False)
    assert summary["config"]["sink_tokens"] == 4 and summary["config"]["setting"].endswith("_s4")
    sel = pd.read_parquet(out / "selection.parquet")
    assert len(sel) == 4 * len(LAYERS) * 9 and set(sel.phase) == {0, 1, 2, 3}
    orc = pd.read_parquet(out / "oracle.parquet")
    assert set(orc.scope) == {"none", "all", "top heads"} and orc.accuracy.between(0, 1).all()
    patch = pd.read_parquet(out / "patching.parquet")
    assert set(patch.site) == {"head", "resid", "selection", "atp"}
    assert (patch.n_pairs == 1).all()
    assert (patch.clean_phase == 3).all() and (patch.corrupted_phase == 0).all()
    pairs = pd.read_parquet(out / "patching_pairs.parquet")
    assert list(pairs.clean_phase) == [3] and list(pairs.corrupted_phase) == [0]
    sel_site = patch[patch.site == "selection"]
    assert sorted(sel_site.layer) == [-1, *LAYERS] and sel_site.kept.between(1, 3).all()
    att = pd.read_parquet(out / "head_attention.parquet")
    assert len(att) == 2 * 30 * 9 * 4 and att.mass.between(0, 1).all()
    assert summary["n_pairs"] == 1 and list(summary["contrast_phases"]) == [3, 0]
    assert "route_d4_w16_k1_s4" in (out / "summary.md").read_text()
    page = page_data((out / "explain.html").read_text())
    assert len(page["heads"]["labels"]) == 270 and "selection" in page["figures"]
    assert summary["atp_check"]["n"] == 20 and summary["findings"]["top_patching"]
    assert not (out / "ablation.parquet").exists()
    jobs = _mtimes(out)
    again = run_explain(cfg, out, progress=False)
    assert _mtimes(out) == jobs
    assert again["accuracy_by_phase"] == summary["accuracy_by_phase"]


def test_audit_and_explain_are_experiments_on_the_launcher(tmp_path):
    """``phasemech run audit --profile tiny`` runs the registered audit into RUNS/audit_tiny
    (the launcher's cache, resume and ``--address`` serve it as every other study); a rerun
    computes nothing."""
    from typer.testing import CliRunner

    from phasemech.cli import app
    from phasemech.experiments import experiment

    assert isinstance(experiment("explain").profile("tiny"), ExplainConfig)
    runs = tmp_path / "runs"
    res = CliRunner().invoke(app, ["run", "audit", "--profile", "tiny", "--runs", str(runs)])
    assert res.exit_code == 0, res.output
    folder = runs / "audit_tiny"
    summary = json.loads((folder / "summary.json").read_text())
    # summary.json's config is the audit's, flat: it rebuilds the very config that ran
    assert AuditConfig.of(**summary["config"]) == experiment("audit").profile("tiny")
    assert summary["prompts"] == 2 * 4 * 2  # contents x phases x (null, route)
    again = CliRunner().invoke(app, ["run", "audit", "--profile", "tiny", "--runs", str(runs)])
    assert again.exit_code == 0 and "0 jobs run" in again.output
