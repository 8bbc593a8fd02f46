"""SWIM membership wired into the daemon (issue #24): ``node.membership = "swim"``.

The service tests run 3-4 real libp2p hosts on 127.0.0.1 in one trio loop, each with its own
:class:`node.swarm.swim_service.SwimService` (what the daemon runs in SWIM mode), with a faster protocol period
than the default so that a death is decided in seconds. The replicator tests check what SWIM mode changes
there: member states from SWIM, and the member record re-signed only when it changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from node.config.load import NodeConfig
from node.swarm.crdt import MemberState, SwarmState, peer_id_of
from node.swarm.membership import MembershipConfig
from node.swarm.replicator import ReplicationTiming, StateReplicator
from node.swarm.swim_service import PROTOCOL_ID, REDIAL_S, SwimService
from p2p.connmgr import ConnManager
from p2p.host import build_host
from p2p.wire import LibP2PByteStream, PlainFrameChannel
from starling_testing.liveness import CallableLiveness

# Half-second periods: a dead member is suspect within probe_timeout_s of its connection closing, and gone
# within the suspicion timeout after that, at most suspicion_max_mult x suspicion_mult x period_s = 12 s.
# Push-pull every 5 s (30 s by default): a node not connected to a member learns of it from gossip, whose
# few retransmissions can all go elsewhere at N = 4 (CI, once: a node still held a member unknown after
# 20 s); the push-pull is the protocol's bound on that, so it is scaled down with the rest.
FAST = MembershipConfig(period_s=0.5, ack_timeout_s=0.4, probe_timeout_s=1.5, pushpull_s=5.0)
# The connection poll, then the probe's deadlines: the direct one stretched (up to max_answer_wait_s) where
# answers came slowly, as they may on a loaded machine, then the indirect stage.
SUSPECT_BOUND_S = 0.5 + FAST.max_answer_wait_s + FAST.probe_timeout_s - FAST.ack_timeout_s
GONE_BOUND_S = FAST.suspicion_max_mult * FAST.suspicion_mult * FAST.period_s
SLACK_S = 10.0  # a loaded 2-core machine: the bounds are the protocol's, the slack is the event loop's


async def eventually(predicate: Callable[[], bool], what: str, *, timeout: float,
                     detail: Callable[[], object] = lambda: "") -> None:
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.05)
        return
    pytest.fail(f"not within {timeout:.0f}s: {what} {detail()}")


@dataclass
class Node:
    host: Any
    swim: SwimService
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    @property
    def name(self) -> str:
        return self.host.get_id().to_base58()


class Swarm:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.nodes: list[Node] = []

    async def add(self) -> Node:
        key = create_new_key_pair()
        host = build_host(key)
        node = Node(host, SwimService(host, key, config=FAST))

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with node.scope:
                async with host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                    await node.swim.run(task_status=task_status)

        await self.nursery.start(run)
        self.nodes.append(node)
        return node

    async def connect(self, *pairs: tuple[Node, Node]) -> None:
        async def one(a: Node, b: Node) -> None:
            await a.host.connect(info_from_p2p_addr(b.host.get_addrs()[0]))

        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                for a, b in pairs:
                    nursery.start_soon(one, a, b)


@asynccontextmanager
async def swarm() -> AsyncIterator[Swarm]:
    async with trio.open_nursery() as nursery:
        yield Swarm(nursery)
        nursery.cancel_scope.cancel()


def sees(a: Node, b: Node, state: MemberState) -> bool:
    return a.swim.member_state(b.name) is state


async def test_swim_daemons_see_each_other_alive_and_a_killed_one_turns_suspect_then_gone() -> None:
    async with swarm() as s:
        n0, n1, n2, n3 = [await s.add() for _ in range(4)]
        # n2 is not connected to n3: it learns of n3, and of its death, from the others' piggy-backed news.
        await s.connect((n1, n0), (n2, n0), (n3, n0), (n3, n1))
        nodes = [n0, n1, n2, n3]
        await eventually(lambda: all(sees(a, b, MemberState.ALIVE) for a in nodes for b in nodes if a is not b),
                         "every node holds every other alive", timeout=20,
                         detail=lambda: [([a.swim.state_name(b.name) for b in nodes], dict(a.swim.counters))
                                         for a in nodes])
        n3.scope.cancel()  # the daemon dies: its host closes, its connections with it
        survivors = [n0, n1, n2]
        await eventually(lambda: all(not sees(a, n3, MemberState.ALIVE) for a in survivors),
                         "the killed node no longer shown alive", timeout=SUSPECT_BOUND_S + SLACK_S)
        assert any(a.swim.counters["became_suspect"] for a in survivors)  # suspect first, not dead at once
        await eventually(lambda: all(sees(a, n3, MemberState.GONE) for a in survivors),
                         "the killed node gone everywhere", timeout=GONE_BOUND_S + SLACK_S)
        # Nobody mistook a live member for a dead one meanwhile.
        assert all(sees(a, b, MemberState.ALIVE) for a in survivors for b in survivors if a is not b)
        assert n2.swim.counters["disconnect_probes"] == 0  # it never was connected to n3


async def test_a_garbage_frame_drops_the_stream_not_the_service() -> None:
    async with swarm() as s:
        a, b = await s.add(), await s.add()
        await s.connect((b, a))
        await eventually(lambda: sees(a, b, MemberState.ALIVE) and sees(b, a, MemberState.ALIVE),
                         "a and b hold each other alive", timeout=15)
        rogue = build_host(create_new_key_pair())
        async with rogue.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with trio.fail_after(15):
                await rogue.connect(info_from_p2p_addr(a.host.get_addrs()[0]))
                stream = await rogue.new_stream(a.host.get_id(), [PROTOCOL_ID])
                channel = PlainFrameChannel(LibP2PByteStream(stream))
                await channel.send(b"\xc1 not msgpack at all")
                await eventually(lambda: a.swim.counters["garbage"] == 1, "the garbage noticed", timeout=10)
                # The stream is dropped: the rogue's writes fail or its read ends (reset or closed). A stream
                # left open would keep taking frames and never end the read: `dropped` stays False.
                dropped = False
                with trio.move_on_after(10):
                    try:
                        for _ in range(20):
                            await channel.send(b"more")
                            await trio.sleep(0.05)
                        await channel.recv()
                    except Exception:  # noqa: BLE001  (our ProtocolError, or libp2p's own for a reset stream)
                        pass
                    dropped = True
                assert dropped
                # And its new streams are refused for a while (or fail to open at all): no second garbage read.
                try:
                    again = await rogue.new_stream(a.host.get_id(), [PROTOCOL_ID])
                    await PlainFrameChannel(LibP2PByteStream(again)).send(b"\xc1")
                except Exception:  # noqa: S110  (libp2p's errors for a refused stream)
                    pass
                await trio.sleep(0.5)
                assert a.swim.counters["garbage"] == 1
        # The service goes on: b's probes are still answered, a and b still hold each other alive.
        received = a.swim.counters["received"]
        await eventually(lambda: a.swim.counters["received"] > received + 2, "a keeps receiving", timeout=10)
        assert sees(a, b, MemberState.ALIVE) and sees(b, a, MemberState.ALIVE)
        assert a.swim.member_state(rogue.get_id().to_base58()) is MemberState.GONE


async def test_a_member_is_probed_only_once_both_of_its_streams_are_up() -> None:
    """At a join every node opens streams to several new peers at once, and on a busy machine negotiating
    one takes seconds: a ping (or its ack) waiting for a stream that is not up yet turned a live member
    suspect (4-6 members at 16 daemons). Here ``c`` accepts a's stream but has not opened its own to a (the
    path of its acks): a holds it as a member and does not probe it, while it goes on probing b."""
    async with swarm() as s:
        a, b = await s.add(), await s.add()
        await s.connect((b, a))
        c = build_host(create_new_key_pair())

        async def swallow(stream: Any) -> None:  # reads what a sends, never answers (its stream to a: not yet)
            with trio.move_on_after(60):
                while await stream.read(65536):
                    pass

        c.set_stream_handler(PROTOCOL_ID, swallow)
        async with c.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with trio.fail_after(15):  # a dials: it opens its stream at once (c has opened none)
                await a.host.connect(info_from_p2p_addr(c.get_addrs()[0]))
            await eventually(lambda: a.swim.state_name(c.get_id().to_base58()) == "alive", "a holds c", timeout=15)
            acks = a.swim.core.counters["acks"]
            await eventually(lambda: a.swim.core.counters["acks"] >= acks + 6, "a probes b six more times",
                             timeout=30)
            assert a.swim.state_name(c.get_id().to_base58()) == "alive"
            assert a.swim.core.counters["suspected"] == 0 and a.swim.core.counters["probes"] == a.swim.core.counters["acks"]


async def test_a_peer_that_dialled_opens_the_first_swim_stream_and_a_dial_back_prober_gets_none() -> None:
    """A reachability check has a helper dial back from a throwaway host that speaks dial-back alone
    (protocols/dialback.py): the node it dials opens no SWIM stream to it (one could only fail; at a 64-daemon
    join most of SWIM's 150-470 failed opens were these). A member that dials opens its own stream at once, and
    the node it dialled answers with its own once that one arrives: both hold each other alive."""
    async with swarm() as s:
        a = await s.add()
        prober = build_host(create_new_key_pair())
        async with prober.run([]):
            with trio.fail_after(15):
                await prober.connect(info_from_p2p_addr(a.host.get_addrs()[0]))
            for _ in range(6):  # three of the service's polls of the connected set
                await trio.sleep(0.25)
            assert prober.get_id() in a.host.get_connected_peers()
            assert a.swim.counters["open_failed"] == 0 and prober.get_id() not in a.swim._outboxes
        b = await s.add()
        await s.connect((b, a))  # b dialled a
        await eventually(lambda: sees(a, b, MemberState.ALIVE) and sees(b, a, MemberState.ALIVE), "both alive",
                         timeout=15)
        assert a.swim.counters["open_failed"] == b.swim.counters["open_failed"] == 0


async def test_a_connection_this_node_closed_is_no_news_and_the_other_side_with_nobody_to_ask_suspects_nobody(
        ) -> None:
    async with swarm() as s:
        # Both SWIM streams up both ways first: a drop before they are up is no news to b either (see below).
        a, b, _, _ = await _two_ready(s)
        await eventually(lambda: sees(a, b, MemberState.ALIVE) and sees(b, a, MemberState.ALIVE),
                         "a and b hold each other alive", timeout=15)
        # a's connection manager closes the connection for its cap (Daemon wires connmgr.on_closing to this).
        a.swim.closing(b.host.get_id())
        await a.host.disconnect(b.host.get_id())
        # a: not news, no probe. b: the connection dropped, so it probes a; with no connection to a and no other
        # member to ask, nobody could answer either way: no evidence, no suspicion.
        await eventually(lambda: a.swim.counters["closed_here"] == 1 and b.swim.core.counters["no_evidence"] == 1,
                         "a noted its own close, b's probe ended", timeout=SUSPECT_BOUND_S + SLACK_S,
                         detail=lambda: (dict(a.swim.counters), dict(b.swim.counters), dict(b.swim.core.counters)))
        assert a.swim.counters["disconnect_probes"] == 0 and b.swim.counters["disconnect_probes"] == 1
        assert a.swim.core.counters["suspected"] == b.swim.core.counters["suspected"] == 0
        assert sees(a, b, MemberState.ALIVE) and sees(b, a, MemberState.ALIVE)


async def _two_ready(s: Swarm) -> tuple[Node, Node, Any, Any]:
    """Two nodes of ``s``, b connected to a, once both SWIM streams are up both ways: (a, b, a's ID, b's ID)."""
    a, b = await s.add(), await s.add()
    await s.connect((b, a))
    a_id, b_id = a.host.get_id(), b.host.get_id()
    await eventually(lambda: b_id in a.swim._ready and a_id in b.swim._ready, "both streams up both ways",
                     timeout=15)
    return a, b, a_id, b_id


async def test_a_peer_told_of_a_close_for_the_cap_does_not_probe_the_node_that_closed_it() -> None:
    """The other side of a close for the cap: b, whose connection a closes, took the drop for news and probed
    a at once, with no direct path and helpers not connected to a, and turned a suspect (at a 64-daemon join,
    40 of 50 such probes were of the bootstrap node). a's connection manager now tells b first (a closing
    notice, answered) and b takes the drop as a close, not news."""
    async with swarm() as s:
        a, b, a_id, b_id = await _two_ready(s)
        mgr = ConnManager(a.host, on_closing=a.swim.tell_closing)  # as node/daemon.py wires it
        await mgr._disconnect(b_id)  # what _prune starts for a connection over the cap
        assert a.swim.counters["closing_notices_sent"] == 1 and b.swim.counters["closing_notices_received"] == 1
        await eventually(lambda: b.swim.counters["closed_here"] + b.swim.counters["disconnect_probes"] >= 1,
                         "b saw the connection drop", timeout=SLACK_S)
        assert b.swim.counters["closed_here"] == 1 and b.swim.counters["disconnect_probes"] == 0
        assert a.swim.counters["disconnect_probes"] == 0 and a.swim.counters["closing_notices_received"] == 0
        assert sees(a, b, MemberState.ALIVE) and sees(b, a, MemberState.ALIVE)


async def test_a_node_that_has_not_taken_in_the_peers_stream_yet_still_tells_it_of_a_close_for_the_cap() -> None:
    """At a 64-daemon join the starved bootstrap node closed newcomers for its cap before it had taken in
    their SWIM streams to it (not "ready" on its side, though up on theirs) and told none of them: each took
    the drop for news and probed it, through helpers it answered too late, and turned it suspect. Our own
    stream to the peer is all a notice needs."""
    async with swarm() as s:
        a, b, a_id, b_id = await _two_ready(s)
        a.swim._ready.discard(b_id)  # as if a had not read b's stream yet (its own to b is up)
        mgr = ConnManager(a.host, on_closing=a.swim.tell_closing)  # as node/daemon.py wires it
        await mgr._disconnect(b_id)
        assert a.swim.counters["closing_notices_sent"] == 1
        await eventually(lambda: b.swim.counters["closed_here"] + b.swim.counters["disconnect_probes"] >= 1,
                         "b saw the connection drop", timeout=SLACK_S)
        assert b.swim.counters["closed_here"] == 1 and b.swim.counters["disconnect_probes"] == 0
        assert b.swim.core.counters["suspected"] == 0 and sees(b, a, MemberState.ALIVE)


async def test_a_peer_that_reads_the_closing_notice_late_still_takes_the_close_as_no_news() -> None:
    """A closing notice read late: b's event loop reads a's notice 2.5 s after it was sent (at a 64-daemon join
    the starved bootstrap node answered 1.3 s after). a's close waits for b's notice back, so the connection
    drops only once b has read a's: b takes the drop as a's close and probes nobody. With a wait of 1 s, a
    closed first, b lost the notice with the connection, probed a as news through helpers not connected to it,
    and turned a live member suspect after the join."""
    async with swarm() as s:
        a, b, a_id, b_id = await _two_ready(s)
        read_notice = b.swim._noticed

        def read_late(peer: Any, now: float) -> None:  # b's loop gets to the notice 2.5 s after it arrived
            async def later() -> None:
                await trio.sleep(2.5)
                read_notice(peer, trio.current_time())
            s.nursery.start_soon(later)

        b.swim._noticed = read_late  # type: ignore[method-assign]
        mgr = ConnManager(a.host, on_closing=a.swim.tell_closing)  # as node/daemon.py wires it
        await mgr._disconnect(b_id)  # what _prune starts for a connection over the cap (it waits for b's notice back)
        await eventually(lambda: b.swim.counters["closed_here"] + b.swim.counters["disconnect_probes"] >= 1,
                         "b saw the connection drop", timeout=SLACK_S)
        assert b.swim.counters["closed_here"] == 1 and b.swim.counters["disconnect_probes"] == 0
        assert b.swim.core.counters["probes_abandoned"] + b.swim.core.counters["suspected"] == 0


async def test_a_dropped_connection_whose_swim_streams_never_came_up_is_no_news_of_the_member() -> None:
    """A member b dials a and gives up before the connection's SWIM streams are up (at a 64-daemon join,
    py-libp2p's dial cancelled mid-handshake after a had registered the connection). a had no path to b on it,
    so its drop says nothing of b: a probes nobody (it probed b at once, through helpers not connected to b,
    and turned a live member suspect after the join). b here runs no SWIM service, so its streams never come
    up; a holds b alive, as it would from gossip."""
    async with swarm() as s:
        a = await s.add()
        b_key = create_new_key_pair()
        b_host = build_host(b_key)
        async with b_host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            b_id = b_host.get_id()
            pid = a.swim._intern(b_id)
            assert pid is not None
            a.swim.core.preload([pid], trio.current_time())
            await b_host.connect(info_from_p2p_addr(a.host.get_addrs()[0]))
            await eventually(lambda: b_id in a.swim._connected, "a saw b's connection", timeout=SLACK_S)
            assert b_id not in a.swim._ready
            await b_host.disconnect(a.host.get_id())
            await eventually(lambda: b_id not in a.swim._connected, "a saw the connection drop", timeout=SLACK_S)
        assert a.swim.counters["unready_drops"] == 1 and a.swim.counters["disconnect_probes"] == 0
        assert a.swim.core.counters["probes"] == 0 and a.swim.core.counters["suspected"] == 0
        assert a.swim.state_name(b_id.to_base58()) == "alive"


def test_names_of_forgotten_dead_members_are_reclaimed_so_churn_beyond_the_cap_still_lets_members_join() -> None:
    """The service interns at most ``max_members`` peer names; each member that dies is reaped after
    ``dead_retention_s`` and its name (and id) given back. Ten rounds of churn through a cap of 16 names:
    every newcomer is still taken in, and an id reused does not carry its last owner's progress or signature."""
    from libp2p.peer.id import ID

    from node.swarm.membership import ALIVE, DEAD, Dead, Ping, Progress

    key = create_new_key_pair()
    service = SwimService(build_host(key), key, config=MembershipConfig(dead_retention_s=60.0), max_members=16)
    core, now = service.core, 0.0
    used: set[int] = set()
    for round_ in range(10):
        newcomers = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(8)]
        pids = [service._intern(peer) for peer in newcomers]
        assert None not in pids, f"round {round_}: the registry is full ({len(service._ids)} names)"
        ids = [pid for pid in pids if pid is not None]
        used.update(ids)
        core.preload(ids, now)
        for pid in ids:
            assert core.progress_of(pid) is None  # nothing of an earlier owner of the id
            core.receive(now, Ping(pid, 1, core.me, (Progress(pid, 1, round_, 1.0, 1.0),)))
            service._sigs[(4, pid, 1, round_, 1.0, 1.0)] = b"sig"
        assert all(service.member_state(p.to_base58()) is MemberState.ALIVE for p in newcomers)
        for pid in ids:  # each leaves: its own dead claim
            core.receive(now + 1, Ping(pid, 2, core.me, (Dead(pid, 0, pid),)))
            assert core.state_of(pid) == DEAD
        now += 100.0  # past dead_retention_s: reaped by the next tick, reclaimed after it
        core.tick(now)
        assert service.reclaim(now) == 8
        assert all(service.member_state(p.to_base58()) is MemberState.GONE for p in newcomers)
        assert not any(k[1] in ids for k in service._sigs)
    assert max(used) < 16 and len(service._ids) == 1 and core.state_of(core.me) == ALIVE  # ids reused


