"""p2p/discovery.py's pacing: DHT lookups and provider announcements back off on a settled swarm and come
back when it changes."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2p import discovery
from p2p.connmgr import ConnManager
from p2p.discovery import (
    FAST_INTERVAL_S,
    FAST_ROUNDS,
    MAX_BACKOFF,
    LookupPacer,
    SwarmDiscovery,
)
from starling_testing.fakes import FakeHost


def test_lookups_are_fast_at_start_then_double_while_nothing_new_is_found_up_to_the_cap() -> None:
    pacer = LookupPacer(10.0)
    fast = [pacer.after_lookup(found_new=False) for _ in range(FAST_ROUNDS - 1)]
    assert fast == [FAST_INTERVAL_S] * (FAST_ROUNDS - 1)
    settled = [pacer.after_lookup(found_new=False) for _ in range(6)]
    assert settled == [10.0, 20.0, 40.0, 80.0, 80.0, 80.0]
    assert max(settled) == 10.0 * MAX_BACKOFF


def test_a_new_member_or_a_new_connection_brings_lookups_back_to_the_interval() -> None:
    pacer = LookupPacer(10.0)
    for _ in range(FAST_ROUNDS + 5):
        pacer.after_lookup(found_new=False)
    assert pacer.after_lookup(found_new=False) == 80.0
    assert pacer.after_lookup(found_new=True) == 10.0
    assert pacer.after_lookup(found_new=False) == 10.0  # and doubles again from there
    assert pacer.after_lookup(found_new=False) == 20.0
    pacer.woken()
    assert pacer.after_lookup(found_new=False) == 10.0


# --- SwarmDiscovery.run on a settled swarm, with a fake DHT and virtual time -----------------------------------


def peer(i: int) -> ID:
    return ID(f"peer{i}".encode())


ADDR = [multiaddr.Multiaddr("/ip4/198.51.100.7/tcp/4001")]


class SettledDHT:
    """A DHT in a settled swarm of ``n`` members: every peer asked answers with the same providers (every
    member) after ``answer_s`` seconds, naming the others as closer peers. Counts what it is asked."""

    def __init__(self, n: int, answer_s: float = 0.5) -> None:
        self.members = [PeerInfo(peer(i), ADDR) for i in range(n)]
        self.answer_s = answer_s
        self.provider_store = self.peer_routing = self.routing_table = self
        self.get_providers_sent = 0
        self.closest_peer_walks = 0
        self.provides = 0

    def get_routing_table_size(self) -> int:
        return len(self.members)

    async def add_peer(self, peer_id: ID, skip_server_mode_check: bool = False) -> bool:
        return True

    async def provide(self, key: str) -> bool:
        self.provides += 1
        return True

    def get_providers(self, key: bytes) -> list[PeerInfo]:
        return list(self.members)

    def add_provider(self, key: bytes, provider: PeerInfo) -> None:
        pass

    def find_local_closest_peers(self, key: bytes, count: int = 20) -> list[ID]:
        return [m.peer_id for m in self.members][:count]

    async def find_closest_peers_network(self, key: bytes) -> list[ID]:  # an iterative FIND_NODE walk
        self.closest_peer_walks += 1
        await trio.sleep(self.answer_s)
        return [m.peer_id for m in self.members][:20]

    async def _get_providers_from_peer_with_closers(self, peer_id: ID, key: bytes) -> tuple[list[PeerInfo], list[ID]]:
        self.get_providers_sent += 1
        await trio.sleep(self.answer_s)
        return list(self.members), [m.peer_id for m in self.members if m.peer_id != peer_id]


def settled_node(dht: SettledDHT, connected: int, *, records: bool = True) -> SwarmDiscovery:
    """A node connected to the first ``connected`` members, every member a candidate learnt from the swarm
    state unless ``records`` is False (no state session has given it any)."""
    host = FakeHost(peers={peer(i): "127.0.0.1" for i in range(connected)})
    mgr = ConnManager(host, target=8)
    if records:
        mgr.add_candidates(dht.members, source="state")  # every member learnt from the swarm state
    disc = SwarmDiscovery.__new__(SwarmDiscovery)  # without the real KadDHT (and its host)
    disc.host, disc.connmgr, disc.key, disc.interval = host, mgr, discovery.swarm_key("s"), 10.0
    disc.dht, disc.members_found, disc.lookups, disc.last_error, disc.provides = dht, set(), 0, "", 0
    disc.lookups_skipped = 0
    disc._wake, disc._in_table = trio.Event(), set()
    return disc


async def run_for(disc: SwarmDiscovery, seconds: float, monkeypatch: Any) -> None:
    @asynccontextmanager
    async def no_service(service: Any) -> AsyncIterator[None]:
        yield

    monkeypatch.setattr(discovery, "background_trio_service", no_service)
    with trio.move_on_after(seconds):
        await disc.run()


async def test_an_idle_node_with_its_connections_asks_the_dht_little_in_an_hour(
        monkeypatch: Any, autojump_clock: Any) -> None:
    """Issue #24: a settled node announced itself every 60 s and looked up every 10 to 80 s (each lookup a
    closest-peer walk, then 20 GET_PROVIDERS): most of an idle daemon's traffic and CPU, growing with N."""
    dht = SettledDHT(16)
    await run_for(settled_node(dht, connected=8), 3600.0, monkeypatch)
    assert dht.closest_peer_walks == 0
    assert dht.provides <= 1 + 3600 / 600.0
    # At its target it looks nothing up; a few lookups before that at most, each one batch.
    assert dht.get_providers_sent <= 25 * discovery.PROVIDER_QUERY_BATCH


