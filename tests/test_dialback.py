"""Dial-back reachability: the protocol on loopback hosts, target selection, error classes, the verdict."""

from __future__ import annotations

import errno
import functools
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import multiaddr
import pytest
import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2p.auth import generate_swarm_key
from p2p.host import build_host
from p2p.wire import LibP2PByteStream, ProtocolError, from_map, recv_as, send_msg, to_map
from protocols import dialback
from protocols.dialback import (
    DialbackOutcome,
    DialbackProbe,
    DialbackRequest,
    DialbackResult,
    DialbackService,
    DialStatus,
    ProbeAck,
    classify_dial_error,
    select_targets,
    verdict,
)

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


@asynccontextmanager
async def running_hosts(n: int, psk: str | None = None) -> AsyncIterator[list[IHost]]:
    hosts = [build_host(create_new_key_pair(), psk=psk) for _ in range(n)]
    async with trio.open_nursery() as nursery:
        stops = [trio.Event() for _ in hosts]

        async def run(host: IHost, started: trio.Event, stop: trio.Event) -> None:
            async with host.run([LOOPBACK]):
                started.set()
                await stop.wait()

        for host, stop in zip(hosts, stops, strict=True):
            started = trio.Event()
            nursery.start_soon(run, host, started, stop)
            await started.wait()
        try:
            yield hosts
        finally:
            for stop in stops:
                stop.set()


async def connect(a: IHost, b: IHost) -> None:
    await a.connect(PeerInfo(b.get_id(), b.get_transport_addrs()))


def addrs_of(host: IHost) -> list[str]:
    return [str(a) for a in host.get_transport_addrs()]


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the protocol between real hosts ---------------------------------------------------------------


async def test_helper_dials_back_from_a_fresh_connection_and_the_asker_confirms_it() -> None:
    async with running_hosts(2) as (asker, helper):
        ask, serve = DialbackService(asker), DialbackService(helper)
        ask.register()
        serve.register()
        await connect(asker, helper)
        outcome = await ask.ask(helper.get_id(), addrs_of(asker))
        assert outcome.status is DialStatus.REACHED
        assert outcome.observed_ip == "127.0.0.1"
        assert outcome.addr == addrs_of(asker)[0]
        assert serve.served == 1
        with trio.fail_after(5):  # the throwaway host hung up: only the helper stays connected
            while asker.get_connected_peers() != [helper.get_id()]:
                await trio.sleep(0.05)


async def test_in_a_keyed_swarm_the_dial_back_presents_the_swarm_key_and_reaches_the_asker() -> None:
    """Issue #14: the throwaway host dialled without the swarm key, the asker refused its handshake, and
    every node of a private swarm was judged `private` (no fast side channel)."""
    psk = generate_swarm_key()
    async with running_hosts(2, psk=psk) as (asker, helper):
        ask = DialbackService(asker, psk=psk)
        ask.register()
        DialbackService(helper, psk=psk).register()
        await connect(asker, helper)
        outcome = await ask.ask(helper.get_id(), addrs_of(asker))
        assert outcome.status is DialStatus.REACHED, outcome


async def test_a_dial_back_without_the_swarm_key_cannot_reach_a_keyed_asker() -> None:
    """The other side of the test above: the keyed asker really refuses a keyless probe (the old default).
    Either the asker drops the connection (`failed`) or the two handshakes wait on each other until the
    dial's deadline: the TCP connection opened, so that says nothing of NATs and the answer is inconclusive."""
    psk = generate_swarm_key()
    async with running_hosts(2, psk=psk) as (asker, helper):
        ask = DialbackService(asker, psk=psk)
        ask.register()
        keyless = DialbackService(helper, make_prober=lambda: build_host(create_new_key_pair(), max_connections=4))
        keyless.register()
        await connect(asker, helper)
        outcome = await ask.ask(helper.get_id(), addrs_of(asker))
        assert outcome.status is not DialStatus.REACHED, outcome
        assert outcome.conclusive or "TCP connection opened" in outcome.detail, outcome


async def test_a_closed_port_is_reported_refused_and_does_not_count_as_reached() -> None:
    async with running_hosts(2) as (asker, helper):
        ask, serve = DialbackService(asker), DialbackService(helper)
        ask.register()
        serve.register()
        await connect(asker, helper)
        outcome = await ask.ask(helper.get_id(), [f"/ip4/127.0.0.1/tcp/{closed_port()}"])
        assert outcome.status is DialStatus.REFUSED
        assert "RST" in outcome.detail


