"""Unit tests for the swarm-state CRDT (node/swarm/crdt.py) and its hybrid logical clock (protocols/hlc.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import msgpack
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair

from node.swarm import crdt
from node.swarm.crdt import (
    CounterRecord,
    Manifest,
    MemberRecord,
    MemberState,
    RecordError,
    SignedRecord,
    StateFileError,
    SwarmState,
    Totals,
    Verifier,
    decode_digest,
    encode_body,
    encode_digest,
    peer_id_of,
    sign_record,
)
from node.swarm.manifest_trust import ManifestAuthority, ManifestMismatch, ManifestRefused
from protocols.hlc import MAX_LOGICAL, ClockSkewError, HybridLogicalClock, Timestamp
from protocols.record import record_to_wire

# Key generation is cheap but deterministic keys make failures reproducible.
KEYS: list[KeyPair] = [create_new_key_pair(bytes([i + 1]) * 32) for i in range(8)]
PIDS: list[str] = [peer_id_of(k.public_key) for k in KEYS]
T0 = 1_700_000_000.0
MANIFEST = Manifest("stdlib-lm", "a" * 64, "b" * 64, 1)


class FakeClock:
    """Wall clock under test control (seconds)."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def replica(i: int, clock: FakeClock, **kwargs: Any) -> SwarmState:
    kwargs.setdefault("suspect_after", 10.0)
    kwargs.setdefault("gone_after", 60.0)
    return SwarmState(KEYS[i], clock=clock, **kwargs)


def envelope(body: bytes, pubkey: bytes, sig: bytes, v: object = 1) -> bytes:
    return msgpack.packb({"v": v, "body": body, "pubkey": pubkey, "sig": sig}, use_bin_type=True)


def signed_envelope(body: bytes, key: KeyPair) -> bytes:
    """An envelope with a valid signature by `key` over `body`, whatever `body` says."""
    return envelope(body, key.public_key.serialize(), key.private_key.sign(crdt.SIGNING_DOMAIN + body))


def member_wire(**overrides: Any) -> dict[str, Any]:
    wire = record_to_wire(MemberRecord(PIDS[0], Timestamp(1, 0)))
    wire.update(overrides)
    return wire


def exchange(a: SwarmState, b: SwarmState) -> None:
    """One anti-entropy session, both directions, through the wire encoding of digests."""
    b.apply(a.missing_for(decode_digest(encode_digest(b.digest()))))
    a.apply(b.missing_for(decode_digest(encode_digest(a.digest()))))


# ---------------------------------------------------------------------------------------------------
# Hybrid logical clock


def test_hlc_stays_monotonic_when_the_wall_clock_steps_back() -> None:
    clock = FakeClock(100.0)
    hlc = HybridLogicalClock(clock)
    first = hlc.now()
    clock.t = 50.0
    second = hlc.now()
    third = hlc.now()
    assert first < second < third
    assert second.wall_ms == first.wall_ms  # the logical part absorbs the step back
    clock.t = 200.0
    assert hlc.now() == Timestamp(200_000, 0)


def test_hlc_issues_timestamps_after_any_it_observed() -> None:
    clock = FakeClock(100.0)
    hlc = HybridLogicalClock(clock)
    remote = Timestamp(100_500, 7)
    hlc.observe(remote)
    assert hlc.now() > remote


def test_hlc_refuses_timestamps_beyond_the_allowed_drift() -> None:
    clock = FakeClock(100.0)
    hlc = HybridLogicalClock(clock, max_drift_s=10.0)
    with pytest.raises(ClockSkewError, match="ahead of the local clock"):
        hlc.observe(Timestamp(111_000, 0))
    assert hlc.now() == Timestamp(100_000, 0)  # the refused timestamp left no trace


def test_hlc_borrows_a_millisecond_when_the_logical_counter_is_exhausted() -> None:
    clock = FakeClock(100.0)
    hlc = HybridLogicalClock(clock)
    hlc.observe(Timestamp(100_000, MAX_LOGICAL))
    assert hlc.now() == Timestamp(100_001, 0)


# ---------------------------------------------------------------------------------------------------
# Encoding, decoding, signing


