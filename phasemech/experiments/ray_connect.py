"""Ray for the launcher: an embedded local Ray, or a running cluster joined at an address.

Ray 2.60 ships token authentication: ``ray start --head`` turns it on wherever a token is
configured (``ray get-auth-token --generate`` and every ``ray.init()`` that starts a local
Ray write one to ``~/.ray/auth_token``), while a driver that joins by an explicit address
sends its token only under ``RAY_AUTH_MODE=token``, and the modes must agree both ways (a
driver in token mode joins an unauthenticated cluster, but its actors die unstarted). This
module chooses the mode so that the user does not have to, and refuses a cluster in seconds
with one line that says why.

Joining ``address`` (``HOST:PORT``, ``auto`` or ``ray://...``), before ``ray.init`` (which
retries a refusing cluster for ~25 s, printing a warning a second):

* a TCP connect, then a GCS call in a child process (~1 s; 8 s at most) that also reads
  the cluster's Ray and Python versions;
* the mode the user chose (``RAY_AUTH_MODE``) stands. Unset, the call goes first without a
  token; if the cluster asks for one and a token is configured for this user
  (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), again in token
  mode, the mode the driver then joins in;
* each refusal is a ``ConnectionError`` of one line: unreachable, not answering as Ray,
  authentication (what to set), version mismatch. A ``ray://`` (Ray Client) address gets
  only the TCP check (Ray Client reports the rest), and token mode where a token is
  configured.

The embedded Ray takes token authentication with a token made for this session: it lives in
the environment of the processes the session starts, is never written to disk, and nothing
is printed about it. ``RAY_AUTH_MODE=disabled``, set by the user, stands.

Either way the process environment is restored when the session ends. While the session
lasts, Ray's own notice of a node marked dead (a paragraph, some 15 s after the node went) is
not printed: the launcher says in one line what a lost node cost (``launcher.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator

MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
PROBE_SECONDS = 8.0  # the child's deadline: ~1 s to import Ray, a GCS answers in milliseconds
CALL_SECONDS = 2  # one GCS call's own limit
KEEP = "-"  # a probe mode: the RAY_AUTH_MODE the user set
GET_TOKEN = "`ray get-auth-token` on the head prints it"
PORT_HINT = "(is it the port `ray start --head` printed?)"
WHERE = f"{TOKEN}, a file named by {TOKEN_PATH}, or ~/.ray/auth_token"
NODE_MARKED_DEAD = re.compile(r"^The node with node id: \w+ .* has been marked dead", re.DOTALL)


@contextlib.contextmanager
def ray_connected(address: str | None, num_cpus: int | None) -> Iterator[bool]:
    """Ray in this process for the block; yields True if the block started or joined it.

    Ray already initialised here (by the caller) is used as it is and left running.
    ``address=None`` starts an embedded local Ray with ``num_cpus`` CPUs (default: all).
    """
    import ray

    if ray.is_initialized():
        yield False
        return
    check_mode()
    bootstrap, env = (None, _embedded_env()) if address is None else check_cluster(address)
    with _environment(env):
        if bootstrap is None:
            _init_embedded(num_cpus)
        else:
            _join(address, bootstrap)
        try:
            with _quiet_node_deaths():
                yield True
        finally:
            ray.shutdown()


@contextlib.contextmanager
def _quiet_node_deaths() -> Iterator[None]:
    """Leave out Ray's notice of a node marked dead, which its driver prints as it comes (the
    launcher reports the jobs it cost). Ray's other notices pass; a Ray without the hook
    (``ray._private.worker.print_to_stdstream``) is left as it is."""
    from ray._private import worker

    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None:
        yield
        return

    def filtered(data: dict, *args, **kwargs) -> None:
        lines = [line for line in data.get("lines", ()) if not NODE_MARKED_DEAD.match(line)]
        if lines:
            printer({**data, "lines": lines}, *args, **kwargs)

    worker.print_to_stdstream = filtered
    try:
        yield
    finally:
        worker.print_to_stdstream = printer


def check_mode() -> None:
    """A ``RAY_AUTH_MODE`` the user set must be one Ray knows (Ray reads any other value as
    ``disabled``, silently)."""
    mode = os.environ.get(MODE)
    if mode is not None and mode.lower() not in ("disabled", "token"):
        raise ValueError(
            f"{MODE}={mode!r} is not a Ray authentication mode: allowed 'disabled', 'token', "
            "or unset (phasemech then chooses)"
        )


def _init_embedded(num_cpus: int | None) -> None:
    import ray

    ray.init(
        address="local",  # a new Ray, whatever RAY_ADDRESS or a `ray start` node here says
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        # results are small JSON: a small object store keeps the embedded Ray light
        object_store_memory=200 * 1024**2,
    )


def _join(address: str, bootstrap: str) -> None:
    import ray

    try:
        ray.init(address=bootstrap, log_to_driver=False)
    except Exception as err:  # what the checks could not foresee, still in one line
        msg = _first_line(err)
        raise ConnectionError(f"could not join the Ray cluster at {address!r}: {msg}") from err


def _first_line(err: Exception) -> str:
    """An exception in one line: Ray's messages run to several, with advice on each."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _embedded_env() -> dict[str, str | None]:
    """Token authentication with a fresh token, unless the user turned authentication off."""
    if os.environ.get(MODE, "").lower() == "disabled":
        return {}
    return {MODE: "token", TOKEN: secrets.token_hex(32), TOKEN_PATH: None}