async def test_a_helper_claiming_success_without_a_probe_is_not_believed() -> None:
    async with running_hosts(2) as (asker, liar):
        ask = DialbackService(asker)
        ask.register()

        async def lie(stream: INetStream) -> None:
            wrapped = LibP2PByteStream(stream)
            await recv_as(wrapped, DialbackRequest)
            await send_msg(wrapped, DialbackResult(DialStatus.REACHED, "/ip4/127.0.0.1/tcp/1", "127.0.0.1"))
            await wrapped.aclose()

        liar.set_stream_handler(dialback.PROTOCOL_ID, lie)
        await connect(asker, liar)
        outcome = await ask.ask(liar.get_id(), addrs_of(asker))
        assert outcome.status is DialStatus.UNVERIFIED
        assert not outcome.conclusive


async def test_a_probe_over_the_helpers_own_connection_does_not_count() -> None:
    """The whole point: reusing the existing connection (AutoNAT v1's flaw) proves nothing."""
    async with running_hosts(2) as (asker, cheat):
        ask = DialbackService(asker)
        ask.register()

        async def reuse_connection(stream: INetStream) -> None:
            wrapped = LibP2PByteStream(stream)
            request = await recv_as(wrapped, DialbackRequest)
            probe = LibP2PByteStream(await cheat.new_stream(asker.get_id(), [dialback.PROTOCOL_ID]))
            await send_msg(probe, DialbackProbe(nonce=request.nonce))
            assert (await recv_as(probe, ProbeAck)).ok is False
            await send_msg(wrapped, DialbackResult(DialStatus.REACHED, addrs_of(asker)[0], "127.0.0.1"))
            await wrapped.aclose()

        cheat.set_stream_handler(dialback.PROTOCOL_ID, reuse_connection)
        await connect(asker, cheat)
        outcome = await ask.ask(cheat.get_id(), addrs_of(asker))
        assert outcome.status is DialStatus.UNVERIFIED


async def test_a_probe_stream_that_breaks_after_reaching_the_asker_leaves_reachability_unknown() -> None:
    """Seen in the network lab: at start-up a helper connected to the asker's own peer id, the probe stream
    was then reset, and the helper said `failed`; two such answers made a reachable node judge itself
    private for five minutes (no side channel offered, a punch tried at every exchange). The connection
    proved the address reachable, so the answer is inconclusive and a later ask decides."""
    async with running_hosts(2) as (asker, helper):
        ask, serve = DialbackService(asker), DialbackService(helper)
        ask.register()
        serve.register()

        async def reset_probes(stream: INetStream) -> None:
            await stream.reset()

        asker.set_stream_handler(dialback.PROTOCOL_ID, reset_probes)  # the asker's end of probes breaks
        await connect(asker, helper)
        outcome = await ask.ask(helper.get_id(), addrs_of(asker))
        assert outcome.status is DialStatus.ERROR, outcome
        assert "probe stream failed" in outcome.detail
        assert not outcome.conclusive
        assert verdict([outcome, DialbackOutcome("h2", DialStatus.ERROR, at=2.0)], own_ips=OWN,
                       available=2).reachability == "unknown"


async def test_an_address_that_takes_the_tcp_connection_but_stalls_the_handshake_is_no_evidence_of_a_nat() -> None:
    """Seen over a 0.08 Mbit/s link: the helper's dial reached the trainer, but the handshake sat behind
    seconds of queued transfer and the deadline fired; `timeout` made that trainer judge itself private. A
    NAT that drops unsolicited SYNs never lets the TCP connection open, so where it opened the answer is
    inconclusive. (A closed port stays `refused`: the test above.)"""
    async with running_hosts(1) as (helper,):
        serve = DialbackService(helper, dial_timeout=1.0)
        accepted: list[trio.SocketStream] = []

        async def silent(stream: trio.SocketStream) -> None:
            accepted.append(stream)
            await trio.sleep_forever()  # takes the connection, never answers the handshake

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            asker = ID.from_pubkey(create_new_key_pair().public_key)
            status, detail = await serve.probe(multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}"), asker, b"n" * 16)
            nursery.cancel_scope.cancel()
        assert accepted
        assert status is DialStatus.ERROR, (status, detail)
        assert "TCP connection opened" in detail