async def test_a_lookup_that_ran_out_of_time_after_answers_lets_the_node_back_off(
        monkeypatch: Any, autojump_clock: Any) -> None:
    """On a busy machine (16 daemons on 2 cores) every lookup ran past LOOKUP_TIMEOUT_S and counted as
    failed, and failed lookups never back off: every node looked up every 10 s for ever. Answers that
    name only members the node knows are a sign that the swarm has settled, finished or not."""
    dht = SettledDHT(30, answer_s=discovery.QUERY_TIMEOUT_S * 0.9)  # the third batch misses the deadline
    disc = settled_node(dht, connected=8)
    original = dht._get_providers_from_peer_with_closers

    async def new_answers_each_time(peer_id: ID, key: bytes) -> tuple[list[PeerInfo], list[ID]]:
        providers, closer = await original(peer_id, key)  # each answer names a member not named yet ...
        return [PeerInfo(peer(100 + dht.get_providers_sent), ADDR)] + providers, closer

    dht._get_providers_from_peer_with_closers = new_answers_each_time  # type: ignore[method-assign]
    for i in range(100, 140):  # ... that the node knows of all the same (from the swarm state)
        disc.connmgr.add_candidate(PeerInfo(peer(i), ADDR), source="state")
    assert await disc._lookup() is False
    assert dht.get_providers_sent > discovery.PROVIDER_QUERY_BATCH  # it did run out of time
    assert disc.lookups == 0


async def test_a_lookup_no_peer_answers_counts_as_failed(monkeypatch: Any, autojump_clock: Any) -> None:
    dht = SettledDHT(16, answer_s=discovery.LOOKUP_TIMEOUT_S * 2)
    assert await settled_node(dht, connected=8)._lookup() is True


def test_a_new_connection_wakes_lookups_only_while_the_node_is_short_of_connections() -> None:
    disc = settled_node(SettledDHT(16), connected=8)
    disc.peer_connected(peer(7))
    assert disc._wake.is_set()  # the 8th connection: the node was below its target
    disc._wake = trio.Event()
    disc.connmgr.host.peers[peer(9)] = "127.0.0.1"  # type: ignore[attr-defined]
    disc.peer_connected(peer(9))
    assert not disc._wake.is_set()


# --- the DHT at a join: a fallback for members' records (issue #24) --------------------------------------------


async def test_a_joining_node_whose_records_name_members_enough_asks_the_dht_nothing(
        monkeypatch: Any, autojump_clock: Any) -> None:
    """At a 64-daemon join each newcomer's ten fast lookups and its announcements went through the bootstrap
    node while 63 others leaned on it (the join took 90 s, 31 s without them): a newcomer connected to its
    bootstrap node alone, whose state session gave it every member's record, looks nothing up and does not
    announce itself while it dials them."""
    dht = SettledDHT(64)
    disc = settled_node(dht, connected=1)
    await run_for(disc, discovery.PROVIDE_GRACE_S - 1, monkeypatch)
    assert dht.get_providers_sent == 0 and dht.provides == 0
    assert disc.lookups_skipped > 0