def token_source() -> str | None:
    """Where this user's Ray token comes from (Ray's own order), or None: none configured.
    A ``RAY_AUTH_TOKEN_PATH`` naming a missing or empty file is an error, not a fallback."""
    if os.environ.get(TOKEN):  # Ray takes any non-empty value
        return TOKEN
    if TOKEN_PATH in os.environ:
        path = os.environ[TOKEN_PATH]
        if not _readable_token(path):
            raise ValueError(
                f"{TOKEN_PATH}={path!r} names no readable token file: point it at the "
                f"cluster's token ({GET_TOKEN}) or unset it"
            )
        return f"{TOKEN_PATH} ({path})"
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return default if _readable_token(default) else None


def _readable_token(path: str) -> bool:
    try:
        with open(path) as f:
            return bool(f.read().strip())
    except OSError:
        return False


@contextlib.contextmanager
def _environment(changes: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, remove) environment variables for the block, then restore them.
    Ray reads its mode and token once per process: both caches are refreshed each way, even
    with no change (the environment may have changed since Ray last read it)."""
    saved = {name: os.environ.get(name) for name in changes}
    _apply(changes)
    try:
        yield
    finally:
        _apply(saved)


def _apply(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def check_cluster(address: str) -> tuple[str, dict[str, str | None]]:
    """The cluster's ``HOST:PORT`` (``auto`` resolved as Ray resolves it) and the environment
    to join it in, once it answers, accepts this process and runs its Ray and Python; else a
    one-line ``ConnectionError`` naming the address, the cause and what to do."""
    # first: a bad RAY_AUTH_TOKEN_PATH is this machine's fault (unread under mode disabled)
    disabled = os.environ.get(MODE, "").lower() == "disabled"
    source = None if disabled else token_source()
    bootstrap = _resolve(address)
    host, _, port = bootstrap.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConnectionError(f"--address {address!r} is not HOST:PORT, auto or ray://HOST:PORT")
    head = f"could not join the Ray cluster at {address!r}: "
    try:
        socket.create_connection((host, int(port)), timeout=5.0).close()
    except OSError as err:
        raise ConnectionError(
            head + f"{err.strerror or err} (start one with `ray start --head`, or leave "
            "--address out for a local Ray)"
        ) from err
    if bootstrap.startswith("ray://"):  # Ray Client speaks its own protocol: no GCS call
        unset = MODE not in os.environ and source is not None
        return bootstrap, {MODE: "token"} if unset else {}
    env, metadata = _authenticate(bootstrap, head, source)
    refusal = version_refusal(metadata)
    if refusal is not None:
        raise ConnectionError(head + refusal)
    return bootstrap, env


def _authenticate(bootstrap: str, head: str, source: str | None) -> tuple[dict, dict]:
    """The mode that the cluster at ``bootstrap`` accepts (the user's, else none, else token
    with the token from ``source``) and the cluster's metadata, read in that mode."""
    chosen = os.environ.get(MODE)
    if chosen is not None and chosen.lower() == "token" and source is None:
        # checked here: Ray aborts the whole process on token mode without a token
        raise ConnectionError(
            head + f"{MODE}=token is set but no token is configured: put the cluster's token "
            f"({GET_TOKEN}) in {WHERE}"
        )
    if chosen is not None:
        modes = [KEEP]
    else:  # no token first: the token goes only to a cluster that asks for one
        modes = ["disabled"] if source is None else ["disabled", "token"]
    mode, metadata = _probe(bootstrap, modes, head)
    if metadata is None:
        raise ConnectionError(head + auth_refusal(chosen or modes[-1], source))
    return ({} if mode == KEEP else {MODE: mode}), metadata


