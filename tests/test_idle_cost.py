"""What an idle daemon repeats, done once (issue #24: bench/scale.py --profile on 16 network-only daemons)."""

from __future__ import annotations

import multiaddr
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from node import daemon
from p2p import host as host_module


def test_the_package_version_in_every_heartbeat_is_read_from_its_metadata_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """importlib.metadata parses the package's METADATA file on every call: 5% of an idle daemon's CPU when
    each heartbeat (every 2 s) asked for it."""
    calls = []
    monkeypatch.setattr(daemon, "version", lambda name: calls.append(name) or "9.9.9")
    daemon.starling_version.cache_clear()
    try:
        assert [daemon.starling_version() for _ in range(5)] == ["9.9.9"] * 5
        assert calls == ["starling"]
    finally:
        daemon.starling_version.cache_clear()


async def test_the_advertised_addresses_are_built_once_while_the_listeners_stay_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """py-libp2p rebuilds them (addrs factory, interface list, multiaddr parsing: ~2 ms) for every gossip
    message published or forwarded; 6% of an idle daemon's CPU. A new listener shows at once."""
    built = []
    expand = host_module.expand_wildcards
    monkeypatch.setattr(host_module, "expand_wildcards", lambda c: built.append(1) or expand(c))
    host = host_module.build_host(create_new_key_pair())
    assert host.get_addrs() == []  # not listening yet
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        first = host.get_addrs()
        assert len(first) == 1 and str(first[0]).startswith("/ip4/127.0.0.1/tcp/")  # the listener, at once
        built.clear()
        assert [host.get_addrs() for _ in range(50)] == [first] * 50
        assert built == []


def test_cached_addresses_are_rebuilt_after_their_time_to_live() -> None:
    class Host:
        calls = 0

        def get_transport_addrs(self) -> list[multiaddr.Multiaddr]:
            return [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/1")]

        def get_addrs(self) -> list[str]:
            self.calls += 1
            return [f"build {self.calls}"]

    now = [0.0]
    host = Host()
    host_module.cache_addrs(host, ttl=10, clock=lambda: now[0])  # type: ignore[arg-type]
    assert host.get_addrs() == host.get_addrs() == ["build 1"]
    now[0] = 10
    assert host.get_addrs() == ["build 2"]