def _service_with_one_connected_member() -> tuple[SwimService, list[tuple[int, Any]], Any, int]:
    """A SWIM service (never run) whose sends are recorded, holding one member alive that it may send to:
    (service, sends, that member's peer ID, its id)."""
    from libp2p.peer.id import ID

    key = create_new_key_pair()
    service = SwimService(build_host(key), key)
    sent: list[tuple[int, Any]] = []
    service._dispatch = sent.extend  # type: ignore[method-assign]
    helper = ID.from_pubkey(create_new_key_pair().public_key)
    helper_id = service._intern(helper)
    assert helper_id is not None
    service.core.preload([helper_id], trio.current_time())
    service.core.can_probe = lambda pid: pid == helper_id
    return service, sent, helper, helper_id


async def test_members_never_heard_of_or_held_dead_are_looked_up_a_few_at_a_time_with_a_wait_that_doubles() -> None:
    """The daemon hands the service every member its swarm state holds whom SWIM shows gone; the service asks a
    member it may send to about those it never heard of or holds dead, at most LOOKUPS_PER_CALL a call, and
    the same one again only after a wait that doubles each time (2.5 s, 5 s, ... up to 5 min): a member that
    crashed long ago, whose record stays, is not asked about forever every 5 s."""
    from libp2p.peer.id import ID

    from node.swarm.membership import Dead, Ping, SyncRequest
    from node.swarm.swim_service import LOOKUP_WAIT_S, LOOKUPS_PER_CALL

    service, sent, helper, helper_id = _service_with_one_connected_member()
    now = trio.current_time()
    strangers = [ID.from_pubkey(create_new_key_pair().public_key).to_base58() for _ in range(LOOKUPS_PER_CALL + 1)]
    names = [*strangers, helper.to_base58()]
    service._catch_up_at = math.inf  # (no pull of the whole table instead: see the next test)
    assert service.look_up(names) == LOOKUPS_PER_CALL  # the helper, held alive, is not asked about
    assert service.look_up(names) == 1 and service.look_up(names) == 0  # the rest wait
    assert all(dst == helper_id and isinstance(m, SyncRequest) for dst, m in sent)
    # One of them turns out dead (a claim by the helper): still asked about, once its wait is over, after twice as long.
    dead = service._by_name[strangers[0]]
    service.core.preload([dead], now)
    service.core.receive(now, Ping(helper_id, 1, service.core.me, (Dead(dead, 0, helper_id),)))
    service._lookups = {name: (now - 1.0, wait) for name, (_, wait) in service._lookups.items()}
    assert service.look_up([strangers[0]]) == 1 and sent[-1][1].entries == (Dead(dead, 0, service.core.me),)
    assert service._lookups == {strangers[0]: (pytest.approx(trio.current_time() + 2 * LOOKUP_WAIT_S[0]), 2 * LOOKUP_WAIT_S[0])}