def _resolve(address: str) -> str:
    """``auto`` as ``ray.init`` reads it: RAY_ADDRESS as given, else a node on this machine."""
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError):
        found = None
    if not found:
        raise ConnectionError(
            "--address auto found no running Ray cluster on this machine (RAY_ADDRESS unset, "
            "no `ray start` node here): give HEAD:PORT, or start one with `ray start --head`"
        )
    return found


def _probe(bootstrap: str, modes: list[str], head: str) -> tuple[str, dict | None]:
    """The first of ``modes`` (RAY_AUTH_MODE values; KEEP: the user's) in which the GCS at
    ``bootstrap`` answers, and the cluster's metadata; ``(last mode, None)`` where it refused
    every one. Run in a child process (this file as a script, ~1 s): Ray's client logs each
    refusal, waits ~12 s on a port that is not a GCS and caches its mode for the process;
    the child takes all three with it, and is killed at the deadline."""
    # -P: this file's folder (the experiments' modules) must not shadow what Ray imports
    cmd = [sys.executable, "-P", __file__, bootstrap, *modes]
    try:
        child = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_SECONDS)
        reply = json.loads(child.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        raise ConnectionError(
            head + f"{bootstrap} accepts connections but does not answer as a Ray GCS within "
            f"{PROBE_SECONDS:.0f} s {PORT_HINT}"
        ) from None
    except (IndexError, json.JSONDecodeError):
        last = (child.stderr.strip().splitlines() or ["no reply"])[-1]
        raise ConnectionError(head + f"the check of {bootstrap} failed: {last}") from None
    if "error" in reply:
        raise ConnectionError(head + f"{reply['error']} {PORT_HINT}")
    return reply["mode"], reply.get("metadata")


def _probe_child(bootstrap: str, modes: list[str]) -> dict:
    """The child's side of :func:`_probe`: one GCS call per mode, in order."""
    from ray._common.usage.usage_constants import CLUSTER_METADATA_KEY
    from ray._private.ray_constants import KV_NAMESPACE_CLUSTER
    from ray._raylet import AuthenticationTokenLoader, Config, InnerGcsClient
    from ray.exceptions import AuthenticationError

    for mode in modes:
        if mode != KEEP:
            os.environ[MODE] = mode
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
        try:
            client = InnerGcsClient.standalone(bootstrap, None, CALL_SECONDS * 1000)
            raw = client.internal_kv_get(CLUSTER_METADATA_KEY, KV_NAMESPACE_CLUSTER, CALL_SECONDS)
        except Exception as err:  # Ray raises RpcError, AuthenticationError, ...
            if isinstance(err, AuthenticationError) or "Unauthenticated" in str(err):
                continue
            return {"error": _first_line(err)}
        return {"mode": mode, "metadata": json.loads(raw) if raw else {}}
    return {"mode": modes[-1], "metadata": None}


def auth_refusal(mode: str, source: str | None) -> str:
    """Why the cluster refused a driver in authentication ``mode`` (RAY_AUTH_MODE for the
    call) with the token from ``source`` (None: none configured), and what to set."""
    if mode.lower() == "token" and source is not None:
        return (
            f"it refused the token from {source}: use the cluster's token ({GET_TOKEN}) in {WHERE}"
        )
    if MODE in os.environ and mode.lower() != "token":
        return (
            f"it requires token authentication but {MODE}={mode} is set: unset it (phasemech "
            f"then sends the token configured in {WHERE}) or set {MODE}=token"
        )
    return (
        "it requires token authentication and no token is configured here: put the "
        f"cluster's token ({GET_TOKEN}) in {WHERE}"
    )


def version_refusal(metadata: dict) -> str | None:
    """A mismatch of Ray or Python between the cluster and this process, in one line (Ray's
    rule: the same Ray, and the same Python to the level RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL
    sets, patch by default); None where they match or the cluster records no versions."""
    from ray._private.utils import check_version_info, compute_version_info

    if not {"ray_version", "python_version"} <= metadata.keys():
        return None
    try:
        check_version_info(metadata, "this machine", raise_on_mismatch=True)
    except RuntimeError:
        ray_here, python_here = compute_version_info()[:2]
        return (
            f"version mismatch: the cluster runs Ray {metadata['ray_version']} on Python "
            f"{metadata['python_version']}, this process Ray {ray_here} on Python "
            f"{python_here}; install the cluster's versions here (or start the cluster with "
            "this environment)"
        )
    return None


__all__ = [
    "auth_refusal",
    "check_cluster",
    "check_mode",
    "ray_connected",
    "token_source",
    "version_refusal",
]

if __name__ == "__main__":  # the probe's child: python ray_connect.py HOST:PORT MODE...
    print(json.dumps(_probe_child(sys.argv[1], sys.argv[2:])))
