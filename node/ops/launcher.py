"""The one launcher of `starling run` processes: start a daemon on its HOME, watch it through its control
socket, stop it.

`make run` (node/ops/localswarm.py), the tests and the benchmarks (through starling_testing.daemon, which adds
what only tests need: a group that always cleans up, tiny models, network-lab daemons) all start daemons
with :class:`DaemonProcess`, and read their status with :func:`node.ops.control.request_status`, the same dict
`starling status --json` prints, without spawning a Python process per poll (about a second of CPU on a
loaded 2-core machine).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from node.config.home import Home
from node.ops.control import ControlError, request_status
from node.status_schema import NodeStatus

#: `starling` as a command line, with this interpreter (the venv's, by absolute path).
STARLING = [sys.executable, "-m", "node.cli"]

Status = NodeStatus


class DaemonError(RuntimeError):
    """A daemon exited, or did not reach a state in time; the message carries its status and log tail."""


class DaemonProcess:
    """One `starling run --home HOME ARGS` process.

    ``proc`` is the running process: a :class:`subprocess.Popen` from :meth:`start`, or anything with
    ``pid``, ``poll()`` and ``wait(timeout)`` that a caller started itself (a network-lab process, say).
    """

    #: What :meth:`wait` raises (starling_testing makes it an AssertionError, so a test reads a failed wait
    #: as a failed expectation).
    error: type[Exception] = DaemonError

    def __init__(
        self,
        home: Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        name: str | None = None,
        proc: Any = None,
        log_path: Path | None = None,
    ) -> None:
        self.home = Path(home)
        self.args = list(args)
        self.env = dict(env or {})
        self.name = name or self.home.name
        self.proc: Any = proc
        self.log_path = log_path
        self.started = time.monotonic()  # at spawn
        self.peer_id = ""  # known once it answered a status

    def argv(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", "node.cli", "run", "--home", str(self.home), *self.args]

    def start(
        self,
        *,
        append_log: bool = True,
        new_session: bool = False,
        core: int | None = None,
        log: Path | None = None,
        stdout_to_log: bool = True,
    ) -> Self:
        """Spawn the daemon, its output going to ``log`` (default HOME/daemon.log, appended to unless
        ``append_log`` is false; with ``stdout_to_log`` false, stdout goes to /dev/null and only stderr to the
        log); does not wait. ``new_session``: its own process group, so that a Ctrl+C in the terminal reaches
        only the launcher; ``core``: pinned to one CPU core (its worker inherits the affinity)."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = log or Home(self.home).log
        pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
        with open(self.log_path, "ab" if append_log else "wb") as out:
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=out if stdout_to_log else subprocess.DEVNULL,
                stderr=subprocess.STDOUT if stdout_to_log else out,
                env={**os.environ, **self.env},
                start_new_session=new_session,
                preexec_fn=pin,
            )
        self.started = time.monotonic()
        return self

    # -- state -----------------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> bool:
        """It was started and has exited."""
        return self.proc is not None and self.proc.poll() is not None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def status(self, timeout: float = 10.0) -> Status | None:
        """Its status (what `starling status --json` prints), or None while it does not answer (starting,
        stopped, or exited: a stale socket is not asked)."""
        if self.exited():
            return None
        try:
            st = request_status(self.home, timeout=timeout)
        except ControlError:
            return None
        self.peer_id = st.get("peer_id") or self.peer_id
        return st

    def wait(
        self,
        predicate: Callable[[Status], bool] = lambda s: True,
        timeout: float = 30.0,
        what: str = "the expected status",
        interval: float = 0.5,
    ) -> Status:
        """Poll the status until ``predicate`` holds and return that status; :attr:`error` at once if the
        daemon exits, or after ``timeout`` seconds (both with the last status and the log's tail)."""
        deadline = time.monotonic() + timeout
        last: Status | None = None
        while True:
            if self.exited():
                raise self.error(f"{self.name}: daemon exited ({self.returncode()}) before {what}\n{self.tail()}")
            last = self.status()
            if last is not None and predicate(last):
                return last
            if time.monotonic() > deadline:
                raise self.error(f"{self.name}: {what} not seen within {timeout:.0f} s; last status: {last}\n{self.tail()}")
            time.sleep(interval)

    def addr(self, timeout: float = 30.0) -> str:
        """Its first listen address (ending in /p2p/<PeerID>), once it listens."""
        return self.wait(lambda s: bool(s.get("addrs")), timeout, "a listen address")["addrs"][0]

    # -- stopping --------------------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the daemon (only while it has not been reaped, so never to a reused pid)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the graceful stop systemd uses), SIGKILL after ``timeout``; the exit status, None if it
        had to be killed or was never started. (A network-lab process stops its whole group: ``proc.stop()``.)"""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.poll()
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


    # -- output ----------------------------------------------------------------------------------------

    def log(self) -> str:
        """Everything in its log so far."""
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def tail(self, chars: int = 3000) -> str:
        return f"--- end of {self.log_path} ---\n{self.log()[-chars:]}"


def stop_all(daemons: Iterable[DaemonProcess], timeout: float = 15.0) -> None:
    """Stop several daemons gracefully and together: SIGTERM to all first, then wait for each (SIGKILL after
    ``timeout``), so that their drains overlap instead of adding up."""
    daemons = [d for d in daemons if d.proc is not None]
    for d in daemons:
        d.signal(signal.SIGTERM)
    for d in daemons:
        try:
            d.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            d.kill()
