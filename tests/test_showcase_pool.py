"""The figures experiment's pooled per-phase table reads only the models a converged profile
pools: a model that never learned is not averaged into a figure's curve or gap."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from phasemech.experiments.experiment import Done
from phasemech.experiments.showcase import study as showcase
from phasemech.experiments.sweep.jobs import make_jobs
from phasemech.experiments.sweep.profiles import PROFILES

P = PROFILES["tiny_search"]  # none and gated, d 4, H 2, seeds 0 and 1


def _targets(job, result):
    # 64 sequences x 8 targets; the accuracy of every target is the run's held-out accuracy
    rng = np.random.default_rng(job.train.seed)
    n = 64 * 8
    return pd.DataFrame(
        {
            "step": result["step"],
            "source_pos": np.tile(np.arange(8), 64),
            "group_id": np.repeat(np.arange(64), 8),
            "depth": 1.0,
            "correct": rng.random(n) < result["heldout_accuracy"],
        }
    )


def _done(accuracies: dict[tuple[str, int], float]) -> Done:
    done = Done()
    for (design, seed), acc in accuracies.items():
        job = next(
            j for j in make_jobs(P, None, (seed,), 30) if j.train.compression.design == design
        )
        done.jobs[job.key] = job
        done.results[job.key] = {
            "curve": [{"step": 30, "accuracy": acc}],
            "heldout_accuracy": acc,
            "step": 30,
        }
    return done


def test_per_phase_table_pools_only_models_at_the_threshold(monkeypatch):
    monkeypatch.setattr(showcase, "scored_targets", _targets)
    done = _done({("none", 0): 1.0, ("none", 1): 1.0, ("gated", 0): 0.25, ("gated", 1): 0.99})
    p = replace(P, n_boot=0, n_perm=10, extra=(("pool_min_accuracy", 0.95),))
    t = showcase.per_phase_table(p, done).groupby("design")[["seeds", "overall"]].first()
    assert t.loc["gated", "seeds"] == 1 and t.loc["gated", "overall"] > 0.95
    assert t.loc["none", "seeds"] == 2
    # without a threshold every chosen run is pooled, the plateaued seed too
    t = showcase.per_phase_table(replace(p, extra=()), done).groupby("design")["seeds"].first()
    assert t.loc["gated"] == 2
