"""What the NAT service costs the peers it talks to (issue #24): the RTT that status shows per connected peer
comes from the connection's muxer, not from streams; a reachability round asks only the helpers it needs.

Issue #24: the NAT service pinged every connected peer with libp2p ping every 15 s, each ping a new stream
(multistream-select, a Yamux open and close). In a 64-daemon run that was 3,100 streams, queued at the
busiest nodes behind every other protocol's negotiations, for a figure only status shows. py-libp2p's
Yamux already measures each connection's RTT with PING frames of its own."""

from __future__ import annotations

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from node.swarm.nat import DIRECT_FIRST_S, NatConfig, NatService, dial_budget_s
from p2p.connmgr import ConnManager
from p2p.host import build_host
from protocols.dialback import DialbackOutcome, DialStatus, helpers_wanted

PING = "/ipfs/ping/1.0.0"


async def test_a_connected_peers_rtt_is_shown_without_a_ping_stream() -> None:
    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    pings_at_b = 0

    async def counting(stream: object) -> None:
        nonlocal pings_at_b
        pings_at_b += 1
        await stream.reset()  # type: ignore[attr-defined]

    nat = NatService(a, ConnManager(a, target=2, cap=4), NatConfig())
    loopback = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
    with trio.fail_after(30):
        async with a.run(loopback), b.run(loopback), trio.open_nursery() as nursery:
            b.set_stream_handler(PING, counting)
            await nursery.start(nat.run)
            await a.connect(info_from_p2p_addr(b.get_addrs()[0]))
            nat.peer_connected(b.get_id())
            rows: list = []
            while not rows or rows[0]["rtt_ms"] is None:  # the muxer's first PING frame: 0.5 s in
                await trio.sleep(0.1)
                rows = [r for r in nat.peers_status() if r["peer_id"] == str(b.get_id())]
            assert rows[0]["path"] == "direct" and rows[0]["rtt_ms"] > 0
            assert nat.typical_rtt_s() is not None and nat.typical_rtt_s() > 0  # the prior for unconnected peers
            await trio.sleep(6.0)  # past the old first ping (within 5 s of the connection)
            assert pings_at_b == 0
            nursery.cancel_scope.cancel()


def test_a_reachability_round_asks_only_the_helpers_the_verdict_still_needs() -> None:
    """Each ask is a probe, a connection of its own from a throwaway host: at a 64-daemon join rounds of three
    asks made 3.4 per node, about a third of the join's connections. A verdict needs two conclusive answers
    that agree, so a round asks two at first, then one while an answer is still missing."""
    def answer(helper: str, status: DialStatus, at: float = 0.0) -> DialbackOutcome:
        return DialbackOutcome(helper, status, at=at)

    assert helpers_wanted([]) == 2
    assert helpers_wanted([answer("a", DialStatus.REACHED)]) == 1  # the first helper answered: one more
    assert helpers_wanted([answer("a", DialStatus.TIMEOUT)]) == 1
    assert helpers_wanted([answer("a", DialStatus.UNVERIFIED), answer("b", DialStatus.ERROR)]) == 2  # inconclusive
    assert helpers_wanted([answer("a", DialStatus.REACHED), answer("b", DialStatus.REFUSED)]) == 1  # a tie
    # The latest answer of each helper counts: one that reached us, then gave no conclusive answer, gave none.
    assert helpers_wanted([answer("a", DialStatus.REACHED, 1.0), answer("a", DialStatus.ERROR, 2.0)]) == 2


async def test_no_dial_back_is_asked_in_a_nodes_first_seconds_then_one_is() -> None:
    """Each answer is a dial from a fresh connection (a handshake on both sides, every protocol's first
    streams): at a 64-daemon join every newcomer asked at once, some 370 dial-back streams and their
    connections in the join (issue #24). A node asks once past its grace."""
    host = build_host(create_new_key_pair())
    now = 100.0
    nat = NatService(host, ConnManager(host, target=2, cap=4), NatConfig(), clock=lambda: now)
    helper = build_host(create_new_key_pair()).get_id()
    asked: list[object] = []

    async def ask(peer: object, offered: list[str]) -> DialbackOutcome:
        asked.append(peer)
        return DialbackOutcome(str(peer), DialStatus.REACHED, at=now)

    nat._helpers = lambda: [helper]  # type: ignore[method-assign]
    nat.dialback.ask = ask  # type: ignore[method-assign]
    now += NatConfig().dialback_grace_s - 1
    await nat._check_reachability()
    assert asked == [] and nat.reachability == "unknown"
    now += 2
    await nat._check_reachability()
    assert asked == [helper]


def test_a_dials_budget_grows_with_the_round_trips_measured_never_below_the_base() -> None:
    """Issue #50's audit: 3 s for a direct dial (6 round trips) is 1.8 s of round trips at 300 ms, and a lost
    SYN's retry takes 1 s more: a reachable peer was given up for a relay. With 300 ms measured the budget
    is a lost SYN and 10 round trips; on a LAN, or before anything is measured, the base as before."""
    assert dial_budget_s(3.0, None) == 3.0 and dial_budget_s(3.0, 0.0) == 3.0
    assert dial_budget_s(3.0, 0.01) == 3.0
    assert dial_budget_s(3.0, 0.3) == 4.0
    assert dial_budget_s(3.0, 0.35) == 4.5
    assert dial_budget_s(3.0, 90.0) == 21.0  # a muxer's wild sample is capped


async def test_a_direct_dial_slower_than_3_s_is_not_given_up_for_a_relay_where_round_trips_are_long(
    autojump_clock: trio.abc.Clock, monkeypatch
) -> None:
    host = build_host(create_new_key_pair())
    nat = NatService(host, ConnManager(host, target=2, cap=4), NatConfig())
    peer = build_host(create_new_key_pair()).get_id()
    tried: list[str] = []

    async def slow_connect(info: PeerInfo) -> None:
        tried.append("direct")
        await trio.sleep(DIRECT_FIRST_S + 0.5)  # a healthy dial over 300 ms of RTT with a lost SYN

    async def circuit(addr: object) -> None:
        tried.append("circuit")

    monkeypatch.setattr(host, "connect", slow_connect)
    monkeypatch.setattr(nat, "dial_circuit", circuit)
    addrs = [Multiaddr("/ip4/10.0.0.1/tcp/4001"),
             Multiaddr(f"/ip4/10.0.0.2/tcp/4001/p2p/{peer}/p2p-circuit/p2p/{peer}")]
    monkeypatch.setattr(nat, "typical_rtt_s", lambda: 0.3)
    await nat.dial(PeerInfo(peer, addrs))
    assert tried == ["direct"]
    tried.clear()
    monkeypatch.setattr(nat, "typical_rtt_s", lambda: None)  # nothing measured: 3 s, then the relay
    await nat.dial(PeerInfo(peer, addrs))
    assert tried == ["direct", "circuit"]