@pytest.mark.parametrize(
    "record",
    [
        MemberRecord(PIDS[0], Timestamp(5, 1), addrs=("/ip4/10.0.0.1/tcp/4001",), loss=2.5, left=True),
        CounterRecord(PIDS[0], Timestamp(5, 2), samples=10, tokens=2560),
        crdt.ManifestRecord(PIDS[0], Timestamp(5, 3), "lm", "m" * 64, "o" * 64, 3),
    ],
    ids=["member", "counter", "manifest"],
)
def test_every_record_kind_round_trips_through_sign_and_verify(record: crdt.Record) -> None:
    signed = sign_record(record, KEYS[0])
    decoded = Verifier().decode(signed.data)
    assert decoded.record == record
    assert decoded.order == signed.order
    assert decoded.key == record.key


@pytest.mark.parametrize(
    "wire",
    [
        member_wire(outer_step=True),  # bool is not an int
        member_wire(samples_per_s=3),  # int is not a float
        member_wire(loss=float("nan")),
        member_wire(heartbeat=-1.0),
        member_wire(step=-1),
        member_wire(addrs=["/ip4/1.2.3.4/tcp/1"] * (crdt.MAX_ADDRS + 1)),
        member_wire(role="x" * (crdt.MAX_LABEL_CHARS + 1)),
        member_wire(hlc=[1]),
        member_wire(kind="bogus"),
        member_wire(extra="field"),
        {k: v for k, v in member_wire().items() if k != "left"},
    ],
    ids=[
        "bool-as-int",
        "int-as-float",
        "nan",
        "negative-heartbeat",
        "negative-step",
        "too-many-addrs",
        "long-role",
        "short-hlc",
        "unknown-kind",
        "extra-field",
        "missing-field",
    ],
)
def test_decode_rejects_a_validly_signed_record_with_a_bad_field(wire: dict[str, Any]) -> None:
    data = signed_envelope(msgpack.packb(wire, use_bin_type=True), KEYS[0])
    with pytest.raises(RecordError) as err:
        Verifier().decode(data)
    assert err.value.reason == crdt.MALFORMED


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x93\x01\x02\x03",  # an array, not a map
        msgpack.packb({"v": 1, "body": b"x", "pubkey": b"x", "sig": b"x"}) + b"\x00",  # trailing byte
        msgpack.packb({"v": 1, "body": "text", "pubkey": b"x", "sig": b"x"}),
        msgpack.packb({"v": 1, "body": b"\x01", "pubkey": b"x", "sig": b"x"}),  # body is not a map
        envelope(encode_body(MemberRecord(PIDS[0], Timestamp(1, 0))), b"not a key", b"x" * 64),
    ],
    ids=["empty", "reserved-byte", "array", "trailing", "text-body", "scalar-body", "bad-pubkey"],
)
def test_decode_rejects_garbage_as_malformed(data: bytes) -> None:
    with pytest.raises(RecordError) as err:
        Verifier().decode(data)
    assert err.value.reason == crdt.MALFORMED


def test_decode_rejects_unknown_envelope_and_body_versions() -> None:
    body = encode_body(MemberRecord(PIDS[0], Timestamp(1, 0)))
    with pytest.raises(RecordError) as err:
        Verifier().decode(envelope(body, b"", b"", v=2))
    assert err.value.reason == crdt.UNSUPPORTED_VERSION
    with pytest.raises(RecordError) as err:
        Verifier().decode(signed_envelope(msgpack.packb(member_wire(v=2)), KEYS[0]))
    assert err.value.reason == crdt.UNSUPPORTED_VERSION


def test_decode_rejects_an_oversized_record_before_decoding_it() -> None:
    with pytest.raises(RecordError) as err:
        Verifier().decode(b"\x80" * (crdt.MAX_ENVELOPE_BYTES + 1))
    assert err.value.reason == crdt.TOO_LARGE


def test_sign_record_refuses_to_sign_for_another_peer() -> None:
    with pytest.raises(ValueError, match="cannot sign a record for peer"):
        sign_record(MemberRecord(PIDS[1], Timestamp(1, 0)), KEYS[0])


def test_record_signed_with_another_peers_key_is_rejected_as_wrong_signer_and_counted() -> None:
    clock = FakeClock()
    state = replica(0, clock)
    body = encode_body(MemberRecord(PIDS[1], Timestamp(1, 0), role="impostor"))
    forged = signed_envelope(body, KEYS[2])  # a valid signature, by the wrong peer
    assert state.merge(forged) is False
    assert state.merge(forged) is False
    assert state.rejected[crdt.WRONG_SIGNER] == 2
    assert state.member(PIDS[1]) is None


