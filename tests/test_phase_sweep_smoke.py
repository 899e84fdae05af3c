"""The headline sweep runs end to end on the launcher at its tiny profile, caches its work and
reports (``phasemech run phase_sweep``)."""

import json

import pandas as pd
from typer.testing import CliRunner

from phasemech.cli import app
from phasemech.experiments import experiment
from phasemech.experiments.experiment import run_experiment


def test_phase_sweep_tiny_profile(tmp_path, embedded_ray):
    # the module's embedded Ray (one warm worker); no progress board (an actor of its own)
    first = run_experiment(experiment("phase_sweep"), "tiny", tmp_path, progress=False)
    assert not first.failures and (first.ran, first.cached) == (4, 0)
    sweep = tmp_path / "phase_sweep_tiny"
    assert first.folder == sweep
    results = pd.read_parquet(sweep / "results.parquet")
    pooled = results[(results["seed"] == "pooled") & (results["step"] == "final")]
    far = pooled[pooled["targets"] == "far"]  # sources read through blocks only
    pooled = pooled[pooled["targets"] == "all"]
    assert len(far) == len(pooled) == 2
    assert (far["n"].to_numpy() < pooled["n"].to_numpy()).all()
    assert set(pooled["design"]) == {"none", "gated"}
    for r in pooled.itertuples():
        assert len(r.acc_by_phase) == r.phase_stride == 4
        assert 0 <= r.accuracy <= 1 and 0 <= r.p_perm <= 1
        assert r.debiased_lo <= r.debiased_gap <= r.debiased_hi
    # intermediate checkpoints are scored too (steps 10, 20 and the final 30)
    per_seed = results[results["seed"] != "pooled"]
    assert set(per_seed["step"]) == {"10", "20", "final"}
    curve = pd.read_parquet(sweep / "gap_vs_accuracy.parquet")
    assert set(curve["step"]) == {10, 20, 30}
    assert "| gated | 4 | 2 | 32 |" in (sweep / "summary.md").read_text()
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["models"] == 2 and len(summary["runs"]) == 2
    assert summary["profile"]["d_model"] == 64  # the report reads the width from the recording
    # so are the positions and design options the models were trained with
    assert summary["profile"]["positional"] == "standard"
    assert summary["profile"]["design_options"] == {}
    assert len(summary["rows"]) == len(results)  # the report reads these rows, not markdown
    # a second run reuses every job: nothing is retrained, rescored or rewritten
    cached = sorted(sweep.rglob("model.safetensors")) + sorted((sweep / "jobs").glob("*.json"))
    stamps = {f: f.stat().st_mtime_ns for f in cached}
    cmd = ["run", "phase_sweep", "--profile", "tiny", "--runs", str(tmp_path), "--num-cpus", "2"]
    again = CliRunner().invoke(app, cmd)  # the CLI, in this process: nothing to launch
    assert again.exit_code == 0, again.output
    assert "phase_sweep (tiny): 0 jobs run, 4 cached" in " ".join(again.output.split())
    assert {f: f.stat().st_mtime_ns for f in cached} == stamps


def test_far_targets_of_a_short_context_give_no_row():
    """At d = 16 and T = 64 no target lies 3d - 1 back: no 'far' row (not an empty-frame
    error that fails the sweep's statistics)."""
    import pandas as pd

    from phasemech.experiments.sweep.jobs import report_row

    df = pd.DataFrame({"distance": [3, 20, 46], "source_pos": [10, 20, 30]})
    assert report_row({"targets": "far"}, df, 16, 10, 10) is None


def test_systems_profiles_build_the_systems_they_name():
    """The systems' own geometry and training, and the rotary profiles' positions and pooling
    (a profile option that silently fell away would compare a design with itself)."""
    from phasemech.experiments.sweep.profiles import PROFILES, run_specs, train_config

    def configs(profile):
        p = PROFILES[profile]
        return {s.name: train_config(s, p) for s in run_specs(p) if s.seed == 0}

    base = configs("systems")
    assert base["nsa_d4_h2_T64_s0"].compression.select_len == 8
    assert base["dsa_d4_h2_T64_s0"].selection_warmup == 500
    assert base["hca_d16_h2_T64_s0"].compression.stride == 16
    assert {c.model.positional_embedding_type for c in base.values()} == {"standard"}
    for profile, pool in (("systems_rotary", "pre"), ("systems_rotary_post", "post")):
        cfgs = configs(profile)
        assert sorted(cfgs) == sorted(["none_d4_h2_T64_s0", "none_d16_h2_T64_s0",
                                       "csa_d4_h2_T64_s0", "hca_d16_h2_T64_s0"])  # fmt: skip
        assert {c.model.positional_embedding_type for c in cfgs.values()} == {"rotary"}
        for name in ("csa_d4_h2_T64_s0", "hca_d16_h2_T64_s0"):
            assert cfgs[name].compression.pool_rope == pool
    gate = configs("systems_nsa_mlp_gate")
    assert sorted(gate) == ["none_d4_h2_T64_s0", "nsa_d4_h2_T64_s0"]
    assert gate["nsa_d4_h2_T64_s0"].compression.gate_hidden == 32
    assert base["nsa_d4_h2_T64_s0"].compression.gate_hidden is None
    # the same geometry as "systems"' nsa, and its dense control is the same job (cached)
    assert gate["nsa_d4_h2_T64_s0"].compression.select_len == 8
    assert gate["none_d4_h2_T64_s0"] == base["none_d4_h2_T64_s0"]


def test_recorded_profiles_keep_their_job_keys():
    """A new optional config field or profile option must not move the keys of recorded runs'
    jobs (their cache): the ``systems`` sweep's first-stage keys as recorded."""
    from phasemech.experiments.experiment import Done
    from phasemech.experiments.sweep.jobs import search_jobs
    from phasemech.experiments.sweep.profiles import PROFILES

    keys = sorted(j.key for j in search_jobs(PROFILES["systems"], Done()))
    assert keys == ["459b87352ff692f5", "510a7071ff1dc72d", "9378acd838cc7360",
                    "a29dc2485e52e007", "a5d067c999c8d884", "b4a08368d5cee6a6",
                    "b85689543cb00d79"]  # fmt: skip


def test_the_systems_fixes_profiles_at_t128():
    """``fixes --profile systems_<design>_T128`` trains at T = 128; the T = 64 profiles keep
    their recorded job keys (their cache)."""
    from phasemech.experiments.fixes.jobs import train_jobs
    from phasemech.experiments.fixes.profiles import PROFILES as FIXES

    long = train_jobs(FIXES["systems_partition_T128"])
    assert {j.train.task.seq_len for j in long} == {128} and len(long) == 9
    assert sorted(j.key for j in train_jobs(FIXES["systems_partition"])) == [
        "12517235a9302db3", "15739d70bfed471c", "1d0e7add6e6ee17a", "513938ed972c780a",
        "5d2f75c93cc29629", "8d8d674074e2c64a", "cc675afc81e43282", "ce08f899867b447c",
        "dff644b3704d94a8"]  # fmt: skip