async def test_a_probe_with_an_unknown_nonce_is_refused() -> None:
    async with running_hosts(2) as (asker, stranger):
        DialbackService(asker).register()
        await connect(stranger, asker)
        stream = LibP2PByteStream(await stranger.new_stream(asker.get_id(), [dialback.PROTOCOL_ID]))
        await send_msg(stream, DialbackProbe(nonce=secrets.token_bytes(dialback.NONCE_BYTES)))
        assert (await recv_as(stream, ProbeAck)).ok is False


async def test_asking_the_same_helper_again_at_once_is_answered_busy() -> None:
    async with running_hosts(2) as (asker, helper):
        ask, serve = DialbackService(asker), DialbackService(helper)
        ask.register()
        serve.register()
        await connect(asker, helper)
        assert (await ask.ask(helper.get_id(), addrs_of(asker))).status is DialStatus.REACHED
        again = await ask.ask(helper.get_id(), addrs_of(asker))
        assert again.status is DialStatus.BUSY
        assert serve.served == 1


async def test_garbage_on_the_stream_is_dropped_and_the_helper_keeps_serving() -> None:
    async with running_hosts(2) as (asker, helper):
        ask, serve = DialbackService(asker), DialbackService(helper)
        ask.register()
        serve.register()
        await connect(asker, helper)
        raw = LibP2PByteStream(await asker.new_stream(helper.get_id(), [dialback.PROTOCOL_ID]))
        await raw.write(b"\x00\x00\x00\x03abc")  # a framed message that is not msgpack
        with trio.fail_after(5), pytest.raises(ProtocolError):
            await recv_as(raw, DialbackResult)
        assert (await ask.ask(helper.get_id(), addrs_of(asker))).status is DialStatus.REACHED


async def test_a_peer_without_the_protocol_gives_an_inconclusive_error() -> None:
    async with running_hosts(2) as (asker, other):
        ask = DialbackService(asker)
        ask.register()
        await connect(asker, other)
        outcome = await ask.ask(other.get_id(), addrs_of(asker))
        assert outcome.status is DialStatus.ERROR
        assert outcome.detail == "the peer does not speak dial-back"
        assert not outcome.conclusive


# --- messages --------------------------------------------------------------------------------------


def test_requests_with_a_wrong_nonce_or_too_many_addresses_are_rejected() -> None:
    good = to_map(DialbackRequest(nonce=bytes(16), addrs=("/ip4/1.2.3.4/tcp/1",)))
    assert from_map(DialbackRequest, good).addrs == ("/ip4/1.2.3.4/tcp/1",)
    with pytest.raises(ProtocolError, match="nonce"):
        from_map(DialbackRequest, {**good, "nonce": bytes(3)})
    with pytest.raises(ProtocolError, match="addrs"):
        from_map(DialbackRequest, {**good, "addrs": ["/ip4/1.2.3.4/tcp/1"] * (dialback.MAX_ADDRS + 1)})
    with pytest.raises(ProtocolError, match="characters"):
        from_map(DialbackRequest, {**good, "addrs": ["/ip4/" + "1" * 300]})
    with pytest.raises(ProtocolError, match="status"):
        from_map(DialbackResult, {**to_map(DialbackResult(DialStatus.REACHED)), "status": "teleported"})


# --- target selection ------------------------------------------------------------------------------


def test_the_helper_dials_only_offered_addresses_at_the_observed_ip() -> None:
    offered = [
        "/ip4/192.168.1.5/tcp/4001",
        "/ip4/203.0.113.7/tcp/4002/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
        "/ip4/1.1.1.1/tcp/9",
    ]
    assert [str(t) for t in select_targets(offered, "203.0.113.7")] == ["/ip4/203.0.113.7/tcp/4002"]


def test_without_an_address_at_the_observed_ip_the_helper_tries_the_offered_ports_there() -> None:
    offered = [
        "/ip4/192.168.1.5/tcp/4001",
        "/ip4/192.168.1.5/tcp/4001",
        "/ip4/10.0.0.2/tcp/4002",
        "/ip4/10.0.0.3/tcp/4003",
    ]
    targets = [str(t) for t in select_targets(offered, "198.51.100.1")]
    assert targets == ["/ip4/198.51.100.1/tcp/4001", "/ip4/198.51.100.1/tcp/4002"]  # capped at MAX_TARGETS