def test_tampered_or_unsigned_records_are_rejected_as_bad_signature() -> None:
    clock = FakeClock()
    state = replica(0, clock)
    genuine = sign_record(MemberRecord(PIDS[1], Timestamp(1, 0), outer_step=1), KEYS[1])
    env = msgpack.unpackb(genuine.data)
    tampered_body = encode_body(MemberRecord(PIDS[1], Timestamp(1, 0), outer_step=999))
    pubkey = KEYS[1].public_key.serialize()
    assert not state.merge(envelope(tampered_body, pubkey, env["sig"]))
    assert not state.merge(envelope(env["body"], pubkey, b""))
    # A signature over the body without the domain tag is not a signature over the record.
    assert not state.merge(envelope(env["body"], pubkey, KEYS[1].private_key.sign(env["body"])))
    assert state.rejected[crdt.BAD_SIGNATURE] == 3
    assert state.members() == []


def test_verification_of_identical_bytes_is_done_once() -> None:
    verifier = Verifier()
    signed = sign_record(MemberRecord(PIDS[1], Timestamp(1, 0)), KEYS[1])
    for _ in range(5):
        assert verifier.decode(signed.data) == signed
    assert verifier.verifications == 1


def test_update_self_refuses_unknown_fields_and_values_peers_would_reject() -> None:
    state = replica(0, FakeClock())
    with pytest.raises(ValueError, match="unknown or managed fields"):
        state.update_self(heartbeat=1.0)
    with pytest.raises(ValueError, match="role"):
        state.update_self(role="r" * 100)
    assert state.members() == []


# ---------------------------------------------------------------------------------------------------
# Member records: last writer wins, failure detection, departure


def test_newer_member_record_replaces_older_and_older_is_ignored() -> None:
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    old = alice.update_self(outer_step=1)
    clock.t += 1
    new = alice.update_self(outer_step=2)
    assert bob.merge(new) is True
    assert bob.merge(old) is False
    assert bob.merge(new) is False
    view = bob.member(PIDS[0])
    assert view is not None and view.record.outer_step == 2


def test_update_self_keeps_the_fields_it_is_not_given() -> None:
    clock = FakeClock()
    state = replica(0, clock)
    state.update_self(addrs=["/ip4/127.0.0.1/tcp/4001"], role="trainer", outer_step=3)
    clock.t += 5
    state.update_self(loss=1.5)
    record = state.member(PIDS[0]).record  # type: ignore[union-attr]
    assert record.addrs == ("/ip4/127.0.0.1/tcp/4001",)
    assert (record.outer_step, record.loss, record.heartbeat) == (3, 1.5, T0 + 5)


def test_non_finite_loss_is_published_as_unknown() -> None:
    state = replica(0, FakeClock())
    signed = state.update_self(loss=float("nan"), val_loss=float("inf"))
    assert signed.record.loss is None and signed.record.val_loss is None  # type: ignore[union-attr]


def test_a_restarted_node_whose_state_file_predates_its_last_records_still_supersedes_them(
    tmp_path: Path,
) -> None:
    """SIGKILL: the last records of the previous life never reached the state file, but peers hold them."""
    clock, peer_clock = FakeClock(), FakeClock()
    node, peer = replica(0, clock), replica(1, peer_clock)
    peer.merge(node.update_self(step=1))
    node.save(tmp_path / "state.msgpack")
    for step in range(2, 30):  # heartbeats after the last save, all seen by the peer
        clock.t += 0.001
        peer.merge(node.update_self(step=step))
    clock.t += 0.001  # the restart takes at least a millisecond
    restarted = SwarmState.load(tmp_path / "state.msgpack", KEYS[0], clock=clock)
    assert peer.merge(restarted.update_self(step=0)) is True
    assert peer.member(PIDS[0]).record.step == 0  # type: ignore[union-attr]


def test_a_newer_record_of_its_own_from_a_peer_is_reported_once_so_the_node_can_reassert_itself() -> None:
    ahead, clock = FakeClock(T0 + 100), FakeClock()
    previous_life, node = replica(0, ahead), replica(0, clock)
    node.update_self(step=2)
    assert node.own_record_superseded() is False  # its own writes do not count
    last_words = previous_life.update_self(step=1)  # signed with a clock 100 s ahead of today's
    assert node.merge(last_words) is True
    assert node.own_record_superseded() is True
    assert node.own_record_superseded() is False  # reported once
    assert node.update_self(step=2).record.hlc > last_words.record.hlc  # re-signing supersedes it


