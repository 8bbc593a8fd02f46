"""The systemd notify protocol (``sd_notify(3)``), without libsystemd.

Under a ``Type=notify`` unit systemd hands the service a datagram socket in ``$NOTIFY_SOCKET``; the
service sends newline-separated ``KEY=VALUE`` assignments to it:

- ``READY=1`` once the node is listening, so ``systemctl start`` returns only when the node is usable
  and units ordered after it start at the right time;
- ``STATUS=...`` a one-line human summary shown by ``systemctl status``;
- ``WATCHDOG=1`` a keep-alive; with ``WatchdogSec=`` systemd kills and restarts a node whose event loop
  hung (a wedged trio loop is otherwise invisible: the process is alive but answers nothing);
- ``STOPPING=1`` when a graceful drain begins; ``EXTEND_TIMEOUT_USEC=`` asks for more time while a
  checkpoint is still being written.

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a cheap no-op, so the daemon calls it
unconditionally. A failed send is logged and swallowed: losing a status line must never take a node down.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import trio

from node.status_schema import NodeStatus

log = logging.getLogger(__name__)

# systemd accepts notify datagrams up to 4 KiB; a STATUS line longer than this is useless in
# `systemctl status` anyway, and the cap keeps every message far below that limit.
MAX_STATUS_CHARS = 512

# How often watchdog_loop refreshes STATUS when there is no watchdog to feed.
DEFAULT_STATUS_INTERVAL_S = 10.0


def parse_notify_address(value: str) -> str | None:
    """The socket address in ``$NOTIFY_SOCKET``: a filesystem path, or ``@name`` for an abstract socket.

    Returns the address as ``socket.sendto`` wants it (abstract names start with a NUL byte), or None
    for a value this implementation cannot use (empty, relative, or a ``vsock:`` address).
    """
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def parse_watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between watchdog pings, or None when no watchdog is armed for this process.

    systemd sets ``WATCHDOG_USEC`` to the full timeout; pinging at half of it (what sd_watchdog_enabled(3)
    recommends) leaves room for one late ping. ``WATCHDOG_PID``, when present, names the process the
    watchdog is meant for, so a child that inherited the environment does not feed it.
    """
    usec = environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    watchdog_pid = environ.get("WATCHDOG_PID")
    if watchdog_pid:
        try:
            if int(watchdog_pid) != pid:
                return None
        except ValueError:
            log.warning("ignoring malformed WATCHDOG_PID=%r", watchdog_pid)
            return None
    try:
        timeout_us = int(usec)
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC=%r", usec)
        return None
    if timeout_us <= 0:
        return None
    return timeout_us / 2 / 1_000_000


def _one_line(text: str) -> str:
    """A STATUS value: newlines would start a new assignment, so they become spaces."""
    flat = " ".join(text.split())
    return flat[:MAX_STATUS_CHARS]


