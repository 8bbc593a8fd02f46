"""The Starling daemon: one trio process that owns the libp2p host and everything built on it.

The daemon is a tree of tasks in one nursery (control socket, connection manager, discovery, and the
trainer's supervisor when training); cancelling the nursery stops them all. Each component owns its own
deadlines, so no remote peer can hold the daemon. The trainer runs in a separate worker process: the
daemon only ever waits on it through a pipe, never on torch.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair

from node.config import Config
from node.control import SOCKET_FILE, serve_control
from node.metrics import Metrics, serve_metrics
from node.sdnotify import Notifier, summarize_status, watchdog_loop
from p2p.addrs import parse_bootstrap, parse_listen
from p2p.bootstrap_file import watch_bootstrap_files, write_addr_file
from p2p.connmgr import ConnManager
from p2p.discovery import SwarmDiscovery, make_on_connected
from p2p.host import build_host
from p2p.identity import peer_id_of

log = logging.getLogger("starling.daemon")


def starling_version() -> str:
    try:
        return version("starling")
    except PackageNotFoundError:
        return "0+unknown"


class StartupError(Exception):
    """The daemon cannot start for a reason the operator must fix (exit code 2)."""


def _why_not_listening(host: str, port: int) -> str:
    """Reproduce a failed bind to report the real reason (py-libp2p only logs it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is already in use"
            return e.strerror or str(e)
    return "the listener failed to start"


class Daemon:
    def __init__(self, cfg: Config, home: Path, key_pair: KeyPair, *, train: bool) -> None:
        self.cfg = cfg
        self.home = home
        self.key_pair = key_pair
        self.peer_id = peer_id_of(key_pair)
        self.train = train
        self.started_at = time.time()
        node = cfg.node
        self.listen_addrs = [parse_listen(a) for a in node.listen]
        announce = [parse_listen(a, allow_wildcard=False) for a in node.announce]
        self.host = build_host(
            key_pair, announce=announce, max_connections=node.max_peers * 2, dial_timeout=node.dial_timeout
        )
        self.connmgr = ConnManager(
            self.host, target=node.target_peers, cap=node.max_peers, dial_timeout=node.dial_timeout
        )
        self.discovery = SwarmDiscovery(self.host, self.connmgr, node.swarm, interval=node.discovery_interval)
        self.connmgr.on_connected = make_on_connected(self.discovery.peer_connected)
        for text in node.bootstrap:
            self.connmgr.add_candidate(parse_bootstrap(text), source="bootstrap", permanent=True)
        self.supervisor: Any = None
        self.ready = trio.Event()
        # The worker process must not inherit NOTIFY_SOCKET: only the daemon speaks to systemd.
        self.notifier = Notifier.from_env(unset_environment=True)
        self.metrics = Metrics()

    # --- status ------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = {
            "peer_id": str(self.peer_id),
            "swarm": self.cfg.node.swarm,
            "version": starling_version(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "home": str(self.home),
            "addrs": [str(a) for a in self.host.get_addrs()],
            "connected_peers": sorted(str(p) for p in self.connmgr.connected()),
            "connections": self.connmgr.status(),
            "discovery": self.discovery.status(),
            "role": "trainer" if self.train else "network-only",
        }
        if self.supervisor is not None:
            st["training"] = self.supervisor.status()
        return st

    async def _handle_control(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request["cmd"]
        if cmd == "status":
            return {"ok": True, "status": self.status()}
        if cmd == "ping":
            return {"ok": True}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    # --- run ---------------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        node = self.cfg.node
        async with self.host.run(self.listen_addrs):
            self._check_listening()
            log.info("peer id %s, swarm %r", self.peer_id, self.cfg.node.swarm)
            for a in self.host.get_addrs():
                log.info("listening on %s", a)
            async with trio.open_nursery() as nursery:
                if self.cfg.node.addr_file:
                    write_addr_file(Path(self.cfg.node.addr_file), [str(a) for a in self.host.get_addrs()])
                if self.cfg.node.bootstrap_files:
                    paths = [Path(p) for p in self.cfg.node.bootstrap_files]
                    nursery.start_soon(watch_bootstrap_files, paths, self.connmgr)
                await nursery.start(serve_control, self.home / SOCKET_FILE, self._handle_control)
                await nursery.start(self.connmgr.run)
                await nursery.start(self.discovery.run)
                if self.train:
                    self.supervisor = self._make_supervisor()
                    if self.supervisor is not None:
                        nursery.start_soon(self.supervisor.run)
                if node.metrics_port:
                    try:
                        await nursery.start(serve_metrics, self.metrics, node.metrics_host, node.metrics_port)
                    except OSError as e:
                        raise StartupError(
                            f"cannot serve metrics on {node.metrics_host}:{node.metrics_port}: {e.strerror or e}"
                        ) from None
                    log.info("metrics on http://%s:%d/metrics", node.metrics_host, node.metrics_port)
                    nursery.start_soon(self._refresh_metrics)
                self.ready.set()
                self.notifier.ready(summarize_status(self.status()))
                nursery.start_soon(watchdog_loop, self.notifier, lambda: summarize_status(self.status()))
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    self.notifier.stopping("stopping")

    async def _refresh_metrics(self) -> None:
        """Gauges follow the status once a second; events (rounds) are observed where they happen."""
        while True:
            self.metrics.update_from_status(self.status())
            await trio.sleep(1.0)

    def _check_listening(self) -> None:
        bound = self.host.get_transport_addrs()
        if len(bound) >= len(self.listen_addrs):
            return
        bound_text = {str(a) for a in bound}
        for addr in self.listen_addrs:
            if str(addr) in bound_text:
                continue
            proto = addr.protocols()[0].name
            host = addr.value_for_protocol(proto)
            port = int(addr.value_for_protocol("tcp"))
            if port == 0 and any(str(b).startswith(f"/{proto}/{host}/tcp/") for b in bound):
                continue
            raise StartupError(f"cannot listen on {addr}: {_why_not_listening(host, port)}")

    def _make_supervisor(self) -> Any:
        try:
            from node.supervisor import WorkerSupervisor
        except ImportError:
            log.warning("no trainer available in this build; running network-only")
            return None
        from node.averager import make_exchange

        return WorkerSupervisor(self.cfg.train, self.home, str(self.peer_id), make_exchange(self))
