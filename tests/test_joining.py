"""How nodes that reach a full bootstrap node find the rest of the swarm (issue #24: 64 daemons on one
bootstrap node never learnt of each other).

- p2p/connmgr.py: a full node keeps a newcomer's connection through a grace period (time for the state
  session that hands it every member's record and address), then closes it, keeping its long-lived ones;
  and a peer that closes a fresh connection is redialed after a back-off, not at the next tick;
- p2p/discovery.py: what a DHT lookup found before its deadline reaches the connection manager;
- node/daemon.py + node/swarm/replicator.py: suspect members' addresses are dialed too.

All in-process, on fake hosts and clocks (bench/scale.py measures the real daemons).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from node.config.load import load_config
from node.daemon import Daemon
from node.swarm.crdt import MemberRecord, MemberState, peer_id_of, sign_record
from p2p import discovery
from p2p.connmgr import PRUNE_GRACE_S, STABLE_S, ConnManager
from p2p.discovery import SwarmDiscovery
from protocols.hlc import Timestamp
from starling_testing.fakes import FakeHost


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def peer(i: int) -> ID:
    return ID(f"peer{i}".encode())


ADDR = [multiaddr.Multiaddr("/ip4/198.51.100.7/tcp/4001")]


def _full_node() -> tuple[Clock, FakeHost, ConnManager]:
    """A node at its cap (4) with four connections from four subnets."""
    clock = Clock()
    host = FakeHost(peers={peer(i): f"198.51.{i}.7" for i in range(4)})
    return clock, host, ConnManager(host, target=2, cap=4, clock=clock, ip_of=lambda p: host.peers.get(p))


async def test_a_full_node_keeps_a_newcomer_through_its_grace_period_then_closes_it_not_its_old_connections() -> None:
    clock, host, mgr = _full_node()
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)
        clock.t += 600
        host.peers[peer(4)] = "198.51.4.7"  # the newcomer: one over the cap
        mgr._tick(nursery)
        await trio.sleep(0)
        assert peer(4) in host.peers and not host.disconnected  # it gets its grace (before: closed at once)
        clock.t += PRUNE_GRACE_S - 1
        mgr._tick(nursery)
        await trio.sleep(0)
        assert not host.disconnected
        clock.t += 1
        mgr._tick(nursery)
    assert host.disconnected == [peer(4)]  # the newest past its grace; the long-lived four stay
    assert mgr.status()["cap_pruned"] == 1


async def test_newcomers_in_their_grace_period_do_not_push_out_long_lived_connections() -> None:
    clock, host, mgr = _full_node()
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)
        clock.t += 600
        for i in range(4, 10):
            host.peers[peer(i)] = f"198.51.{i}.7"
        mgr._tick(nursery)
        clock.t += PRUNE_GRACE_S
        mgr._tick(nursery)
    assert sorted(host.disconnected, key=str) == sorted((peer(i) for i in range(4, 10)), key=str)


async def test_a_peer_that_closes_a_fresh_connection_is_redialed_after_a_growing_back_off() -> None:
    """The other side is full and closes us after its grace period: before, the candidate's failures were
    reset by the successful dial and it was redialed at the next tick (twice a second, forever)."""
    clock = Clock()
    host = FakeHost()
    dials: list[float] = []

    async def dial(info: PeerInfo) -> None:
        dials.append(clock.t)
        host.peers[info.peer_id] = "198.51.100.7"

    boot = peer(0)
    mgr = ConnManager(host, target=8, cap=32, clock=clock, dial=dial, ip_of=lambda p: host.peers.get(p))
    mgr.add_candidate(PeerInfo(boot, ADDR), source="bootstrap", permanent=True)
    delays = []
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            mgr._tick(nursery)
            await trio.sleep(0.01)  # the dial task runs
            mgr._tick(nursery)  # sees the connection
            clock.t += PRUNE_GRACE_S + 1
            host.peers.pop(boot)  # the full peer closes it
            mgr._tick(nursery)
            await trio.sleep(0.01)
            cand = mgr.candidates[boot]
            assert cand.next_attempt > clock.t and len(dials) == len(delays) + 1  # not redialed yet
            assert "closed after" in cand.last_error
            delays.append(cand.next_attempt - clock.t)
            clock.t = cand.next_attempt
    assert delays[0] < delays[1] < delays[2], delays
    assert mgr.candidates[boot].failures == 3


async def test_a_connection_that_lasted_clears_its_peers_failures_and_is_redialed_at_once() -> None:
    clock = Clock()
    host = FakeHost()
    mgr = ConnManager(host, target=8, cap=32, clock=clock, ip_of=lambda p: host.peers.get(p))
    mgr.add_candidate(PeerInfo(peer(1), ADDR), source="state")
    mgr.candidates[peer(1)].failures = 3
    async with trio.open_nursery() as nursery:
        host.peers[peer(1)] = "198.51.100.7"
        mgr._tick(nursery)
        assert mgr.candidates[peer(1)].failures == 3
        clock.t += STABLE_S
        mgr._tick(nursery)
        assert mgr.candidates[peer(1)].failures == 0
        host.peers.pop(peer(1))
        mgr._tick(nursery)
        assert mgr.candidates[peer(1)].next_attempt <= clock.t
        nursery.cancel_scope.cancel()


# --- discovery --------------------------------------------------------------------------------------------


class SlowDHT:
    """A DHT whose network lookup never finishes; its local provider store knows three members."""

    def __init__(self, providers: list[PeerInfo]) -> None:
        self.provider_store = self
        self.peer_routing = self
        self._providers = providers

    def get_routing_table_size(self) -> int:
        return 1

    def get_providers(self, key: bytes) -> list[PeerInfo]:
        return self._providers

    async def find_closest_peers_network(self, key: bytes) -> list[ID]:
        await trio.sleep_forever()
        return []


async def test_a_dht_lookup_that_misses_its_deadline_still_hands_over_the_members_it_found(monkeypatch: Any) -> None:
    """On a loaded machine no lookup finished within LOOKUP_TIMEOUT_S, and what they had found was dropped:
    the DHT never gave a node a single member (`discovery.lookups` stayed 0 with 16 daemons on 2 cores)."""
    monkeypatch.setattr(discovery, "LOOKUP_TIMEOUT_S", 0.05)
    host = FakeHost()
    mgr = ConnManager(host)
    members = [PeerInfo(peer(i), ADDR) for i in range(3)]
    disc = SwarmDiscovery.__new__(SwarmDiscovery)  # without the real KadDHT (and its host)
    disc.host, disc.connmgr, disc.key = host, mgr, discovery.swarm_key("s")
    disc.dht, disc.members_found, disc.lookups, disc.last_error = SlowDHT(members), set(), 0, ""
    assert await disc._lookup() is True  # unfinished: no sign that the swarm has settled
    assert set(mgr.candidates) == {p.peer_id for p in members}
    assert len(disc.members_found) == 3 and disc.lookups == 0  # found, though no lookup finished


# --- members learnt from the swarm state ------------------------------------------------------------------


async def test_suspect_members_addresses_are_given_to_the_connection_manager(tmp_path: Path) -> None:
    """A suspect member is the one a connection helps most; before, only alive members were handed over,
    so on a loaded machine where most members looked suspect nobody dialed anyone."""
    cfg = load_config(tmp_path, overrides={"node.listen": ["/ip4/127.0.0.1/tcp/0"]}, environ={})
    daemon = Daemon(cfg, tmp_path, create_new_key_pair(), train=False)
    now = time.time()
    keys = [create_new_key_pair() for _ in range(2)]
    for key, port in zip(keys, (4101, 4102), strict=True):
        record = MemberRecord(peer_id_of(key.public_key), Timestamp(int(now * 1000), 0), role="network-only", heartbeat=now,
                              addrs=(f"/ip4/198.51.100.9/tcp/{port}",))
        assert daemon.replicator.state.merge(sign_record(record, key))
    later = now + cfg.node.suspect_after + 5  # both silent since: suspect, not gone
    daemon.replicator._clock = lambda: later
    assert {v.state for v in daemon.replicator.state.members(later) if v.peer_id != str(daemon.peer_id)} == {
        MemberState.SUSPECT}
    with trio.move_on_after(0.5):
        await daemon._learn_member_addrs()
    assert {str(p) for p in daemon.connmgr.candidates} == {str(peer_id_of(k.public_key)) for k in keys}
    assert all(c.source == "state" for c in daemon.connmgr.candidates.values())
