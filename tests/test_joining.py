"""How nodes that reach a full bootstrap node find the rest of the swarm (issue #24: 64 daemons on one
bootstrap node never learnt of each other).

- p2p/connmgr.py: a full node keeps a newcomer's connection through a grace period (time for the state
  session that hands it every member's record and address), then closes it, keeping its long-lived ones;
  at the host's connection limit the grace is cut short so that the next newcomer finds a free slot;
  a peer that closes a fresh connection is redialed after a back-off, not at the next tick; a member that
  has its target does not keep coming back to the bootstrap node; a node with no connection retries its
  bootstrap peers within seconds, py-libp2p's one-minute negative cache notwithstanding; a node whose every
  connection has delivered nothing for a while (a stalled first connection to a crowded bootstrap) closes
  them and dials again;
- p2p/discovery.py: what a DHT lookup found before its deadline reaches the connection manager; the DHT
  opens no connections beyond the target;
- node/daemon.py + node/swarm/replicator.py: suspect members' addresses are dialed too.

In-process, on fake hosts and clocks, but for two real py-libp2p hosts where the library's own behaviour is
the point (bench/scale.py measures the real daemons).
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
from p2p.connmgr import (
    BOOTSTRAP_REFRESH_S,
    CROWDED_GRACE_S,
    ISOLATED_RETRY_S,
    PRUNE_GRACE_S,
    SILENT_S,
    STABLE_S,
    TICK_S,
    ConnManager,
)
from p2p.discovery import DialRefused, SwarmDiscovery
from p2p.host import build_host
from protocols.hlc import Timestamp
from protocols.state import MANIFEST_MISMATCH, SyncRefused
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


async def test_a_full_node_closes_a_newcomer_it_has_served_without_waiting_out_the_grace() -> None:
    """At a 64-daemon join the bootstrap node and the first members every newcomer learnt of held 40 to 63
    connections through the 30 s grace, answered probes late and turned suspect in many views. Once this node
    has served the newcomer (a state session, or a referral) the newcomer has others to dial: over the cap,
    its connection goes at the next tick."""
    clock, host, mgr = _full_node()
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)
        clock.t += 600
        host.peers[peer(4)] = "198.51.4.7"  # one over the cap
        host.peers[peer(5)] = "198.51.5.7"  # and another, not served yet
        mgr._tick(nursery)
        await trio.sleep(0)
        assert not host.disconnected
        mgr.served(peer(4))
        clock.t += 1
        mgr._tick(nursery)
    assert host.disconnected == [peer(4)]  # served: no grace; peer(5) keeps its grace
    mgr.served(peer(9))  # not connected: nothing remembered
    assert peer(9) not in mgr._served


async def test_a_close_under_way_is_not_started_again_while_the_peer_is_being_told() -> None:
    """A close waits for ``on_closing`` (SWIM tells the peer; up to a second), and the manager ticks twice a
    second: each tick would close the same connection again, the second close ending it before the peer
    had been told, and counting it twice."""
    clock, host, mgr = _full_node()
    told: list[ID] = []
    answered = trio.Event()

    async def on_closing(peer_id: ID) -> None:
        told.append(peer_id)
        await answered.wait()

    mgr.on_closing = on_closing
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)
        clock.t += 600
        host.peers[peer(4)] = "198.51.4.7"
        mgr._tick(nursery)
        clock.t += PRUNE_GRACE_S
        for _ in range(4):
            mgr._tick(nursery)
            await trio.sleep(0.001)
            clock.t += 0.5
        assert told == [peer(4)] and host.disconnected == [] and mgr.status()["cap_pruned"] == 1
        answered.set()
    assert host.disconnected == [peer(4)]


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


def _newcomer(**options: Any) -> tuple[Clock, FakeHost, list[float], ConnManager, ID]:
    """A node that knows only its bootstrap peer (``peer(0)``), whose dials connect at once and are recorded
    (the fake clock's time of each); ``options`` go to its connection manager."""
    clock = Clock()
    host = FakeHost()
    dials: list[float] = []

    async def dial(info: PeerInfo) -> None:
        dials.append(clock.t)
        host.peers[info.peer_id] = "198.51.100.7"

    boot = peer(0)
    mgr = ConnManager(host, target=8, cap=32, clock=clock, dial=dial, ip_of=lambda p: host.peers.get(p), **options)
    mgr.add_candidate(PeerInfo(boot, ADDR), source="bootstrap", permanent=True)
    return clock, host, dials, mgr, boot


async def test_a_peer_that_closes_a_fresh_connection_is_redialed_after_a_growing_back_off() -> None:
    """The other side is full and closes us after its grace period: before, the candidate's failures were
    reset by the successful dial and it was redialed at the next tick (twice a second, forever)."""
    clock, host, dials, mgr, boot = _newcomer()
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
        self.routing_table = self
        self._providers = providers

    def get_routing_table_size(self) -> int:
        return 1

    def get_providers(self, key: bytes) -> list[PeerInfo]:
        return self._providers

    def find_local_closest_peers(self, key: bytes, count: int = 20) -> list[ID]:
        return [peer(9)]

    async def _get_providers_from_peer_with_closers(self, peer_id: ID, key: bytes) -> tuple[list[PeerInfo], list[ID]]:
        await trio.sleep_forever()
        return [], []


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
    # gossip membership: liveness from the records' age (in swim mode SWIM's probes decide it)
    cfg = load_config(tmp_path, overrides={"node.listen": ["/ip4/127.0.0.1/tcp/0"], "node.membership": "gossip"},
                      environ={})
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


# --- a bootstrap node at its connection limit (issue #24: 12 daemons at max_peers 2, 64 at the defaults) ---


async def test_at_the_host_limit_the_oldest_newcomer_past_a_short_grace_makes_room_for_the_next() -> None:
    """Cap 2, host limit 4: two long-lived connections and two newcomers fill the host, which then refuses
    every inbound connection before its handshake. Before, both newcomers held their slots for the full
    grace period while nine others were refused; now the older one goes after CROWDED_GRACE_S."""
    clock = Clock()
    host = FakeHost(peers={peer(i): f"198.51.{i}.7" for i in range(2)})
    mgr = ConnManager(host, target=2, cap=2, limit=4, clock=clock, ip_of=lambda p: host.peers.get(p))
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)
        clock.t += 600
        host.peers[peer(2)] = "198.51.2.7"
        mgr._tick(nursery)
        clock.t += 1
        host.peers[peer(3)] = "198.51.3.7"  # the host is now at its limit
        mgr._tick(nursery)
        clock.t += CROWDED_GRACE_S - 1  # peer 2 has had its short grace, peer 3 not yet
        mgr._tick(nursery)
    assert host.disconnected == [peer(2)]  # one slot free; the long-lived two and the newest stay


