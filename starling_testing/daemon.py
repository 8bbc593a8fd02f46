"""Real `starling run` daemons for tests and benchmarks: on 127.0.0.1 or in network-lab namespaces.

Every daemon is a :class:`node.ops.launcher.DaemonProcess` (the one launcher, also behind `make run`), watched
through its control socket (:func:`node.ops.control.request_status`: the dict `starling status --json` prints).
Here it gets what tests need on top: a failed wait is an AssertionError (:class:`DaemonError`), a
:class:`DaemonGroup` that stops every daemon it started, tiny models that train in seconds (:data:`TINY`),
and daemons inside a :class:`starling_testing.netlab.Lab` host (:func:`spawn_daemon`, :func:`start_daemon`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.ops import launcher
from node.ops.launcher import STARLING, DaemonProcess, Status

if TYPE_CHECKING:
    from starling_testing.netlab import Host, Proc

__all__ = [
    "PORT", "PYTHON", "ROOT", "STARLING", "TINY", "TINY_TRAIN", "DaemonError", "DaemonGroup", "DaemonProc",
    "LabDaemon", "free_port", "path_to", "spawn_daemon", "start_daemon", "starling",
]  # fmt: skip

#: The repository root (the daemons' working directory in a lab).
ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable  # the venv's interpreter, by absolute path: lab namespaces share the file system
PORT = 4001  # what a lab daemon listens on, at its host's address

#: A model small enough that five trainers fit on two cores, and quick pairing: the training part of
#: TINY, also used by the network-lab tests. A later `--set` of the same option wins.
TINY_TRAIN = [
    "--set", "train.d_model=32", "--set", "train.n_layers=1", "--set", "train.n_heads=2",
    "--set", "train.seq_len=32", "--set", "train.batch_size=4", "--set", "train.inner_steps=5",
    "--set", "train.data_bytes=300000", "--set", "train.warmup=10", "--set", "train.lr=0.003",
    "--set", "train.max_lag=5", "--set", "train.checkpoint_every=2", "--set", "train.checkpoint_min_s=0",
    "--set", "train.eval_batches=1",
    "--set", "sync.pair_window_s=2", "--set", "sync.backoff_s=1", "--set", "sync.join_wait_s=2",
]  # fmt: skip

#: Options for daemons that train together on 127.0.0.1: TINY_TRAIN, quick membership timers.
TINY = [
    "--listen", "/ip4/127.0.0.1/tcp/0",
    *TINY_TRAIN,
    # Nodes start seconds apart on a loaded 2-core machine and step solo meanwhile (H = 5 is fast):
    # allow them to pair despite that head start.
    "--set", "sync.max_step_gap=50",
    "--set", "node.heartbeat_s=1", "--set", "node.suspect_after=5", "--set", "node.gone_after=10",
]  # fmt: skip


class DaemonError(AssertionError, launcher.DaemonError):
    """A daemon exited, or did not reach a state in time; the message carries its status and log tail.

    An AssertionError, so that a test reads it as a failed expectation; benchmarks report it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def starling(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run one `starling` command to completion (output captured as text)."""
    return subprocess.run(
        [*STARLING, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


class DaemonProc(DaemonProcess):
    """A daemon for a test or a benchmark: :class:`node.ops.launcher.DaemonProcess` whose failed waits are
    :class:`DaemonError` (an AssertionError)."""

    error = DaemonError

    def wait_status(
        self, pred: Callable[[Status], bool] = lambda s: True, timeout: float = 30.0, interval: float = 0.5
    ) -> Status:
        """Poll until ``pred(status)`` holds; the status that satisfied it."""
        return self.wait(pred, timeout, "the expected status", interval)


class DaemonGroup:
    """Starts daemons and guarantees they are stopped (SIGKILL as a last resort) when the test ends."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemons: list[DaemonProc] = []

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> DaemonProc:
        d = DaemonProc(self.root / name, list(args), env or {}).start()
        self.daemons.append(d)
        return d

    def close(self) -> None:
        launcher.stop_all(self.daemons, timeout=12)


# --- daemons in a network lab (starling_testing.netlab) ----------------------------------------------------


class LabDaemon(DaemonProc):
    """One `starling run` process in a lab host's namespace, as the NAT lab tests and bench/nat.py drive
    them; ``proc`` is the lab's :class:`starling_testing.netlab.Proc` (``proc.stop()`` stops its group)."""

    def __init__(self, name: str, host: Host, home: Path, proc: Proc, started: float | None = None) -> None:
        super().__init__(home, name=name, proc=proc, log_path=proc.log_path)
        self.host = host
        if started is not None:
            self.started = started

    def tail(self, chars: int = 3000) -> str:
        return self.proc.tail(40)


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
