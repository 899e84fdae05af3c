"""Ray for the launcher: an embedded local Ray, or a running cluster joined at an address.

Ray 2.60 ships token authentication: ``ray start --head`` turns it on wherever a token is
configured (``ray get-auth-token --generate`` and every ``ray.init()`` that starts a local
Ray write one to ``~/.ray/auth_token``), while a driver that joins by an explicit address
sends its token only under ``RAY_AUTH_MODE=token``, and the modes must agree both ways (a
driver in token mode also refuses the calls of an unauthenticated cluster's workers). This
module chooses the mode so that the user does not have to, and refuses a cluster in seconds
with one line that says why.

Joining ``address`` (``HOST:PORT``, ``auto`` or ``ray://...``), before ``ray.init`` (which
retries a refusing cluster for ~25 s, printing a warning a second):

* a TCP connect, then one GCS call (2 s at most) that also reads the cluster's Ray and
  Python versions;
* the mode the user chose (``RAY_AUTH_MODE``) stands. Unset, the call goes first without a
  token; if the cluster asks for one and a token is configured for this user
  (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), again in token
  mode, the mode the driver then joins in;
* each refusal is a ``ConnectionError`` of one line: unreachable, not answering as Ray,
  authentication (what to set), version mismatch. A ``ray://`` (Ray Client) address gets
  the TCP check, and token mode where a token is configured.

The embedded Ray takes token authentication with a token made for this session: it lives in
the environment of the processes the session starts, is never written to disk, and nothing
is printed about it. ``RAY_AUTH_MODE=disabled``, set by the user, stands.

Either way the process environment is restored when the session ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
from collections.abc import Iterator

MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
PROBE_SECONDS = 2.0  # a GCS answers in milliseconds; a port that is not Ray never does
GET_TOKEN = "`ray get-auth-token` on the head prints it"
WHERE = f"{TOKEN}, a file named by {TOKEN_PATH}, or ~/.ray/auth_token"


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
            yield True
        finally:
            ray.shutdown()


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
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConnectionError(f"could not join the Ray cluster at {address!r}: {first}") from err


def _embedded_env() -> dict[str, str | None]:
    """Token authentication with a fresh token, unless the user turned authentication off."""
    if os.environ.get(MODE, "").lower() == "disabled":
        return {}
    return {MODE: "token", TOKEN: secrets.token_hex(32), TOKEN_PATH: None}


def token_source() -> str | None:
    """Where this user's Ray token comes from (Ray's own order), or None: none configured.
    A ``RAY_AUTH_TOKEN_PATH`` naming a missing or empty file is an error, not a fallback."""
    if os.environ.get(TOKEN, "").strip():
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
    Ray reads its mode and token once per process: both caches are refreshed each way."""
    saved = {name: os.environ.get(name) for name in changes}
    _apply(changes)
    try:
        yield
    finally:
        _apply(saved)


def _apply(values: dict[str, str | None]) -> None:
    if not values:
        return
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
    source = token_source()  # first: a bad RAY_AUTH_TOKEN_PATH is this machine's fault
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
    env: dict[str, str | None] = {} if chosen is not None else {MODE: "disabled"}
    metadata = _probe(bootstrap, env, head)
    if metadata is None and chosen is None and source is not None:
        env = {MODE: "token"}  # the cluster asked for a token and this user has one
        metadata = _probe(bootstrap, env, head)
    if metadata is None:
        raise ConnectionError(head + auth_refusal(env.get(MODE) or chosen, source))
    return env, metadata


def _resolve(address: str) -> str:
    if address != "auto":
        return address
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


def _probe(bootstrap: str, env: dict[str, str | None], head: str) -> dict | None:
    """One GCS round trip under ``env``: the cluster's metadata, or None where the cluster
    refused the credentials. Runs in a thread: Ray's client waits ~12 s on a port that is
    not a Ray GCS."""
    from ray._common.usage.usage_constants import CLUSTER_METADATA_KEY
    from ray._private.ray_constants import KV_NAMESPACE_CLUSTER
    from ray._raylet import InnerGcsClient
    from ray.exceptions import AuthenticationError

    box: dict = {}

    def call() -> None:
        try:
            client = InnerGcsClient.standalone(bootstrap, None, int(PROBE_SECONDS * 1000))
            raw = client.internal_kv_get(CLUSTER_METADATA_KEY, KV_NAMESPACE_CLUSTER, 2000)
            box["metadata"] = json.loads(raw) if raw else {}
        except Exception as err:  # Ray raises RpcError, AuthenticationError, ...
            box["error"] = err

    with _environment(env), _quiet_stderr():  # Ray's client logs a refusal before raising
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(PROBE_SECONDS + 1.0)
    if "metadata" in box:
        return box["metadata"]
    err = box.get("error")
    if err is None:
        raise ConnectionError(
            head + f"{bootstrap} accepts connections but does not answer as a Ray GCS within "
            f"{PROBE_SECONDS:.0f} s (is it the port `ray start --head` printed?)"
        )
    if isinstance(err, AuthenticationError) or "Unauthenticated" in str(err):
        return None
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise ConnectionError(head + f"{first} (is it the port `ray start --head` printed?)")


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


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for the block (Ray's C++ logs go there)."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to quiet
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


__all__ = [
    "auth_refusal",
    "check_cluster",
    "check_mode",
    "ray_connected",
    "token_source",
    "version_refusal",
]