async def test_more_members_never_heard_of_than_one_call_looks_up_pull_the_table_again_instead() -> None:
    """A joiner that joined on its seed's partial table held 28 members unknown, looked up 8 every 5 s: when
    more are due than one call asks about, one page request for the whole table goes to a member it may
    send to (``Membership.catch_up``), those members wait as if looked up, and no second pull follows
    within ``CATCH_UP_S``."""
    from libp2p.peer.id import ID

    from node.swarm.membership import SyncReply, SyncRequest
    from node.swarm.swim_service import LOOKUPS_PER_CALL

    service, sent, _, helper_id = _service_with_one_connected_member()
    strangers = [ID.from_pubkey(create_new_key_pair().public_key).to_base58() for _ in range(3 * LOOKUPS_PER_CALL)]
    assert service.look_up(strangers) == 1
    (dst, request), = sent
    assert dst == helper_id and isinstance(request, SyncRequest) and request.cursor == 0
    assert service.core.counters["catch_ups"] == 1 and set(service._lookups) == set(strangers)
    assert service.look_up(strangers) == 0  # (while the pull is under way, they wait for it)
    service.core.receive(trio.current_time(), SyncReply(helper_id, request.seq, -1))  # the pull's last page
    assert service.core.counters["caught_up"] == 1 and not service.core.pulling
    service._lookups = {}  # (their waits over) but within CATCH_UP_S: looked up one by one again
    assert service.look_up(strangers) == LOOKUPS_PER_CALL and service.core.counters["catch_ups"] == 1


