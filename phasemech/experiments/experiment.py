"""An experiment as data: named profiles, stages of jobs, and a finish step that writes tables.

As in Zoology, an experiment is a list of configs and one launcher runs any of them. Here a
stage is a function ``(profile, done) -> jobs``: the first stage's jobs depend on the profile
alone; a later stage may read what the earlier ones returned (``done``: every finished job and
its result). Every stage runs through :func:`phasemech.experiments.launcher.launch` inside one
Ray session, with its jobs cached under ``RUNS/<name>_<profile>/jobs/``. ``finish(profile, done,
out)`` then writes the experiment's tables (parquet and ``summary.json``) into
``RUNS/<name>_<profile>/`` and returns the summary.

A stage with failed jobs stops the experiment after the stage's other jobs have finished: the
failures are reported, later stages and the tables wait for a rerun (which computes only what
is missing).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasemech.core.config import TRAINED_DESIGNS
from phasemech.core.device import check_device_name
from phasemech.experiments.jobs import Job
from phasemech.experiments.launcher import Failure, launch, read_cached
from phasemech.experiments.ray_connect import ray_connected


@dataclass(frozen=True)
class Profile:
    """The sizes of an experiment: one type for every experiment and profile.

    Models: ``designs`` x ``strides`` x ``heads`` x ``seeds`` at ``seq_lens[0]``; longer
    contexts (``seq_lens[1:]``) only for ``long_designs`` x ``long_strides`` x ``long_heads``;
    ``models`` keeps only the named runs (None: all). Training: ``steps`` (early stop at
    ``target_accuracy``), evaluation every ``eval_every`` steps, checkpoints every
    ``checkpoint_every``. Scoring: ``test_sequences`` phase-balanced sequences; statistics with
    ``n_boot`` bootstrap draws and ``n_perm`` permutations.
    """

    steps: int
    seeds: tuple[int, ...] = (0,)
    designs: tuple[str, ...] = TRAINED_DESIGNS
    strides: tuple[int, ...] = (4, 8)
    heads: tuple[int, ...] = (2, 4)
    seq_lens: tuple[int, ...] = (64,)
    long_designs: tuple[str, ...] = ()
    long_strides: tuple[int, ...] = (4, 8)
    long_heads: tuple[int, ...] = (4,)
    models: tuple[str, ...] | None = None
    n_pairs: int = 8
    d_model: int = 64
    eval_every: int = 100
    checkpoint_every: int | None = 500
    target_accuracy: float | None = 0.995
    test_sequences: int = 4096
    n_boot: int = 400
    n_perm: int = 400
    #: what only some experiments read (e.g. the dashboard panel's sizes), as (name, value)
    extra: tuple[tuple[str, Any], ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.extra).get(name, default)


@dataclass
class Done:
    """What the stages so far produced: every finished job (by key) and its result."""

    jobs: dict[str, Job] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: what the experiment's ``check`` returned (e.g. the model's source), for the finish
    checked: Any = None
    started: float = field(default_factory=time.perf_counter)

    def of(self, cls: type) -> list[tuple[Any, dict[str, Any]]]:
        """``(job, result)`` of the finished jobs of one class, in submission order."""
        return [(j, self.results[k]) for k, j in self.jobs.items() if isinstance(j, cls)]


#: a stage: ``(profile or config, done) -> jobs``
Stage = Callable[[Any, Done], list[Job]]


@dataclass(frozen=True)
class Experiment:
    """A study: named profiles (a :class:`Profile`, or the study's own frozen config, as the
    real-model studies' ``AuditConfig``), its stages and its finish. ``check(config)`` runs
    before any job (a one-line ``ValueError`` on bad input; what it returns reaches the stages
    and the finish as ``done.checked``). :func:`run_experiment` takes a profile's name or a
    config of the study's own."""

    name: str
    profiles: Mapping[str, Any]
    stages: tuple[Stage, ...]
    finish: Callable[[Any, Done, Path], dict[str, Any]] | None = None
    about: str = ""
    #: profile -> folder name under RUNS, where it differs from ``<name>_<profile>`` (a profile
    #: that shares another experiment's jobs shares its cache)
    folders: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[Any], Any] | None = None

    def profile(self, name: str) -> Any:
        if name not in self.profiles:
            raise ValueError(
                f"profile {name!r} of {self.name!r} is unknown: allowed {list(self.profiles)}"
            )
        return self.profiles[name]

    def folder(self, runs: str | Path, profile: str) -> Path:
        return Path(runs) / self.folders.get(profile, f"{self.name}_{profile}")


