"""The experiment launcher on Ray: job keys, the on-disk cache, failures reported while the
other jobs finish, the embedded Ray's quiet authentication, a launcher interrupted mid-sweep
whose rerun completes only the missing jobs, and which errors count as a lost node (rerun)
rather than a failure. Clusters, and a node killed mid-run: ``test_ray_cluster.py``.

Ray's worker start-up costs seconds on 2 cores: each test launches few, small jobs."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from rich.console import Console

ray = pytest.importorskip("ray")

from phasemech.experiments import Job, experiment, launch, launcher  # noqa: E402
from phasemech.experiments.launcher import read_cached  # noqa: E402
from phasemech.experiments.ray_connect import ray_connected  # noqa: E402
from phasemech.experiments.sweep.jobs import train_jobs  # noqa: E402
from phasemech.experiments.sweep.profiles import PROFILES  # noqa: E402

# jobs defined here travel to the workers by value (the workers cannot import tests/)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class EchoJob(Job):
    kind: ClassVar[str] = "echo"
    value: int
    fail: bool = False

    def run(self, workdir: Path) -> dict:
        import torch

        if self.fail:
            raise RuntimeError(f"boom {self.value}")
        (workdir / "touched").write_text("x")
        return {"double": 2 * self.value, "threads": torch.get_num_threads(), "nan": float("nan")}


@dataclass(frozen=True)
class SaysLostJob(Job):
    """A job that itself raises Ray's lost-node error: its own failure, not a lost node."""

    kind: ClassVar[str] = "says_lost"
    value: int

    def run(self, workdir: Path) -> dict:
        raise ray.exceptions.NodeDiedError("Node IP: 10.0.0.9, node ID: abc1. (the job's own)")


def test_job_keys_are_stable_and_name_the_config():
    a, b, c = EchoJob(1), EchoJob(1), EchoJob(2)
    assert a.key == b.key != c.key and len(a.key) == 16
    assert a.config == {"kind": "echo", "value": 1, "fail": False}
    sweep = train_jobs(PROFILES["tiny"])
    assert len({j.key for j in sweep}) == len(sweep) == 2
    assert [j.key for j in sweep] == [j.key for j in train_jobs(PROFILES["tiny"])]
    with pytest.raises(ValueError, match="'nope' is unknown: allowed"):
        experiment("nope")
    with pytest.raises(ValueError, match="profile 'huge'"):
        experiment("phase_sweep").profile("huge")
    with pytest.raises(ValueError, match="cpus_per_job=0"):
        launch([a], "unused", cpus_per_job=0)


def test_launch_caches_results_and_reports_failures(tmp_path, monkeypatch, capfd, caplog):
    jobs = [EchoJob(1), EchoJob(2), EchoJob(3, fail=True), EchoJob(1), SaysLostJob(4)]
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # the embedded Ray never joins this
    # the launcher's embedded Ray (ray_connected, as a launch without one starts it: the
    # interrupted launcher's test below has launches start their own), one for both launches
    with ray_connected(None, 1):
        out = launch(jobs, tmp_path, progress=False)
        # a rerun computes only what is missing (the failed job), and reads the rest
        again = launch(jobs, tmp_path, progress=False)
    # the embedded Ray chose token auth with a session token: nothing said, nothing written
    said = capfd.readouterr().err + caplog.text  # Ray logs through logging, or to stderr
    assert "authentication" not in said.lower()
    assert not home.exists() and "RAY_AUTH_MODE" not in os.environ
    assert {out.results[j.key]["double"] for j in jobs[:2]} == {2, 4}
    assert out.results[jobs[0].key]["threads"] == 1 and out.results[jobs[0].key]["nan"] is None
    assert len(out.ran) == 2 and not out.cached and not out.rerun
    failure, says_lost = sorted(out.failures, key=lambda f: f.config["value"])
    assert "the job's own" in says_lost.error and "lost node" not in said  # not rerun
    assert failure.config == {"kind": "echo", "value": 3, "fail": True}
    assert "RuntimeError: boom 3" in failure.error and 'test_launcher.py", line' in failure.error
    assert "\x1b" not in failure.error  # plain text, no terminal colours
    assert (tmp_path / "work" / jobs[0].key / "touched").is_file()
    saved = json.loads((tmp_path / f"{jobs[1].key}.json").read_text())
    assert saved["config"] == jobs[1].config and saved["result"]["double"] == 4
    assert sorted(again.cached) == sorted({j.key for j in jobs[:2]}) and not again.ran
    assert len(again.failures) == 2
    # a corrupt cache file is recomputed, not trusted
    (tmp_path / f"{jobs[0].key}.json").write_text("{half")
    assert read_cached(tmp_path, jobs[0]) is None


@dataclass(frozen=True)
class GateJob(Job):
    """Job 0 finishes at once; the others wait for the ``gate`` file (at most a minute, so a
    worker orphaned by an interrupted launcher cannot outlive the test)."""

    kind: ClassVar[str] = "gate"
    value: int
    gate: str

    def run(self, workdir: Path) -> dict:
        deadline = time.monotonic() + 60
        while self.value and not Path(self.gate).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no gate {self.gate}")
            time.sleep(0.05)
        return {"value": self.value}