async def test_members_never_heard_of_wait_for_the_pull_of_the_table_under_way_instead_of_being_looked_up() -> None:
    """A joiner whose pull of its seed's table is under way (its seed answering "busy", at a 64-daemon join)
    looked up the members its swarm state held and SWIM had not heard of yet, 8 at a time, nearly all from
    its seed: 350 requests on the starved seed. Now they wait for the pull, which brings them; once it ends,
    those still unknown are looked up as before."""
    from libp2p.peer.id import ID

    from node.swarm.membership import SyncReply

    service, sent, _, helper_id = _service_with_one_connected_member()
    now = trio.current_time()
    strangers = [ID.from_pubkey(create_new_key_pair().public_key).to_base58() for _ in range(3)]
    join_request = service.core.join(helper_id, now)  # (the seed: the member it may send to)
    assert join_request and service.core.pulling
    assert service.look_up(strangers) == 0 and sent == [] and service._lookups == {}
    busy = SyncReply(helper_id, service.core._join_seq, 0, busy=True)
    service.core.receive(now, busy)
    assert service.core.pulling and service.look_up(strangers) == 0  # "busy": the pull goes on, later
    service.core.receive(now, SyncReply(helper_id, service.core._join_seq, -1))  # the table's last page
    assert not service.core.pulling and service.core.counters["joined"] == 1
    assert service.look_up(strangers) == 3 and len(sent) == 3


