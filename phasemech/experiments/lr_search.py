"""A learning-rate search in the style of Zoology's sweeps, as two launcher stages.

A *setting* is every field of a training config except the learning rate and the seed (design,
stride, heads, context, steps, ...). Stage 1 trains each setting on the search seed at every
learning rate of the profile; stage 2 reads those runs, keeps the best rate per setting
(:func:`best_lr`) and trains the other seeds at it. Every run is recorded
(:func:`search_table`), the chosen ones make the convergence table (:func:`convergence_table`:
steps to 0.95 held-out accuracy, final accuracy, converged or not), and only chosen runs reach
an experiment's statistics (:func:`chosen_runs`). Spending the search on one seed and the seeds
on one rate is what keeps the compute affordable; the launcher's cache lets a long search stop
and continue.

Axes: rows are runs (setting x learning rate x seed); ``curve`` rows are evaluations.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pandas as pd

from phasemech.experiments.experiment import Done, Profile
from phasemech.experiments.jobs import TrainJob
from phasemech.training.config import TrainConfig

#: held-out accuracy a converged model reaches (the convergence table's threshold)
CONVERGED = 0.95

#: ``make(profile, lr, seeds, steps) -> train jobs`` of every setting of a profile
MakeJobs = Callable[[Profile, float | None, tuple[int, ...], int], list[TrainJob]]


def lrs(p: Profile) -> tuple[float, ...]:
    """The profile's learning rates (extra ``lrs``); empty: no search, the config's default."""
    return tuple(p.get("lrs", ()))


def search_steps(p: Profile) -> int:
    """The search runs' step budget (extra ``search_steps``; default the profile's steps)."""
    return int(p.get("search_steps", p.steps))


def setting(cfg: TrainConfig) -> str:
    """The setting a config belongs to: its JSON without learning rate, seed and step budget
    (a search may spend a shorter budget than the seeds)."""
    d = cfg.to_dict()
    d.pop("lr"), d.pop("seed"), d.pop("steps")
    return json.dumps(d, sort_keys=True)


def steps_to(curve: list[dict[str, Any]], accuracy: float = CONVERGED) -> int | None:
    """The first evaluated step at which held-out accuracy reached ``accuracy`` (None: never)."""
    return next((int(m["step"]) for m in curve if m["accuracy"] >= accuracy), None)


def _rank(result: dict[str, Any]) -> tuple:
    """Converged runs first, by fewer steps to 0.95; then the rest by held-out accuracy."""
    first = steps_to(result["curve"])
    return (0, first) if first is not None else (1, -result["heldout_accuracy"])


def best_lr(runs: list[tuple[TrainJob, dict[str, Any]]]) -> float:
    """The learning rate of the best run (ties: the smaller rate)."""
    return min(runs, key=lambda jr: (*_rank(jr[1]), jr[0].train.lr))[0].train.lr


def chosen_lrs(done: Done) -> dict[str, float]:
    """Per setting, the best learning rate among its finished runs on the search seed (the
    runs of the lowest seed of the setting)."""
    by: dict[str, list[tuple[TrainJob, dict]]] = {}
    for job, result in done.of(TrainJob):
        by.setdefault(setting(job.train), []).append((job, result))
    out = {}
    for key, runs in by.items():
        seed = min(j.train.seed for j, _ in runs)
        out[key] = best_lr([(j, r) for j, r in runs if j.train.seed == seed])
    return out


def chosen_runs(done: Done) -> list[tuple[TrainJob, dict[str, Any]]]:
    """The finished runs at their setting's chosen learning rate (what statistics read); a
    seed trained on both the search budget and the full one counts with the full one."""
    best = chosen_lrs(done)
    kept: dict[tuple[str, int], tuple[TrainJob, dict[str, Any]]] = {}
    for job, result in done.of(TrainJob):
        key = (setting(job.train), job.train.seed)
        if job.train.lr != best[key[0]]:
            continue
        if key not in kept or job.train.steps > kept[key][0].train.steps:
            kept[key] = (job, result)
    return list(kept.values())


def analysed_runs(
    done: Done, min_accuracy: float = 0.0, seeds: tuple[int, ...] | str | None = None
) -> list[tuple[TrainJob, dict[str, Any]]]:
    """The chosen runs that reached ``min_accuracy`` held-out accuracy (and are among
    ``seeds``, if given; ``"first"``: the lowest such seed of each setting): what statistics
    and analyses read."""
    if seeds is not None and seeds != "first" and not isinstance(seeds, tuple):
        raise ValueError(f"seeds={seeds!r}: allowed are a tuple of seeds, 'first' or None")
    runs = [
        (j, r)
        for j, r in chosen_runs(done)
        if r["heldout_accuracy"] >= min_accuracy
        and (seeds is None or seeds == "first" or j.train.seed in seeds)
    ]
    if seeds != "first":
        return runs
    # a setting whose seed 0 stayed on the plateau is still analysed, on its first seed that
    # learned, rather than dropped
    first: dict[str, tuple[TrainJob, dict[str, Any]]] = {}
    for j, r in sorted(runs, key=lambda jr: jr[0].train.seed):
        first.setdefault(setting(j.train), (j, r))
    return list(first.values())


def search_stages(make: MakeJobs) -> tuple[Callable, Callable]:
    """The two stages of a search over ``make``'s settings: (1) the first seed at every rate
    of the profile, on the search budget (every seed at the default rate when the profile has
    no rates); (2) the other seeds at each setting's best rate, on the full budget."""

    def search(p: Profile, done: Done) -> list[TrainJob]:
        if not lrs(p):
            return make(p, None, p.seeds, p.steps)
        return [j for lr in lrs(p) for j in make(p, lr, p.seeds[:1], search_steps(p))]

    def seeds(p: Profile, done: Done) -> list[TrainJob]:
        if not lrs(p) or len(p.seeds) < 2:
            return []
        best = chosen_lrs(done)
        # the search seed again on the full budget where its search run did not converge
        unconverged = {
            setting(j.train)
            for j, r in done.of(TrainJob)
            if j.train.lr == best[setting(j.train)] and steps_to(r["curve"]) is None
        }
        retrain = search_steps(p) < p.steps  # a longer budget can still take it off the plateau
        jobs = []
        for lr in lrs(p):
            for job in make(p, lr, p.seeds, p.steps):
                key = setting(job.train)
                first = job.train.seed == p.seeds[0]
                if best.get(key) == lr and (not first or (retrain and key in unconverged)):
                    jobs.append(job)
        return jobs

    return search, seeds


