"""Swarm authorization: without the swarm key a peer reaches nothing; the allowlist narrows further."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from procs import DaemonGroup, starling

from p2p.auth import SwarmKeyError, format_swarm_key, generate_swarm_key, read_swarm_key

LOOPBACK = ["--no-train", "--listen", "/ip4/127.0.0.1/tcp/0"]


def test_swarm_key_file_round_trips_and_garbage_is_named(tmp_path: Path) -> None:
    key = generate_swarm_key()
    (tmp_path / "k").write_text(format_swarm_key(key))
    assert read_swarm_key(tmp_path / "k") == key
    (tmp_path / "bad").write_text("/key/swarm/psk/1.0.0/\n/base16/\nxyz\n")
    with pytest.raises(SwarmKeyError, match="bad"):
        read_swarm_key(tmp_path / "bad")


def test_swarm_key_command_writes_a_private_file_and_never_overwrites(tmp_path: Path) -> None:
    out = tmp_path / "swarm.key"
    assert starling("swarm-key", "--out", str(out)).returncode == 0
    assert out.stat().st_mode & 0o777 == 0o600 and len(read_swarm_key(out)) == 64
    r = starling("swarm-key", "--out", str(out))
    assert r.returncode == 2 and "already exists" in r.stderr


@pytest.mark.slow
def test_a_peer_without_the_swarm_key_cannot_connect_or_read_state(group: DaemonGroup, tmp_path: Path) -> None:
    key, other = tmp_path / "key", tmp_path / "other"
    starling("swarm-key", "--out", str(key))
    starling("swarm-key", "--out", str(other))
    for name, k in (("a", key), ("b", key), ("x", other)):
        assert starling("init", "--home", str(tmp_path / name), "--swarm-key", str(k)).returncode == 0
    a = group.start("a", *LOOPBACK, "--swarm", "private")
    addr = a.addr()
    b = group.start("b", *LOOPBACK, "--swarm", "private", "--bootstrap", addr)
    x = group.start("x", *LOOPBACK, "--swarm", "private", "--bootstrap", addr)
    plain = group.start("p", *LOOPBACK, "--swarm", "private", "--bootstrap", addr)  # no key at all
    a_id, b_id = a.wait_status()["peer_id"], b.wait_status()["peer_id"]
    b.wait_status(lambda s: a_id in s["connected_peers"], timeout=30)
    a.wait_status(lambda s: s["authorization"]["refused_handshakes"] >= 2, timeout=30)
    time.sleep(2)
    for outsider in (x, plain):
        st = outsider.status()
        assert a_id not in st["connected_peers"] and b_id not in st["connected_peers"]
        assert all(m["peer_id"] != a_id for m in st.get("members", []))  # it never read the swarm state
    st = a.status()
    assert st["authorization"]["swarm_key"] is True
    assert set(st["connected_peers"]) == {b_id}
    assert "refused a connection from 127.0.0.1" in a.log()


@pytest.mark.slow
def test_allowlisted_swarm_refuses_and_disconnects_other_peers(group: DaemonGroup) -> None:
    b = group.start("b", *LOOPBACK)
    b_id = b.wait_status()["peer_id"]
    c = group.start("c", *LOOPBACK)
    c_id = c.wait_status()["peer_id"]
    a = group.start("a", *LOOPBACK, "--set", f"node.allow_peers={b_id}", "--bootstrap", b.addr())
    a_addr = a.addr()
    c2 = group.start("c2", *LOOPBACK, "--bootstrap", a_addr)
    c2_id = c2.wait_status()["peer_id"]
    a.wait_status(lambda s: b_id in s["connected_peers"], timeout=30)
    a.wait_status(lambda s: s["authorization"]["refused_peers"] >= 1, timeout=30)
    time.sleep(2)
    connected = a.wait_status()["connected_peers"]
    assert c2_id not in connected and c_id not in connected