def test_garbage_udp_and_circuit_addresses_are_never_dialed() -> None:
    offered = [
        "not a multiaddr",
        "/ip4/1.2.3.4/udp/4001",
        "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit",
        "/dns4/example.com/tcp/4001",
        "/ip4/1.2.3.4/tcp/0",
    ]
    assert select_targets(offered, "1.2.3.4") == []
    assert select_targets(["/ip4/1.2.3.4/tcp/1"], "not an ip") == []


# --- error classification --------------------------------------------------------------------------


def test_dial_errors_are_classified_through_causes_and_exception_groups() -> None:
    refused = ExceptionGroup("all attempts failed", [ConnectionRefusedError(errno.ECONNREFUSED, "refused")])
    wrapped = RuntimeError("fail to open connection")
    wrapped.__cause__ = OSError("all attempts to connect failed")
    wrapped.__cause__.__cause__ = refused
    assert classify_dial_error(wrapped)[0] is DialStatus.REFUSED
    assert classify_dial_error(OSError(errno.EHOSTUNREACH, "no route"))[0] is DialStatus.UNREACHABLE
    assert classify_dial_error(trio.TooSlowError())[0] is DialStatus.TIMEOUT
    status, detail = classify_dial_error(ValueError("peer id mismatch"))
    assert status is DialStatus.FAILED and "mismatch" in detail


# --- the verdict -----------------------------------------------------------------------------------


def outcome(
    helper: str, status: DialStatus, observed_ip: str = "203.0.113.7", at: float = 1.0
) -> DialbackOutcome:
    return DialbackOutcome(helper, status, "/ip4/203.0.113.7/tcp/4001", observed_ip, "", at)


OWN = {"192.168.1.5", "127.0.0.1"}


def test_two_confirmations_make_a_node_public() -> None:
    v = verdict(
        [outcome("h1", DialStatus.REACHED), outcome("h2", DialStatus.REACHED)], own_ips=OWN, available=3
    )
    assert v.reachability == "public"
    assert "203.0.113.7" in v.reason


def test_one_confirmation_is_enough_only_when_one_helper_is_available() -> None:
    one = [outcome("h1", DialStatus.REACHED)]
    assert verdict(one, own_ips=OWN, available=1).reachability == "public"
    assert verdict(one, own_ips=OWN, available=3).reachability == "unknown"


def test_consistent_failures_make_a_node_private_and_the_reason_says_how_it_failed() -> None:
    v = verdict(
        [outcome("h1", DialStatus.TIMEOUT), outcome("h2", DialStatus.REFUSED)], own_ips=OWN, available=2
    )
    assert v.reachability == "private"
    assert "timeout" in v.reason
    assert verdict([outcome("h1", DialStatus.REFUSED)], own_ips=OWN, available=1).reachability == "private"


def test_mixed_or_inconclusive_answers_leave_reachability_unknown() -> None:
    mixed = [outcome("h1", DialStatus.REACHED), outcome("h2", DialStatus.TIMEOUT)]
    assert verdict(mixed, own_ips=OWN, available=2).reachability == "unknown"
    noise = [
        outcome("h1", DialStatus.BUSY),
        outcome("h2", DialStatus.UNVERIFIED),
        outcome("h3", DialStatus.ERROR),
    ]
    v = verdict(noise, own_ips=OWN, available=3)
    assert v.reachability == "unknown" and "unverified" in v.reason
    assert verdict([], own_ips=OWN, available=0).reachability == "unknown"


def test_only_the_latest_answer_of_each_helper_counts() -> None:
    history = [
        outcome("h1", DialStatus.TIMEOUT, at=1.0),
        outcome("h1", DialStatus.REACHED, at=2.0),
        outcome("h2", DialStatus.REACHED, at=1.0),
    ]
    assert verdict(history, own_ips=OWN, available=2).reachability == "public"


def test_confirmations_from_our_own_lan_do_not_make_a_node_behind_nat_public() -> None:
    lan = outcome("neighbour", DialStatus.REACHED, observed_ip="192.168.1.5")
    outside = outcome("far", DialStatus.TIMEOUT, observed_ip="198.51.100.9")
    v = verdict([lan, outside], own_ips=OWN, available=2)
    assert v.reachability == "private"
    assert "LAN" in v.reason
    # With no outside view at all, everyone sees our interface address: reachable by the whole swarm.
    both_lan = [lan, outcome("n2", DialStatus.REACHED, observed_ip="192.168.1.5")]
    assert verdict(both_lan, own_ips=OWN, available=2).reachability == "public"