async def test_below_the_host_limit_a_newcomer_keeps_its_whole_grace_period() -> None:
    clock = Clock()
    host = FakeHost(peers={peer(i): f"198.51.{i}.7" for i in range(2)})
    mgr = ConnManager(host, target=2, cap=2, limit=4, clock=clock, ip_of=lambda p: host.peers.get(p))
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)
        clock.t += 600
        host.peers[peer(2)] = "198.51.2.7"  # three of four: a slot is free
        mgr._tick(nursery)
        clock.t += PRUNE_GRACE_S - 1
        mgr._tick(nursery)
        assert not host.disconnected
        clock.t += 1
        mgr._tick(nursery)
    assert host.disconnected == [peer(2)]


async def test_a_member_with_its_target_does_not_keep_coming_back_to_the_bootstrap_node() -> None:
    """Each return took one of the bootstrap node's slots for a grace period; with every member doing it,
    the bootstrap node was full whenever a newcomer, who knows no one else, tried. It is still redialed
    now and then (how the islands of a partition find each other again)."""
    clock = Clock()
    host = FakeHost(peers={peer(1): "198.51.1.7", peer(2): "198.51.2.7"})  # the target (2) met by members
    dials: list[ID] = []

    async def dial(info: PeerInfo) -> None:
        dials.append(info.peer_id)
        host.peers[info.peer_id] = "198.51.100.7"

    boot = peer(0)
    mgr = ConnManager(host, target=2, cap=4, clock=clock, dial=dial, ip_of=lambda p: host.peers.get(p))
    mgr.add_candidate(PeerInfo(boot, ADDR), source="bootstrap", permanent=True)
    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)  # a node that starts dials its bootstrap peer
        await trio.sleep(0.01)
        assert dials == [boot]
        mgr._tick(nursery)
        clock.t += PRUNE_GRACE_S + 1
        host.peers.pop(boot)  # the full bootstrap node closes it after its grace period
        for _ in range(20):  # ten minutes of ticks, short of the refresh
            clock.t += (BOOTSTRAP_REFRESH_S - PRUNE_GRACE_S - 2) / 20
            mgr._tick(nursery)
            await trio.sleep(0.001)
        assert dials == [boot]  # before: redialed after each back-off (1 s, 2 s, 4 s, ...)
        clock.t += 2
        mgr._tick(nursery)
        await trio.sleep(0.01)
    assert dials == [boot, boot]