def test_a_restarted_node_publishes_records_newer_than_its_previous_life() -> None:
    clock, observer_clock = FakeClock(), FakeClock()
    before_restart, observer = replica(0, clock), replica(1, observer_clock)
    observer.merge(before_restart.update_self(outer_step=7))
    clock.t -= 3600  # the host comes back with its clock an hour behind, and without its state file
    after_restart = replica(0, clock)
    exchange(after_restart, observer)  # learns its own old record from a peer
    assert observer.merge(after_restart.update_self(outer_step=0)) is True
    assert observer.member(PIDS[0]).record.outer_step == 0  # type: ignore[union-attr]


def test_member_becomes_suspect_then_gone_and_its_record_is_kept() -> None:
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    bob.merge(alice.update_self(outer_step=4))
    assert bob.member(PIDS[0]).state is MemberState.ALIVE  # type: ignore[union-attr]
    clock.t += 11
    assert bob.member(PIDS[0]).state is MemberState.SUSPECT  # type: ignore[union-attr]
    clock.t += 50
    view = bob.member(PIDS[0])
    assert view is not None and view.state is MemberState.GONE
    assert view.record.outer_step == 4 and view.last_seen == T0
    bob.merge(alice.update_self())
    assert bob.member(PIDS[0]).state is MemberState.ALIVE  # type: ignore[union-attr]


def test_departed_member_is_shown_as_left_and_rejoins_on_its_next_update() -> None:
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    bob.merge(alice.update_self(outer_step=9))
    clock.t += 1
    departure = alice.depart()
    assert bob.merge(departure) is True
    view = bob.member(PIDS[0])
    assert view is not None and view.state is MemberState.LEFT and view.record.outer_step == 9
    clock.t += 1000
    assert bob.member(PIDS[0]).state is MemberState.LEFT  # type: ignore[union-attr]
    bob.merge(alice.update_self())
    assert bob.member(PIDS[0]).state is MemberState.ALIVE  # type: ignore[union-attr]


def test_a_heartbeat_from_a_clock_running_ahead_does_not_keep_a_member_alive() -> None:
    ahead, local = FakeClock(T0 + 300), FakeClock(T0)
    alice, bob = replica(0, ahead), replica(1, local)
    bob.merge(alice.update_self())
    view = bob.member(PIDS[0])
    assert view is not None and view.last_seen == T0  # capped at the local receipt time
    local.t += 61
    assert bob.member(PIDS[0]).state is MemberState.GONE  # type: ignore[union-attr]


def test_a_member_whose_records_keep_arriving_late_stays_alive() -> None:
    """Records queued for 20 s (an overloaded event loop or relay) against a 10 s suspect time: each one
    still proves its author was alive recently, so the member must not turn suspect while they come."""
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    written = []
    for _ in range(20):  # alice heartbeats every 2 s; bob receives each record 20 s after it was written
        written.append(alice.update_self())
        if len(written) > 10:
            bob.merge(written[-11])
            assert bob.member(PIDS[0]).state is MemberState.ALIVE  # type: ignore[union-attr]
        clock.t += 2
    # Once they stop coming, it turns suspect within the suspect time of the last one's arrival.
    clock.t += 10
    assert bob.member(PIDS[0]).state is MemberState.SUSPECT  # type: ignore[union-attr]


def test_a_member_whose_clock_runs_behind_ours_stays_alive_while_its_heartbeats_arrive() -> None:
    behind, local = FakeClock(T0 - 30), FakeClock(T0)
    alice, bob = replica(0, behind), replica(1, local)
    for _ in range(5):
        bob.merge(alice.update_self())
        view = bob.member(PIDS[0])
        assert view is not None and view.state is MemberState.ALIVE
        assert view.last_seen == local.t - bob.late_news_s  # the record proves life, not its own timestamp
        behind.t += 2
        local.t += 2


def test_a_late_record_counts_from_its_heartbeat_when_that_is_recent_enough() -> None:
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    record = alice.update_self()
    clock.t += 3  # within late_news_s (5 s): as old as its heartbeat says
    bob.merge(record)
    assert bob.member(PIDS[0]).last_seen == T0  # type: ignore[union-attr]


def test_the_last_record_of_a_long_gone_member_shows_it_gone_to_a_node_that_learns_it_late() -> None:
    clock = FakeClock()
    alice, joiner = replica(0, clock), replica(1, clock)
    last_words = alice.update_self()  # alice dies right after
    clock.t += 61  # more than gone_after later a node that just joined receives it from a peer
    joiner.merge(last_words)
    view = joiner.member(PIDS[0])
    assert view is not None and view.state is MemberState.GONE and view.last_seen == T0


