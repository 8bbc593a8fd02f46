"""Swarm-state replication: the /starling/state/2.0.0 anti-entropy protocol (and 1.0.0) and the StateReplicator.

The protocol tests run both sides over in-memory streams. The replicator tests run 3-4 real libp2p hosts
on 127.0.0.1 in one trio loop, each with its own SwarmState and StateReplicator, with short intervals.
Convergence is judged on *identical digests*, so those tests keep heartbeats long (the state is quiet
once the test's own updates are in) and drive updates explicitly.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

import node.swarm.replicator as replicator_module
from node.swarm import crdt
from node.swarm.crdt import (
    ApplyResult,
    Delivery,
    Manifest,
    MemberRecord,
    MemberState,
    SwarmState,
    encode_body,
)
from node.swarm.replicator import (
    INTRODUCED_FRESH_S,
    MAX_INBOUND_SESSIONS,
    MAX_TIMES_NAMED,
    OPEN_TIMEOUT_S,
    REFERRAL_COUNT_S,
    REFERRAL_DRAWS,
    REFERRALS_COUNTED,
    REFUSED_RETRY_S,
    DeliveredReplica,
    ReplicationTiming,
    StateReplicator,
    load_state,
)
from p2p.host import build_host
from p2p.wire import (
    LibP2PByteStream,
    ProtocolError,
    Reason,
    TrioByteStream,
    encode_msg,
    recv_as,
    recv_msg,
    send_msg,
)
from protocols import state as protocol
from protocols.hlc import Timestamp
from protocols.state import LocalInfo, SyncRefused
from starling_testing.liveness import CallableLiveness

SWARM = "test-swarm"
MANIFEST_A = Manifest("stdlib-lm", "a" * 64, "b" * 64, 1)
MANIFEST_B = Manifest("stdlib-lm", "c" * 64, "b" * 64, 1)
HEARTBEAT_S = 0.2
ANTI_ENTROPY_S = 0.5
QUIET_HEARTBEAT_S = 60.0  # no heartbeat during the test: the state changes only when the test says


async def eventually(predicate: Callable[[], bool], what: str, *, timeout: float = 10.0) -> None:
    """Wait until ``predicate()`` holds; fail the test after ``timeout`` seconds."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.05)
        return
    pytest.fail(f"not within {timeout:.0f}s: {what}")


# ---------------------------------------------------------------------------------------------------
# The protocol over in-memory streams


class FakeReplica:
    """A replica that holds nothing and offers fixed records: a rogue or test peer's side."""

    def __init__(self, records: Iterable[bytes] = ()) -> None:
        self.records = list(records)
        self.applied: list[bytes] = []

    def digest(self) -> Mapping[str, tuple[int, ...]]:
        return {}

    def missing_for(self, their_digest: Mapping[str, tuple[int, ...]]) -> list[bytes]:
        return list(self.records)

    def apply(self, records: Iterable[bytes]) -> ApplyResult:
        batch = list(records)
        self.applied.extend(batch)
        return ApplyResult(unchanged=len(batch))


def replica_with_progress(samples: int, **fields: Any) -> SwarmState:
    state = SwarmState(create_new_key_pair())
    state.update_self(**fields)
    state.add_progress(samples=samples)
    return state


def info(manifest_hash: str = "", swarm: str = SWARM) -> LocalInfo:
    return LocalInfo("0.1.0", swarm, manifest_hash)


async def run_session(
    initiator: protocol.Replica,
    responder: protocol.Replica,
    initiator_info: LocalInfo,
    responder_info: LocalInfo,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Run both sides over a memory stream pair; returns each side's result or exception."""
    a, b = trio.testing.memory_stream_pair()
    outcome: dict[str, Any] = {}

    async def side(name: str, fn: Any, stream: Any, replica: protocol.Replica, local: LocalInfo) -> None:
        try:
            outcome[name] = await fn(TrioByteStream(stream), replica, local, **kwargs)
        except (SyncRefused, ProtocolError, trio.TooSlowError) as exc:
            outcome[name] = exc
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "i", protocol.initiate, a, initiator, initiator_info)
        nursery.start_soon(side, "r", protocol.respond, b, responder, responder_info)
    return outcome["i"], outcome["r"]


async def test_one_session_gives_both_replicas_what_they_lacked() -> None:
    a = replica_with_progress(10, step=1)
    b = replica_with_progress(20, step=2)
    a_result, b_result = await run_session(a, b, info(), info())
    assert a.digest() == b.digest()
    assert {m.peer_id for m in a.members()} == {a.peer_id, b.peer_id}
    assert a.counters().samples == b.counters().samples == 30
    assert (a_result.sent, a_result.received, a_result.changed) == (2, 2, 2)
    assert (b_result.sent, b_result.received, b_result.changed) == (2, 2, 2)
    # A second session finds nothing to send either way.
    a_again, _ = await run_session(a, b, info(), info())
    assert (a_again.sent, a_again.received) == (0, 0)


async def test_manifest_mismatch_is_refused_on_both_sides_naming_both_hashes() -> None:
    a, b = replica_with_progress(1), replica_with_progress(2)
    a_error, b_error = await run_session(a, b, info(MANIFEST_A.hash), info(MANIFEST_B.hash))
    for error in (a_error, b_error):
        assert isinstance(error, SyncRefused) and error.incompatible
        assert MANIFEST_A.hash in str(error) and MANIFEST_B.hash in str(error)
    assert (a_error.local, a_error.remote) == (MANIFEST_A.hash, MANIFEST_B.hash)
    assert (b_error.local, b_error.remote) == (MANIFEST_B.hash, MANIFEST_A.hash)
    assert b.peer_id not in {m.peer_id for m in a.members()}  # no state moved


async def test_a_node_without_a_manifest_syncs_with_any_and_learns_the_swarms() -> None:
    swarm_node = replica_with_progress(1)
    swarm_node.set_manifest(MANIFEST_A)
    fresh = replica_with_progress(0)
    await run_session(fresh, swarm_node, info(""), info(MANIFEST_A.hash))
    assert fresh.manifest == MANIFEST_A


async def test_a_peer_of_another_swarm_is_refused() -> None:
    a_error, b_error = await run_session(FakeReplica(), FakeReplica(), info(swarm="one"), info(swarm="two"))
    assert isinstance(a_error, SyncRefused) and a_error.code == protocol.SWARM_MISMATCH
    assert isinstance(b_error, SyncRefused) and "'one'" in str(b_error) and "'two'" in str(b_error)


async def test_a_busy_responder_is_not_taken_for_an_incompatible_one() -> None:
    ours, theirs = trio.testing.memory_stream_pair()

    async def busy_responder() -> None:
        stream = TrioByteStream(theirs)
        await recv_as(stream, protocol.Hello, max_bytes=1 << 20)
        await protocol.refuse_busy(stream, info())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(busy_responder)
        with pytest.raises(SyncRefused) as excinfo:
            await protocol.initiate(TrioByteStream(ours), FakeReplica(), info())
    assert excinfo.value.code == protocol.BUSY and not excinfo.value.incompatible


def member_record(**fields: Any) -> tuple[SwarmState, bytes]:
    """A member's replica and its encoded signed member record."""
    state = SwarmState(create_new_key_pair())
    return state, state.update_self(**fields).data


async def refused_busy_with(error: Any, replica: protocol.Replica) -> SyncRefused | ProtocolError:
    """Run an initiator against a responder that answers its hello with ``error`` (a message or a map,
    sent as it is); returns what the initiator raised."""
    ours, theirs = trio.testing.memory_stream_pair()

    async def busy_responder() -> None:
        stream = TrioByteStream(theirs)
        await recv_as(stream, protocol.Hello, max_bytes=1 << 20)
        await send_msg(stream, error, max_bytes=1 << 20)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(busy_responder)
        try:
            await protocol.initiate(TrioByteStream(ours), replica, info())
        except (SyncRefused, ProtocolError) as exc:
            return exc
    pytest.fail("the initiator was not refused")


async def test_a_busy_refusal_refers_the_initiator_to_other_members_it_then_holds() -> None:
    others = [member_record(addrs=(f"/ip4/10.0.0.{i}/tcp/4001",)) for i in range(3)]
    ours, theirs = trio.testing.memory_stream_pair()

    async def busy_responder() -> None:
        stream = TrioByteStream(theirs)
        await recv_as(stream, protocol.Hello, max_bytes=1 << 20)
        await protocol.refuse_busy(stream, info(), referral=[data for _, data in others])

    newcomer = SwarmState(create_new_key_pair())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(busy_responder)
        with pytest.raises(SyncRefused) as excinfo:
            await protocol.initiate(TrioByteStream(ours), newcomer, info())
    assert excinfo.value.code == protocol.BUSY and not excinfo.value.incompatible
    assert excinfo.value.referred == ApplyResult(changed=3)
    for state, _ in others:
        view = newcomer.member(state.peer_id)
        assert view is not None and view.record.addrs  # an address to dial
    assert not newcomer.rejected


async def test_a_busy_refusal_that_a_crowded_node_takes_seconds_to_write_still_delivers_its_referral(
    autojump_clock: Any,
) -> None:
    """A crowded bootstrap took more than 2 s to write a refusal at a 64-daemon join, and the write was cut:
    the newcomer read a closed stream instead of the members it could dial."""
    others = [member_record(addrs=(f"/ip4/10.0.0.{i}/tcp/4001",)) for i in range(3)]
    ours, theirs = trio.testing.memory_stream_pair()

    async def busy_responder() -> None:
        await recv_as(TrioByteStream(theirs), protocol.Hello, max_bytes=1 << 20)
        await protocol.refuse_busy(SlowWrites(theirs, 5.0), info(), referral=[data for _, data in others])

    newcomer = SwarmState(create_new_key_pair())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(busy_responder)
        with pytest.raises(SyncRefused) as excinfo:
            await protocol.initiate(TrioByteStream(ours), newcomer, info())
    assert excinfo.value.code == protocol.BUSY and excinfo.value.referred == ApplyResult(changed=3)


async def test_a_referral_is_cut_to_its_bounds_by_the_refusing_side() -> None:
    records = [member_record(addrs=("/ip4/10.0.0.1/tcp/4001",))[1] for _ in range(protocol.MAX_REFERRAL_RECORDS + 4)]
    assert len(protocol.fit_referral(records)) == protocol.MAX_REFERRAL_RECORDS
    big = b"x" * (protocol.MAX_REFERRAL_BYTES - 100)
    fitted = protocol.fit_referral([big, *records])
    assert fitted[0] == big and sum(map(len, fitted)) <= protocol.MAX_REFERRAL_BYTES and len(fitted) < len(records)