async def test_a_node_without_records_looks_members_up_after_the_grace_and_announces_itself(
        monkeypatch: Any, autojump_clock: Any) -> None:
    """The DHT stays the way in where no state session gave a member (or too few to reach the target)."""
    dht = SettledDHT(16)
    disc = settled_node(dht, connected=1, records=False)
    await run_for(disc, discovery.LOOKUP_GRACE_S - 0.5, monkeypatch)
    assert dht.get_providers_sent == 0 and dht.provides == 0
    # Past the grace it is short of candidates: it announces itself (so do the others of a small swarm,
    # who need the DHT as it does) and looks members up.
    await run_for(settled_node(dht, connected=1, records=False), discovery.LOOKUP_GRACE_S + 1, monkeypatch)
    assert dht.get_providers_sent > 0 and dht.provides == 1


async def test_a_node_with_its_connections_announces_itself_only_after_the_join(
        monkeypatch: Any, autojump_clock: Any) -> None:
    """At a 64-daemon join, first announcements at a node's target of connections (or 30 s after its start)
    were 2,600 DHT streams, half the join's streams in its last 20 s: each a closest-peer walk and an
    ADD_PROVIDER to the same 20 peers. A node that needs no DHT to find members announces itself later."""
    dht = SettledDHT(16)
    await run_for(settled_node(dht, connected=8), discovery.PROVIDE_GRACE_S - 1, monkeypatch)
    assert dht.provides == 0
    dht = SettledDHT(16)
    await run_for(settled_node(dht, connected=8), discovery.PROVIDE_LATEST_S + 11, monkeypatch)
    assert dht.provides == 1


def test_first_announcements_are_spread_between_the_grace_and_the_latest() -> None:
    rng = random.Random(7)
    firsts = [discovery.ProvidePacer(0.0, rng).first for _ in range(64)]
    assert discovery.PROVIDE_GRACE_S <= min(firsts) and max(firsts) <= discovery.PROVIDE_LATEST_S
    per_minute = Counter(int(t // 60) for t in firsts)
    assert max(per_minute.values()) <= 64 // 2  # not all in one minute
    pacer = discovery.ProvidePacer(0.0, rng)
    assert not pacer.due(discovery.LOOKUP_GRACE_S - 1, short=True)
    assert pacer.due(discovery.LOOKUP_GRACE_S, short=True)  # short of candidates: it needs the DHT now
    assert not pacer.due(discovery.LOOKUP_GRACE_S, short=False)


def test_only_untried_candidates_count_against_a_lookup() -> None:
    """Candidates that failed (a full peer closed on us, an address that does not answer) may never connect:
    a node whose candidates all failed is short of them, and looks members up."""
    host = FakeHost(peers={peer(0): "127.0.0.1"})
    mgr = ConnManager(host, target=4)
    assert mgr.short_of_candidates()
    mgr.add_candidates([PeerInfo(peer(i), ADDR) for i in range(1, 4)], source="state")
    assert not mgr.short_of_candidates()  # 1 connected + 3 to dial: the target
    mgr.candidates[peer(3)].failures = 1
    assert mgr.short_of_candidates()
    host.peers.update({peer(i): "127.0.0.1" for i in range(1, 4)})
    assert not mgr.short_of_candidates()  # at the target


async def test_the_dht_does_not_walk_the_network_as_it_starts_only_at_its_periodic_refresh(
        autojump_clock: Any) -> None:
    """py-libp2p's DHT refreshed its routing table as soon as it ran (a closest-peer walk for its own id,
    asking the bootstrap node first): in a traced 64-daemon join 997 DHT streams, 82 without that walk, in
    the newcomers' first seconds, which this module keeps quiet. Its periodic refresh still runs."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.kad_dht.kad_dht import ROUTING_TABLE_REFRESH_INTERVAL

    from p2p.host import build_host

    host = build_host(create_new_key_pair())
    disc = SwarmDiscovery(host, ConnManager(host, target=8), "s")
    walks: list[float] = []

    async def walk(key: bytes) -> list[ID]:
        walks.append(trio.current_time())
        return []

    disc.dht.peer_routing.find_closest_peers_network = walk  # type: ignore[method-assign]
    start = trio.current_time()
    async with discovery.background_trio_service(disc.dht):
        await trio.sleep(ROUTING_TABLE_REFRESH_INTERVAL + 1)
    assert [t - start for t in walks] == [ROUTING_TABLE_REFRESH_INTERVAL]