def test_member_views_do_not_depend_on_the_order_records_arrived_in() -> None:
    clock = FakeClock()
    alice = replica(0, clock)
    records = []
    for _ in range(3):
        records.append(alice.update_self())
        clock.t += 20
    in_order, reversed_order = replica(1, clock), replica(2, clock)
    in_order.apply(records)
    reversed_order.apply(reversed(records))
    assert in_order.members() == reversed_order.members()


def test_a_record_far_in_the_future_is_rejected_as_clock_skew() -> None:
    clock = FakeClock()
    bob = replica(1, clock, max_drift_s=60.0)
    future = sign_record(MemberRecord(PIDS[0], Timestamp(int((T0 + 3600) * 1000), 0)), KEYS[0])
    assert bob.merge(future) is False
    assert bob.rejected[crdt.CLOCK_SKEW] == 1
    clock.t += 3600  # once local time catches up the same record is accepted
    assert bob.merge(future) is True


# ---------------------------------------------------------------------------------------------------
# Grow-only counter


def test_counters_sum_the_progress_of_every_peer() -> None:
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    alice.add_progress(samples=10, tokens=100)
    alice.add_progress(samples=5, tokens=50)
    bob.add_progress(samples=1, tokens=7)
    exchange(alice, bob)
    assert alice.counters() == bob.counters() == Totals(16, 157)
    with pytest.raises(ValueError, match="must not be negative"):
        alice.add_progress(samples=-1)


def test_a_peers_counter_never_shrinks_when_it_restarts_without_its_state() -> None:
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    bob.merge(alice.add_progress(samples=100, tokens=1000))
    clock.t += 10
    fresh_alice = replica(0, clock)
    smaller = fresh_alice.add_progress(samples=1, tokens=10)  # newer HLC, smaller totals
    assert bob.merge(smaller) is False
    assert bob.counters() == Totals(100, 1000)
    exchange(fresh_alice, bob)  # the restarted node adopts its larger entry and continues from it
    bob.merge(fresh_alice.add_progress(samples=1, tokens=10))
    assert bob.counters() == fresh_alice.counters() == Totals(101, 1010)


# ---------------------------------------------------------------------------------------------------
# Run manifest


def test_the_founders_manifest_is_kept_and_a_later_equal_proposal_publishes_nothing() -> None:
    clock = FakeClock()
    founder, joiner = replica(0, clock), replica(1, clock)
    founded = founder.set_manifest(MANIFEST)
    assert founded is not None
    joiner.merge(founded)
    assert joiner.set_manifest(MANIFEST) is None
    assert joiner.manifest == MANIFEST
    joiner.check_manifest(MANIFEST)
    joiner.check_manifest(MANIFEST.hash)


def test_concurrent_founders_of_one_manifest_resolve_to_the_lowest_hlc_on_every_replica() -> None:
    early, late = FakeClock(T0), FakeClock(T0 + 5)
    a, b, c = replica(0, early), replica(1, late), replica(2, late)
    from_a, from_b = a.set_manifest(MANIFEST), b.set_manifest(MANIFEST)
    assert from_a is not None and from_b is not None
    c.merge(from_b)
    c.merge(from_a)
    exchange(a, b)
    assert a.digest() == b.digest() == c.digest()
    assert a.missing_for({}) == b.missing_for({})  # the very record: a's, the lowest HLC


def test_without_a_configured_founder_a_replica_keeps_the_first_manifest_it_held() -> None:
    """Trust on first use: a different manifest, even one signed at HLC (0, 0), is refused and reported
    once with both hashes; lowest-HLC-wins let any fresh key take the swarm over this way."""
    early, late = FakeClock(T0), FakeClock(T0 + 5)
    swarm, attacker = replica(0, late), replica(1, early)
    swarm.set_manifest(MANIFEST)
    other = dataclasses.replace(MANIFEST, model_hash="c" * 64)
    forged = attacker.set_manifest(other)
    assert forged is not None and forged.order < swarm.digest()["manifest"]
    assert not swarm.merge(forged) and not swarm.merge(forged)
    assert swarm.manifest == MANIFEST and swarm.rejected[crdt.MANIFEST_REFUSED] == 2
    [refusal] = swarm.take_manifest_refusals()
    assert MANIFEST.hash in str(refusal) and other.hash in str(refusal) and PIDS[1] in str(refusal)
    assert swarm.take_manifest_refusals() == []