async def test_hostile_referrals_are_refused_or_rejected_and_nothing_is_applied() -> None:
    good = member_record(addrs=("/ip4/10.0.0.1/tcp/4001",))[1]
    forged = bytearray(good)
    forged[-1] ^= 0xFF  # the signature's last byte
    busy = {"t": "error", "v": 2, "code": protocol.BUSY, "reason": "busy"}
    cases: list[tuple[dict[str, Any], Reason]] = [
        ({**busy, "referral": [good] * (protocol.MAX_REFERRAL_RECORDS + 1)}, Reason.BAD_FIELD),  # too many
        ({**busy, "referral": [good[:1] * 1000] * 9}, Reason.BAD_FIELD),  # 9 KB: more than the referral's bytes
        ({**busy, "referral": [b"x" * (protocol.ERROR_MAX_BYTES + 1)]}, Reason.TOO_LARGE),  # past the message limit
        ({**busy, "referral": "not a list"}, Reason.BAD_FIELD),
        ({**busy, "referral": [1, 2]}, Reason.BAD_FIELD),
    ]
    for error, reason in cases:
        newcomer = SwarmState(create_new_key_pair())
        outcome = await refused_busy_with(error, newcomer)
        assert isinstance(outcome, ProtocolError) and outcome.reason is reason, (error.get("referral", "")[:1], outcome)
        assert [m.peer_id for m in newcomer.members()] == []
    # Forged and malformed records in a well-formed referral: rejected and counted, the good one applied.
    newcomer = SwarmState(create_new_key_pair())
    outcome = await refused_busy_with({**busy, "referral": [bytes(forged), b"\x93junk", good]}, newcomer)
    assert isinstance(outcome, SyncRefused) and outcome.referred == ApplyResult(changed=1, rejected=2)
    assert len(newcomer.members()) == 1 and sum(newcomer.rejected.values()) == 2


async def test_an_incompatible_peers_referral_is_not_taken() -> None:
    good = member_record(addrs=("/ip4/10.0.0.1/tcp/4001",))[1]
    error = protocol.Error(protocol.SWARM_MISMATCH, "other swarm", swarm="elsewhere", referral=[good])
    newcomer = SwarmState(create_new_key_pair())
    outcome = await refused_busy_with(error, newcomer)
    assert isinstance(outcome, SyncRefused) and outcome.incompatible and outcome.referred is None
    assert newcomer.members() == []


async def test_a_busy_refusal_on_1_0_0_is_unchanged_and_carries_no_referral() -> None:
    good = member_record(addrs=("/ip4/10.0.0.1/tcp/4001",))[1]
    ours, theirs = trio.testing.memory_stream_pair()
    await protocol.refuse_busy(TrioByteStream(theirs), info(), referral=[good], legacy=True)
    raw = await recv_msg(TrioByteStream(ours), max_bytes=1 << 20)
    assert raw == {"t": "error", "v": 1, "code": protocol.BUSY, "reason": "too many concurrent state sessions",
                   "manifest_hash": "", "swarm": SWARM}
    # And a 1.0.0 initiator reads it as busy, as before.
    ours, theirs = trio.testing.memory_stream_pair()

    async def busy_responder() -> None:
        stream = TrioByteStream(theirs)
        await recv_as(stream, protocol.HelloV1, max_bytes=1 << 20)
        await protocol.refuse_busy(stream, info(), referral=[good], legacy=True)

    newcomer = SwarmState(create_new_key_pair())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(busy_responder)
        with pytest.raises(SyncRefused) as excinfo:
            await protocol.initiate(TrioByteStream(ours), newcomer, info(), legacy=True)
    assert excinfo.value.code == protocol.BUSY and excinfo.value.referred is None and newcomer.members() == []


async def test_a_silent_peer_runs_into_the_session_deadline() -> None:
    a, _b = trio.testing.memory_stream_pair()
    with pytest.raises(trio.TooSlowError):
        await protocol.respond(TrioByteStream(a), FakeReplica(), info(), timeout_s=0.2)


class SlowWrites:
    """A byte stream whose every write takes ``delay`` seconds: a peer on an overloaded machine."""

    def __init__(self, stream: Any, delay: float) -> None:
        self.inner, self.delay = TrioByteStream(stream), delay

    async def read(self, max_bytes: int) -> bytes:
        return await self.inner.read(max_bytes)

    async def write(self, data: Any) -> None:
        await trio.sleep(self.delay)
        await self.inner.write(data)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_slow_peer_that_keeps_answering_completes_a_session_longer_than_one_step_deadline(
    autojump_clock: Any,
) -> None:
    a, b = replica_with_progress(10), replica_with_progress(20)
    ours, theirs = trio.testing.memory_stream_pair()
    delay = 0.6 * protocol.STEP_TIMEOUT_S  # each of the responder's messages: within a step's deadline
    outcome: dict[str, Any] = {}

    async def responder() -> None:
        outcome["r"] = await protocol.respond(SlowWrites(theirs, delay), b, info())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(responder)
        started = trio.current_time()
        outcome["i"] = await protocol.initiate(TrioByteStream(ours), a, info())
    assert trio.current_time() - started > protocol.STEP_TIMEOUT_S  # longer than one step may take
    assert a.digest() == b.digest() and outcome["i"].received == outcome["r"].sent == 2


async def test_a_peer_that_stops_answering_is_cut_after_one_step_deadline(autojump_clock: Any) -> None:
    a, _b = trio.testing.memory_stream_pair()
    started = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await protocol.respond(TrioByteStream(a), FakeReplica(), info())
    assert trio.current_time() - started == pytest.approx(protocol.STEP_TIMEOUT_S)


async def test_more_records_than_the_session_limit_is_a_protocol_error() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    peer = TrioByteStream(theirs)
    replica = FakeReplica()

    async def initiator_sending_too_much() -> None:
        await send_msg(peer, all_differ_hello())
        await recv_as(peer, protocol.Hello, max_bytes=protocol.HELLO_MAX_BYTES)
        await recv_as(peer, protocol.Entries, max_bytes=1 << 20)
        await send_msg(peer, protocol.Entries(crdt.encode_digest({})))
        await recv_as(peer, protocol.Records)
        await send_msg(peer, protocol.Records([b"r1", b"r2", b"r3"], done=True))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(initiator_sending_too_much)
        with pytest.raises(ProtocolError) as excinfo:
            await protocol.respond(TrioByteStream(ours), replica, info(), max_records=2)
    assert excinfo.value.reason is Reason.TOO_LARGE
    assert replica.applied == []


async def test_more_records_than_the_session_limit_is_a_protocol_error_in_a_1_0_0_session() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    peer = TrioByteStream(theirs)
    replica = FakeReplica()

    async def initiator_sending_too_much() -> None:
        await send_msg(peer, protocol.HelloV1("x", SWARM, "", crdt.encode_digest({})))
        await recv_as(peer, protocol.HelloV1, max_bytes=1 << 20)
        await recv_as(peer, protocol.Records)
        await send_msg(peer, protocol.Records([b"r1", b"r2", b"r3"], done=True))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(initiator_sending_too_much)
        with pytest.raises(ProtocolError) as excinfo:
            await protocol.respond(TrioByteStream(ours), replica, info(), max_records=2, legacy=True)
    assert excinfo.value.reason is Reason.TOO_LARGE
    assert replica.applied == []


# ---------------------------------------------------------------------------------------------------
# 2.0.0: bucket hashes first, entries and records only where they differ


def all_differ_hello(salt: bytes = b"s" * protocol.SALT_BYTES) -> protocol.Hello:
    """An initiator's hello whose every bucket hash differs from any replica's."""
    return protocol.Hello("x", SWARM, "", salt, b"\xff" * (protocol.BUCKETS * protocol.BUCKET_HASH_BYTES))


def member_records(n: int) -> list[bytes]:
    """Member records of ``n`` distinct peers, each signed by its own key."""
    out = []
    for i in range(n):
        author = SwarmState(create_new_key_pair())
        out.append(author.update_self(role="trainer", step=i).data)
    return out


def converged_pair(records: list[bytes]) -> tuple[SwarmState, SwarmState]:
    a, b = replica_with_progress(1), replica_with_progress(2)
    for replica in (a, b):
        replica.apply(records)
    a.apply(b.missing_for(a.digest()))
    b.apply(a.missing_for(b.digest()))
    assert a.digest() == b.digest()
    return a, b


class Counted:
    """A byte stream that counts what it writes (what a session costs on the wire)."""

    def __init__(self, stream: Any) -> None:
        self.inner, self.written = TrioByteStream(stream), 0

    async def read(self, max_bytes: int) -> bytes:
        return await self.inner.read(max_bytes)

    async def write(self, data: Any) -> None:
        self.written += len(data)
        await self.inner.write(data)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def counted_session(a: protocol.Replica, b: protocol.Replica, **kwargs: Any) -> tuple[Any, Any, int]:
    """One session, ``a`` initiating; returns both results and the bytes both sides wrote."""
    x, y = trio.testing.memory_stream_pair()
    ours, theirs = Counted(x), Counted(y)
    outcome: dict[str, Any] = {}

    async def responder() -> None:
        outcome["r"] = await protocol.respond(theirs, b, info(), **kwargs)
        await theirs.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(responder)
        outcome["i"] = await protocol.initiate(ours, a, info(), **kwargs)
        await ours.aclose()
    return outcome["i"], outcome["r"], ours.written + theirs.written


async def test_a_converged_pair_exchanges_two_hellos_of_a_size_independent_of_the_swarm() -> None:
    """Version 1.0.0 sent every member's digest entry in each hello: an idle pair's round grew with N."""
    costs, legacy_costs = {}, {}
    for n in (4, 200):
        a, b = converged_pair(member_records(n))
        i, r, written = await counted_session(a, b)
        assert (i.sent, i.received, r.sent, r.received) == (0, 0, 0, 0)
        assert i.differing_buckets == r.differing_buckets == 0
        costs[n] = written
        legacy_costs[n] = (await counted_session(a, b, legacy=True))[2]
    assert costs[4] == costs[200]  # the same bytes for 6 and 202 members
    assert costs[200] < 1000, costs  # two hellos of about 330 bytes
    assert legacy_costs[200] > 20 * costs[200]  # 1.0.0: 202 entries in each hello


