"""One launcher for every experiment: jobs run as Ray tasks, results cached on disk by key.

With no ``address`` the launcher starts an embedded local Ray (``ray.init(num_cpus=...)``, no
dashboard) and shuts it down afterwards, so a user starts nothing; ``address`` joins a running
Ray cluster (``ray start --head`` on one machine, ``ray start --address=HEAD`` on the others),
which is how an experiment outgrows one machine, and leaves it when done. Authentication and
the checks before joining are :mod:`phasemech.experiments.ray_connect`'s. Each job holds
``cpus_per_job`` CPUs (and torch uses that many threads) and ``gpus_per_job`` GPUs.

A results folder holds ``<key>.json`` per finished job (``{"key", "config", "result"}``, written
atomically by the launcher as each job returns) and ``work/<key>/``, the job's own folder
(checkpoints of a training job: a killed job resumes there). A crash, Ctrl-C or a killed worker
loses only the jobs in flight; rerunning the same experiment runs only what is missing. A job
that fails is reported with its config and traceback at the end; the others finish.

A node lost mid-run (dead or unreachable: Ray fails each of its jobs with ``NodeDiedError``
about 2 s later, long before the GCS marks it dead) costs only its jobs in flight: the launcher
runs them again on the nodes that remain (never that node again), says so in one line per node,
and caches each result once, as ever. A result lost with its node after the job finished
(``ObjectLostError``) is recomputed the same way. A job lost ``MAX_LOSSES`` times is reported as
a failure (a job that takes its node down must not take every node down); a job that raises,
or whose worker alone dies, is a failure at once, as before.

On a multi-machine cluster ``work/`` is written on the node that ran the job: point the results
folder at a shared filesystem to keep checkpoints in one place. The results themselves travel
back through Ray, so the cache is complete either way.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console

from phasemech.core.device import check_device_name
from phasemech.core.io import json_safe, write_json_atomic
from phasemech.core.progress import progress_bar
from phasemech.experiments.jobs import Job
from phasemech.experiments.ray_connect import ray_connected

WORK_DIR = "work"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its tracebacks
MAX_LOSSES = 3  # times a job may be lost with its node before it is reported as failed
GRACE = 3.0  # seconds: the jobs of one lost node fail within about a second of each other
NODE_DIED = re.compile(r"Node IP: ([^,\s]+), node ID: ([0-9a-f]+)")  # in NodeDiedError's text
NODE_ID = "ray.io/node-id"  # the label Ray gives every node: reruns avoid the lost ones


@dataclass(frozen=True)
class Failure:
    """A job that raised: its config and the worker's traceback."""

    key: str
    label: str
    config: dict[str, Any]
    error: str