def test_a_configured_founder_is_the_only_key_whose_manifest_any_replica_adopts() -> None:
    authority = ManifestAuthority(founder=PIDS[0])
    founder, joiner = replica(0, FakeClock(T0 + 5), authority=authority), replica(2, FakeClock(), authority=authority)
    outsider = replica(1, FakeClock(T0))
    forged = outsider.set_manifest(MANIFEST)  # the same content, but not the founder's key
    assert forged is not None
    assert not joiner.merge(forged) and joiner.manifest is None
    assert joiner.merge(founder.set_manifest(MANIFEST)) and joiner.manifest == MANIFEST
    other_trainer = replica(3, FakeClock(), authority=authority)
    assert not other_trainer.may_found(MANIFEST) and founder.may_found(MANIFEST)
    with pytest.raises(ManifestRefused):
        other_trainer.set_manifest(MANIFEST)  # only the founder founds


def test_a_configured_manifest_hash_refuses_every_other_manifest() -> None:
    other = dataclasses.replace(MANIFEST, model_hash="c" * 64)
    state = replica(0, FakeClock(), authority=ManifestAuthority(manifest_hash=MANIFEST.hash))
    assert not state.merge(replica(1, FakeClock(T0 - 5)).set_manifest(other))
    assert state.merge(replica(2, FakeClock()).set_manifest(MANIFEST))
    assert state.manifest == MANIFEST


def test_manifest_mismatch_names_both_hashes_and_the_differing_fields() -> None:
    state = replica(0, FakeClock())
    state.set_manifest(MANIFEST)
    mine = dataclasses.replace(MANIFEST, optimizer_hash="d" * 64, protocol_version=2)
    with pytest.raises(ManifestMismatch) as err:
        state.check_manifest(mine)
    message = str(err.value)
    assert MANIFEST.hash in message and mine.hash in message
    assert "optimizer_hash, protocol_version" in message
    assert (err.value.swarm_hash, err.value.local_hash) == (MANIFEST.hash, mine.hash)
    with pytest.raises(ManifestMismatch):
        state.set_manifest(mine)
    with pytest.raises(ManifestMismatch):
        state.check_manifest("0" * 64)  # e.g. the manifest_hash of another member's record


def test_check_manifest_passes_while_the_swarm_manifest_is_unknown() -> None:
    state = replica(0, FakeClock())
    state.check_manifest(MANIFEST)
    assert state.manifest is None


# ---------------------------------------------------------------------------------------------------
# Bounded state: eviction and tombstones


def test_past_the_cap_the_longest_gone_member_is_evicted_first() -> None:
    clock = FakeClock()
    observer = replica(0, clock, max_members=3)
    observer.update_self()
    observer.merge(replica(1, clock).update_self())
    clock.t += 5
    observer.merge(replica(2, clock).update_self())
    clock.t += 100  # 1 and 2 are gone now, 1 for longer
    observer.update_self()
    assert observer.merge(replica(3, clock).update_self()) is True
    assert [v.peer_id for v in observer.members()] == sorted([PIDS[0], PIDS[2], PIDS[3]])


def test_a_departed_member_is_evicted_before_a_suspect_one() -> None:
    clock = FakeClock()
    observer = replica(0, clock, max_members=3)
    observer.update_self()
    leaver = replica(1, clock)
    observer.merge(leaver.depart())
    observer.merge(replica(2, clock).update_self())
    clock.t += 20  # 2 is suspect, 1 has left
    observer.update_self()
    assert observer.merge(replica(3, clock).update_self()) is True
    assert observer.member(PIDS[1]) is None and observer.member(PIDS[2]) is not None


def test_alive_members_are_never_evicted_and_a_newcomer_is_refused_for_capacity() -> None:
    clock = FakeClock()
    observer = replica(0, clock, max_members=2)
    observer.update_self()
    observer.merge(replica(1, clock).update_self())
    assert observer.merge(replica(2, clock).update_self()) is False
    assert observer.rejected[crdt.CAPACITY] == 1
    assert [v.peer_id for v in observer.members()] == sorted(PIDS[:2])