async def test_the_status_keeps_the_members_last_turned_suspect_here_even_once_refuted() -> None:
    """A suspicion raised and refuted between two status reads used to leave no trace in the status (the 64-daemon
    benchmark's polls missed every suspicion after the join). ``recent_suspects`` keeps the members last turned
    suspect here (whoever accused them), with when, at most RECENT_SUSPECTS of them, the latest;
    ``suspects_seen`` counts them all."""
    from libp2p.peer.id import ID

    from node.swarm.membership import Alive, Ping, Suspect
    from node.swarm.swim_service import RECENT_SUSPECTS

    service, _, helper, helper_id = _service_with_one_connected_member()
    core, now, before = service.core, trio.current_time(), time.time()
    core.receive(now, Ping(helper_id, 1, core.me, (Suspect(helper_id, 0, helper_id),)))
    core.receive(now, Ping(helper_id, 2, core.me, (Alive(helper_id, 1),)))  # refuted
    status = service.status()
    assert service.member_state(helper.to_base58()) is MemberState.ALIVE
    assert list(status["recent_suspects"]) == [helper.to_base58()] and status["recent_suspects"][helper.to_base58()] >= before
    assert status["suspects_seen"] == 1
    others = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(RECENT_SUSPECTS + 4)]
    for peer in others:
        pid = service._intern(peer)
        assert pid is not None
        core.preload([pid], now)
        core.receive(now, Ping(helper_id, 3, core.me, (Suspect(pid, 0, helper_id),)))
    status = service.status()
    assert list(status["recent_suspects"]) == [p.to_base58() for p in others[-RECENT_SUSPECTS:]]
    assert status["suspects_seen"] == 1 + len(others)


def test_a_full_registry_forgets_the_members_dead_longest_early() -> None:
    from libp2p.peer.id import ID

    from node.swarm.membership import Dead, Ping

    key = create_new_key_pair()
    service = SwimService(build_host(key), key, max_members=16)  # dead_retention_s: 600 s by default
    core = service.core
    peers = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(15)]
    pids = [service._intern(p) for p in peers]
    core.preload([p for p in pids if p is not None], 0.0)
    for t, pid in enumerate(pids):
        core.receive(float(t), Ping(pid, 1, core.me, (Dead(pid, 0, pid),)))  # type: ignore[arg-type]
    assert service._intern(ID.from_pubkey(create_new_key_pair().public_key)) is None  # full: 16 names
    service.reclaim(20.0)  # far within the retention time, but the registry is over 7/8 full
    assert len(service._ids) < 14
    assert peers[0].to_base58() not in service._by_name  # dead longest: forgotten
    assert service.state_name(peers[-1].to_base58()) == "dead"  # dead last: still held (stale claims stay out)
    assert service._intern(ID.from_pubkey(create_new_key_pair().public_key)) is not None


# ---------------------------------------------------------------------------------------------------
# The replicator in SWIM mode


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def swim_replicator(fields: dict[str, Any], liveness: Callable[[str], MemberState],
                    clock: Clock) -> StateReplicator:
    key = create_new_key_pair()
    state = SwarmState(key, clock=clock)
    return StateReplicator(build_host(key), state, "s", path=None, self_fields=lambda: dict(fields),
                           clock=clock, liveness=CallableLiveness(liveness),
                           timing=ReplicationTiming(progress_every_s=30.0))


def add_trainers(rep: StateReplicator, clock: Clock, count: int) -> list[str]:
    """`count` other trainers' records applied to `rep`'s state, as if they had arrived; their peer IDs."""
    others = []
    for _ in range(count):
        other = SwarmState(create_new_key_pair(), clock=clock)
        assert rep.state.apply([other.update_self(role="trainer").data]).changed
        others.append(other.peer_id)
    return others


