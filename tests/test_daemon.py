"""The daemon as an operator sees it: real `starling run` processes on 127.0.0.1."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from starling_testing.daemon import DaemonGroup, free_port, starling

pytestmark = pytest.mark.slow
LOOPBACK = ["--no-train", "--listen", "/ip4/127.0.0.1/tcp/0"]


def test_status_reports_the_contract_fields_and_peer_id_is_stable_across_restarts(group: DaemonGroup) -> None:
    d = group.start("a", *LOOPBACK, "--swarm", "alpha")
    st = d.wait_status(lambda s: bool(s["addrs"]))
    for key in ("peer_id", "swarm", "version", "uptime_s", "addrs", "connected_peers"):
        assert key in st
    assert st["swarm"] == "alpha"
    assert all(a.endswith("/p2p/" + st["peer_id"]) and "/ip4/0.0.0.0/" not in a for a in st["addrs"])
    assert d.stop() == 0
    d2 = group.start("a", *LOOPBACK)
    assert d2.wait_status()["peer_id"] == st["peer_id"]
    text = starling("status", "--home", str(d2.home))
    assert text.returncode == 0 and st["peer_id"] in text.stdout


def test_status_without_a_daemon_says_so_and_exits_1(tmp_path: Path) -> None:
    r = starling("status", "--home", str(tmp_path))
    assert r.returncode == 1 and "no daemon" in r.stderr


def test_second_daemon_on_the_same_home_is_refused(group: DaemonGroup) -> None:
    d = group.start("a", *LOOPBACK)
    d.wait_status()
    r = starling("run", "--home", str(d.home), *LOOPBACK, timeout=60)
    assert r.returncode == 2 and "already running" in r.stderr and "Traceback" not in r.stderr
    assert d.status() is not None  # the first one is unharmed


def test_port_in_use_is_a_clear_error_with_exit_2(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = starling("run", "--home", str(tmp_path), "--no-train", "--listen", f"/ip4/127.0.0.1/tcp/{port}", timeout=60)
    assert r.returncode == 2
    assert f"cannot listen on /ip4/127.0.0.1/tcp/{port}: port {port} is already in use" in r.stderr


def test_sigterm_stops_gracefully_within_10s_with_exit_0(group: DaemonGroup) -> None:
    d = group.start("a", *LOOPBACK)
    d.wait_status()
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.proc.wait(10) == 0
    assert time.monotonic() - t0 < 10
    assert not (d.home / "control.sock").exists()


def test_sigint_stops_gracefully_with_exit_0(group: DaemonGroup) -> None:
    d = group.start("a", *LOOPBACK)
    d.wait_status()
    d.signal(signal.SIGINT)
    assert d.proc.wait(10) == 0


def test_garbage_and_half_open_connections_on_the_port_leave_the_daemon_serving(group: DaemonGroup) -> None:
    port = free_port()
    d = group.start("a", "--no-train", "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    d.wait_status()
    half_open = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]  # never speak
    for payload in (b"\x00" * 1000, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 40, b"/multistream/1.0.0\n" * 50):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(3)
            try:
                s.recv(100)
            except (TimeoutError, ConnectionResetError):
                pass
    # The daemon still answers its control socket and still accepts a real libp2p peer.
    assert d.status() is not None
    other = group.start("b", *LOOPBACK, "--bootstrap", d.addr())
    pid = d.status()["peer_id"]
    other.wait_status(lambda s: pid in s["connected_peers"], timeout=30)
    for s in half_open:
        s.close()


def test_unreachable_bootstrap_warns_and_keeps_running(group: DaemonGroup) -> None:
    dead_port = free_port()
    fake = f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/12D3KooWPoxc3GetHDNMfRYL4h9TgTs2Dkrxk53DHHVDEVfqWV33"
    d = group.start("a", *LOOPBACK, "--bootstrap", fake)
    d.wait_status()
    deadline = time.monotonic() + 20
    while "cannot reach bootstrap peer" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "cannot reach bootstrap peer" in d.log() and "retrying in" in d.log()
    assert d.proc.poll() is None and d.status() is not None


def test_five_daemons_find_each_other_through_the_dht_from_one_bootstrap(group: DaemonGroup) -> None:
    boot = group.start("boot", *LOOPBACK, "--swarm", "five")
    addr = boot.addr()
    peers = [group.start(f"p{i}", *LOOPBACK, "--swarm", "five", "--bootstrap", addr) for i in range(4)]
    everyone = [boot, *peers]
    ids = [d.wait_status()["peer_id"] for d in everyone]
    deadline = time.monotonic() + 30
    for d, pid in zip(everyone, ids, strict=True):
        others = set(ids) - {pid}
        st = d.wait_status(lambda s, o=others: o <= set(s["connected_peers"]), timeout=max(1, deadline - time.monotonic()))
        assert others <= set(st["connected_peers"])
    # Peers learned the others from the DHT, not only from the bootstrap node (a lookup can finish a moment
    # after the connections are up: status polls answer at once, not after a CLI start-up).
    for d in peers:
        d.wait_status(lambda s: s["discovery"]["members_found"] >= 3, timeout=max(1, deadline - time.monotonic()))


def test_bootstrap_through_shared_addr_file_even_when_written_late(group: DaemonGroup, tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "addrs"
    late = group.start("b", *LOOPBACK, "--bootstrap-file", str(shared))  # the file does not exist yet
    late.wait_status()
    boot = group.start("a", *LOOPBACK, "--addr-file", str(shared))
    boot_id = boot.wait_status()["peer_id"]
    assert all(line.endswith("/p2p/" + boot_id) for line in shared.read_text().split())
    late.wait_status(lambda s: boot_id in s["connected_peers"], timeout=40)
    assert "waiting for bootstrap file" in late.log()


def test_systemd_notify_ready_and_stopping_reach_the_notify_socket(group: DaemonGroup, tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(sock_path))
    server.settimeout(20)
    try:
        d = group.start("a", *LOOPBACK, env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "2000000"})
        messages: list[str] = []
        while not any("READY=1" in m for m in messages):
            messages.append(server.recv(4096).decode())
        assert any("STATUS=" in m for m in messages)
        while not any("WATCHDOG=1" in m for m in messages):
            messages.append(server.recv(4096).decode())
        d.signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in messages):
            messages.append(server.recv(4096).decode())
        assert d.proc.wait(10) == 0
    finally:
        server.close()


def test_metrics_endpoint_serves_prometheus_text(group: DaemonGroup) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    d = group.start("a", *LOOPBACK, "--metrics-port", str(port))
    d.wait_status()
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.3)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"starling_connected_peers", "starling_uptime_seconds"} <= names