async def test_a_node_with_its_target_does_not_look_at_every_members_addresses_each_tick(monkeypatch: Any) -> None:
    """Issue #24: every member is a candidate, and each tick (twice a second) parsed every unconnected
    candidate's addresses to find its network group, though a node with its target dials none of them:
    idle work that grew with the swarm. Below the target they are looked at (and dialled) as before."""
    from p2p import connmgr as connmgr_module

    parsed: list[int] = []
    real_group = connmgr_module.addr_group

    def counting(addrs: Any) -> str | None:
        parsed.append(1)
        return real_group(addrs)

    monkeypatch.setattr(connmgr_module, "addr_group", counting)
    host = FakeHost(peers={peer(1): "198.51.1.7", peer(2): "198.51.2.7"})  # the target (2) met
    dials: list[ID] = []

    async def dial(info: PeerInfo) -> None:
        dials.append(info.peer_id)

    mgr = ConnManager(host, target=2, cap=4, dial=dial, ip_of=lambda p: host.peers.get(p))
    mgr.add_candidates([PeerInfo(peer(i), ADDR) for i in range(3, 60)], source="state")
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            mgr._tick(nursery)
        assert parsed == [] and dials == []
        host.peers.pop(peer(2))  # below the target: candidates are looked at and one is dialled
        mgr._tick(nursery)
        await trio.sleep(0.01)
    assert parsed and len(dials) == 1


async def test_a_node_with_no_connection_retries_its_bootstrap_peer_within_seconds() -> None:
    """A stranded newcomer (it knows only the bootstrap node, which refused it) backed off to a minute; a
    refusal costs the full node a TCP accept and close. The same error is logged at WARNING once."""
    clock = Clock()
    host = FakeHost()

    async def refused(info: PeerInfo) -> None:
        await trio.lowlevel.checkpoint()
        raise ConnectionResetError("connection reset by peer")

    mgr = ConnManager(host, target=2, cap=2, clock=clock, dial=refused)
    mgr.add_candidate(PeerInfo(peer(0), ADDR), source="bootstrap", permanent=True)
    cand = mgr.candidates[peer(0)]
    for _ in range(10):
        await mgr._dial(cand)
        assert cand.next_attempt - clock.t <= ISOLATED_RETRY_S * 1.2
    assert cand.failures == 10
    host.peers[peer(1)] = "198.51.1.7"  # with a connection, the usual back-off applies
    await mgr._dial(cand)
    assert cand.next_attempt - clock.t > ISOLATED_RETRY_S * 1.2


async def ticks(mgr: ConnManager, clock: Clock, nursery: trio.Nursery, seconds: float) -> None:
    """Run the manager's loop for ``seconds`` of the fake clock, a tick every TICK_S as its loop does."""
    for _ in range(round(seconds / TICK_S)):
        clock.t += TICK_S
        mgr._tick(nursery)
        await trio.sleep(0.001)  # its dial and disconnect tasks run


