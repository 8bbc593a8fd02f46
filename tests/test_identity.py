"""The node's identity: created once with mode 0600, stable across restarts, never silently replaced."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from p2p.identity import IdentityError, load_or_create_identity, peer_id_of
from starling_testing.daemon import starling


def test_identity_file_is_private_and_reloads_to_the_same_peer_id(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    kp1, created1 = load_or_create_identity(path)
    kp2, created2 = load_or_create_identity(path)
    assert created1 and not created2
    assert peer_id_of(kp1) == peer_id_of(kp2)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_corrupt_identity_raises_naming_the_file_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(b"\x00garbage")
    with pytest.raises(IdentityError, match=str(path)):
        load_or_create_identity(path)
    assert path.read_bytes() == b"\x00garbage"


def test_init_prints_the_same_peer_id_every_time(tmp_path: Path) -> None:
    r1 = starling("init", "--home", str(tmp_path / "n"), "--swarm", "s1")
    r2 = starling("init", "--home", str(tmp_path / "n"))
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert r1.stdout.strip() == r2.stdout.strip() and r1.stdout.startswith("12D3Koo")
    assert 'swarm = "s1"' in (tmp_path / "n" / "config.toml").read_text()


def test_run_with_corrupt_identity_exits_2_naming_the_file(tmp_path: Path) -> None:
    home = tmp_path / "n"
    home.mkdir()
    (home / "identity.key").write_bytes(b"not a key")
    r = starling("run", "--home", str(home), "--no-train", "--listen", "/ip4/127.0.0.1/tcp/0")
    assert r.returncode == 2
    assert "identity.key" in r.stderr and "Traceback" not in r.stderr
    assert (home / "identity.key").read_bytes() == b"not a key"