async def test_a_pair_differing_in_one_record_moves_it_and_the_entries_of_one_bucket_only() -> None:
    records = member_records(200)
    a, b = converged_pair(records)
    author = SwarmState(create_new_key_pair())
    newer = author.update_self(role="trainer", step=1).data
    b.apply([newer])  # a new member, known to b only
    full_digest = len(crdt.encode_digest(a.digest()))
    i, r, written = await counted_session(a, b)
    assert i.differing_buckets == r.differing_buckets == 1
    assert (i.received, i.changed, i.sent, r.sent) == (1, 1, 0, 1)
    assert a.digest() == b.digest()
    # Two hellos, the entries of one bucket (about 1/32 of the table) each way and the one record:
    # far less than the one whole digest 1.0.0 sent in each hello.
    assert written < 2 * protocol.HELLO_MAX_BYTES + len(newer) + full_digest // 4


async def test_a_newcomer_gets_the_whole_table_and_sends_its_own_records_once() -> None:
    a, b = converged_pair(member_records(50))
    fresh = replica_with_progress(3)
    i, r, _ = await counted_session(fresh, b)
    assert fresh.digest().keys() == b.digest().keys() == a.digest().keys() | fresh.digest().keys()
    assert i.sent == 2 and r.received == 2 and i.received == r.sent == len(a.digest())


async def test_sessions_converge_whatever_the_differences_in_every_bucket() -> None:
    """Many records on each side only, in every bucket: one session each way leaves both equal."""
    shared = member_records(40)
    a, b = converged_pair(shared)
    a.apply(member_records(60))
    b.apply(member_records(60))
    i, r, _ = await counted_session(b, a)
    assert i.differing_buckets > 16
    assert a.digest() == b.digest() and len(a.digest()) == 4 + 40 + 120
    assert (i.sent, i.received) == (60, 60)


async def test_a_1_0_0_session_still_converges_both_sides() -> None:
    a, b = replica_with_progress(10, step=1), replica_with_progress(20, step=2)
    i, r, _ = await counted_session(a, b, legacy=True)
    assert a.digest() == b.digest() and (i.sent, r.sent) == (2, 2)
    assert i.differing_buckets == r.differing_buckets == -1


async def responder_fed(*messages: Any, max_bytes: int = 1 << 20, **kwargs: Any) -> ProtocolError:
    """Run a responder against an initiator that sends ``messages`` (reading whatever comes back);
    returns the ProtocolError the responder raised."""
    ours, theirs = trio.testing.memory_stream_pair()
    peer = TrioByteStream(theirs)

    async def initiator() -> None:
        for message in messages:
            await send_msg(peer, message, max_bytes=max_bytes)
        with trio.move_on_after(1):
            while await theirs.receive_some(65536):
                pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(initiator)
        with pytest.raises(ProtocolError) as excinfo:
            await protocol.respond(TrioByteStream(ours), replica_with_progress(1), info(), **kwargs)
        await ours.aclose()
    return excinfo.value


def hello_map(**changes: Any) -> dict[str, Any]:
    fields = {"t": "hello", "v": 2, "version": "x", "swarm": SWARM, "manifest_hash": "",
              "salt": b"s" * protocol.SALT_BYTES, "buckets": b"\0" * (protocol.BUCKETS * protocol.BUCKET_HASH_BYTES)}  # fmt: skip
    fields.update(changes)
    return fields


@pytest.mark.parametrize(
    ("changes", "reason", "words"),
    [
        ({"buckets": b"\0" * 8}, Reason.BAD_FIELD, "buckets: length 8"),
        ({"buckets": [b"\0" * 8] * 32}, Reason.BAD_FIELD, "buckets: expected bytes, got list"),
        ({"salt": b""}, Reason.BAD_FIELD, "salt: length 0"),
        ({"salt": 7}, Reason.BAD_FIELD, "salt: expected bytes, got int"),
        ({"digest": b""}, Reason.BAD_FIELD, "unknown field 'digest'"),
        ({"v": 1}, Reason.BAD_VERSION, "Hello version 1, this node speaks 2"),
        ({"swarm": "s" * 100_000}, Reason.TOO_LARGE, ""),
    ],
)
async def test_a_hostile_hello_is_refused_with_a_named_reason(changes: dict[str, Any], reason: Reason, words: str) -> None:
    error = await responder_fed(hello_map(**changes))
    assert error.reason is reason and words in str(error)


async def test_entries_in_buckets_whose_hashes_match_are_refused() -> None:
    """A peer must not make this node consider entries it did not ask for."""
    responder_state = replica_with_progress(1)
    salt = b"s" * protocol.SALT_BYTES
    theirs = protocol.bucket_hashes(responder_state.digest(), salt)
    # The initiator claims the responder's hashes in every bucket but one, then sends an entry elsewhere.
    mine = bytearray(theirs)
    mine[:protocol.BUCKET_HASH_BYTES] = b"\xff" * protocol.BUCKET_HASH_BYTES
    other_key = next(f"m:{k}" for k in range(10**6) if protocol.bucket_of(f"m:{k}") != 0)
    ours, peer_end = trio.testing.memory_stream_pair()
    peer = TrioByteStream(peer_end)

    async def initiator() -> None:
        await send_msg(peer, protocol.Hello("x", SWARM, "", salt, bytes(mine)))
        await recv_as(peer, protocol.Hello, max_bytes=protocol.HELLO_MAX_BYTES)
        await recv_as(peer, protocol.Entries, max_bytes=1 << 20)
        await send_msg(peer, protocol.Entries(crdt.encode_digest({other_key: (1, 0, 0)})))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(initiator)
        with pytest.raises(ProtocolError) as excinfo:
            await protocol.respond(TrioByteStream(ours), responder_state, info())
    assert excinfo.value.reason is Reason.MALFORMED and "whose hashes match" in str(excinfo.value)


async def test_entries_beyond_the_digest_limit_are_refused_before_they_are_used() -> None:
    too_many = {f"m:{k}": (1, 0, 0) for k in range(50)}
    error = await responder_fed(all_differ_hello(), protocol.Entries(crdt.encode_digest(too_many)),
                                max_digest_entries=10)
    assert error.reason in (Reason.MALFORMED, Reason.TOO_LARGE) and "digest" in str(error)


async def test_a_responder_that_hashes_with_another_salt_is_refused() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    peer = TrioByteStream(theirs)

    async def responder() -> None:
        await recv_as(peer, protocol.Hello, max_bytes=protocol.HELLO_MAX_BYTES)
        await send_msg(peer, all_differ_hello(salt=b"t" * protocol.SALT_BYTES))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(responder)
        with pytest.raises(ProtocolError) as excinfo:
            await protocol.initiate(TrioByteStream(ours), replica_with_progress(1), info())
    assert excinfo.value.reason is Reason.MALFORMED and "salt" in str(excinfo.value)


def test_bucket_hashes_depend_on_every_entry_and_the_salt() -> None:
    digest = {"m:a": (1, 2, 3), "m:b": (4, 5, 6), "c:a": (1, 1, 1, 1, 1), "manifest": (0, 0, 0)}
    salt = b"s" * protocol.SALT_BYTES
    base = protocol.bucket_hashes(digest, salt)
    assert len(base) == protocol.BUCKETS * protocol.BUCKET_HASH_BYTES
    assert protocol.bucket_hashes(dict(reversed(digest.items())), salt) == base  # order-free
    assert protocol.bucket_hashes(digest, b"t" * protocol.SALT_BYTES) != base
    for key in digest:
        changed = dict(digest, **{key: (*digest[key][:-1], digest[key][-1] + 1)})
        hashes = protocol.bucket_hashes(changed, salt)
        differ = [i for i in range(protocol.BUCKETS) if hashes[i * 8 : i * 8 + 8] != base[i * 8 : i * 8 + 8]]
        assert differ == [protocol.bucket_of(key)]


def test_record_batches_respect_the_count_and_byte_limits() -> None:
    small = [b"x" * 100] * (protocol.MAX_BATCH_RECORDS + 1)
    assert [len(b) for b in protocol._batches(small)] == [protocol.MAX_BATCH_RECORDS, 1]
    big = [b"y" * crdt.MAX_ENVELOPE_BYTES] * 40
    batches = list(protocol._batches(big))
    assert all(sum(map(len, b)) <= protocol.MAX_BATCH_BYTES for b in batches)
    assert sum(map(len, batches)) == 40


# ---------------------------------------------------------------------------------------------------
# Replicators on real libp2p hosts


@dataclass
class Node:
    key: KeyPair
    host: Any
    state: SwarmState
    rep: StateReplicator
    fields: dict[str, Any]
    path: Path | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stopped: trio.Event = field(default_factory=trio.Event)
    host_nursery: Any = None

    @property
    def pid(self) -> str:
        return self.state.peer_id

    def member_ids(self) -> set[str]:
        return {m.peer_id for m in self.state.members()}

    def member_state(self, pid: str) -> MemberState | None:
        view = self.state.member(pid)
        return None if view is None else view.state


def make_replicator(
    host: Any,
    state: SwarmState,
    fields: dict[str, Any],
    *,
    path: Path | None = None,
    manifest: Manifest | None = None,
    heartbeat_s: float = QUIET_HEARTBEAT_S,
    anti_entropy_s: float = ANTI_ENTROPY_S,
    gossip: bool = True,
    save_s: float = 10.0,
) -> StateReplicator:
    return StateReplicator(
        host,
        state,
        SWARM,
        path=path,
        self_fields=lambda: dict(fields),
        local_manifest=lambda: manifest,
        timing=ReplicationTiming(heartbeat_s=heartbeat_s, anti_entropy_s=anti_entropy_s, save_s=save_s),
        gossip=gossip,
    )


class Cluster:
    """Hosts and replicators for one test. Each host runs in its own task of the cluster's nursery,
    with a nursery of its own for its replicator, so a replicator can stop and restart on a live host."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.nodes: list[Node] = []

    async def add(
        self,
        *,
        tmp_path: Path | None = None,
        manifest: Manifest | None = None,
        suspect_after: float = 30.0,
        **kwargs: Any,
    ) -> Node:
        key = create_new_key_pair()
        host = build_host(key)
        state = SwarmState(key, suspect_after=suspect_after, gone_after=4 * suspect_after)
        fields: dict[str, Any] = {"role": "trainer", "version": "0.1.0", "step": 0}
        if manifest is not None:
            fields["manifest_hash"] = manifest.hash
        path = tmp_path / f"state-{len(self.nodes)}.msgpack" if tmp_path is not None else None
        rep = make_replicator(host, state, fields, path=path, manifest=manifest, **kwargs)
        node = Node(key, host, state, rep, fields, path)
        node.host_nursery = await self.nursery.start(self._serve_host, host)
        await self.start(node)
        self.nodes.append(node)
        return node

    @staticmethod
    async def _serve_host(host: Any, task_status: trio.TaskStatus[trio.Nursery]) -> None:
        async with host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]), trio.open_nursery() as nursery:
            task_status.started(nursery)
            await trio.sleep_forever()

    async def start(self, node: Node) -> None:
        node.scope, node.stopped = trio.CancelScope(), trio.Event()

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with node.scope:
                    await node.rep.run(task_status=task_status)
            finally:
                node.stopped.set()

        await node.host_nursery.start(run)

    async def stop(self, node: Node) -> None:
        """A graceful stop of the node's replicator (its host stays up)."""
        node.scope.cancel()
        with trio.fail_after(10):
            await node.stopped.wait()

    async def connect(self, *pairs: tuple[Node, Node]) -> None:
        """Connect pairs concurrently (each dial costs >= 250 ms) and tell both replicators, as the
        daemon's connection manager does."""

        async def one(a: Node, b: Node) -> None:
            await a.host.connect(info_from_p2p_addr(b.host.get_addrs()[0]))
            a.rep.peer_connected(b.host.get_id())
            b.rep.peer_connected(a.host.get_id())

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for a, b in pairs:
                    nursery.start_soon(one, a, b)


@asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    async with trio.open_nursery() as nursery:
        yield Cluster(nursery)
        nursery.cancel_scope.cancel()


@dataclass
class RecordedConnections:
    """The replicator's view of a connection manager (node/swarm/replicator.py `Connections`), recording what it
    is told: `is_crowded` is what it answers."""

    is_crowded: bool = False
    served_peers: list[ID] = field(default_factory=list)
    heard: list[ID] = field(default_factory=list)

    def crowded(self) -> bool:
        return self.is_crowded

    def served(self, peer_id: ID) -> None:
        self.served_peers.append(peer_id)

    def heard_from(self, peer_id: ID) -> None:
        self.heard.append(peer_id)


def idle_replicator() -> StateReplicator:
    """A replicator that is never run: for its scheduling decisions and its pubsub set-up."""
    key = create_new_key_pair()
    return make_replicator(build_host(key), SwarmState(key), {})


def test_anti_entropy_rounds_reach_every_connected_peer_once_per_round_of_peers() -> None:
    rep = idle_replicator()
    peers = {ID.from_pubkey(create_new_key_pair().public_key) for _ in range(6)}
    chosen = []
    for round_ in range(3 * len(peers)):
        peer = rep._least_recently_synced(peers)
        assert peer is not None
        chosen.append(peer)
        rep._last_attempt[peer] = float(round_)
    for start in range(0, len(chosen), len(peers)):
        assert set(chosen[start : start + len(peers)]) == peers


def test_a_restarted_replicator_never_reuses_a_gossip_sequence_number() -> None:
    """A gossip message's ID is (author, sequence number): reusing one gets a record dropped as a
    duplicate by every peer that saw the previous life's message (for 2 minutes in py-libp2p)."""
    rep = idle_replicator()
    previous_life, _ = rep._make_pubsub()
    for _ in range(1000):  # a busy life: more messages than seconds
        last = previous_life._next_seqno()
    next_life, _ = rep._make_pubsub()
    assert next_life._next_seqno() > last


def identical(nodes: list[Node]) -> bool:
    first = nodes[0].state.digest()
    return all(n.state.digest() == first for n in nodes[1:])


async def test_replicas_on_a_chain_converge_to_identical_state() -> None:
    async with cluster() as c:
        nodes = [await c.add() for _ in range(4)]
        await c.connect((nodes[0], nodes[1]), (nodes[1], nodes[2]), (nodes[2], nodes[3]))
        for i, node in enumerate(nodes):
            node.fields["step"] = 100 + i
            node.rep.refresh()
            node.rep.add_progress(samples=10 * (i + 1), tokens=1)
        everyone = {n.pid for n in nodes}
        await eventually(lambda: identical(nodes) and nodes[0].member_ids() == everyone, "identical digests")
        for node in nodes:
            status = node.rep.status()
            assert {m["peer_id"]: m["step"] for m in status["members"]} == {
                n.pid: 100 + i for i, n in enumerate(nodes)
            }
            assert all(m["state"] == "alive" for m in status["members"])
            totals = status["swarm_totals"]
            assert (totals["samples"], totals["tokens"]) == (100, 4)
            assert totals["members"]["alive"] == 4


async def test_heartbeats_publish_the_fields_the_daemon_reports() -> None:
    async with cluster() as c:
        a, b = await c.add(heartbeat_s=HEARTBEAT_S), await c.add(heartbeat_s=HEARTBEAT_S)
        await c.connect((a, b))
        a.fields.update(outer_step=7, loss=2.5, samples_per_s=123.0)  # no refresh(): the heartbeat carries it
        await eventually(
            lambda: (view := b.state.member(a.pid)) is not None and view.record.outer_step == 7, "heartbeat"
        )
        member = next(m for m in b.rep.status()["members"] if m["peer_id"] == a.pid)
        assert (member["loss"], member["samples_per_s"], member["state"]) == (2.5, 123.0, "alive")
        assert member["last_seen_s"] >= 0 and abs(member["last_seen"] - time.time()) < 60
        # The author's heartbeat and our receipt time, for `starling doctor`'s clock check.
        assert member["heartbeat"] <= member["received_at"] <= time.time()
        assert [v.peer_id for v in b.rep.alive_members()] == [a.pid]


async def test_a_node_without_gossip_catches_up_through_anti_entropy_alone() -> None:
    async with cluster() as c:
        nodes = [await c.add() for _ in range(3)]
        await c.connect((nodes[0], nodes[1]), (nodes[1], nodes[2]))
        for i, node in enumerate(nodes):
            node.rep.add_progress(samples=i + 1)
        await eventually(lambda: identical(nodes), "the first three converge")

        late = await c.add(gossip=False)
        late.rep.add_progress(samples=1000)
        await c.connect((late, nodes[0]))
        nodes[2].fields["step"] = 5  # an update after the late node joined, two hops away from it
        nodes[2].rep.refresh()
        everyone = nodes + [late]
        await eventually(
            lambda: identical(everyone) and late.member_ids() == {n.pid for n in everyone},
            "late node caught up",
        )
        assert late.state.member(nodes[2].pid).record.step == 5  # type: ignore[union-attr]
        assert late.state.counters().samples == 1006
        # Nothing reached it by gossip, and its own records reached nodes it is not connected to.
        assert late.rep.stats.gossip_received == 0 and late.rep.stats.records_changed > 0
        assert late.pid in nodes[2].member_ids()


def test_exactly_one_side_of_a_new_connection_starts_its_first_session() -> None:
    reps = [idle_replicator() for _ in range(6)]
    for a in reps:
        for b in reps:
            if a is not b:
                assert a._opens_first_session(b._me) != b._opens_first_session(a._me)


async def test_a_new_connection_gets_one_state_session_not_two_crossing_ones() -> None:
    """Both sides used to start a session on a new connection; the two crossed and each side sent the other
    everything it lacked twice (a newcomer got the whole table twice from the node everyone dials)."""
    async with cluster() as c:
        # No gossip: a gossip record from a peer not verified yet starts a session of its own (by design).
        a, b = [await c.add(anti_entropy_s=3600.0, gossip=False) for _ in range(2)]
        await c.connect((a, b))  # tells both replicators, as the daemon's connection manager does

        def settled() -> bool:
            return (identical([a, b]) and a.member_ids() == b.member_ids() == {a.pid, b.pid}
                    and not a.rep._in_flight and not b.rep._in_flight and a.rep._inbound == b.rep._inbound == 0)

        await eventually(settled, "one session, both replicas complete")
        for _ in range(20):  # the loops' next polls find the connection again: still no second session
            await trio.sleep(0.1)
        assert settled()
        assert (a.rep.stats.sessions_ok, b.rep.stats.sessions_ok) == (1, 1)
        # Each one's own record, once: the initiator's in its hello (2.1.0), the responder's in the session.
        sent = a.rep.stats.records_sent + b.rep.stats.records_sent
        assert (sent, a.rep.stats.introductions + b.rep.stats.introductions) == (1, 1)


async def test_without_gossip_no_gossipsub_runs_and_a_changed_record_is_pushed_at_once() -> None:
    """gossip=False (the daemon's swim mode): no pubsub service at all, and a record this node signs goes out
    in a session started at once, not with a round (an hour here) nor by gossip."""
    async with cluster() as c:
        a = await c.add(gossip=False, anti_entropy_s=3600.0)
        b = await c.add(gossip=False, anti_entropy_s=3600.0)
        assert a.rep.pubsub is None and b.rep.pubsub is None
        await c.connect((a, b))
        await eventually(lambda: a.member_ids() == b.member_ids() == {a.pid, b.pid}, "the first session")
        for node in (a, b):
            protocols = {str(p) for p in node.host.get_mux().get_protocols()}
            assert not any("meshsub" in p for p in protocols), protocols
        a.fields["step"] = 42
        a.rep.refresh()
        await eventually(
            lambda: (view := b.state.member(a.pid)) is not None and view.record.step == 42, "the pushed record"
        )
        assert b.rep.stats.gossip_received == 0 and a.rep.stats.gossip_published == 0


async def test_a_partition_heals_to_identical_state_after_reconnecting() -> None:
    async with cluster() as c:
        nodes = [await c.add() for _ in range(4)]
        left, right = nodes[:2], nodes[2:]
        await c.connect((left[0], left[1]), (right[0], right[1]))
        for round_ in range(3):  # both halves keep updating while apart
            for node in nodes:
                node.fields["step"] = round_
                node.rep.refresh()
                node.rep.add_progress(samples=1)
            await trio.sleep(0.1)
        await eventually(lambda: identical(left) and identical(right), "each half converges")
        assert not left[0].member_ids() & {n.pid for n in right}

        await c.connect((left[1], right[0]))
        await eventually(lambda: identical(nodes), "the halves merge", timeout=10.0)
        for node in nodes:
            assert node.member_ids() == {n.pid for n in nodes}
            assert node.state.counters().samples == 12


def forged_member_record(victim: str, attacker: KeyPair, *, victim_key: KeyPair | None = None) -> bytes:
    """A well-formed member record for ``victim`` saying it left, signed by ``attacker``.

    With ``victim_key``, the envelope carries the victim's public key (the signature then does not
    verify); without it, the attacker's own key (it verifies, but for the wrong peer).
    """
    record = MemberRecord(
        victim, Timestamp(int(time.time() * 1000) + 1000, 0), heartbeat=time.time(), left=True
    )
    body = encode_body(record)
    pubkey = (victim_key or attacker).public_key.serialize()
    signature = attacker.private_key.sign(crdt.SIGNING_DOMAIN + body)
    return msgpack.packb({"v": 1, "body": body, "pubkey": pubkey, "sig": signature}, use_bin_type=True)