def with_lr(cfg: TrainConfig, lr: float | None) -> TrainConfig:
    return cfg if lr is None else dataclasses.replace(cfg, lr=lr)


def run_row(job: TrainJob, result: dict[str, Any]) -> dict[str, Any]:
    """One run's convergence record: its setting's axes, rate, seed, budget, final step, steps
    to 0.95, held-out and test accuracy, training seconds."""
    c = job.train
    return {
        "name": job.name,
        "design": c.compression.design,
        "stride": c.compression.stride,
        "heads": c.model.n_heads,
        "seq_len": c.task.seq_len,
        "lr": c.lr,
        "seed": c.seed,
        "budget": c.steps,
        "step": result["step"],
        "steps_to_95": steps_to(result["curve"]),
        "heldout_accuracy": result["heldout_accuracy"],
        "test_accuracy": result["test_accuracy"],
        "train_seconds": result["train_seconds"],
    }


def search_table(done: Done) -> pd.DataFrame:
    """Every run of the search: setting, rate, seed, steps to 0.95, accuracies, and whether
    the rate is the one kept for its setting."""
    best = chosen_lrs(done)
    rows = [
        {**run_row(j, r), "chosen": j.train.lr == best[setting(j.train)]}
        for j, r in done.of(TrainJob)
    ]
    return pd.DataFrame(rows)


def convergence_frame(runs: list[tuple[TrainJob, dict[str, Any]]]) -> pd.DataFrame:
    """One :func:`run_row` per run, with ``converged``: held-out accuracy reached
    :data:`CONVERGED`."""
    df = pd.DataFrame([run_row(j, r) for j, r in runs])
    if len(df):
        df["converged"] = df["steps_to_95"].notna()
    return df


def convergence_table(done: Done) -> pd.DataFrame:
    """The chosen runs: setting x seed with steps to 0.95 and final held-out accuracy."""
    return convergence_frame(chosen_runs(done))


def curves(done: Done) -> pd.DataFrame:
    """Held-out accuracy along training of every run (the learning curves of the report)."""
    rows = []
    for job, result in done.of(TrainJob):
        base = run_row(job, result)
        keep = {k: base[k] for k in ("name", "design", "stride", "heads", "seq_len", "lr", "seed")}
        rows += [{**keep, "step": m["step"], "accuracy": m["accuracy"]} for m in result["curve"]]
    return pd.DataFrame(rows)


__all__ = [
    "CONVERGED",
    "analysed_runs",
    "best_lr",
    "chosen_lrs",
    "chosen_runs",
    "convergence_frame",
    "convergence_table",
    "curves",
    "lrs",
    "run_row",
    "search_stages",
    "search_table",
    "setting",
    "steps_to",
    "with_lr",
]