def test_an_evicted_member_is_not_resurrected_by_anti_entropy_but_returns_with_newer_state() -> None:
    clock = FakeClock()
    observer, keeper = replica(0, clock, max_members=2), replica(1, clock)
    ghost = replica(2, clock)
    observer.merge(keeper.update_self())
    first = ghost.update_self(outer_step=1)
    observer.merge(first)
    keeper.merge(first)
    clock.t += 100
    keeper.update_self()
    observer.merge(keeper.update_self())
    observer.update_self()  # self joins at the cap: the gone ghost makes room
    assert observer.member(PIDS[2]) is None
    assert first.data not in keeper.missing_for(observer.digest())  # its tombstone is in the digest
    assert observer.merge(first) is False
    assert observer.member(PIDS[2]) is None
    clock.t += 1
    observer.update_self()
    assert observer.merge(ghost.update_self(outer_step=2)) is False  # no room: 0 and 1 are alive
    clock.t += 100
    observer.update_self()  # 1 is gone now
    assert observer.merge(ghost.update_self(outer_step=3)) is True
    assert observer.member(PIDS[2]).record.outer_step == 3  # type: ignore[union-attr]


def test_evicted_counter_entries_stay_in_the_totals_without_double_counting() -> None:
    clock = FakeClock()
    observer, worker, newcomer = replica(0, clock, max_members=2), replica(1, clock), replica(2, clock)
    observer.update_self()
    observer.merge(worker.update_self())
    observer.merge(worker.add_progress(samples=40, tokens=400))
    clock.t += 100
    observer.update_self()
    observer.merge(newcomer.update_self())  # evicts the gone worker, with its counter entry
    assert observer.member(PIDS[1]) is None
    assert observer.counters() == Totals(40, 400)
    clock.t += 100
    observer.update_self()
    observer.merge(worker.update_self())  # back: the newcomer is gone now and makes room
    observer.merge(worker.add_progress(samples=2, tokens=20))
    assert observer.counters() == Totals(42, 420)


def test_tombstones_are_bounded() -> None:
    clock = FakeClock()
    observer = replica(0, clock, max_members=2, max_tombstones=2)
    for i in range(1, 7):
        clock.t += 100
        observer.update_self()
        observer.merge(replica(i, clock).update_self())
    assert len(observer.members()) == 2
    assert len(observer.digest()) == 2 + 2  # two live members, two remembered evictions


# ---------------------------------------------------------------------------------------------------
# Anti-entropy


def test_missing_for_sends_only_what_the_peer_lacks_or_holds_older() -> None:
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    alice_v1 = alice.update_self()
    bob.merge(alice_v1)
    bob_v1 = bob.update_self()
    assert alice.missing_for(bob.digest()) == []
    clock.t += 1
    alice_v2 = alice.update_self()
    assert alice.missing_for(bob.digest()) == [alice_v2.data]
    assert bob.missing_for(alice.digest()) == [bob_v1.data]


def test_an_anti_entropy_exchange_makes_two_replicas_equal() -> None:
    clock = FakeClock()
    alice, bob = replica(0, clock), replica(1, clock)
    alice.set_manifest(MANIFEST)
    alice.update_self(outer_step=1)
    alice.add_progress(samples=3)
    bob.update_self(outer_step=2)
    exchange(alice, bob)
    assert alice.digest() == bob.digest()
    assert alice.members() == bob.members()
    assert bob.manifest == MANIFEST and bob.counters() == Totals(3, 0)


@pytest.mark.parametrize(
    "data",
    [
        b"\x01",
        msgpack.packb({"v": 2, "entries": {}}),
        msgpack.packb({"v": 1, "entries": {"x:peer": [1, 2, 3]}}),
        msgpack.packb({"v": 1, "entries": {"m:peer": [1, 2]}}),
        msgpack.packb({"v": 1, "entries": {"c:peer": [1, 2, 3]}}),
        msgpack.packb({"v": 1, "entries": {"m:peer": [1, -2, 3]}}),
        msgpack.packb({"v": 1, "entries": {"m:peer": [1, "2", 3]}}),
        msgpack.packb({"v": 1, "entries": {"m:" + "p" * 200: [1, 2, 3]}}),
    ],
    ids=["scalar", "version", "bad-prefix", "short", "counter-arity", "negative", "string", "long-key"],
)
def test_decode_digest_rejects_bad_digests(data: bytes) -> None:
    with pytest.raises(RecordError):
        decode_digest(data)


def test_decode_digest_refuses_more_entries_than_allowed() -> None:
    digest = {f"m:{i}": (1, 2, 3) for i in range(20)}
    assert decode_digest(encode_digest(digest)) == digest
    with pytest.raises(RecordError):
        decode_digest(encode_digest(digest), max_entries=10)