async def test_forged_records_are_rejected_counted_and_not_spread() -> None:
    async with cluster() as c:
        a, b, victim = await c.add(), await c.add(), await c.add()
        await c.connect((a, b), (b, victim))
        await eventually(lambda: identical([a, b, victim]), "converged")
        attacker = create_new_key_pair()

        # Through gossip, injected at node a.
        assert a.rep.pubsub is not None
        await a.rep.pubsub.publish(a.rep.topic, forged_member_record(victim.pid, attacker))
        await eventually(lambda: a.state.rejected[crdt.WRONG_SIGNER] >= 1, "gossip forgery counted")
        assert a.rep.status()["swarm_totals"]["rejected"][crdt.WRONG_SIGNER] >= 1

        # Through anti-entropy, from a rogue host that speaks the protocol.
        rogue = build_host(attacker)
        async with rogue.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            await rogue.connect(info_from_p2p_addr(b.host.get_addrs()[0]))
            stream = await rogue.new_stream(b.host.get_id(), [protocol.PROTOCOL_ID])
            forged = forged_member_record(victim.pid, attacker, victim_key=victim.key)
            result = await protocol.initiate(LibP2PByteStream(stream), FakeReplica([forged]), info(), introduce=True)
            await stream.close()
        assert result.sent == 1
        assert b.rep.status()["swarm_totals"]["rejected"][crdt.BAD_SIGNATURE] == 1

        await trio.sleep(2 * ANTI_ENTROPY_S)  # give a forgery the chance to travel, were it accepted
        # The gossip forgery stopped at a (its validator refused to forward it) ...
        assert b.state.rejected[crdt.WRONG_SIGNER] == victim.state.rejected[crdt.WRONG_SIGNER] == 0
        # ... and no node took either forgery as the victim's word.
        for node in (a, b, victim):
            assert node.member_state(victim.pid) is MemberState.ALIVE
            assert attacker_pid(attacker) not in node.member_ids()


def attacker_pid(key: KeyPair) -> str:
    return crdt.peer_id_of(key.public_key)


async def test_manifest_mismatch_is_refused_logged_once_and_reported_on_both_sides(caplog: Any) -> None:
    caplog.set_level(logging.ERROR, logger="starling.replicator")
    async with cluster() as c:
        a, b = await c.add(manifest=MANIFEST_A), await c.add(manifest=MANIFEST_A)
        await c.connect((a, b))
        await eventually(lambda: a.state.manifest == b.state.manifest == MANIFEST_A, "swarm founded")

        odd = await c.add(manifest=MANIFEST_B)
        await c.connect((odd, a))
        await eventually(
            lambda: a.rep.incompatible_peers() == {odd.pid} and odd.rep.incompatible_peers() == {a.pid},
            "both sides refuse",
        )
        mismatches = a.rep.stats.manifest_mismatches + odd.rep.stats.manifest_mismatches
        a.rep.peer_connected(odd.host.get_id())  # a reconnect retries the handshake ...
        odd.rep.peer_connected(a.host.get_id())
        await eventually(
            lambda: a.rep.stats.manifest_mismatches + odd.rep.stats.manifest_mismatches >= mismatches + 2,
            "refused again",
        )

        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        about_odd = [m for m in errors if m.startswith(f"peer {odd.pid}")]
        about_a = [m for m in errors if m.startswith(f"peer {a.pid}")]
        assert len(about_odd) == 1 and len(about_a) == 1  # ... but is logged once per peer
        for message in about_odd + about_a:
            assert MANIFEST_A.hash in message and MANIFEST_B.hash in message

        # The odd node's state went nowhere, and nobody offers it for averaging.
        assert odd.pid not in a.member_ids() | b.member_ids()
        assert odd.pid not in {v.peer_id for v in a.rep.alive_members()}
        totals = a.rep.status()["swarm_totals"]
        assert totals["incompatible_peers"] == [odd.pid] and totals["replication"]["manifest_mismatches"] >= 1
        assert totals["manifest_hash"] == MANIFEST_A.hash
        # Issue #27: what differs, for `status` (which showed the refused peer only as "suspect").
        [differs] = totals["incompatible"]
        assert (differs["peer_id"], differs["field"], differs["theirs"], differs["ours"]) == (
            odd.pid, "manifest", MANIFEST_B.hash, MANIFEST_A.hash)
        assert totals["our_manifest"] is not None and totals["our_manifest"]["task"] == MANIFEST_A.task


async def test_a_node_whose_manifest_differs_from_the_swarms_it_knows_reports_it(caplog: Any) -> None:
    caplog.set_level(logging.ERROR, logger="starling.replicator")
    async with cluster() as c:
        node = await c.add(manifest=MANIFEST_B)
        await c.stop(node)
        # As after a restart with a changed config: the saved view holds the swarm's manifest A.
        founder = SwarmState(create_new_key_pair())
        founded = founder.set_manifest(MANIFEST_A)
        assert founded is not None and node.state.merge(founded)
        node.rep = make_replicator(node.host, node.state, node.fields, manifest=MANIFEST_B)
        await c.start(node)
        assert node.rep.manifest_error is not None  # checked on the first heartbeat, at start
        error = node.rep.status()["swarm_totals"]["manifest_error"]
        assert MANIFEST_A.hash in error and MANIFEST_B.hash in error
        assert MANIFEST_A.hash in caplog.text and MANIFEST_B.hash in caplog.text


async def test_a_graceful_stop_publishes_left_and_saves(tmp_path: Path) -> None:
    async with cluster() as c:
        nodes = [await c.add(tmp_path=tmp_path, heartbeat_s=HEARTBEAT_S) for _ in range(3)]
        a, b, leaving = nodes
        await c.connect((a, b), (b, leaving), (a, leaving))
        others = {a.host.get_id(), b.host.get_id()}

        def gossip_mesh_ready() -> bool:
            pubsub = leaving.rep.pubsub
            return pubsub is not None and set(pubsub.router.mesh.get(leaving.rep.topic, ())) >= others  # type: ignore[attr-defined]

        await eventually(gossip_mesh_ready, "gossip mesh formed")
        await eventually(
            lambda: all(n.member_state(leaving.pid) is MemberState.ALIVE for n in (a, b)), "alive"
        )

        await c.stop(leaving)
        await eventually(
            lambda: all(n.member_state(leaving.pid) is MemberState.LEFT for n in (a, b)), "departure seen"
        )
        assert leaving.path is not None
        saved = SwarmState.load(leaving.path, leaving.key)
        assert saved.member(leaving.pid).state is MemberState.LEFT  # type: ignore[union-attr]
        assert saved.member(a.pid) is not None


async def test_a_graceful_stop_reaches_peers_by_anti_entropy_when_gossip_carries_nothing() -> None:
    async with cluster() as c:
        a = await c.add(heartbeat_s=HEARTBEAT_S, anti_entropy_s=3600.0)
        leaving = await c.add(heartbeat_s=HEARTBEAT_S, gossip=False, anti_entropy_s=3600.0)
        await c.connect((a, leaving))
        await eventually(lambda: a.member_state(leaving.pid) is MemberState.ALIVE, "alive")
        await c.stop(leaving)  # no gossip and no regular round due: only the goodbye's session can tell `a`
        await eventually(lambda: a.member_state(leaving.pid) is MemberState.LEFT, "departure seen")


async def test_state_is_saved_periodically_and_restored_on_restart(tmp_path: Path) -> None:
    async with cluster() as c:
        a = await c.add(tmp_path=tmp_path, save_s=0.2)
        b = await c.add()
        await c.connect((a, b))
        b.rep.add_progress(samples=7)
        a.rep.add_progress(samples=5)
        await eventually(lambda: identical([a, b]), "converged")
        assert a.path is not None
        await eventually(lambda: a.rep.stats.saves >= 1 and a.path.exists(), "periodic save")  # type: ignore[union-attr]
        await c.stop(a)
        await eventually(lambda: b.member_state(a.pid) is MemberState.LEFT, "a left")

        restored = load_state(a.path, a.key)
        assert restored.member(b.pid) is not None and restored.counters().samples == 12
        # Restart on the restored state: the new heartbeat supersedes the departure everywhere.
        a.state = restored
        a.rep = make_replicator(a.host, restored, a.fields, path=a.path)
        await c.start(a)
        a.rep.peer_connected(b.host.get_id())
        await eventually(lambda: b.member_state(a.pid) is MemberState.ALIVE, "a is back")
        assert restored.member(a.pid).state is MemberState.ALIVE  # type: ignore[union-attr]


async def test_before_its_first_session_a_restarted_node_takes_gossip_about_members_it_knows_and_nothing_else() -> None:
    async with cluster() as c:
        restarted, peer = await c.add(), await c.add(heartbeat_s=HEARTBEAT_S)
        # As after a restart: its state file lists the peer, and no session can complete (both stop
        # serving the state protocol, as an overloaded peer that times out would).
        restarted.state.apply(peer.state.missing_for({}))
        for node in (restarted, peer):
            for protocol_id in protocol.PROTOCOL_IDS:
                node.host.remove_stream_handler(protocol_id)
        await c.connect((restarted, peer))

        peer.fields["step"] = 5  # the peer's next heartbeats carry it, by gossip only
        await eventually(
            lambda: (view := restarted.state.member(peer.pid)) is not None and view.record.step == 5,
            "gossip about a member it knows",
        )
        # A record of a peer it has never heard of waits for the handshake (it could be another run's).
        stranger = SwarmState(create_new_key_pair())
        refused = restarted.rep.stats.gossip_refused
        assert peer.rep.pubsub is not None
        await peer.rep.pubsub.publish(peer.rep.topic, stranger.update_self(step=1).data)
        await eventually(lambda: restarted.rep.stats.gossip_refused > refused, "the stranger refused")
        assert stranger.peer_id not in restarted.member_ids()
        assert restarted.rep.stats.sessions_ok == 0 and restarted.rep.stats.session_failures["open"] >= 1


