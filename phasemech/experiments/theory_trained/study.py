"""Theory vs trained models as an
:class:`~phasemech.experiments.experiment.Experiment`: its stages and its finish, which pools
the rank tests over the models that learned and writes ``results.parquet``,
``weights.parquet``, ``convergence.parquet``, ``lr_search.parquet``, ``summary.json`` and
``summary.md``.

Axes: ``head``, ``phase``; rows are models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.lr_search import convergence_table, search_table
from phasemech.experiments.theory_trained.jobs import (
    TheoryFitJob,
    TheorySimJob,
    fit_jobs,
    search_jobs,
    seed_jobs,
)
from phasemech.experiments.theory_trained.profiles import D_HEAD, PROFILES
from phasemech.experiments.theory_trained.summary import summary_markdown
from phasemech.measure.learning import PLATEAU_EXIT


def pooled_tests(results: pd.DataFrame) -> dict:
    """The pooled rank test (all models, then per H) over the models that learned (column
    ``learned``: held-out accuracy at the profile's ``min_accuracy``, by default off the loss
    plateau)."""
    from phasemech.theory.fit import pooled_rank_test

    def test(rows: pd.DataFrame) -> dict:
        rows = rows[rows["learned"]]
        pairs = zip(rows["predicted_accuracy"], rows["acc_by_phase"], strict=True)
        return pooled_rank_test(list(pairs))

    return {"all": test(results)} | {f"H={h}": test(g) for h, g in results.groupby("heads")}


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    sims = {j.heads: r for j, r in done.of(TheorySimJob)}
    fits = done.of(TheoryFitJob)
    results = pd.DataFrame([{**r["row"], **sims[r["row"]["heads"]]} for _, r in fits])
    weights = pd.concat(
        [pd.DataFrame(r["weights"]).assign(heads=j.train.train.model.n_heads,
                                           seed=j.train.train.seed) for j, r in fits],
        ignore_index=True,
    )  # fmt: skip
    # converged profiles test only models at min_accuracy; the older ones those off the plateau
    learned_at = p.get("min_accuracy", PLATEAU_EXIT)
    results["learned"] = results["accuracy"] >= learned_at
    conv, search = convergence_table(done), search_table(done)
    for name, df in (("results", results), ("weights", weights), ("convergence", conv),
                     ("lr_search", search)):  # fmt: skip
        atomic_write(out / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
    pooled = pooled_tests(results)
    profile = {
        "stride": p.strides[0], "heads": list(p.heads), "seq_len": p.seq_lens[0],
        "n_pairs": p.n_pairs, "seeds": list(p.seeds), "steps": p.steps,
        "test_sequences": p.test_sequences, "eval_every": p.eval_every, "d_model": p.d_model,
        "d_head": D_HEAD, **{k: v for k, v in p.extra},  # extra's d_head overrides
    }  # fmt: skip
    summary = json_safe(
        {
            "profile": profile,
            "plateau_exit": PLATEAU_EXIT,
            "learned_at": learned_at,
            "models": results.to_dict("records"),
            "lr_search": search.to_dict("records"),
            "pooled_rank_test": pooled,
        }
    )
    write_json_atomic(out / "summary.json", summary)
    write_text_atomic(out / "summary.md", summary_markdown(results, p, pooled, search))
    return summary


THEORY_TRAINED = Experiment(
    name="theory_trained",
    profiles=PROFILES,
    stages=(search_jobs, seed_jobs, fit_jobs),
    finish=finish,
    about="gated models of 2, 4 and 8 heads against the gradient-flow theory",
)


__all__ = ["THEORY_TRAINED", "finish", "pooled_tests"]
