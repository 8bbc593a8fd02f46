"""Helpers for tests that run real `starling` daemons as separate processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STARLING = [sys.executable, "-m", "node.cli"]

#: A model small enough that five trainers fit on two cores, and quick pairing: the training part of
#: TINY, also used by the network-lab tests. A later `--set` of the same option wins.
TINY_TRAIN = [
    "--set", "train.d_model=32", "--set", "train.n_layers=1", "--set", "train.n_heads=2",
    "--set", "train.seq_len=32", "--set", "train.batch_size=4", "--set", "train.inner_steps=5",
    "--set", "train.data_bytes=300000", "--set", "train.warmup=10", "--set", "train.lr=0.003",
    "--set", "train.max_lag=5", "--set", "train.checkpoint_every=2", "--set", "train.eval_batches=1",
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def starling(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*STARLING, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@dataclass
class DaemonProc:
    home: Path
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self) -> DaemonProc:
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = self.home / "daemon.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*STARLING, "run", "--home", str(self.home), *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
        )
        log.close()
        return self

    def status(self) -> dict[str, Any] | None:
        r = starling("status", "--home", str(self.home), "--json", timeout=20)
        if r.returncode != 0:
            return None
        return json.loads(r.stdout)

    def wait_status(self, pred: Any = lambda s: True, timeout: float = 30.0, interval: float = 0.5) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            last = self.status()
            if last is not None and pred(last):
                return last
            time.sleep(interval)
        raise AssertionError(f"condition not met within {timeout}s; last status: {last}\n{self.log()[-3000:]}")

    def addr(self) -> str:
        st = self.wait_status(lambda s: bool(s["addrs"]))
        return st["addrs"][0]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


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
        for d in self.daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in self.daemons:
            if d.proc is not None:
                try:
                    d.proc.wait(12)
                except subprocess.TimeoutExpired:
                    d.kill()