async def test_a_newcomer_whose_only_connection_delivers_nothing_drops_it_and_redials() -> None:
    """At a 64-daemon join one newcomer per run sat 20-40 s on a first connection to the crowded bootstrap
    that delivered nothing (no ack, no session) until the bootstrap closed it for its cap; the redial then
    worked. Now, once every connection has been silent for SILENT_S (counted from the last message a
    protocol heard on it), the node closes it and dials again within seconds."""
    clock, host, dials, mgr, boot = _newcomer(silent_after=SILENT_S)
    async with trio.open_nursery() as nursery:
        await ticks(mgr, clock, nursery, 1)
        assert dials and boot in host.peers
        await ticks(mgr, clock, nursery, 5)
        mgr.heard_from(boot)  # the seed's first SWIM message: then nothing
        await ticks(mgr, clock, nursery, SILENT_S - 1)
        assert host.disconnected == []
        await ticks(mgr, clock, nursery, 1)
        assert host.disconnected == [boot] and mgr.status()["silent_closed"] == 1
        closed_at = clock.t
        while len(dials) < 2 and clock.t - closed_at < 60:
            await ticks(mgr, clock, nursery, TICK_S)
        assert len(dials) == 2 and dials[1] - closed_at <= ISOLATED_RETRY_S * 1.2 + TICK_S  # within seconds
        assert boot in host.peers
        # The new connection gets its own SILENT_S from its opening (seen at the next tick).
        await ticks(mgr, clock, nursery, SILENT_S - 1)
        assert host.disconnected == [boot]
        await ticks(mgr, clock, nursery, 1 + TICK_S)
        assert host.disconnected == [boot, boot]
        nursery.cancel_scope.cancel()


async def test_a_stranded_newcomer_whose_seed_answers_swim_but_gives_no_member_redials_it() -> None:
    """At a 64-daemon join nine newcomers held their one connection to the bootstrap node for 25-45 s with
    SWIM's long-lived streams working (so the connection delivered) and every new stream failing to open, so
    they learnt no member. A node whose connections are all SILENT_S old while it knows no member but itself
    closes them and dials again; once it knows one, it stays."""
    known = False
    clock, host, _, mgr, boot = _newcomer(silent_after=SILENT_S, stranded=lambda: not known)
    async with trio.open_nursery() as nursery:
        await ticks(mgr, clock, nursery, TICK_S)
        assert boot in host.peers
        connected_at = clock.t
        for _ in range(round(2 * SILENT_S)):
            mgr.heard_from(boot)  # SWIM keeps talking
            await ticks(mgr, clock, nursery, 1)
            if host.disconnected:
                break
        assert host.disconnected == [boot] and SILENT_S <= clock.t - connected_at <= SILENT_S + 2
        while boot not in host.peers:
            await ticks(mgr, clock, nursery, TICK_S)
        known = True  # its new connection's session gave it the members
        for _ in range(round(2 * SILENT_S)):
            mgr.heard_from(boot)
            await ticks(mgr, clock, nursery, 1)
        assert host.disconnected == [boot]
        nursery.cancel_scope.cancel()


def test_a_node_whose_only_peers_refused_it_as_incompatible_is_not_stranded(tmp_path: Path) -> None:
    """A node knowing no member, connected only to peers of another swarm or run, would be judged stranded
    and redial them every SILENT_S: each time a handshake and the same refused session. It is stranded only
    while some peer it holds is not known to be incompatible."""
    cfg = load_config(tmp_path, overrides={"node.listen": ["/ip4/127.0.0.1/tcp/0"]}, environ={})
    daemon = Daemon(cfg, tmp_path, create_new_key_pair(), train=False)
    other_run, same_run = (peer_id_of(create_new_key_pair().public_key) for _ in range(2))
    connected = [ID.from_base58(other_run)]
    daemon.connmgr.connected = lambda: connected  # type: ignore[method-assign]
    assert daemon._stranded()  # nothing known of it yet: a redial may get a working session
    daemon.replicator._refused(other_run, SyncRefused(MANIFEST_MISMATCH, local="aa", remote="bb"))
    assert not daemon._stranded()
    connected.append(ID.from_base58(same_run))  # one peer that may yet give members
    assert daemon._stranded()