@dataclass
class ExperimentRun:
    """What :func:`run_experiment` did: the finished jobs, the failures, the summary (None
    when a stage failed) and the folder it wrote."""

    folder: Path
    done: Done
    failures: list[Failure]
    summary: dict[str, Any] | None
    ran: int = 0
    cached: int = 0
    seconds: float = 0.0

    def summary_or_raise(self, what: str) -> dict[str, Any]:
        """The finish's summary, or one ``RuntimeError`` naming the first failed job (``what``:
        the kind of job, for the message)."""
        if self.failures:
            f = self.failures[0]
            n = len(self.failures)
            raise RuntimeError(f"{n} {what} jobs failed; first: {f.label}\n{f.error}")
        return self.summary


@contextlib.contextmanager
def ray_session(address: str | None, num_cpus: int | None) -> Iterator[Callable[[], None]]:
    """One Ray session for several launches (starting Ray costs seconds), started or joined on
    the first call of the yielded ``ensure()`` only (a fully cached experiment starts none),
    and shut down or left after if this session started or joined it."""
    import ray

    with contextlib.ExitStack() as stack:

        def ensure() -> None:
            if not ray.is_initialized():
                stack.enter_context(ray_connected(address, num_cpus))

        yield ensure


def run_experiment(
    exp: Experiment,
    profile: str | Any,
    runs: str | Path = "runs",
    *,
    folder: str | Path | None = None,
    address: str | None = None,
    num_cpus: int | None = None,
    cpus_per_job: int = 1,
    gpus_per_job: float = 0,
    progress: bool = True,
    device: str = "cpu",
) -> ExperimentRun:
    """Run every stage of ``exp`` at ``profile`` (only what is not cached), then its finish.
    ``profile``: a profile's name (results in ``RUNS/<name>_<profile>/``), or a config of the
    study's own (``phasemech audit``'s ``AuditConfig``), which names its ``folder``.
    ``device``: where jobs run their models (see :func:`launch`)."""
    t0 = time.perf_counter()
    if isinstance(profile, str):
        p, folder = exp.profile(profile), Path(folder or exp.folder(runs, profile))
    elif folder is None:
        raise ValueError(
            f"run_experiment: {exp.name} with a {type(profile).__name__} needs a folder"
        )
    else:
        p, folder = profile, Path(folder)
    kw = dict(cpus_per_job=cpus_per_job, gpus_per_job=gpus_per_job, progress=progress)
    kw["device"] = check_device_name(device)
    out = ExperimentRun(folder, Done(), [], None)
    if exp.check is not None:  # bad input fails here, in one line, before Ray or any job
        out.done.checked = exp.check(p)
    out.done.started = time.perf_counter()  # the studies' wall time: their jobs and finish
    with ray_session(address, num_cpus) as ensure:
        for stage in exp.stages:
            jobs = stage(p, out.done)
            if any(read_cached(folder / "jobs", j) is None for j in jobs):
                ensure()
            launched = launch(jobs, folder / "jobs", **kw)
            out.ran, out.cached = out.ran + len(launched.ran), out.cached + len(launched.cached)
            for job in jobs:
                if job.key in launched.results:
                    out.done.jobs[job.key] = job
                    out.done.results[job.key] = launched.results[job.key]
            if launched.failures:
                out.failures = launched.failures
                break
    if not out.failures and exp.finish is not None:
        out.summary = exp.finish(p, out.done, folder)
    out.seconds = time.perf_counter() - t0
    return out


def run_study(
    exp: Experiment,
    config: Any,
    out: str | Path,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Run (or finish from the cache) a study's own ``config`` into ``out`` (its jobs under
    ``out/jobs``) and return the finish's summary; a failed job raises one ``RuntimeError``
    naming the first failure (the real-model studies: ``run_audit``, ``run_explain``)."""
    run = run_experiment(exp, config, folder=out, address=address, num_cpus=num_cpus,
                         progress=progress, device=device)  # fmt: skip
    return run.summary_or_raise(exp.name)


__all__ = [
    "Done",
    "Experiment",
    "ExperimentRun",
    "Profile",
    "ray_session",
    "run_experiment",
    "run_study",
]
