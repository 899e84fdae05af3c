"""The launcher on a real Ray cluster, made as a user makes one: ``ray start`` (Ray 2.60 turns
token authentication on where a token is configured), a head and a worker node on this
machine, in a temporary ``RAY_TMPDIR`` and ``HOME``. The tiny sweep through ``--address``
(the CLI, the token from the default file) and through ``auto`` (in process, the token from
``RAY_AUTH_TOKEN``) gives the embedded run's numbers; every refusal is one line raised before
``ray.init``; a node killed while its jobs run costs only those jobs, run again on the nodes
that remain. Only the nodes these tests start are stopped (their own sessions). The
nodes import phasemech from this checkout (``PYTHONPATH``), as the driver does."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

ray = pytest.importorskip("ray")

from phasemech.experiments import (  # noqa: E402
    Job,
    experiment,
    launch,
    launcher,
    ray_connect,
    run_experiment,
)
from phasemech.experiments.jobs import payload  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


@dataclass(frozen=True)
class DoubleJob(Job):
    kind: ClassVar[str] = "double"
    value: int

    def run(self, workdir: Path) -> dict:
        return {"double": 2 * self.value}


@dataclass(frozen=True)
class GatedJob(Job):
    """Notes in its folder each start (the node and the phasemech it runs) and each end; with
    a ``gate`` (not in the key) it waits for that file first, a minute at most."""

    kind: ClassVar[str] = "gated"
    value: int
    gate: str = payload(default="")

    def run(self, workdir: Path) -> dict:
        import torch

        import phasemech

        node = ray.get_runtime_context().get_node_id()
        with open(workdir / "starts", "a") as f:
            f.write(f"{node} {phasemech.__file__}\n")
        deadline = time.monotonic() + 60
        while self.gate and not Path(self.gate).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no gate {self.gate}")
            time.sleep(0.05)
        with open(workdir / "ends", "a") as f:
            f.write(f"{node}\n")
        numbers = torch.randn(8, generator=torch.Generator().manual_seed(self.value))
        return {"value": self.value, "sum": float(numbers.sum())}


GATED = [GatedJob(v) for v in range(2)]  # as many as the lost node's CPUs: all running there


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One ``ray start --block`` in a session of its own, logging to a file. The session holds
    the node's processes: its raylet and agents, and its workers, which Ray starts each in a
    process group of its own (a kill of the group alone leaves them running)."""

    def __init__(self, args: list[str], env: dict, log: Path, cpus: int = 1) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [RAY, "start", "--num-cpus", str(cpus), "--block", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_started(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "ray start did not finish in time"
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM ``ray start --block`` (it stops its node's processes), then kill what is
        left of its session: this node's processes and no others."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL every process of this node at once, as a machine that is lost goes."""
        for _ in range(100):
            pids = self._session()
            if not pids:
                break
            for pid in pids:
                self._signal(pid)
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.wait(10)

    def _signal(self, pid: int) -> None:
        """SIGKILL ``pid`` if it is still this node's (a pidfd: a PID reused meanwhile is not
        signalled)."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            if pid in self._session():
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)

    def running(self, wait: float = 10.0) -> list[int]:
        """The live (not zombie) processes of this node's session, once none is left or after
        ``wait`` seconds (a killed process takes a moment to go)."""
        deadline = time.monotonic() + wait
        while (pids := self._session()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return pids

    def _session(self) -> list[int]:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[3]) == self.proc.pid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids


def head_args(port: int) -> list[str]:
    """A head on ``port``, its other fixed-by-default ports free ones: two heads (or a user's
    own) can run side by side. The Ray Client server (10001) runs only with ``ray[client]``."""
    args = ["--head", "--port", str(port), "--include-dashboard=false"]
    args += ["--dashboard-agent-listen-port", str(free_port())]
    if importlib.util.find_spec("grpc") is not None:
        args += ["--ray-client-server-port", str(free_port())]
    return args


def user_env(home: Path, tmp: Path, **extra) -> dict:
    """A user's shell in this checkout: its phasemech first on the path (the nodes' workers
    import it, not an installed one), ``HOME`` and ``RAY_TMPDIR`` the test's."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return {**env, "HOME": str(home), "RAY_TMPDIR": str(tmp), "PYTHONPATH": path, **extra}


@pytest.fixture(scope="module")
def booting_cluster():
    """A head and a worker node started with the ray CLI, token authentication on. They boot
    in a thread, while the embedded run computes (it asks for this fixture first): use
    ``token_cluster``, which waits for them."""
    root = Path(tempfile.mkdtemp(prefix="pm-ray-", dir="/tmp"))  # short: Ray's socket paths
    home, tmp = root / "home", root / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = user_env(home, tmp)
    # a worker node joins in token mode (Ray's CLI picks the token up only when told)
    worker_env = {**env, "RAY_AUTH_MODE": "token"}
    port = free_port()
    cluster = {"root": root, "home": home, "tmp": tmp, "port": port, "nodes": []}
    nodes, errors = cluster["nodes"], []

    def boot() -> None:
        try:
            # the user's token, where Ray keeps it (~/.ray/auth_token): ray start turns auth on
            get = [RAY, "get-auth-token", "--generate"]
            subprocess.run(get, env=env, check=True, capture_output=True)
            cluster["token"] = (home / ".ray" / "auth_token").read_text().strip()
            nodes.append(Node(head_args(port), env, root / "h"))
            nodes[0].wait_started()
            nodes.append(Node(["--address", f"127.0.0.1:{port}"], worker_env, root / "w"))
            nodes[1].wait_started()
        except BaseException as err:  # raised where the cluster is awaited
            errors.append(err)

    booting = threading.Thread(target=boot, daemon=True)
    booting.start()

    def ready() -> dict:
        booting.join()
        if errors:
            raise errors[0]
        return cluster

    cluster["ready"] = ready
    try:
        yield cluster
    finally:
        booting.join()
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert not [pid for node in nodes for pid in node.running()]  # nothing of ours left


@pytest.fixture(scope="module")
def token_cluster(booting_cluster):
    """The booted cluster: ``root``, ``home``, ``tmp``, ``port``, ``token``, ``nodes``."""
    return booting_cluster["ready"]()


@pytest.fixture(scope="module")
def embedded(booting_cluster, tmp_path_factory):
    """The embedded run's results (no address): the tiny sweep's and ``GATED``'s, in one Ray,
    computed while the cluster boots."""
    folder = tmp_path_factory.mktemp("embedded")
    with ray_connect.ray_connected(None, 2):
        run = run_experiment(experiment("phase_sweep"), "tiny", folder, progress=False)
        gated = launch(GATED, folder / "gated", progress=False)
    assert not run.failures and run.ran == 4 and not gated.failures
    return {"sweep": job_results(run.folder), "gated": gated.results}


@pytest.fixture(scope="module")
def embedded_sweep(embedded):
    return embedded["sweep"]


def job_results(folder: Path) -> dict:
    """Every job's result in a run folder, timings left out."""
    out = {}
    for path in sorted((folder / "jobs").glob("*.json")):
        result = json.loads(path.read_text())["result"]
        out[path.stem] = {k: v for k, v in result.items() if "seconds" not in k}
    return out


@pytest.fixture
def no_auth_env(monkeypatch, tmp_path):
    """This process as a user with no Ray authentication configured (an empty HOME)."""
    for name in AUTH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_cli_joins_a_token_cluster_by_address(embedded_sweep, token_cluster, tmp_path):
    c = token_cluster
    env = user_env(c["home"], c["tmp"])  # a user's shell: the token in ~/.ray, no mode set
    cmd = [sys.executable, "-m", "phasemech.cli", "run", "phase_sweep", "--profile", "tiny"]
    address = f"127.0.0.1:{c['port']}"
    done = subprocess.run(
        [*cmd, "--runs", str(tmp_path), "--address", address],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "4 jobs run" in done.stdout
    assert "InvalidAuthToken" not in done.stderr and "Token authentication" not in done.stderr
    assert job_results(tmp_path / "phase_sweep_tiny") == embedded_sweep


def test_auto_joins_with_the_token_from_the_environment(
    embedded_sweep, token_cluster, no_auth_env, monkeypatch, tmp_path
):
    monkeypatch.setenv("RAY_TMPDIR", str(token_cluster["tmp"]))  # where `auto` looks
    monkeypatch.setenv("RAY_AUTH_TOKEN", token_cluster["token"])
    with ray_connect.ray_connected("auto", None) as joined:
        nodes = [n for n in ray.nodes() if n["Alive"]]
    assert joined and len(nodes) == 2 and not ray.is_initialized()
    run = run_experiment(
        experiment("phase_sweep"), "tiny", tmp_path, address="auto", progress=False
    )
    assert not run.failures and run.ran == 4 and not ray.is_initialized()
    assert job_results(run.folder) == embedded_sweep
    assert "RAY_AUTH_MODE" not in os.environ  # the process environment is restored


def test_a_node_lost_mid_run_costs_only_its_jobs(
    embedded, token_cluster, no_auth_env, monkeypatch, tmp_path, capfd
):
    """A third node joins with 2 CPUs; the head's and the first worker's are held (a placement
    group), so both jobs start there. Its processes are killed while they run: the launch
    runs them again on the other two nodes, caches each once, and says so in one line."""
    from ray.util.placement_group import placement_group, remove_placement_group

    c = token_cluster
    monkeypatch.setenv("RAY_AUTH_TOKEN", c["token"])
    address = f"127.0.0.1:{c['port']}"
    written = Counter()  # each results file the launcher writes
    write = launcher.write_json_atomic
    monkeypatch.setattr(
        launcher,
        "write_json_atomic",
        lambda p, obj: (written.update([Path(p).name]), write(p, obj)),
    )
    gate, dest = tmp_path / "gate", tmp_path / "jobs"
    jobs = [GatedJob(j.value, str(gate)) for j in GATED]
    folders = [dest / launcher.WORK_DIR / j.key for j in jobs]
    victim_env = user_env(c["home"], c["tmp"], RAY_AUTH_MODE="token")
    args = ["--address", address, "--labels", "role=victim"]
    victim = Node(args, victim_env, tmp_path / "victim.log", cpus=2)  # starts meanwhile
    try:
        with ray_connect.ray_connected(address, None):

            def nodes(alive: bool = True, victims: bool = False) -> set[str]:
                return {
                    n["NodeID"]
                    for n in ray.nodes()
                    if n["Alive"] == alive and ("role" in n["Labels"]) == victims
                }

            others = nodes()  # the head and the first worker
            held = placement_group(
                [{"CPU": 1}] * len(others),
                bundle_label_selector=[{launcher.NODE_ID: n} for n in others],
            )
            ray.get(held.ready(), timeout=60)
            victim.wait_started()
            deadline = time.monotonic() + 30
            while not nodes(victims=True):  # registered by now, but the GCS may lag
                assert time.monotonic() < deadline, "the victim did not join"
                time.sleep(0.2)
            [lost] = nodes(victims=True)

            def kill_when_running() -> None:
                """Once both jobs run on the victim: kill its processes, open the gate (only
                then: no job on the victim can end), free the other nodes' CPUs."""
                deadline = time.monotonic() + 60
                try:
                    while not all((f / "starts").exists() for f in folders):
                        assert time.monotonic() < deadline, "the jobs did not start"
                        time.sleep(0.05)
                    victim.kill()  # its raylet, agents and workers, at once
                finally:
                    gate.touch()
                    remove_placement_group(held)

            killer = threading.Thread(target=kill_when_running, daemon=True)
            killer.start()
            out = launch(jobs, dest)  # with progress: its board stays on the driver's node
            killer.join(60)
            # Ray marks the node dead some 15 s later: its notice of that is not printed
            deadline = time.monotonic() + 60
            while lost not in nodes(alive=False, victims=True):
                assert time.monotonic() < deadline, "Ray did not mark the lost node dead"
                time.sleep(0.2)
            time.sleep(1)  # the notice reaches this driver
            alive = nodes() | nodes(victims=True)
    finally:
        victim.stop()
    said = capfd.readouterr()
    assert not out.failures and sorted(out.ran) == sorted(out.rerun) == sorted(j.key for j in jobs)
    assert out.results == embedded["gated"]  # the embedded run's numbers
    assert written == Counter(f"{j.key}.json" for j in jobs)  # each cached once, none missing
    for folder in folders:
        starts = [line.split() for line in (folder / "starts").read_text().splitlines()]
        assert len(starts) == 2 and starts[0][0] == lost and starts[1][0] in others
        assert all(Path(where).is_relative_to(ROOT) for _, where in starts)  # this checkout's
        [end] = (folder / "ends").read_text().split()  # finished once, not on the lost node
        assert end in others
    [line] = [line for line in said.err.splitlines() if "lost" in line]
    said_lost = (
        rf"lost node \S+ \({lost[:8]}, dead or unreachable\): 2 jobs rerun on the remaining nodes"
    )
    assert re.fullmatch(said_lost, line), line
    assert "Traceback" not in said.err and "marked dead" not in said.out + said.err
    assert not victim.running(wait=0)
    assert alive == others and all(node.proc.poll() is None for node in c["nodes"])


def refusal(address: str, monkeypatch, tmp_path: Path, capfd) -> str:
    """The one-line error joining ``address``, raised before ``ray.init`` is reached, with
    nothing else said (Ray's client logs each refusal: the probe's child keeps them)."""

    def no_init(*args, **kwargs):
        raise AssertionError("ray.init was called: the refusal came too late")

    monkeypatch.setattr(ray, "init", no_init)
    with pytest.raises(ConnectionError) as info:
        launch([DoubleJob(1)], tmp_path, address=address, progress=False)
    message = str(info.value)
    assert "\n" not in message and address in message
    assert capfd.readouterr().err == ""
    return message


def test_refusals_say_why_and_what_to_set(token_cluster, no_auth_env, monkeypatch, tmp_path, capfd):
    address = f"127.0.0.1:{token_cluster['port']}"

    def refused() -> str:
        return refusal(address, monkeypatch, tmp_path, capfd)

    assert "no token is configured here" in refused()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    assert "refused the token from RAY_AUTH_TOKEN" in refused()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert "RAY_AUTH_MODE=disabled is set" in refused()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    assert "RAY_AUTH_MODE=token is set but no token" in refused()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(no_auth_env / "missing"))
    with pytest.raises(ValueError, match="RAY_AUTH_TOKEN_PATH=.*missing' names no readable"):
        launch([DoubleJob(1)], tmp_path, address=address, progress=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token_cluster["token"])
    old = {"ray_version": "2.0.0", "python_version": "3.8.0"}
    monkeypatch.setattr(ray_connect, "_probe", lambda *a: (ray_connect.KEEP, old))
    assert "the cluster runs Ray 2.0.0 on Python 3.8.0" in refused()
    assert os.environ["RAY_AUTH_MODE"] == "token"  # the user's choice stays as it was


def test_a_port_that_is_not_ray_is_refused_in_seconds(no_auth_env, monkeypatch, tmp_path, capfd):
    with socket.socket() as server:  # accepts, then never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        held = []
        threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert "does not answer as a Ray GCS" in refusal(address, monkeypatch, tmp_path, capfd)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # what `auto` reads first, as Ray does
    assert "Connection refused" in refusal("auto", monkeypatch, tmp_path, capfd)
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("RAY_AUTH_MODE", "on")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE='on' is not a Ray authentication mode"):
        launch([DoubleJob(1)], tmp_path, address=address, progress=False)


def test_a_cluster_without_auth_is_joined_without_the_token(no_auth_env, tmp_path):
    """A driver in token mode joins such a cluster, but its actors die unstarted: the token
    configured here must not be sent to a cluster that did not ask for it."""
    root = Path(tempfile.mkdtemp(prefix="pm-ray-", dir="/tmp"))
    (no_auth_env / ".ray").mkdir()
    (no_auth_env / ".ray" / "auth_token").write_text("f" * 64)  # configured, not asked for
    port = free_port()
    env = user_env(no_auth_env, root, RAY_AUTH_MODE="disabled")
    head = Node(head_args(port), env, root / "h")
    try:
        head.wait_started()
        # with progress: its board is an actor, the first thing a driver in token mode breaks
        out = launch([DoubleJob(3)], tmp_path / "out", address=f"127.0.0.1:{port}")
    finally:
        head.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert not out.failures and out.results[DoubleJob(3).key]["double"] == 6
    assert not head.running()