@pytest.mark.parametrize("serves, handler", [
    (protocol.PROTOCOL_ID_1_0, "_handle_legacy_stream"),  # a node of a release before 2.0.0
    (protocol.PROTOCOL_ID_2_0, "_handle_stream_2_0"),  # before 2.1.0 (no record in the initiator's hello)
])
async def test_a_node_of_an_older_release_still_syncs_both_ways(serves: str, handler: str) -> None:
    """Swarms upgrade node by node: a peer that serves only an older version is spoken to (and served) in it."""
    async with cluster() as c:
        new, old = await c.add(gossip=False), await c.add(gossip=False)
        for newer in protocol.PROTOCOL_IDS[:protocol.PROTOCOL_IDS.index(serves)]:
            old.host.remove_stream_handler(newer)
        sessions = []

        async def counted(stream: Any) -> None:
            sessions.append(stream)
            await getattr(old.rep, handler)(stream)

        old.host.set_stream_handler(serves, counted)
        await c.connect((new, old))
        for i, node in enumerate((new, old)):
            node.fields["step"] = 10 + i
            node.rep.refresh()
        await eventually(lambda: identical([new, old]) and new.member_ids() == {new.pid, old.pid}, "identical digests")
        assert sessions  # new asked for the newer versions first, fell back to the one served
        assert old.rep.stats.introductions == 0  # (its own sessions to new are 2.1.0's here: it runs this code)
        assert new.rep.stats.session_failures["open"] == old.rep.stats.session_failures["open"] == 0


async def test_a_connected_member_that_goes_quiet_is_probed_so_it_stays_alive_without_gossip() -> None:
    async with cluster() as c:
        # No gossip, and no anti-entropy round after the first for a minute: only probes bring news.
        quiet = {"gossip": False, "anti_entropy_s": 60.0, "suspect_after": 2.0}
        member = await c.add(heartbeat_s=HEARTBEAT_S, **quiet)
        observer = await c.add(**quiet)
        await c.connect((member, observer))
        await eventually(lambda: observer.member_state(member.pid) is MemberState.ALIVE, "first session")
        first = observer.state.member(member.pid).record.hlc  # type: ignore[union-attr]
        changed = observer.rep.stats.records_changed
        await eventually(lambda: observer.rep.stats.records_changed >= changed + 3, "newer heartbeats")
        assert observer.state.member(member.pid).record.hlc > first  # type: ignore[union-attr]
        assert member.rep.stats.gossip_published == observer.rep.stats.gossip_published == 0


async def test_a_restarted_node_reasserts_itself_as_soon_as_a_peer_shows_it_a_newer_record_of_its_own() -> None:
    async with cluster() as c:
        node, peer = await c.add(), await c.add()  # heartbeats a minute apart: none during the test
        # Its previous life's last record, signed with a clock 100 s ahead (adopted from a fast peer),
        # never reached its state file, but the peer holds it.
        previous_life = SwarmState(node.key, clock=lambda: time.time() + 100)
        assert peer.state.merge(previous_life.update_self(step=1))
        node.fields["step"] = 2
        await c.connect((node, peer))
        await eventually(
            lambda: (view := peer.state.member(node.pid)) is not None and view.record.step == 2,
            "the node's current record replaces its previous life's",
        )


def test_progress_counters_travel_by_anti_entropy_not_gossip() -> None:
    rep = idle_replicator()
    rep.add_progress(samples=5, tokens=7)
    assert rep.state.counters() == crdt.Totals(5, 7)
    assert rep._outbox_recv.statistics().current_buffer_used == 0  # nothing queued for gossip


def test_a_corrupt_state_file_is_moved_aside_and_an_empty_state_used(tmp_path: Path, caplog: Any) -> None:
    path = tmp_path / "state.msgpack"
    path.write_bytes(b"\x00not a state file")
    key = create_new_key_pair()
    with caplog.at_level(logging.WARNING, logger="starling.replicator"):
        state = load_state(path, key)
    assert state.members() == [] and not path.exists()
    assert (tmp_path / "state.msgpack.corrupt").read_bytes() == b"\x00not a state file"
    assert "moved it to" in caplog.text


class _Muxed:
    def __init__(self, peer_id: ID) -> None:
        self.peer_id = peer_id


class HeldStateStream:
    """An inbound state stream from `peer_id` whose session the test holds open (what a peer keeping
    sessions alive with empty record batches does); records whether it was refused busy."""

    def __init__(self, peer_id: ID, sent: bytes = b"") -> None:
        self.muxed_conn = _Muxed(peer_id)
        self.refused = False
        self.unread = bytearray(sent)  # what the initiator sent (a refusal on 2.1.0 reads its hello)

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        size = len(self.unread) if n is None else min(n, len(self.unread))
        data = bytes(self.unread[:size])
        del self.unread[:size]
        return data

    async def write(self, data: bytes) -> None:
        self.refused = True  # the only thing the handler writes itself is the busy refusal

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


class WrittenStateStream(HeldStateStream):
    """As :class:`HeldStateStream`, keeping what the handler wrote (the busy refusal)."""

    def __init__(self, peer_id: ID, sent: bytes = b"") -> None:
        super().__init__(peer_id, sent)
        self.written = bytearray()

    async def write(self, data: bytes) -> None:
        self.refused = True
        self.written += data


async def written_error(stream: WrittenStateStream, cls: Any) -> Any:
    ours, theirs = trio.testing.memory_stream_pair()
    await theirs.send_all(bytes(stream.written))
    return await recv_as(TrioByteStream(ours), cls, max_bytes=1 << 20)


async def test_a_busy_replicator_refers_to_other_alive_members_never_the_asker() -> None:
    replicator = idle_replicator()
    gate = trio.Event()

    async def session(peer: ID, stream: Any, *, initiator: bool, legacy: bool = False,
                      introduce: bool = False) -> None:
        await gate.wait()

    replicator._session = session  # type: ignore[method-assign]
    asker_key = create_new_key_pair()
    asker = ID.from_pubkey(asker_key.public_key)
    asker_state = SwarmState(asker_key)
    replicator.state.merge(asker_state.update_self(addrs=("/ip4/10.0.0.99/tcp/4001",)).data)
    dialable = [member_record(addrs=(f"/ip4/10.0.1.{i}/tcp/4001",)) for i in range(10)]
    silent = [member_record() for _ in range(3)]  # no addresses: behind the dialable ones
    for _, data in dialable + silent:
        replicator.state.merge(data)
    replicator.state.update_self(addrs=("/ip4/10.0.0.1/tcp/4001",))
    async with trio.open_nursery() as nursery:
        streams = [WrittenStateStream(asker) for _ in range(3)]  # its share is 2: the third is refused
        for s in streams:
            nursery.start_soon(replicator._handle_stream, s)
        await trio.testing.wait_all_tasks_blocked()
        refused = [s for s in streams if s.refused]
        assert len(refused) == 1
        error = await written_error(refused[0], protocol.Error)
        gate.set()
    assert error.code == protocol.BUSY and len(error.referral) == protocol.MAX_REFERRAL_RECORDS
    referred = {replicator.state.verify(data).record.peer_id for data in error.referral}
    assert referred <= {state.peer_id for state, _ in dialable}  # dialable members first; not the asker, not itself
    assert replicator.stats.referred_records == protocol.MAX_REFERRAL_RECORDS
    # A legacy (1.0.0) stream's refusal carries none.
    async with trio.open_nursery() as nursery:
        gate = trio.Event()
        streams = [WrittenStateStream(asker) for _ in range(3)]
        for s in streams:
            nursery.start_soon(functools.partial(replicator._handle_stream, s, legacy=True))
        await trio.testing.wait_all_tasks_blocked()
        refused = [s for s in streams if s.refused]
        legacy_error = await written_error(refused[0], protocol.ErrorV1)
        gate.set()
    assert legacy_error.code == protocol.BUSY


def test_a_referral_looks_at_a_bounded_sample_of_members_and_holds_only_valid_alive_ones() -> None:
    """A crowded bootstrap refers every newcomer: each referral looks at most at REFERRAL_DRAWS members' views
    (the liveness asked once per member looked at), not every member's, and still holds up to 8 signed records
    of alive members with addresses, never the asker or the node itself, within the referral's bytes."""
    replicator = idle_replicator()
    members = [member_record(addrs=(f"/ip4/10.0.{i // 250}.{i % 250}/tcp/4001",)) for i in range(240)]
    for _, data in members:
        replicator.state.merge(data)
    replicator.state.update_self(addrs=("/ip4/10.0.0.1/tcp/4001",))
    suspect = {state.peer_id for state, _ in members[::4]}  # a quarter held suspect by SWIM
    asked: list[str] = []

    def liveness(peer_id: str) -> MemberState:
        asked.append(peer_id)
        return MemberState.SUSPECT if peer_id in suspect else MemberState.ALIVE

    replicator.liveness = CallableLiveness(liveness)
    asker = members[1][0].peer_id
    for _ in range(5):
        asked.clear()
        referral = replicator._referral(asker)
        assert len(asked) <= REFERRAL_DRAWS < len(members)
        assert len(referral) == protocol.MAX_REFERRAL_RECORDS and sum(map(len, referral)) <= protocol.MAX_REFERRAL_BYTES
        for data in referral:
            record = replicator.state.verify(data).record  # signed, verifies
            assert isinstance(record, MemberRecord) and record.addrs
            assert record.peer_id not in suspect and record.peer_id not in (asker, replicator.state.peer_id)


async def test_a_crowded_replicator_hands_a_newcomer_on_with_a_referral_and_serves_members() -> None:
    """Over its connection cap, a newcomer (no record of it held) gets a referral, not the whole table, though
    session slots are free; a member whose record it holds still gets a session, and so does a newcomer
    when the node is not crowded."""
    replicator = idle_replicator()
    conns = replicator.connections = RecordedConnections(is_crowded=True)  # the daemon's connection manager
    sessions: list[ID] = []

    async def session(peer: ID, stream: Any, *, initiator: bool, legacy: bool = False,
                      introduce: bool = False) -> None:
        sessions.append(peer)

    replicator._session = session  # type: ignore[method-assign]
    for _, data in [member_record(addrs=(f"/ip4/10.0.1.{i}/tcp/4001",)) for i in range(10)]:
        replicator.state.merge(data)
    member_key = create_new_key_pair()
    replicator.state.merge(SwarmState(member_key).update_self(addrs=("/ip4/10.0.0.99/tcp/4001",)).data)
    member = ID.from_pubkey(member_key.public_key)
    newcomer = ID.from_pubkey(create_new_key_pair().public_key)

    handed_on = WrittenStateStream(newcomer)
    await replicator._handle_stream(handed_on)
    error = await written_error(handed_on, protocol.Error)
    assert error.code == protocol.BUSY and len(error.referral) == protocol.MAX_REFERRAL_RECORDS
    assert conns.served_peers == [newcomer]  # no grace needed any more
    assert sessions == [] and replicator.stats.newcomers_handed_on == 1 and replicator.stats.peer_share_refusals == 0
    await replicator._handle_stream(WrittenStateStream(member))
    conns.is_crowded = False
    await replicator._handle_stream(WrittenStateStream(newcomer))
    assert sessions == [member, newcomer] and replicator.stats.busy_refusals == 1
    # A 1.0.0 refusal carries no referral, so a 1.0.0 newcomer is served as before.
    conns.is_crowded = True
    await replicator._handle_stream(WrittenStateStream(newcomer), legacy=True)
    assert sessions[-1] == newcomer and replicator.stats.newcomers_handed_on == 1
    # The side referred on is told when a referral brought members new to it (the daemon dials them at once).
    told: list[bool] = []
    replicator.on_new_members = lambda: told.append(True)
    replicator._refused(str(member), SyncRefused(protocol.BUSY, referred=ApplyResult(unchanged=8)))
    replicator._refused(str(member), SyncRefused(protocol.BUSY, referred=ApplyResult(changed=2, unchanged=6)))
    assert told == [True] and replicator.stats.referrals_changed == 2