def test_interrupted_launcher_rerun_runs_only_the_missing_jobs(tmp_path):
    # deterministic: the jobs after the first cannot finish before the Ctrl-C (they wait for a
    # gate opened only after the launcher died), so exactly one is cached when it lands. One
    # CPU: the jobs start in order, job 1 waits at the gate while job 2 is queued
    dest, gate = tmp_path / "jobs", tmp_path / "gate"
    jobs = [GateJob(v, str(gate)) for v in range(3)]
    script = (  # Ctrl-C restored: a process started by a pytest-xdist worker inherits it ignored
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_launcher import GateJob, launch\n"
        f"launch([GateJob(v, {str(gate)!r}) for v in range(3)], {str(dest)!r}, num_cpus=1)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not list(dest.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(dest.glob("*.json")), "no job finished in time"
        proc.send_signal(signal.SIGINT)  # Ctrl-C mid-sweep
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0  # interrupted, not finished
    assert {p.stem for p in dest.glob("*.json")} == {jobs[0].key}
    gate.touch()
    out = launch(jobs, dest, num_cpus=1, progress=False)  # its own embedded Ray, one worker
    assert out.cached == [jobs[0].key] and set(out.ran) == {j.key for j in jobs[1:]}
    assert not out.failures and out.results[jobs[2].key] == {"value": 2}


def test_an_unreachable_cluster_fails_fast_and_names_the_address(tmp_path):
    # checked before ray.init, which would retry for minutes
    with pytest.raises(ConnectionError, match=r"'127.0.0.1:1'.*ray start --head"):
        launch([EchoJob(1)], tmp_path, address="127.0.0.1:1", progress=False)
    assert not list(tmp_path.glob("*.json"))


def test_each_running_job_gets_a_progress_row_with_its_own_eta():
    from phasemech.core.progress import progress_bar
    from phasemech.experiments.launcher import ProgressRows

    a, b = EchoJob(1), EchoJob(2)
    reports = {a.key: (3.0, 10.0)}
    bar = progress_bar(disable=True)
    rows = ProgressRows(bar, lambda: dict(reports), "2 jobs", 2)
    rows.poll({"ref-a": a, "ref-b": b})
    [row] = [t for t in bar.tasks if t.description.strip() == a.label]
    assert (row.completed, row.total) == (3.0, 10.0)  # rich's ETA column reads these
    reports[b.key] = (1.0, 4.0)
    reports[a.key] = (7.0, 10.0)
    rows.poll({"ref-a": a, "ref-b": b})
    assert {t.description.strip(): t.completed for t in bar.tasks} == {
        "2 jobs": 0,
        a.label: 7.0,
        b.label: 1.0,
    }
    rows.finish(a, failed=False)  # a finished job's row goes, the overall bar advances
    assert {t.description.strip() for t in bar.tasks} == {"2 jobs", b.label}
    assert bar.tasks[0].completed == 1
    reports.pop(b.key)
    rows.poll({"ref-b": b, "ref-c": EchoJob(3)})  # a job that never reports gets no row
    assert len(bar.tasks) == 2


def test_only_a_lost_node_or_result_means_rerun(tmp_path):
    """Ray's NodeDiedError and ObjectLostError: the job runs again, ``MAX_LOSSES`` times at
    most (then it is a failure). A job's own exception (even one wrapping those), a worker that
    died alone, a task Ray's memory monitor killed: failures at once."""
    rex = ray.exceptions
    died = "Task failed because the node it was running on is dead or unavailable. "
    lost = rex.NodeDiedError(died + "Node IP: 10.0.0.7, node ID: 9f3c2a1b0d. This can happen")
    wrapped = rex.RayTaskError("run", "Traceback ...", lost).as_instanceof_cause()
    assert isinstance(wrapped, rex.NodeDiedError)  # why RayTaskError is checked first
    others = [wrapped, rex.WorkerCrashedError(), rex.OutOfMemoryError("killed"), ValueError()]

    class FakeRay:  # ray.get of a finished job's ref raises the job's error
        def get(self, err):
            raise err

    said = io.StringIO()
    losses = launcher._Losses(Console(file=said, width=200))
    out, job = launcher.Launch(), EchoJob(1)
    args = (tmp_path, out, losses)
    object_lost = rex.ObjectLostError("ab" * 14, None, "")
    assert launcher._collect(FakeRay(), object_lost, job, *args)
    for _ in range(launcher.MAX_LOSSES - 1):
        assert launcher._collect(FakeRay(), lost, job, *args)
    assert not launcher._collect(FakeRay(), lost, job, *args)  # once too often: a failure
    [failure] = out.failures
    assert failure.error.startswith(f"lost with its node {launcher.MAX_LOSSES + 1} times")
    assert out.rerun == [job.key] * launcher.MAX_LOSSES and losses.dead == {"9f3c2a1b0d"}
    for err in others:
        assert not launcher._collect(FakeRay(), err, EchoJob(2), *args)
    assert len(out.failures) == 1 + len(others) and not list(tmp_path.glob("*.json"))
    losses.announce()  # within GRACE of the last loss: not yet
    assert said.getvalue() == ""
    losses.announce(final=True)  # the launch ends: one line per node
    assert said.getvalue().splitlines() == [
        "lost a node: 1 job rerun on the remaining nodes",  # ObjectLostError names none
        "lost node 10.0.0.7 (9f3c2a1b, dead or unreachable): 2 jobs rerun on the remaining nodes",
    ]
    losses.announce(final=True)  # said once
    assert len(said.getvalue().splitlines()) == 2