async def test_a_silent_connection_beside_one_that_delivers_is_kept_and_a_late_tick_judges_nothing() -> None:
    """Only a node none of whose connections delivers is stranded; and after a tick that ran late (this
    node's own loop starved) what its peers sent may still be unread, so silence is not judged then."""
    clock = Clock()
    host = FakeHost(peers={peer(1): "198.51.1.7", peer(2): "198.51.2.7"})
    mgr = ConnManager(host, target=2, cap=4, clock=clock, ip_of=lambda p: host.peers.get(p), silent_after=SILENT_S)
    async with trio.open_nursery() as nursery:
        for _ in range(3 * round(SILENT_S)):
            mgr.heard_from(peer(2))  # peer(1) is silent throughout
            await ticks(mgr, clock, nursery, 1)
        assert host.disconnected == []
        clock.t += 3 * SILENT_S  # the loop starved: nothing heard meanwhile, nothing read yet
        mgr._tick(nursery)
        await trio.sleep(0.001)
        assert host.disconnected == []
        await ticks(mgr, clock, nursery, TICK_S)  # on time again, and still nothing from either: both go
        assert sorted(host.disconnected, key=str) == [peer(1), peer(2)]
        nursery.cancel_scope.cancel()


def test_a_repeated_bootstrap_dial_error_is_logged_at_warning_once(caplog: Any) -> None:
    async def main() -> None:
        async def refused(info: PeerInfo) -> None:
            await trio.lowlevel.checkpoint()
            raise ConnectionResetError("connection reset by peer")

        mgr = ConnManager(FakeHost(), dial=refused)
        mgr.add_candidate(PeerInfo(peer(0), ADDR), source="bootstrap", permanent=True)
        for _ in range(3):
            await mgr._dial(mgr.candidates[peer(0)])

    with caplog.at_level("INFO", logger="starling.connmgr"):
        trio.run(main)
    levels = [r.levelname for r in caplog.records if "cannot reach" in r.getMessage()]
    assert levels == ["WARNING", "INFO", "INFO"]


async def test_a_bootstrap_peer_refused_once_is_redialed_despite_py_libp2ps_negative_cache() -> None:
    """py-libp2p refuses for 60 s to dial a peer whose addresses all failed once; a newcomer refused by a
    full bootstrap node could not retry for a minute, whatever the connection manager's back-off said
    (every retry failed at once with "negative cache"). Two real hosts on loopback."""
    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    async with a.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]), b.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        a.get_network()._negative_peer_cache.mark_failed(str(b.get_id()))  # what the refused dial left
        mgr = ConnManager(a, target=2, cap=2, dial_timeout=10)
        mgr.add_candidate(PeerInfo(b.get_id(), b.get_addrs()), source="bootstrap", permanent=True)
        await mgr._dial(mgr.candidates[b.get_id()])
        assert mgr.candidates[b.get_id()].last_error == ""
        assert b.get_id() in a.get_connected_peers()


# --- the DHT opens no connections beyond the target ------------------------------------------------------


