"""Whole `starling run` daemons in network-lab namespaces (tests/netlab.py), as the NAT lab tests and
bench/nat.py drive them: started in a host's namespace, watched through their control socket."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netlab import Host, Proc

from node.control import ControlError, request_sync

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable  # the venv's interpreter, by absolute path: the namespaces share the file system
PORT = 4001


class DaemonError(AssertionError):
    """A lab daemon exited, or did not reach a state in time; the message carries its status and log tail.

    An AssertionError, so that a test reads it as a failed expectation; bench/nat.py reports it."""


@dataclass
class LabDaemon:
    """One `starling run` process in a lab namespace."""

    name: str
    host: Host
    home: Path
    proc: Proc
    started: float = field(default_factory=time.monotonic)  # time.monotonic() at spawn
    peer_id: str = ""

    def status(self) -> dict[str, Any] | None:
        """The daemon's status (what `status --json` prints), or None while it does not answer."""
        try:
            answer = request_sync(self.home / "control.sock", {"cmd": "status"}, timeout=10)
        except ControlError:
            return None
        return answer.get("status") if answer.get("ok") else None

    def wait(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str, interval: float = 0.5
    ) -> dict[str, Any]:
        """Poll the status until `predicate` holds; :class:`DaemonError` at once if the daemon exits."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while True:
            if self.proc.poll() is not None:
                raise DaemonError(f"{self.name}: daemon exited ({self.proc.poll()}) before {what}\n{self.proc.tail(40)}")
            last = self.status()
            if last is not None and predicate(last):
                return last
            if time.monotonic() > deadline:
                raise DaemonError(
                    f"{self.name}: {what} not seen within {timeout:.0f} s; last status:\n"
                    f"{json.dumps(last, indent=1)[-4000:]}\n{self.proc.tail(40)}"
                )
            time.sleep(interval)


def spawn_daemon(host: Host, home: Path, args: list[str], *, name: str | None = None) -> LabDaemon:
    """Start `starling run --home HOME` listening on `host`'s address in its namespace; does not wait."""
    name = name or home.name
    argv = [PYTHON, "-m", "node.cli", "run", "--home", str(home), "--listen", f"/ip4/{host.ip}/tcp/{PORT}", *args]
    started = time.monotonic()
    return LabDaemon(name, host, home, host.spawn(argv, log=f"{name}.log", cwd=ROOT), started)


def start_daemon(host: Host, home: Path, args: list[str], *, name: str | None = None, timeout: float = 90) -> LabDaemon:
    """:func:`spawn_daemon`, then wait until it listens (and so knows its PeerID)."""
    daemon = spawn_daemon(host, home, args, name=name)
    daemon.peer_id = daemon.wait(lambda s: bool(s.get("addrs")), timeout, "start-up")["peer_id"]
    return daemon


def path_to(status: dict[str, Any], peer_id: str) -> str:
    """direct | hole-punched | relayed, or none when not connected (from the status' `peers`)."""
    return next((p["path"] for p in status.get("peers", []) if p["peer_id"] == peer_id), "none")