def test_swim_mode_re_signs_the_record_only_when_it_changes_and_progress_at_most_every_30_s() -> None:
    clock = Clock()
    fields: dict[str, Any] = {"role": "trainer", "addrs": ["/ip4/1.2.3.4/tcp/1"], "step": 1, "outer_step": 0}
    rep = swim_replicator(fields, lambda peer: MemberState.ALIVE, clock)
    rep.refresh()
    first = rep.state.member(rep.state.peer_id)
    assert first is not None
    for _ in range(10):  # heartbeats with nothing new: no new signature
        clock.t += 2.0
        rep.refresh()
    assert rep.heartbeats == {"signed": 1, "skipped": 10}
    fields["step"] = 50  # progress alone: waits for the 30 s since the last record
    clock.t += 2.0
    rep.refresh()
    assert rep.heartbeats["signed"] == 1
    clock.t += 8.0  # 30 s since the first record
    rep.refresh()
    assert rep.heartbeats["signed"] == 2
    fields["outer_step"] = 1  # not progress: at once
    clock.t += 1.0
    rep.refresh()
    assert rep.heartbeats["signed"] == 3
    record = rep.state.member(rep.state.peer_id)
    assert record is not None and record.record.outer_step == 1 and record.record.step == 50


def test_gossip_mode_still_re_signs_every_heartbeat() -> None:
    key = create_new_key_pair()
    rep = StateReplicator(build_host(key), SwarmState(key), "s", path=None, self_fields=lambda: {"step": 1})
    for _ in range(3):
        rep.refresh()
    assert rep.heartbeats == {"signed": 3}


def test_swim_mode_shows_the_states_swim_holds_not_the_records_age() -> None:
    clock = Clock()
    held: dict[str, MemberState] = {}
    rep = swim_replicator({"role": "trainer"}, lambda peer: held.get(peer, MemberState.GONE), clock)
    rep.refresh()
    others = add_trainers(rep, clock, 3)
    held.update({others[0]: MemberState.ALIVE, others[1]: MemberState.SUSPECT})  # others[2]: unknown to SWIM
    clock.t += 3600  # records an hour old: gone by their age, but SWIM says otherwise
    states = {m["peer_id"]: m["state"] for m in rep.status()["members"]}
    assert states == {rep.state.peer_id: "alive", others[0]: "alive", others[1]: "suspect", others[2]: "gone"}
    assert [m.peer_id for m in rep.alive_members()] == [others[0]]
    assert {m.peer_id for m in rep.members_to_dial()} == {others[0], others[1]}


def test_a_suspect_trainer_is_still_an_averaging_candidate_a_gone_one_is_not() -> None:
    """bench/wan.py, one-slow at 0.4 Mbit/s: the trainer behind the slow link suspected its partners in
    turn (its probes' answers waited behind its own transfers), found "no other trainer to pair with" and
    stepped solo at once while all three trained. Suspect is not dead: it stays a partner candidate."""
    clock = Clock()
    held: dict[str, MemberState] = {}
    rep = swim_replicator({"role": "trainer"}, lambda peer: held.get(peer, MemberState.GONE), clock)
    rep.refresh()
    others = add_trainers(rep, clock, 3)
    held.update({others[0]: MemberState.ALIVE, others[1]: MemberState.SUSPECT})  # others[2]: gone
    assert {m.peer_id for m in rep.partner_candidates()} == {others[0], others[1]}


def test_swim_mode_dials_members_whose_records_are_held_but_swim_never_heard_of() -> None:
    """SWIM hears of members only through connections; a member known by its record alone must be dialled,
    or a joiner connected to the bootstrap alone never meets the rest (64 daemons: one or two connections
    each for a minute). One SWIM holds dead is not dialled."""
    clock = Clock()
    held: dict[str, MemberState] = {}
    dead: set[str] = set()
    rep = swim_replicator({"role": "trainer"}, lambda peer: held.get(peer, MemberState.GONE), clock)
    rep.liveness = CallableLiveness(lambda peer: held.get(peer, MemberState.GONE),
                                    unheard=lambda peer: peer not in held and peer not in dead)
    rep.refresh()
    others = add_trainers(rep, clock, 3)
    held[others[0]] = MemberState.ALIVE
    dead.add(others[1])  # held dead by SWIM: gone, and not dialled
    assert {m.peer_id for m in rep.members_to_dial()} == {others[0], others[2]}
    assert [m.peer_id for m in rep.alive_members()] == [others[0]]  # not an averaging candidate before SWIM says so


def test_swim_mode_shows_last_seen_from_swims_evidence_not_from_the_records_age() -> None:
    clock = Clock()
    heard: dict[str, float] = {}
    rep = swim_replicator({"role": "trainer"}, lambda peer: MemberState.ALIVE, clock)
    rep.liveness = CallableLiveness(lambda peer: MemberState.ALIVE, heard=heard.get)
    rep.refresh()
    other = SwarmState(create_new_key_pair(), clock=clock)
    assert rep.state.apply([other.update_self(role="trainer").data]).changed
    never = SwarmState(create_new_key_pair(), clock=clock)
    assert rep.state.apply([never.update_self(role="trainer").data]).changed
    clock.t += 3600  # both records an hour old (nothing changed, so nothing re-signed)
    heard[other.peer_id] = clock.t - 1.5  # SWIM heard from it 1.5 s ago (an ack)
    members = {m["peer_id"]: m for m in rep.status()["members"]}
    assert members[other.peer_id]["last_seen_s"] == 1.5 and members[other.peer_id]["last_seen"] == clock.t - 1.5
    assert members[never.peer_id]["last_seen_s"] == 3600.0  # no evidence from SWIM: the record's age


async def test_the_service_says_when_it_last_heard_from_a_member() -> None:
    async with swarm() as s:
        a, b = await s.add(), await s.add()
        assert a.swim.last_heard(b.name) is None
        await s.connect((b, a))
        await eventually(lambda: a.swim.core.counters["acks"] >= 2, "a's probes of b answered", timeout=15)
        first = a.swim.last_heard(b.name)
        assert first is not None and first <= time.time()
        await eventually(lambda: (a.swim.last_heard(b.name) or 0) > first, "heard again", timeout=15)


def test_node_membership_is_swim_by_default_or_gossip() -> None:
    assert NodeConfig().membership == "swim"  # issue #24: the per-node cost of gossip grows with the swarm
    NodeConfig(membership="gossip").validate()
    with pytest.raises(ValueError, match="node.membership"):
        NodeConfig(membership="raft").validate()


