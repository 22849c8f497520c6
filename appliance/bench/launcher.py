"""Side-by-side runs: which scheduling policies the installed muxd serves, and a `muxd serve` subprocess per policy
(free port, wait for /ready, stop), so each policy is measured on the same device, model and trace; likewise a
`muxd cluster` subprocess per replica router (engine replicas on Ray Serve), so routers are compared the same way.
"""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx

from appliance.engine.planners.registry import POLICIES
from appliance.errors import ApplianceError, ConfigError

_RESERVED = ("--port", "--host", "--planner", "--policy", "--model", "-m")
_CLUSTER_RESERVED = (*_RESERVED, "--router")
# `muxd cluster --router`'s choices (cluster/settings.py ROUTERS, which bench sits below; a test keeps them equal)
ROUTERS = ("slo", "pow2")
CLUSTER_STOP_S = 90.0  # a cluster stops its Ray Serve application and its local Ray before it exits


def known_policies() -> dict[str, list[str]]:
    """Policy name -> the `muxd serve` flags that select it."""

    return {name: ["--policy", name] for name in POLICIES}


def parse_policies(text: str) -> list[str]:
    """'mux,chunked,serial' -> names, each known to this muxd (refused before anything starts otherwise)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("--policies: give one or more comma-separated policy names, e.g. serial,layerwise")
    known = known_policies()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--policies: {', '.join(unknown)} not available in this muxd; it serves "
                          f"{', '.join(sorted(known))}")
    return _once_each(names, "--policies", text, "policy")


def parse_serve_args(text: str | None) -> list[str]:
    """Extra `muxd serve` flags for the launched servers; the ones bench sets itself are refused."""
    return _extra_flags(text, "--serve-args", _RESERVED, "--model and --policies")


def parse_routers(text: str) -> list[str]:
    """'slo,pow2' -> `muxd cluster` routers (refused before anything starts when unknown)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROUTERS]
    if not names or unknown:
        raise ConfigError(f"--routers: give comma-separated routers among {', '.join(ROUTERS)}, got {text!r}")
    return _once_each(names, "--routers", text, "router")


def parse_cluster_args(text: str | None) -> list[str]:
    """Extra `muxd cluster` flags (replicas, autoscaling, Ray) for the launched clusters."""
    return _extra_flags(text, "--cluster-args", _CLUSTER_RESERVED, "--model, --policies and --routers")


def _once_each(names: list[str], flag: str, text: str, what: str) -> list[str]:
    if len(set(names)) != len(names):
        raise ConfigError(f"{flag}: {text!r} names a {what} twice")
    return names


def _extra_flags(text: str | None, flag: str, reserved, instead: str) -> list[str]:
    """Split extra command-line flags, refusing the ones muxd bench sets itself."""
    args = shlex.split(text or "")
    clash = [a for a in args if a.split("=")[0] in reserved]
    if clash:
        raise ConfigError(f"{flag}: {', '.join(clash)} is set by muxd bench (use {instead})")
    return args


BIND_RETRIES = 3
T = TypeVar("T")


def free_port() -> int:
    """A port free now; another process may take it before a server binds it (see `port_lost`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_lost(proc: subprocess.Popen, log_text: str) -> bool:
    """Whether a server process exited because its port was taken between `free_port()` and its bind."""
    return proc.poll() is not None and "address already in use" in log_text.lower()


def relaunch_on_lost_port(attempt: Callable[[], T], lost: Callable[[], bool], relaunch: Callable[[], None]) -> T:
    """`attempt()` (wait for a launched server); when it raises ApplianceError because the server lost its port
    (`lost()`), `relaunch()` on another and attempt again, up to BIND_RETRIES times. Other failures pass through."""
    for _ in range(BIND_RETRIES):
        try:
            return attempt()
        except ApplianceError:
            if not lost():
                raise
            relaunch()
    return attempt()


class ServerProcess:
    """`muxd serve --model MODEL <policy flags> <extra>` on a free local port (with a `router`: `muxd cluster
    --router ROUTER <extra> <cluster_args>`, engine replicas on Ray Serve behind one endpoint); a context manager
    that waits for /ready on entry and stops the server on exit."""

    def __init__(self, model: str, policy: str | None = None, extra: list[str] | None = None,
                 ready_timeout: float = 600.0, log_dir: str | Path | None = None, router: str | None = None,
                 cluster_args: list[str] | None = None) -> None:
        self.policy, self.router = policy, router
        flags = known_policies()[policy] if policy else []
        command = ["cluster", "--router", router, *(cluster_args or [])] if router else ["serve"]
        self._args = [sys.executable, "-m", "appliance", *command, "--port", None, "--model", model,
                      *flags, *(extra or []), "--log-level", "warning"]
        self._new_port()
        self.ready_timeout = ready_timeout
        self.stop_timeout = CLUSTER_STOP_S if router else 20.0
        log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="muxd-bench-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        name = "-".join(x for x in (policy, router and f"router-{router}") if x) or "default"
        self.log = log_dir / f"server-{name}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _new_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(self.port) if a is None else a for a in self._args]

    def start(self) -> None:
        """Launch without waiting (the model loads meanwhile); `wait_ready` blocks until /ready answers 200."""
        if self.proc is None:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            with self.log.open("w") as log:
                self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        """Block until /ready answers 200. The free port can be taken by another process before the server binds
        it: a server that exits for that reason starts again on another port (a few times)."""
        assert self.proc is not None, "start() first"
        relaunch_on_lost_port(lambda: wait_until_ready(self.url, self.proc, self.ready_timeout, self._log_tail),
                              lambda: port_lost(self.proc, self._log_tail()), self._relaunch)

    def _relaunch(self) -> None:
        self.proc = None
        self._new_port()
        self.start()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_until_ready(url: str, proc: subprocess.Popen | None, timeout: float, log_tail: Callable[[], str]) -> None:
    """Poll GET /ready of a `muxd serve` or `muxd cluster` process (or of a server it does not own: proc None) until
    200; ApplianceError (with its log's tail) if it exits or stays unready for `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ApplianceError(f"`muxd {' '.join(map(str, proc.args[3:]))}` exited with {proc.returncode}:"
                                 f"\n{log_tail()}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    what = f"`muxd {proc.args[3]}`" if proc is not None else f"the server at {url}"
    raise ApplianceError(f"{what} not ready after {timeout:g} s; its log:\n{log_tail()}")