def crowded_replicator_recording_sessions() -> tuple[StateReplicator, list[ID]]:
    """A replicator over its connection cap whose sessions only record the peer they would be with."""
    replicator = idle_replicator()
    replicator.connections = RecordedConnections(is_crowded=True)
    sessions: list[ID] = []

    async def session(peer: ID, stream: Any, *, initiator: bool, legacy: bool = False,
                      introduce: bool = False) -> None:
        sessions.append(peer)

    replicator._session = session  # type: ignore[method-assign]
    return replicator, sessions


async def test_a_crowded_replicator_with_too_few_members_to_refer_serves_a_newcomer_and_learns_its_record() -> None:
    """Over its cap but holding fewer members than a referral carries (a bootstrap node whose newcomers all
    arrived before it held anyone), a newcomer is served a session rather than referred to those few: a
    refusal would bring this node nothing of the newcomer, and its referrals would stay as short as its
    table (docs/benchmarks.md, "Scale: real daemons", 2026-11-27). Once its referral fills, newcomers are
    handed on again."""
    replicator, sessions = crowded_replicator_recording_sessions()
    few = [member_record(addrs=(f"/ip4/10.0.1.{i}/tcp/4001",)) for i in range(protocol.MAX_REFERRAL_RECORDS - 1)]
    for _, data in few:
        replicator.state.merge(data)
    first = ID.from_pubkey(create_new_key_pair().public_key)
    await replicator._handle_stream_2_0(WrittenStateStream(first))  # (2.1.0: see the test after this one)
    assert sessions == [first]
    assert replicator.stats.busy_refusals == 0 and replicator.stats.newcomers_handed_on == 0
    # One more member to refer to: the referral is full, and the next newcomer is handed on with it.
    replicator.state.merge(member_record(addrs=("/ip4/10.0.2.1/tcp/4001",))[1])
    later = WrittenStateStream(ID.from_pubkey(create_new_key_pair().public_key))
    await replicator._handle_stream_2_0(later)
    error = await written_error(later, protocol.Error)
    assert error.code == protocol.BUSY and len(error.referral) == protocol.MAX_REFERRAL_RECORDS
    assert sessions == [first] and replicator.stats.newcomers_handed_on == 1


async def test_on_2_1_0_a_crowded_node_hands_a_newcomer_on_with_any_member_to_name_and_serves_it_with_none() -> None:
    """On 2.1.0 a refusal learns the newcomer from its hello, so a crowded node refers it on with whatever members
    it can name (a session would cost it the whole table, at the moment every newcomer arrives); holding nobody
    to name, it serves the session."""
    replicator, sessions = crowded_replicator_recording_sessions()
    first = ID.from_pubkey(create_new_key_pair().public_key)
    await replicator._handle_stream(WrittenStateStream(first))
    assert sessions == [first] and replicator.stats.newcomers_handed_on == 0
    replicator.state.merge(member_record(addrs=("/ip4/10.0.2.1/tcp/4001",))[1])
    later = WrittenStateStream(ID.from_pubkey(create_new_key_pair().public_key))
    await replicator._handle_stream(later)
    error = await written_error(later, protocol.Error)
    assert error.code == protocol.BUSY and len(error.referral) == 1
    assert sessions == [first] and replicator.stats.newcomers_handed_on == 1


class OpenedStateStream(WrittenStateStream):
    """An outbound state stream as ``host.new_stream`` returns it, negotiated on 2.0.0."""

    def get_protocol(self) -> str:
        return str(protocol.PROTOCOL_ID)


async def test_a_state_stream_that_takes_a_crowded_bootstraps_time_to_open_still_gets_its_session(autojump_clock: Any) -> None:
    """A newcomer's state stream to the bootstrap node took 9-14 s to open at a 64-daemon join (the bootstrap
    bringing it to its handler): the session waits for it rather than giving up at 10 s and opening another,
    which left half the newcomers without the referral that was on its way (docs/benchmarks.md, "Scale: real
    daemons", 2026-11-27)."""
    replicator = idle_replicator()
    peer = ID.from_pubkey(create_new_key_pair().public_key)
    stream = OpenedStateStream(peer)
    sessions: list[Any] = []

    async def slow_open(peer_id: ID, protocols: Any) -> Any:
        await trio.sleep(14.0)
        return stream

    async def session(peer_id: ID, opened: Any, *, initiator: bool, legacy: bool = False,
                      introduce: bool = False) -> None:
        sessions.append((peer_id, opened, initiator))

    replicator.host.new_stream = slow_open  # type: ignore[method-assign]
    replicator._session = session  # type: ignore[method-assign]
    replicator._in_flight.add(peer)
    await replicator._sync_with(peer)
    assert sessions == [(peer, stream, True)] and not replicator.stats.session_failures
    assert peer not in replicator._in_flight


def test_the_host_lets_a_state_streams_negotiation_run_as_long_as_the_replicator_waits_for_it() -> None:
    """py-libp2p negotiates an outbound stream's protocol under its own limit (10 s by default), which failed
    newcomers' state streams to a crowded bootstrap whatever :data:`OPEN_TIMEOUT_S` allowed."""
    replicator = idle_replicator()
    config = replicator.host.get_network().connection_config
    assert config.outbound_stream_protocol_negotiation_timeout >= OPEN_TIMEOUT_S


async def test_one_peer_holding_sessions_takes_at_most_its_share_and_other_peers_are_still_served() -> None:
    replicator = idle_replicator()
    gate, held = trio.Event(), []

    async def session(peer: ID, stream: Any, *, initiator: bool, legacy: bool = False,
                      introduce: bool = False) -> None:
        held.append(peer)
        await gate.wait()

    replicator._session = session  # type: ignore[method-assign]
    hog = ID.from_pubkey(create_new_key_pair().public_key)
    honest = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(3)]
    async with trio.open_nursery() as nursery:
        hog_streams = [HeldStateStream(hog) for _ in range(8)]
        for s in hog_streams:
            nursery.start_soon(replicator._handle_stream, s)
        await trio.testing.wait_all_tasks_blocked()
        assert held.count(hog) == 2 and sum(s.refused for s in hog_streams) == 6
        others = [HeldStateStream(p) for p in honest]
        for s in others:
            nursery.start_soon(replicator._handle_stream, s)
        await trio.testing.wait_all_tasks_blocked()
        assert set(honest) <= set(held) and not any(s.refused for s in others)
        assert replicator.stats.busy_refusals == replicator.stats.peer_share_refusals == 6  # slots were left
        gate.set()
    assert replicator._inbound == 0 and replicator._inbound_by_peer == {}


def test_a_session_that_brought_new_records_is_told_to_the_daemon_and_marks_its_peer_served() -> None:
    """A newcomer's first session gives it the members to dial: the daemon hands them to its connection
    manager at once (not at its next 5 s look), and the serving side's connection manager may close the
    connection for its cap without waiting out the newcomer's grace (issue #24, the 64-daemon join)."""
    replicator = idle_replicator()
    told: list[bool] = []
    conns = replicator.connections = RecordedConnections()
    replicator.on_new_members = lambda: told.append(True)
    peer = ID.from_pubkey(create_new_key_pair().public_key)
    replicator._synced(peer.to_base58(), protocol.SessionResult(0, 3, 0, 0, "", ""))  # nothing new here
    replicator._synced(peer.to_base58(), protocol.SessionResult(0, 3, 2, 0, "", ""))
    assert told == [True] and conns.served_peers == [peer, peer]


def intro_hello(record: bytes, swarm: str = SWARM) -> bytes:
    """A 2.1.0 initiator's hello on the wire, carrying ``record``."""
    salt = bytes(protocol.SALT_BYTES)
    hello = protocol.IntroHello("0.1.0", swarm, "", salt, protocol.bucket_hashes({}, salt), record)
    return encode_msg(hello, max_bytes=protocol.INTRO_HELLO_MAX_BYTES)


def crowded_replicator_with_members(n: int = protocol.MAX_REFERRAL_RECORDS + 2) -> StateReplicator:
    """A replicator over its connection cap that holds enough members with addresses to refer newcomers on."""
    replicator = idle_replicator()
    replicator.connections = RecordedConnections(is_crowded=True)
    for _, data in [member_record(addrs=(f"/ip4/10.0.1.{i}/tcp/4001",)) for i in range(n)]:
        replicator.state.merge(data)
    return replicator


async def test_a_crowded_node_that_refers_a_newcomer_on_keeps_the_record_its_hello_introduced() -> None:
    """On 2.1.0 a refusal reads the newcomer's hello first and takes the record it carries, so that later
    newcomers are referred to this one; on 2.0.0 a refusal takes nothing (its hello has no record)."""
    replicator = crowded_replicator_with_members()
    newcomer_key = create_new_key_pair()
    newcomer = ID.from_pubkey(newcomer_key.public_key)
    record = SwarmState(newcomer_key).update_self(addrs=("/ip4/10.0.9.9/tcp/4001",)).data

    old_peer = WrittenStateStream(newcomer, sent=intro_hello(record))
    await replicator._handle_stream_2_0(old_peer)  # a 2.0.0 refusal: the stream is not read
    assert (await written_error(old_peer, protocol.Error)).code == protocol.BUSY
    assert not replicator.state.holds(str(newcomer)) and replicator.stats.introductions == 0

    refused = WrittenStateStream(newcomer, sent=intro_hello(record))
    await replicator._handle_stream(refused)
    error = await written_error(refused, protocol.Error)
    assert error.code == protocol.BUSY and len(error.referral) == protocol.MAX_REFERRAL_RECORDS
    assert replicator.stats.newcomers_handed_on == 2
    assert replicator.state.holds(str(newcomer)) and replicator.stats.introductions == 1
    view = replicator.state.member(str(newcomer))
    assert view is not None and view.record.addrs == ("/ip4/10.0.9.9/tcp/4001",)
    # Another newcomer's referral may now name it.
    named: set[str] = set()
    for _ in range(20):
        named |= {replicator.state.verify(data).peer_id for data in replicator._referral("someone else")}
    assert str(newcomer) in named