@pytest.mark.parametrize(("option", "value", "message"), [
    ("swim_period_s", 0.0, "node.swim_period_s: must be between 0.1 and 60 seconds"),
    ("swim_period_s", 600.0, "node.swim_period_s: must be between 0.1 and 60 seconds"),
    ("swim_ack_timeout_s", 0.01, "node.swim_ack_timeout_s: must be at least 0.05 seconds and less than swim_period_s"),
    ("swim_ack_timeout_s", 1.0, "node.swim_ack_timeout_s: must be at least 0.05 seconds and less than swim_period_s"),
    ("swim_suspicion_mult", 0, "node.swim_suspicion_mult: must be between 1 and 32"),
])
def test_swim_timing_options_are_validated_with_a_one_line_error(option: str, value: float, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        NodeConfig(membership="swim", **{option: value}).validate()
    assert str(caught.value) == message


def test_the_daemon_runs_swim_with_the_configured_timing(tmp_path: Path) -> None:
    from node.config.load import ConfigError, load_config
    from node.daemon import Daemon

    overrides: dict[str, Any] = {"node.listen": ["/ip4/127.0.0.1/tcp/0"], "node.membership": "swim",
                                 "node.swim_period_s": 2.5, "node.swim_ack_timeout_s": 0.8,
                                 "node.swim_suspicion_mult": 6}
    daemon = Daemon(load_config(tmp_path, overrides=overrides, environ={}), tmp_path, create_new_key_pair(),
                    train=False)
    assert daemon.swim is not None
    config = daemon.swim.core.config
    assert (config.period_s, config.ack_timeout_s, config.probe_timeout_s, config.suspicion_mult) == (2.5, 0.8, 3.2, 6)
    with pytest.raises(ConfigError, match="node.swim_ack_timeout_s"):  # the operator's error, not a traceback
        load_config(tmp_path, overrides={**overrides, "node.swim_ack_timeout_s": 3.0}, environ={})



async def test_each_message_from_a_peer_tells_that_its_connection_delivers() -> None:
    """What the connection manager's silent-connection rule reads (p2p/connmgr.py, ``heard_from``)."""
    async with swarm() as net:
        a, b = await net.add(), await net.add()
        heard: list[Any] = []
        a.swim.on_heard = heard.append
        await net.connect((a, b))
        await eventually(lambda: b.host.get_id() in heard, "a heard from b", timeout=SLACK_S)


def test_in_swim_mode_the_daemon_drops_connections_that_deliver_nothing_in_gossip_mode_not(tmp_path: Path) -> None:
    """SWIM's probes, answered within seconds, make silence a sign of a stalled connection; gossip mode has no
    such steady answers, so its connection manager judges no silence."""
    from p2p.connmgr import SILENT_S

    silent_after = {}
    for mode, daemon in _daemons_in_each_mode(tmp_path):
        silent_after[mode] = daemon.connmgr.silent_after
        if daemon.swim is not None:
            assert daemon.swim.on_heard == daemon.connmgr.heard_from  # given at construction, not patched in
            assert daemon.swim.redial == daemon.connmgr.redial and daemon.swim.redial_s is not None
        assert daemon.replicator.connections is daemon.connmgr  # a session's answer: heard from, in both modes
    assert silent_after == {"swim": SILENT_S, "gossip": None}


def test_the_daemon_replicates_records_without_gossipsub_in_swim_mode_only(tmp_path: Path) -> None:
    """Swim mode: member records by anti-entropy alone (node/swarm/replicator.py, "Or no gossip"); gossip mode
    keeps gossipsub, its records being its heartbeats."""
    gossip_on = {mode: daemon.replicator.gossip for mode, daemon in _daemons_in_each_mode(tmp_path)}
    assert gossip_on == {"swim": False, "gossip": True}


def _daemons_in_each_mode(tmp_path: Path) -> list[tuple[str, Any]]:
    """A daemon (built, not run) with ``node.membership`` swim, and one with gossip."""
    from node.config.load import load_config
    from node.daemon import Daemon

    out = []
    for mode in ("swim", "gossip"):
        home = tmp_path / mode
        home.mkdir()
        overrides: dict[str, Any] = {"node.listen": ["/ip4/127.0.0.1/tcp/0"], "node.membership": mode}
        out.append((mode, Daemon(load_config(home, overrides=overrides, environ={}), home, create_new_key_pair(),
                                 train=False)))
    return out


# ---------------------------------------------------------------------------------------------------
# Whole daemons (in one trio loop)


async def test_three_daemons_in_swim_mode_show_each_other_alive_in_status_without_re_signing_heartbeats(
        tmp_path: Path) -> None:
    from node.config.load import load_config
    from node.daemon import Daemon
    from node.status_schema import NodeStatus
    from starling_testing.daemon import free_port
    from tests.test_status_schema import schema_errors

    port = free_port()
    keys = [create_new_key_pair() for _ in range(3)]
    boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_of(keys[0].public_key)}"
    daemons = []
    for i, key in enumerate(keys):
        home = tmp_path / f"d{i}"
        home.mkdir()
        overrides: dict[str, Any] = {"node.listen": [f"/ip4/127.0.0.1/tcp/{port if i == 0 else 0}"],
                                     "node.membership": "swim", "node.heartbeat_s": 0.5,
                                     "node.swim_period_s": FAST.period_s, "node.swim_ack_timeout_s": FAST.ack_timeout_s}
        if i:
            overrides["node.bootstrap"] = [boot]
        daemon = Daemon(load_config(home, overrides=overrides, environ={}), home, key, train=False)
        assert daemon.swim is not None and daemon.replicator.liveness is daemon.swim
        daemons.append(daemon)
    ids = {str(d.peer_id) for d in daemons}

    def alive(d: Any) -> set[str]:
        return {m["peer_id"] for m in d.status()["members"] if m["state"] == "alive"}

    async with trio.open_nursery() as nursery:
        for d in daemons:
            await nursery.start(d.run)
        await eventually(lambda: all(alive(d) == ids for d in daemons), "every daemon shows all three alive",
                         timeout=25)
        # Heartbeats go on every 0.5 s, and most of them sign nothing: the fields did not change.
        await eventually(lambda: all(d.replicator.heartbeats["skipped"] > d.replicator.heartbeats["signed"] + 3
                                     for d in daemons), "heartbeats that sign nothing", timeout=15)
        assert all(alive(d) == ids for d in daemons)
        # The status: SWIM's counters under `swim`, as the schema says; each peer's last_seen is SWIM's
        # evidence (its messages and acks), not its record's age (signed once, at the start).
        await eventually(lambda: all(d.status()["swim"]["acks"] >= 4 for d in daemons), "probes answered",
                         timeout=15)
        for d in daemons:
            st = d.status()
            assert schema_errors(st, NodeStatus) == []
            peers = [m for m in st["members"] if not m["self"]]
            for m in peers:
                heard = d.swim.last_heard(m["peer_id"])
                assert heard is not None and m["last_seen"] == pytest.approx(heard, abs=2.0), (m, heard)
        for d in daemons:
            d.stop()