# ---------------------------------------------------------------------------------------------------
# Persistence


def populated(clock: FakeClock) -> SwarmState:
    state = replica(0, clock, max_members=3)
    state.set_manifest(MANIFEST)
    state.update_self(addrs=["/ip4/127.0.0.1/tcp/1"], outer_step=5, loss=0.5)
    state.add_progress(samples=9, tokens=90)
    state.merge(replica(1, clock).update_self())
    state.merge(replica(1, clock).add_progress(samples=1))
    clock.t += 100
    state.update_self()
    state.merge(replica(2, clock).update_self())
    state.merge(replica(3, clock).update_self())  # evicts peer 1 (gone): a tombstone and retired counts
    return state


def test_save_and_load_restore_the_same_state(tmp_path: Path) -> None:
    clock = FakeClock()
    state = populated(clock)
    path = tmp_path / "state.msgpack"
    state.save(path)
    restored = SwarmState.load(path, KEYS[0], clock=clock, max_members=3, suspect_after=10.0, gone_after=60.0)
    assert restored.digest() == state.digest()
    assert restored.members() == state.members()
    assert restored.counters() == state.counters() == Totals(10, 90)
    assert restored.manifest == MANIFEST
    assert restored.rejected == {}
    assert os.listdir(tmp_path) == ["state.msgpack"]  # no temp file left behind


def test_a_failed_save_leaves_the_previous_file_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    state = populated(clock)
    path = tmp_path / "state.msgpack"
    state.save(path)
    before = path.read_bytes()
    state.update_self(outer_step=6)

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(crdt.os, "replace", broken_replace)
    with pytest.raises(OSError):
        state.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.msgpack"]


def test_loading_a_missing_file_gives_an_empty_state(tmp_path: Path) -> None:
    state = SwarmState.load(tmp_path / "nothing-here", KEYS[0])
    assert state.digest() == {} and state.members() == []


@pytest.mark.parametrize(
    "content",
    [
        b"garbage",
        msgpack.packb(
            {"v": 1, "format": "something-else", "records": [], "tombstones": [], "retired": [0, 0]}
        ),
        msgpack.packb({"v": 9, "format": "starling-swarm-state"}),
        msgpack.packb(
            {
                "v": 1,
                "format": "starling-swarm-state",
                "records": [["x", 1.0]],
                "tombstones": [],
                "retired": [0, 0],
            }
        ),
    ],
    ids=["garbage", "other-format", "future-version", "bad-entry"],
)
def test_loading_a_corrupt_file_raises_an_error_naming_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "state.msgpack"
    path.write_bytes(content)
    with pytest.raises(StateFileError, match=str(path)):
        SwarmState.load(path, KEYS[0])


def test_a_truncated_state_file_raises_an_error(tmp_path: Path) -> None:
    path = tmp_path / "state.msgpack"
    populated(FakeClock()).save(path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(StateFileError, match="not a valid swarm state file"):
        SwarmState.load(path, KEYS[0], max_members=3)


def test_a_tampered_record_in_the_state_file_is_dropped_and_counted(tmp_path: Path) -> None:
    clock = FakeClock()
    state = replica(0, clock)
    state.update_self()
    peer_record = replica(1, clock).update_self(outer_step=1)
    state.merge(peer_record)
    path = tmp_path / "state.msgpack"
    state.save(path)
    env = msgpack.unpackb(peer_record.data)
    env["body"] = encode_body(dataclasses.replace(peer_record.record, outer_step=2))  # type: ignore[type-var]
    path.write_bytes(path.read_bytes().replace(peer_record.data, msgpack.packb(env)))
    restored = SwarmState.load(path, KEYS[0], clock=clock)
    assert restored.rejected[crdt.BAD_SIGNATURE] == 1
    assert restored.member(PIDS[1]) is None and restored.member(PIDS[0]) is not None


def test_signed_record_passed_as_object_is_still_verified() -> None:
    state = replica(0, FakeClock())
    genuine = sign_record(MemberRecord(PIDS[1], Timestamp(1, 0)), KEYS[1])
    impostor = SignedRecord(genuine.data, MemberRecord(PIDS[1], Timestamp(2, 0), role="fake"), (2, 0, 0))
    assert state.merge(impostor) is True
    assert state.member(PIDS[1]).record.role == "trainer"  # type: ignore[union-attr]