@dataclass
class Notifier:
    """Sends notify messages to systemd; every method is a no-op when ``address`` is None.

    Build it with :meth:`from_env`. The socket is opened lazily on the first send and kept open.
    """

    address: str | None = None
    watchdog_interval_s: float | None = None
    _sock: socket.socket | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_env(
        cls, environ: MutableMapping[str, str] | None = None, *, unset_environment: bool = False
    ) -> Notifier:
        """Read ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC`` / ``$WATCHDOG_PID``.

        ``unset_environment=True`` removes those variables afterwards (like sd_notify's flag of that
        name), so child processes such as the torch worker do not inherit them and try to talk to
        systemd themselves.
        """
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        address = parse_notify_address(raw) if raw else None
        if raw and address is None:
            log.warning("NOTIFY_SOCKET=%r is not a supported address; systemd notifications disabled", raw)
        interval = parse_watchdog_interval(env, os.getpid()) if address else None
        if unset_environment:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                env.pop(key, None)
        return cls(address=address, watchdog_interval_s=interval)

    @property
    def enabled(self) -> bool:
        """True when running under systemd with a notify socket."""
        return self.address is not None

    def notify(self, **assignments: Any) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram; True when it was handed to the socket.

        Keys are given in Python style and upper-cased (``notify(ready=1, status="up")``).
        """
        if self.address is None or not assignments:
            return False
        lines = []
        for key, value in assignments.items():
            text = _one_line(str(value))
            lines.append(f"{key.upper()}={text}")
        payload = ("\n".join(lines) + "\n").encode("utf-8", errors="replace")
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # Never block the trio loop on a full socket buffer: a dropped STATUS is harmless.
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            log.warning("systemd notify failed (%s): %s", payload[:40], exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """The node is up: listening and accepting control requests."""
        if status is None:
            return self.notify(ready=1)
        return self.notify(ready=1, status=status)

    def status(self, text: str) -> bool:
        """Replace the one-line status shown by ``systemctl status``."""
        return self.notify(status=text)

    def watchdog(self) -> bool:
        """Keep-alive ping; only meaningful when a watchdog is armed, harmless otherwise."""
        return self.notify(watchdog=1)

    def stopping(self, status: str | None = None) -> bool:
        """A graceful drain began; systemd now waits up to ``TimeoutStopSec`` for the exit."""
        if status is None:
            return self.notify(stopping=1)
        return self.notify(stopping=1, status=status)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for ``seconds`` more before it times out a start or stop in progress.

        Useful while the drain writes a large checkpoint: send it again before the extension runs out.
        """
        return self.notify(extend_timeout_usec=max(1, math.ceil(seconds * 1_000_000)))

    def close(self) -> None:
        """Close the socket (sends after this reopen it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def watchdog_loop(
    notifier: Notifier,
    status_fn: Callable[[], str | None],
    *,
    status_interval_s: float = DEFAULT_STATUS_INTERVAL_S,
) -> None:
    """Feed the watchdog and refresh STATUS until cancelled; returns at once outside systemd.

    Run it in the daemon's main nursery. Each tick sends ``STATUS=<status_fn()>`` together with
    ``WATCHDOG=1`` when a watchdog is armed. The period is the watchdog interval (half of
    ``WATCHDOG_USEC``) or ``status_interval_s`` without a watchdog, whichever is shorter.

    What the ping proves is that the trio loop is still scheduling tasks, which is what a hung daemon
    loses. A ``status_fn`` that raises is logged and the ping is still sent: a bug in a summary line is
    no reason for systemd to restart the node.
    """
    if not notifier.enabled:
        return
    period = status_interval_s
    if notifier.watchdog_interval_s is not None:
        period = min(period, notifier.watchdog_interval_s)
    while True:
        assignments: dict[str, Any] = {}
        try:
            text = status_fn()
        except Exception:
            log.exception("status summary for systemd failed")
            text = None
        if text:
            assignments["status"] = text
        if notifier.watchdog_interval_s is not None:
            assignments["watchdog"] = 1
        if assignments:
            notifier.notify(**assignments)
        await trio.sleep(period)


def summarize_status(status: NodeStatus) -> str:
    """A one-line summary of the daemon's status JSON for ``STATUS=``; copes with missing sections.

    e.g. ``peers 3 | step 1200 outer 12 loss 2.314 | sync 11 rounds (1 solo, 0 failed)``.
    """
    parts: list[str] = []
    peers = status.get("connected_peers")
    if isinstance(peers, list):
        parts.append(f"peers {len(peers)}")
    training = status.get("training")
    if isinstance(training, Mapping):
        bits = []
        for key, label in (("step", "step"), ("outer_step", "outer")):
            value = training.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                bits.append(f"{label} {value}")
        loss = training.get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool) and math.isfinite(loss):
            bits.append(f"loss {loss:.3f}")
        if bits:
            parts.append(" ".join(bits))
        if training.get("state") == "failed":  # `systemctl status` is where an operator looks first
            parts.insert(0, f"TRAINING FAILED: {training.get('error')}")
    sync = status.get("sync")
    if isinstance(sync, Mapping):
        rounds, solo, failures = (sync.get(k) for k in ("rounds", "solo_rounds", "failures"))
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (rounds, solo, failures)):
            parts.append(f"sync {rounds} rounds ({solo} solo, {failures} failed)")
    return " | ".join(parts) if parts else "running"
