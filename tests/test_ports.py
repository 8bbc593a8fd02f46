"""Ports a daemon cannot have (issue #14, items 2 and 4): a listen port another daemon holds, and a busy
`sync.datapath_port`, each stop the start with one line and exit 2 instead of sharing the port silently or
printing an ExceptionGroup."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.config.load import load_config
from node.daemon import Daemon, StartupError, find_exception
from p2p.host import foreign_listeners, port_in_use
from starling_testing.daemon import TINY, DaemonGroup, free_port, starling


def reuseport_listener(port: int = 0) -> socket.socket:
    """A listener opened the way py-libp2p opens its own: SO_REUSEADDR and SO_REUSEPORT."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


@contextmanager
def listener_in_another_process(port: int) -> Iterator[None]:
    """A second process listening on 127.0.0.1:`port` as py-libp2p does (SO_REUSEPORT), until the block ends."""
    code = (
        "import socket, sys\n"
        "s = socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen()\n"
        "print('up', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        yield
    finally:
        child.kill()
        child.wait(10)


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "ExceptionGroup" not in stderr, stderr
    [line] = [ln for ln in stderr.splitlines() if "error" in ln.lower()]
    return line


def test_a_port_held_with_so_reuseport_counts_as_in_use() -> None:
    """py-libp2p's listeners set SO_REUSEPORT; a probe that set it too would bind beside them."""
    with reuseport_listener() as held:
        port = held.getsockname()[1]
        assert port_in_use("127.0.0.1", port) and port_in_use("0.0.0.0", port)
    assert not port_in_use("127.0.0.1", free_port())


def test_only_another_processs_listener_on_the_port_is_foreign() -> None:
    """The check after binding, for two daemons that passed the probe at the same moment."""
    with reuseport_listener() as ours:
        port = ours.getsockname()[1]
        assert foreign_listeners("127.0.0.1", port) == 0  # our own socket only
        with listener_in_another_process(port):
            assert foreign_listeners("127.0.0.1", port) == 1
            assert foreign_listeners("0.0.0.0", port) == 1  # a wildcard listener would share its connections
            assert foreign_listeners("127.0.0.2", port) == 0  # another address: no conflict


async def test_a_twin_that_bound_the_port_just_after_our_probe_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two daemons started at the same moment both find the port free; the check after binding sees the
    other one (in-process daemon, so that the probe can be made to miss it)."""
    port = free_port()
    cfg = load_config(tmp_path, overrides={"node.listen": [f"/ip4/127.0.0.1/tcp/{port}"]}, environ={})
    daemon = Daemon(cfg, tmp_path, create_new_key_pair(), train=False)
    monkeypatch.setattr("node.daemon.port_in_use", lambda host, port: False)  # the twin came after the probe
    with listener_in_another_process(port):
        with pytest.raises(BaseException) as caught:  # noqa: PT011 (trio may wrap it in exception groups)
            with trio.fail_after(30):
                await daemon.run()
    error = find_exception(caught.value, StartupError)
    assert error is not None, caught.value
    assert f"port {port} is also bound by another process" in str(error)


@pytest.mark.slow
def test_a_second_daemon_on_a_held_listen_port_exits_2_naming_the_port(group: DaemonGroup, tmp_path: Path) -> None:
    port = free_port()
    listen = f"/ip4/127.0.0.1/tcp/{port}"
    first = group.start("first", "--no-train", "--listen", listen)
    first_id = first.wait_status()["peer_id"]
    r = starling("run", "--home", str(tmp_path / "second"), "--no-train", "--listen", listen, timeout=60)
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert f"port {port} is already in use" in line and listen in line
    st = first.wait_status()  # the first daemon keeps its port, alone
    assert st["peer_id"] == first_id and any(a.startswith(f"{listen}/") for a in st["addrs"])


@pytest.mark.slow
def test_a_busy_datapath_port_exits_2_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = starling("run", "--home", str(tmp_path / "n"), *TINY, "--set", f"sync.datapath_port={port}", timeout=120)
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert f"port {port} is already in use" in line and "sync.datapath_port" in line