def _redial_to(node: Node, addrs: dict[str, Any]) -> Callable[[Any], Awaitable[bool]]:
    """A ``redial`` for ``node`` as the daemon wires it (the connection manager dials the member's known
    address and says whether it is connected after), over ``addrs`` (peer name -> multiaddr)."""
    async def redial(peer: Any) -> bool:
        try:
            await node.host.connect(info_from_p2p_addr(addrs[peer.to_base58()]))
        except Exception:
            return False
        return peer in node.host.get_connected_peers()
    return redial


async def test_a_connection_that_ends_under_both_nodes_is_no_news_where_the_member_answers_a_new_dial() -> None:
    """At 64-daemon joins connections ended under both of their nodes (py-libp2p's muxer ending on both sides,
    no close by either connection manager) and each node probed the other through helpers not connected to
    it: a pair of live members held each other suspect in every view. A node now dials the member again
    first: connected, the drop is no news (``redialled``), and no probe is started."""
    async with swarm() as s:
        a, b, a_id, b_id = await _two_ready(s)
        addrs = {n.name: n.host.get_addrs()[0] for n in (a, b)}
        # a dials again (b does not: were both to, the first connection back could come before the other's
        # poll of its connections saw the drop at all).
        a.swim.redial = _redial_to(a, addrs)
        await b.host.disconnect(a_id)  # ended under both: neither told SWIM it was closing it
        await eventually(lambda: a.swim.counters["redialled"] + a.swim.counters["disconnect_probes"] >= 1,
                         "a saw the drop and dialled b again", timeout=SLACK_S,
                         detail=lambda: (dict(a.swim.counters), dict(b.swim.counters)))
        assert a.swim.counters["redialled"] == 1 and a.swim.counters["disconnect_probes"] == 0
        assert a_id in b.host.get_connected_peers()
        # (b, which saw the drop too, probed a at once: with no member to ask, no evidence either way.)
        assert a.swim.core.counters["suspected"] == b.swim.core.counters["suspected"] == 0


async def test_a_dropped_member_that_a_new_dial_does_not_reach_within_its_bound_is_probed_as_before() -> None:
    """The other side of the redial: a member whose host is gone makes the new dial hang; after ``REDIAL_S``
    the drop is news as it was, and the member is probed (here with nobody else to ask: no evidence)."""
    async with swarm() as s:
        a, b, a_id, b_id = await _two_ready(s)
        dials: list[Any] = []

        async def hangs(peer: Any) -> bool:  # a dial to a host that is gone: no answer at all
            dials.append(peer)
            await trio.sleep_forever()
            return False

        a.swim.redial = hangs
        started = trio.current_time()
        await b.host.disconnect(a_id)
        await eventually(lambda: a.swim.counters["disconnect_probes"] == 1, "a probed b after the dial's bound",
                         timeout=REDIAL_S + SLACK_S, detail=lambda: dict(a.swim.counters))
        assert trio.current_time() - started >= REDIAL_S
        assert dials == [b_id] and a.swim.counters["redialled"] == 0 and not a.swim._redialing


async def test_a_probe_under_way_when_its_connection_ends_waits_for_the_redial_not_for_helpers() -> None:
    """A probe of b by a is under way when their connection ends under them: its direct path is gone, and its
    helper (c, not connected to b) could not reach b either. Before, the probe went on through c and turned
    b suspect while a's new dial of b was under way (bootstrap node, 64-daemon join); now it is dropped and
    the redial decides: connected again, no suspicion."""
    async with swarm() as s:
        a, b, a_id, b_id = await _two_ready(s)
        c = await s.add()
        await s.connect((c, a))
        await eventually(lambda: c.host.get_id() in a.swim._ready and sees(a, c, MemberState.ALIVE),
                         "c's streams with a up", timeout=15)
        addrs = {n.name: n.host.get_addrs()[0] for n in (a, b)}
        dial = _redial_to(a, addrs)

        async def slow(peer: Any) -> bool:  # a starved machine: the new dial takes longer than the probe
            await trio.sleep(FAST.probe_timeout_s + 1.0)
            return await dial(peer)

        a.swim.redial = slow
        b_pid = a.swim._ids[b_id.to_bytes()]
        a.swim.core.probe(b_pid, trio.current_time())  # under way (its ping not sent: b will not answer it)
        await b.host.disconnect(a_id)
        await eventually(lambda: a.swim.counters["redialled"] == 1, "a dialled b again", timeout=REDIAL_S + SLACK_S,
                         detail=lambda: (dict(a.swim.counters), dict(a.swim.core.counters)))
        assert a.swim.core.counters["probes_abandoned"] == 1 and a.swim.core.counters["suspected"] == 0
        assert a.swim.counters["disconnect_probes"] == 0 and sees(a, b, MemberState.ALIVE)