@dataclass
class Launch:
    """What a launch produced: every job's result (cached or new) and the failures."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> result
    failures: list[Failure] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)  # keys computed by this launch
    cached: list[str] = field(default_factory=list)  # keys read from the results folder
    rerun: list[str] = field(default_factory=list)  # keys run again after a lost node, per loss
    seconds: float = 0.0

    def frame(self, jobs: Sequence[Job]) -> pd.DataFrame:
        """One row per finished job: its label, key and result fields."""
        unique = {j.key: j for j in jobs if j.key in self.results}  # equal configs: one row
        rows = [{"label": j.label, "key": k, **self.results[k]} for k, j in unique.items()]
        return pd.DataFrame(rows)


def _check(jobs: Sequence[Job], cpus_per_job: int, gpus_per_job: float) -> list[Job]:
    if not all(isinstance(j, Job) for j in jobs):
        bad = next(j for j in jobs if not isinstance(j, Job))
        raise ValueError(f"jobs must be phasemech Job instances, got {type(bad).__name__}")
    if not isinstance(cpus_per_job, int) or cpus_per_job < 1:
        raise ValueError(f"cpus_per_job={cpus_per_job!r} is invalid: need an int >= 1")
    if not isinstance(gpus_per_job, int | float) or gpus_per_job < 0:
        raise ValueError(f"gpus_per_job={gpus_per_job!r} is invalid: need a number >= 0")
    unique: dict[str, Job] = {}
    for job in jobs:  # equal configs are one job
        unique.setdefault(job.key, job)
    return list(unique.values())


def read_cached(results: Path, job: Job) -> dict[str, Any] | None:
    """The cached result of ``job``, or None (missing, unreadable or another job's file)."""
    path = results / f"{job.key}.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(saved, dict) or saved.get("config") != job.config:
        return None
    return saved.get("result")


def _run_job(
    job: Job, workdir: str, threads: int, board: Any = None, device: str = "cpu"
) -> dict[str, Any]:
    """Ray task body: one torch thread per CPU the job holds, progress reports to ``board``,
    the launch's device, then the job itself."""
    import torch

    from phasemech.experiments import jobs

    torch.set_num_threads(threads)
    path = Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    jobs._REPORTER = None if board is None else _throttled(board, job.key)
    jobs._DEVICE = device
    try:
        return job.run(path)
    finally:
        jobs._REPORTER, jobs._DEVICE = None, "cpu"


def _throttled(board: Any, key: str, every: float = 0.5):
    """``report(done, total)`` sending at most one update per ``every`` seconds (and the last)."""
    last = [0.0]

    def report(done: float, total: float) -> None:
        now = time.monotonic()
        if now - last[0] >= every or done >= total:
            last[0] = now
            board.report.remote(key, float(done), float(total))

    return report


def _board_class() -> type:
    """The board's class, made in a function: Ray ships it by value, so the board's worker
    starts without importing phasemech (seconds on a busy machine: ``transformer_lens``)."""

    class _Board:
        """A Ray actor holding each running job's ``(done, total)``: the launcher polls it to
        draw one progress row (with its own ETA) per running job."""

        def __init__(self) -> None:
            self.rows: dict[str, tuple[float, float]] = {}

        def report(self, key: str, done: float, total: float) -> None:
            self.rows[key] = (done, total)

        def snapshot(self) -> dict[str, tuple[float, float]]:
            return dict(self.rows)

    return _Board


_Board = _board_class()


def launch(
    jobs: Sequence[Job],
    results: str | Path,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    cpus_per_job: int = 1,
    gpus_per_job: float = 0,
    progress: bool = True,
    device: str = "cpu",
) -> Launch:
    """Run every job of ``jobs`` not yet cached in ``results``; return all their results.

    ``address``: a Ray cluster to join (``"auto"`` or ``HOST:PORT``); ``None`` starts an
    embedded local Ray with ``num_cpus`` CPUs (default: all) for this call only. ``device``:
    where jobs run their models (``auto``: CUDA in a job that holds a GPU, ``gpus_per_job``).
    A job's result does not depend on it beyond float tolerance, so it is not in the key.
    """
    t0 = time.perf_counter()
    todo_all = _check(jobs, cpus_per_job, gpus_per_job)
    check_device_name(device)
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    out = Launch()
    todo = []
    for job in todo_all:
        cached = read_cached(results, job)
        if cached is None:
            todo.append(job)
        else:
            out.results[job.key] = cached
            out.cached.append(job.key)
    if todo:
        resources = (cpus_per_job, gpus_per_job, device)
        _run_all(todo, results, out, address, num_cpus, resources, progress)
    out.seconds = time.perf_counter() - t0
    return out


def _run_all(todo, results, out, address, num_cpus, resources, progress):
    import ray

    cpus_per_job, gpus_per_job, device = resources
    with ray_connected(address, num_cpus):
        task = ray.remote(num_cpus=cpus_per_job, num_gpus=gpus_per_job, max_retries=0)(_run_job)
        board = _board(ray) if progress else None
        snapshot = None if board is None else lambda: ray.get(board.snapshot.remote())

        def submit(job: Job, avoid: set[str]):
            args = (job, str(results / WORK_DIR / job.key), cpus_per_job, board, device)
            return _avoiding(task, avoid).remote(*args)

        console = Console(stderr=True)
        losses = _Losses(console)
        pending = {submit(job, set()): job for job in todo}
        with progress_bar(console, disable=not progress) as bar:
            rows = ProgressRows(bar, snapshot, f"{len(todo)} jobs", len(todo))
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                rows.poll(pending)
                if done:
                    job = pending.pop(done[0])
                    lost = _collect(ray, done[0], job, results, out, losses)
                    if lost:
                        pending[submit(job, losses.dead)] = job
                    else:
                        rows.finish(job, failed=job.key not in out.results)
                losses.announce(final=not pending)


def _board(ray) -> Any:
    """The progress board, on the driver's node where Ray allows (a node lost mid-run must
    not take the progress display with it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    except Exception:  # e.g. a driver that is no node of its own (Ray Client)
        here = "DEFAULT"
    return ray.remote(num_cpus=0, scheduling_strategy=here)(_Board).remote()


def _avoiding(task, nodes: set[str]):
    """``task`` kept off ``nodes`` (node IDs; Ray takes a while to mark a lost node dead, and
    until then could place a rerun there)."""
    if not nodes:
        return task
    try:
        return task.options(label_selector={NODE_ID: f"!in({', '.join(sorted(nodes))})"})
    except (TypeError, ValueError):  # a Ray without label selectors: Ray's own choice
        return task


def _collect(ray, ref, job: Job, results: Path, out: Launch, losses: _Losses) -> bool:
    """Cache a finished job's result, or record its failure; True where the job was lost with
    its node (to be run again)."""
    try:
        result = ray.get(ref)
    except Exception as err:  # the worker's exception, with its traceback
        if _lost(err):
            times = out.rerun.count(job.key) + 1
            if times <= MAX_LOSSES:
                out.rerun.append(job.key)
                losses.lost(str(err))
                return True
            text = f"lost with its node {times} times; the last time: {_first_line(err)}"
        else:
            text = ANSI.sub("", str(err))
        out.failures.append(Failure(job.key, job.label, job.config, text))
        return False
    payload = {"key": job.key, "config": job.config, "result": json_safe(result)}
    write_json_atomic(results / f"{job.key}.json", payload)
    out.results[job.key] = payload["result"]
    out.ran.append(job.key)
    return False


def _lost(err: Exception) -> bool:
    """Whether ``err`` says the job was lost with its node (or its result with the node that
    held it), not that the job failed. A job's own exception is a ``RayTaskError`` even where
    it wraps one of these (a job's own ``ray.get``)."""
    from ray import exceptions as rex

    if isinstance(err, rex.RayTaskError):
        return False
    return isinstance(err, rex.NodeDiedError | rex.ObjectLostError)


def _first_line(err: Exception) -> str:
    text = ANSI.sub("", str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__


class _Losses:
    """The nodes lost during a launch and the jobs lost with them: one line per node, once its
    jobs have all failed over (``GRACE`` seconds after the last), or when the launch ends."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.dead: set[str] = set()  # node IDs
        self.nodes: dict[str, list] = {}  # node ID (or "") -> [IP, jobs not yet said, time]

    def lost(self, message: str) -> None:
        found = NODE_DIED.search(message)
        ip, node = found.groups() if found else ("", "")
        if node:
            self.dead.add(node)
        entry = self.nodes.setdefault(node, [ip, 0, 0.0])
        entry[1] += 1
        entry[2] = time.monotonic()

    def announce(self, final: bool = False) -> None:
        now = time.monotonic()
        for node, entry in self.nodes.items():
            ip, count, last = entry
            if count and (final or now - last >= GRACE):
                entry[1] = 0
                jobs = f"{count} job{'s' if count > 1 else ''}"
                where = f"node {ip} ({node[:8]}, dead or unreachable)" if node else "a node"
                self.console.print(
                    f"lost {where}: {jobs} rerun on the remaining nodes",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,
                )


class ProgressRows:
    """The progress display: one bar over all jobs, plus one row per running job that reports
    progress (its own completed/total and ETA), removed when the job ends."""

    def __init__(self, bar, snapshot, what: str, total: int) -> None:
        # snapshot(): {job key: (done, total)} of the jobs that reported (None: no rows)
        self.bar, self.snapshot, self.rows = bar, snapshot, {}
        self.all = bar.add_task(what, total=total, item="")

    def poll(self, pending: dict) -> None:
        if self.snapshot is None:
            return
        from ray.exceptions import RayError

        try:
            reports = self.snapshot()
        except RayError:  # the board is gone (lost with its node): the overall bar goes on
            self.snapshot = None
            return
        running = {job.key: job for job in pending.values()}
        for key, (done, total) in reports.items():
            if key not in running:
                continue
            if key not in self.rows:
                label = f"  {running[key].label}"
                self.rows[key] = self.bar.add_task(label, total=total, item="")
            self.bar.update(self.rows[key], completed=done, total=total)

    def finish(self, job: Job, failed: bool) -> None:
        if job.key in self.rows:
            self.bar.remove_task(self.rows.pop(job.key))
        item = f"[red]failed {job.label}" if failed else f"done {job.label}"
        self.bar.update(self.all, advance=1, item=item)


__all__ = ["Failure", "Launch", "ProgressRows", "launch", "read_cached"]