async def test_the_dht_dials_no_new_connection_once_the_node_has_its_target() -> None:
    """DHT queries open a stream to each peer they ask, and py-libp2p dials one it is not connected to:
    with 8 daemons at max_peers 2 most connections were the DHT's redials of peers the connection manager
    had just closed for the cap, each with a fresh grace period, and every node stayed at its host limit."""
    real = build_host(create_new_key_pair())
    opened: list[ID] = []

    async def new_stream(peer_id: ID, protocols: Any) -> Any:
        opened.append(peer_id)
        return object()

    real.new_stream = new_stream  # type: ignore[method-assign]
    fake = FakeHost(peers={peer(1): "198.51.1.7"})
    real.get_connected_peers = fake.get_connected_peers  # type: ignore[method-assign]
    mgr = ConnManager(fake, target=2, cap=4)
    disc = SwarmDiscovery(real, mgr, "s")
    parts = [disc.dht.peer_routing, disc.dht.provider_store, disc.dht.value_store, disc.dht.routing_table]
    for part in parts:
        await part.host.new_stream(peer(7), ["/ipfs/kad/1.0.0"])  # below the target: dialled
    assert opened == [peer(7)] * 4
    fake.peers[peer(2)] = "198.51.2.7"  # the target met
    for part in parts:
        try:
            await part.host.new_stream(peer(8), ["/ipfs/kad/1.0.0"])
        except DialRefused:
            continue
        raise AssertionError(f"{type(part).__name__} dialled a new peer at the target")
    await disc.dht.provider_store.host.new_stream(peer(1), ["/ipfs/kad/1.0.0"])  # connected: fine
    assert opened == [peer(7)] * 4 + [peer(1)]
    assert disc.status()["dials_withheld"] == 4


async def test_a_connections_network_group_is_read_once_not_on_every_tick() -> None:
    """Reading every connection's address twice a second was most of an idle connection manager's CPU
    (bench/scale.py --profile, issue #24). A connection that closes and comes back is read again."""
    reads: list[ID] = []
    host = FakeHost(peers={peer(i): f"198.51.{i}.7" for i in range(1, 5)})

    def ip_of(p: ID) -> str | None:
        reads.append(p)
        return host.peers.get(p)

    mgr = ConnManager(host, target=4, cap=8, ip_of=ip_of)
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            mgr._tick(nursery)
        assert sorted(map(str, reads)) == sorted(str(peer(i)) for i in range(1, 5))
        host.peers.pop(peer(1))
        mgr._tick(nursery)
        host.peers[peer(1)] = "203.0.113.7"  # back, from elsewhere
        mgr._tick(nursery)
        mgr._tick(nursery)
    assert reads.count(peer(1)) == 2


async def test_swims_redial_dials_a_member_at_once_whatever_its_back_off_and_says_if_it_is_connected() -> None:
    """SWIM asks the connection manager to dial a member whose connection ended under it before it takes the
    drop for news (node/swarm/swim_service.py): now, not after the back-off a fresh connection's close earns;
    True only when connected after; False at once for a peer it has no address of."""
    clock, host, dials, mgr, boot = _newcomer()
    mgr.candidates[boot].next_attempt = clock.t + 600  # backing off after a close
    assert await mgr.redial(boot) is True
    assert dials == [clock.t] and boot in host.peers and mgr.candidates[boot].next_attempt == 0.0
    assert await mgr.redial(peer(7)) is False  # no candidate, no address
    host.peers.pop(boot)

    async def refused(info: PeerInfo) -> None:
        raise OSError("connection refused")

    mgr.dial = refused
    assert await mgr.redial(boot) is False and mgr.candidates[boot].failures == 1


async def test_swims_redial_of_a_peer_being_dialled_already_waits_for_that_dial_instead_of_saying_no() -> None:
    """At a 64-daemon join a newcomer's connection to the bootstrap node ended and its manager dialled it
    again at once; SWIM's redial found the peer being dialled and said False at once, so the newcomer probed
    the bootstrap node through its one helper and turned it suspect. The dial under way is the answer."""
    clock, host, dials, mgr, boot = _newcomer()
    go = trio.Event()

    async def slow_dial(info: PeerInfo) -> None:
        dials.append(clock.t)
        await go.wait()
        host.peers[info.peer_id] = "198.51.100.7"

    mgr.dial = slow_dial
    answers: list[bool] = []

    async def redial() -> None:
        answers.append(await mgr.redial(boot))

    async with trio.open_nursery() as nursery:
        mgr._tick(nursery)  # the manager dials its bootstrap peer (no connection)
        await trio.sleep(0.01)
        assert boot in mgr._dialing and len(dials) == 1
        nursery.start_soon(redial)
        await trio.sleep(0.01)
        assert answers == [] and len(dials) == 1  # waiting, not dialling twice
        go.set()
    assert answers == [True] and not mgr._dial_ended
