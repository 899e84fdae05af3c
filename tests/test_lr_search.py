"""The learning-rate search: which rate a setting keeps, which runs the seeds stage adds, which
runs statistics read, and the search end to end on the launcher (``tiny_search``)."""

from __future__ import annotations

import pandas as pd
import pytest

from phasemech.experiments import experiment
from phasemech.experiments.experiment import Done, run_experiment
from phasemech.experiments.lr_search import (
    analysed_runs,
    best_lr,
    chosen_runs,
    convergence_table,
    search_stages,
    search_table,
    setting,
    steps_to,
)
from phasemech.experiments.sweep.jobs import make_jobs
from phasemech.experiments.sweep.profiles import PROFILES

P = PROFILES["tiny_search"]  # none and gated, d 4, H 2, seeds 0 and 1, rates 1e-3 and 3e-2


def _result(curve: list[float], every: int = 10) -> dict:
    return {
        "curve": [{"step": every * (i + 1), "accuracy": a} for i, a in enumerate(curve)],
        "heldout_accuracy": curve[-1],
        "test_accuracy": curve[-1],
        "step": every * len(curve),
        "train_seconds": 1.0,
    }


def _done(results: dict[tuple[str, float, int], list[float]], steps: int = 30) -> Done:
    done = Done()
    for (design, lr, seed), curve in results.items():
        job = next(
            j for j in make_jobs(P, lr, (seed,), steps) if j.train.compression.design == design
        )
        done.jobs[job.key] = job
        done.results[job.key] = _result(curve)
    return done


def test_steps_to_and_ranking():
    assert steps_to(_result([0.2, 0.96, 0.99])["curve"]) == 20
    assert steps_to(_result([0.2, 0.5])["curve"]) is None
    jobs = [j for lr in (1e-3, 3e-2) for j in make_jobs(P, lr, (0,), 30)][:1]
    fast, slow = make_jobs(P, 3e-2, (0,), 30)[0], jobs[0]
    # converged runs first, by fewer steps to 0.95: the faster one wins over a higher final
    assert best_lr([(slow, _result([0.2, 0.2, 0.99])), (fast, _result([0.96, 0.97, 0.97]))]) == 3e-2
    # nobody converged: the higher held-out accuracy wins
    assert best_lr([(slow, _result([0.2, 0.6])), (fast, _result([0.2, 0.4]))]) == 1e-3
    # a tie goes to the smaller rate
    assert best_lr([(fast, _result([0.3])), (slow, _result([0.3]))]) == 1e-3


def test_setting_ignores_rate_seed_and_budget():
    a = make_jobs(P, 1e-3, (0,), 30)[1].train
    b = make_jobs(P, 3e-2, (1,), 500)[1].train
    assert setting(a) == setting(b)
    assert setting(a) != setting(make_jobs(P, 1e-3, (0,), 30)[0].train)  # another design


def test_seed_stage_uses_each_settings_best_rate_and_retrains_an_unconverged_search_seed():
    search, seeds = search_stages(make_jobs)
    first = search(P, Done())
    assert {(j.train.lr, j.train.seed) for j in first} == {(1e-3, 0), (3e-2, 0)}
    assert all(j.train.steps == P.steps for j in first)  # no search_steps: the full budget
    done = _done(
        {
            ("none", 1e-3, 0): [0.5, 0.97],  # converged: 1e-3 kept
            ("none", 3e-2, 0): [0.2, 0.3],
            ("gated", 1e-3, 0): [0.2, 0.2],
            ("gated", 3e-2, 0): [0.2, 0.4],  # nobody converged: the better 3e-2 kept
        }
    )
    second = seeds(P, done)
    picked = {(j.train.compression.design, j.train.lr, j.train.seed) for j in second}
    # seed 1 of each at its rate; gated's seed 0 did not converge, but the search budget was
    # the full one already, so it is not trained again
    assert picked == {("none", 1e-3, 1), ("gated", 3e-2, 1)}
    shorter = type(P)(**{**P.__dict__, "extra": P.extra + (("search_steps", 20),)})
    done_short = _done({k: v for k, v in [(("gated", 3e-2, 0), [0.2, 0.4])]}, steps=20)
    again = {(j.train.lr, j.train.seed, j.train.steps) for j in seeds(shorter, done_short)}
    assert again == {(3e-2, 0, P.steps), (3e-2, 1, P.steps)}


def test_chosen_runs_and_tables():
    done = _done(
        {
            ("gated", 1e-3, 0): [0.2, 0.3],
            ("gated", 3e-2, 0): [0.5, 0.96],
            ("gated", 3e-2, 1): [0.2, 0.25],
        }
    )
    runs = chosen_runs(done)
    assert sorted((j.train.lr, j.train.seed) for j, _ in runs) == [(3e-2, 0), (3e-2, 1)]
    conv = convergence_table(done)
    assert list(conv.sort_values("seed")["converged"]) == [True, False]
    assert conv.sort_values("seed")["steps_to_95"].iloc[0] == 20
    search = search_table(done)
    assert len(search) == 3 and search["chosen"].sum() == 2


def test_tiny_search_on_the_launcher(tmp_path, embedded_ray):
    run = run_experiment(experiment("phase_sweep"), "tiny_search", tmp_path, progress=False)
    assert not run.failures and (run.ran, run.cached) == (8, 0)
    folder = tmp_path / "phase_sweep_tiny_search"
    assert run.folder == folder
    search = pd.read_parquet(folder / "lr_search.parquet")
    assert len(search) == 6  # 2 settings x 2 rates on seed 0, + seed 1 at the kept rate
    assert set(search[search["seed"] == 0]["lr"]) == {1e-3, 3e-2}
    conv = pd.read_parquet(folder / "convergence.parquet")
    assert sorted(conv["seed"]) == [0, 0, 1, 1] and conv["lr"].nunique() >= 1
    for design, g in conv.groupby("design"):
        kept = search[(search["design"] == design) & search["chosen"]]["lr"].unique()
        assert set(g["lr"]) == set(kept)  # every seed at its setting's kept rate
    assert "## Learning-rate search" in (folder / "summary.md").read_text()
    assert len(pd.read_parquet(folder / "curves.parquet")) > 0


def test_analysed_runs_first_keeps_each_settings_lowest_learned_seed():
    done = _done(
        {
            ("none", 1e-3, 0): [0.99],
            ("none", 1e-3, 1): [0.99],
            ("gated", 1e-3, 0): [0.25],  # seed 0 stayed on the plateau
            ("gated", 1e-3, 1): [0.97],
        }
    )
    got = {
        (j.train.compression.design, j.train.seed) for j, _ in analysed_runs(done, 0.95, "first")
    }
    assert got == {("none", 0), ("gated", 1)}
    assert {j.train.seed for j, _ in analysed_runs(done, 0.95, (0,))} == {0}
    with pytest.raises(ValueError, match="seeds='all'"):
        analysed_runs(done, 0.95, "all")