async def test_in_swim_mode_a_newcomer_that_introduced_itself_is_referred_to_before_swim_hears_of_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A crowded node whose SWIM has not heard of anyone yet (every member shown gone: at a join, its SWIM
    streams with the newcomers are still being negotiated) names, in its referrals, the newcomers whose own
    hellos brought it their records within INTRODUCED_FRESH_S; not those it learnt otherwise, nor after that."""
    replicator = crowded_replicator_with_members()
    replicator.liveness = CallableLiveness(lambda peer_id: MemberState.GONE)
    replicator._inbound = MAX_INBOUND_SESSIONS  # every session slot taken: refused, with what it can name
    assert replicator._referral("someone else") == []  # the members it holds came another way
    newcomer_key = create_new_key_pair()
    newcomer = ID.from_pubkey(newcomer_key.public_key)
    record = SwarmState(newcomer_key).update_self(addrs=("/ip4/10.0.9.9/tcp/4001",)).data
    refused = WrittenStateStream(newcomer, sent=intro_hello(record))
    await replicator._handle_stream(refused)
    assert (await written_error(refused, protocol.Error)).code == protocol.BUSY
    assert [replicator.state.verify(data).peer_id for data in replicator._referral("someone else")] == [str(newcomer)]
    later = replicator._clock() + INTRODUCED_FRESH_S
    monkeypatch.setattr(replicator, "_clock", lambda: later)
    assert replicator._referral("someone else") == []


def test_the_newcomers_remembered_as_just_introduced_are_bounded_the_oldest_forgotten_first() -> None:
    """Every hello from a new peer adds one: a stream of fresh identities (all within INTRODUCED_FRESH_S) must
    not grow the memory without bound."""
    from types import SimpleNamespace

    rep = idle_replicator()
    for i in range(REFERRALS_COUNTED + 10):
        rep._count_introduced(SimpleNamespace(introduced=1, delivery=SimpleNamespace(peer_id=f"peer{i}")))
    assert len(rep._introduced_at) == REFERRALS_COUNTED
    assert "peer0" not in rep._introduced_at and f"peer{REFERRALS_COUNTED + 9}" in rep._introduced_at


async def test_a_hello_introduces_its_sender_alone_and_an_incompatible_one_nobody() -> None:
    """A record in a hello that its sender did not sign (another member's, even validly signed) is not taken,
    nor is the record of an initiator from another swarm; the refusal goes out either way."""
    replicator = crowded_replicator_with_members()
    newcomer = ID.from_pubkey(create_new_key_pair().public_key)
    other_state, others_record = member_record(addrs=("/ip4/10.0.8.8/tcp/4001",))
    relayed = WrittenStateStream(newcomer, sent=intro_hello(others_record))
    await replicator._handle_stream(relayed)
    assert (await written_error(relayed, protocol.Error)).code == protocol.BUSY
    assert not replicator.state.holds(other_state.peer_id)

    stranger_key = create_new_key_pair()
    stranger = ID.from_pubkey(stranger_key.public_key)
    own = SwarmState(stranger_key).update_self(addrs=("/ip4/10.0.7.7/tcp/4001",)).data
    foreign = WrittenStateStream(stranger, sent=intro_hello(own, swarm="another-swarm"))
    await replicator._handle_stream(foreign)
    assert (await written_error(foreign, protocol.Error)).code == protocol.BUSY
    assert not replicator.state.holds(str(stranger)) and replicator.stats.introductions == 0

    # The same checks where a session is served: the replica as a session sees it takes its peer's record only.
    replica = DeliveredReplica(replicator.state, Delivery(str(newcomer), "loopback"))
    assert not replica.introduce(others_record) and not replica.introduce(b"\x00garbage")
    assert replica.introduced == 0 and not replicator.state.holds(other_state.peer_id)


async def test_a_served_2_1_0_session_takes_the_initiators_record_from_its_hello_not_from_its_records() -> None:
    """A newcomer's own record arrives with its hello; the session then sends nothing back for it."""
    newcomer, holder = SwarmState(create_new_key_pair()), SwarmState(create_new_key_pair())
    newcomer.update_self(step=1)
    holder.update_self(step=2)
    ours, theirs = trio.testing.memory_stream_pair()
    responder = DeliveredReplica(holder, Delivery(newcomer.peer_id, "loopback"))
    own = newcomer.member_data(newcomer.peer_id)
    assert own is not None
    results: dict[str, Any] = {}

    async def respond() -> None:
        results["r"] = await protocol.respond(TrioByteStream(theirs), responder, info(), introduce=True)

    async def initiate() -> None:
        local = LocalInfo("0.1.0", SWARM, "", own)
        results["i"] = await protocol.initiate(TrioByteStream(ours), newcomer, local, introduce=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(respond)
        nursery.start_soon(initiate)
    assert responder.introduced == 1 and holder.holds(newcomer.peer_id) and newcomer.holds(holder.peer_id)
    assert results["i"].sent == 0 and results["r"].received == 0  # its record went in the hello alone


async def test_a_newcomer_refused_with_nobody_new_to_dial_asks_its_only_peer_again_within_seconds(
        autojump_clock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A newcomer's only connection, refusing it "busy" with a referral that names nobody new (the join's
    first second, or every member named its share), is asked again after REFUSED_RETRY_S, doubling while
    it goes on, not at the next round; not where the referral named someone new, nor where the node has
    other peers to sync with; a state stream that cannot be opened on it is retried the same way. The retry
    is then started by the anti-entropy loop (a prompt)."""
    rep = idle_replicator()
    rep.anti_entropy_s = 5.0  # (the default; the retries stay under it)
    monkeypatch.setattr(replicator_module.random, "uniform", lambda lo, hi: 1.0)  # no jitter: exact delays
    bootstrap, other = (ID.from_pubkey(create_new_key_pair().public_key) for _ in range(2))
    connected = {bootstrap}
    rep._connected = lambda: set(connected)  # type: ignore[method-assign]
    now = trio.current_time()
    rep._retry_soon_if_stuck(bootstrap, SyncRefused("busy", referred=ApplyResult(unchanged=3)))
    assert rep._retry_at[bootstrap] - now == REFUSED_RETRY_S
    rep._retry_soon_if_stuck(bootstrap, SyncRefused("busy"))
    assert rep._retry_at[bootstrap] - now == 2 * REFUSED_RETRY_S  # doubled: a second such refusal in a row
    del rep._retry_at[bootstrap]
    rep._retry_soon_if_stuck(bootstrap, SyncRefused("busy", referred=ApplyResult(changed=2)))
    assert bootstrap not in rep._retry_at and bootstrap not in rep._empty_refusals  # someone new to dial
    connected.add(other)
    rep._retry_soon_if_stuck(bootstrap, SyncRefused("busy"))
    assert bootstrap not in rep._retry_at  # others to sync with
    # A state stream that cannot be opened on the only connection is retried so too.
    connected.discard(other)
    rep._empty_refusals.clear()

    async def cannot_open(peer: ID, protocols: Any) -> Any:
        raise ConnectionError("stream reset")

    rep.host.new_stream = cannot_open  # type: ignore[method-assign]
    rep._in_flight.add(bootstrap)
    await rep._sync_with(bootstrap)
    assert rep._retry_at[bootstrap] - trio.current_time() == REFUSED_RETRY_S
    # The loop starts the round's session at once, and the retry when it is due, long before the next round.
    rep._retry_at[bootstrap] = trio.current_time() + 0.3
    started: list[float] = []

    async def sync_with(peer: ID) -> None:
        started.append(trio.current_time())
        rep._in_flight.discard(peer)

    rep._sync_with = sync_with  # type: ignore[method-assign]
    t0 = trio.current_time()
    with trio.move_on_after(2.0):
        await rep._anti_entropy_loop()
    assert len(started) == 2 and started[1] - t0 < 2.0 < rep.anti_entropy_s * 0.8


def test_referrals_name_each_member_about_as_often_as_any_other() -> None:
    """A crowded node refers most newcomers of a join within seconds: the members it names are the least named
    so far, so none becomes the hub every newcomer dials (at random, the few it held first were named again
    and again)."""
    replicator = crowded_replicator_with_members(20)
    now = [1000.0]
    replicator._clock = lambda: now[0]
    for _ in range(10):
        assert len(replicator._referral("a newcomer")) == protocol.MAX_REFERRAL_RECORDS
    counts = replicator._times_referred
    assert sum(counts.values()) == 10 * protocol.MAX_REFERRAL_RECORDS and len(counts) == 20
    assert max(counts.values()) - min(counts.values()) <= 1
    # None is named more than MAX_TIMES_NAMED times within REFERRAL_COUNT_S: 20 members fill 20 referrals.
    for _ in range(10):
        assert len(replicator._referral("a newcomer")) == protocol.MAX_REFERRAL_RECORDS
    assert set(counts.values()) == {MAX_TIMES_NAMED} and replicator._referral("a newcomer") == []
    now[0] += REFERRAL_COUNT_S + 1  # the burst is over: counted anew
    assert len(replicator._referral("a newcomer")) == protocol.MAX_REFERRAL_RECORDS


async def test_the_side_that_dialled_a_connection_opens_its_first_session() -> None:
    """The dialler wants the session (a newcomer dials the bootstrap node); the side that accepted may be the node
    every newcomer dials, which by the smaller-ID rule opened full sessions to half of them, four at a time,
    while they waited. Exactly one side opens, here the dialler although its ID is the larger."""
    async with cluster() as c:
        nodes = [await c.add(anti_entropy_s=3600.0, gossip=False) for _ in range(2)]
        acceptor, dialler = sorted(nodes, key=lambda n: n.host.get_id().to_bytes())
        await dialler.host.connect(info_from_p2p_addr(acceptor.host.get_addrs()[0]))
        assert dialler.rep._opens_first_session(acceptor.host.get_id())
        assert not acceptor.rep._opens_first_session(dialler.host.get_id())


def test_replication_timing_refuses_a_period_that_is_not_positive_naming_it() -> None:
    for name in ("heartbeat_s", "anti_entropy_s", "save_s", "progress_every_s"):
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            ReplicationTiming(**{name: 0.0})
    assert ReplicationTiming(heartbeat_s=0.5).anti_entropy_s == 5.0  # the others keep their defaults
