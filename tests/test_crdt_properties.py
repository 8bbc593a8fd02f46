"""Property tests (hypothesis) for the swarm-state CRDT: the merge is a join, and replicas converge.

Records are drawn from a few authors with deliberately narrow timestamp and value ranges, so ties,
duplicates and same-timestamp-different-content records (the hard cases for a join) come up often.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair

from node.swarm import crdt
from node.swarm.crdt import (
    CounterRecord,
    ManifestRecord,
    MemberRecord,
    SignedRecord,
    SwarmState,
    Verifier,
    decode_digest,
    encode_body,
    encode_digest,
    join,
    peer_id_of,
    sign_record,
)
from protocols.hlc import Timestamp

# Keys are made once per module; authors write records, observers own the replicas.
AUTHORS: list[KeyPair] = [create_new_key_pair(bytes([0x40 + i]) * 32) for i in range(4)]
OBSERVERS: list[KeyPair] = [create_new_key_pair(bytes([0x60 + i]) * 32) for i in range(4)]
AUTHOR_IDS = [peer_id_of(k.public_key) for k in AUTHORS]
NOW = 2_000_000.0  # replicas' (fixed) wall clock, seconds
BASE_MS = 1_000_000_000  # records' HLC wall times, well in the past of NOW

PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _timestamps() -> st.SearchStrategy[Timestamp]:
    return st.builds(Timestamp, st.integers(BASE_MS, BASE_MS + 20), st.integers(0, 2))


def _record_for(draw: st.DrawFn, kind: str, author: int) -> SignedRecord:
    pid, hlc = AUTHOR_IDS[author], draw(_timestamps())
    record: crdt.Record
    if kind == "member":
        record = MemberRecord(
            pid,
            hlc,
            addrs=tuple(
                draw(st.lists(st.sampled_from(["/ip4/10.0.0.1/tcp/1", "/ip4/10.0.0.2/tcp/2"]), max_size=2))
            ),
            role=draw(st.sampled_from(["trainer", "observer"])),
            outer_step=draw(st.integers(0, 5)),
            loss=draw(st.none() | st.floats(0.0, 10.0)),
            heartbeat=draw(st.floats(NOW - 200.0, NOW)),
            left=draw(st.booleans()),
        )
    elif kind == "counter":
        record = CounterRecord(pid, hlc, samples=draw(st.integers(0, 3)), tokens=draw(st.integers(0, 3)))
    else:
        # One content, any signer: a replica adopts no manifest but the first content it held (trust on
        # first use, node/swarm/manifest_trust.py), and among equal contents the join must converge.
        record = ManifestRecord(pid, hlc, "lm", "m" * 64, "o" * 64, 1)
    return sign_record(record, AUTHORS[author])


@st.composite
def signed_records(draw: st.DrawFn) -> SignedRecord:
    kind = draw(st.sampled_from(["member", "counter", "manifest"]))
    return _record_for(draw, kind, draw(st.integers(0, len(AUTHORS) - 1)))


@st.composite
def same_key_records(draw: st.DrawFn, n: int) -> list[SignedRecord]:
    """n records for one key: one author's member or counter entries, or manifests by anyone."""
    kind = draw(st.sampled_from(["member", "counter", "manifest"]))
    author = st.integers(0, len(AUTHORS) - 1)
    authors = [draw(author) for _ in range(n)] if kind == "manifest" else [draw(author)] * n
    return [_record_for(draw, kind, a) for a in authors]


@st.composite
def forged_records(draw: st.DrawFn) -> bytes:
    """Well-formed records about one author carrying a valid signature by another."""
    honest = draw(signed_records())
    signer = AUTHORS[
        (AUTHOR_IDS.index(honest.peer_id) + draw(st.integers(1, len(AUTHORS) - 1))) % len(AUTHORS)
    ]
    body = encode_body(honest.record)
    sig = signer.private_key.sign(crdt.SIGNING_DOMAIN + body)
    return msgpack.packb(
        {"v": 1, "body": body, "pubkey": signer.public_key.serialize(), "sig": sig}, use_bin_type=True
    )


def fresh(observer: int = 0) -> SwarmState:
    return SwarmState(OBSERVERS[observer], clock=lambda: NOW, suspect_after=30.0, gone_after=120.0)


def state_of(records: Sequence[SignedRecord | bytes], observer: int = 0) -> SwarmState:
    state = fresh(observer)
    state.apply(records)
    return state


def snapshot(state: SwarmState) -> tuple[object, ...]:
    """Everything replicated: digest, exact record bytes, and the derived views."""
    return (
        state.digest(),
        sorted(state.missing_for({})),
        state.members(now=NOW),
        state.counters(),
        state.manifest,
    )


def merged(a: SwarmState, b: SwarmState) -> SwarmState:
    """The state-level join: a new replica holding a's records, then b's."""
    return state_of([*a.missing_for({}), *b.missing_for({})])


def anti_entropy(a: SwarmState, b: SwarmState) -> None:
    b.apply(a.missing_for(decode_digest(encode_digest(b.digest()))))
    a.apply(b.missing_for(decode_digest(encode_digest(a.digest()))))


# ---------------------------------------------------------------------------------------------------
# The join on one key


@PROPERTY_SETTINGS
@given(same_key_records(3))
def test_record_join_is_commutative_associative_and_idempotent(records: list[SignedRecord]) -> None:
    a, b, c = records
    assert join(a, b) == join(b, a)
    assert join(join(a, b), c) == join(a, join(b, c))
    assert join(a, a) == a
    assert join(a, b) in (a, b)


# ---------------------------------------------------------------------------------------------------
# The join on whole replicas


@PROPERTY_SETTINGS
@given(
    st.lists(signed_records(), max_size=8),
    st.lists(signed_records(), max_size=8),
    st.lists(signed_records(), max_size=8),
)
def test_replica_merge_is_commutative_associative_and_idempotent(
    ra: list[SignedRecord], rb: list[SignedRecord], rc: list[SignedRecord]
) -> None:
    a, b, c = state_of(ra), state_of(rb), state_of(rc)
    assert snapshot(merged(a, b)) == snapshot(merged(b, a))
    assert snapshot(merged(merged(a, b), c)) == snapshot(merged(a, merged(b, c)))
    assert snapshot(merged(a, a)) == snapshot(a)
    assert snapshot(state_of([*ra, *ra])) == snapshot(a)


# ---------------------------------------------------------------------------------------------------
# Convergence under reordering, duplication, loss and anti-entropy


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[SignedRecord], list[list[int]], list[tuple[int, int]]]:
    """Records, then per replica a delivery schedule (indices: any order, duplicates, some never),
    then random anti-entropy sessions between replicas."""
    records = draw(st.lists(signed_records(), min_size=1, max_size=20))
    n_replicas = draw(st.integers(2, len(OBSERVERS)))
    index = st.integers(0, len(records) - 1)
    schedules = [draw(st.lists(index, max_size=2 * len(records))) for _ in range(n_replicas)]
    replica = st.integers(0, n_replicas - 1)
    sessions = draw(st.lists(st.tuples(replica, replica), max_size=6))
    return records, schedules, sessions


@PROPERTY_SETTINGS
@given(deliveries(), st.booleans())
def test_replicas_converge_after_any_delivery_order_with_duplicates_drops_and_anti_entropy(
    case: tuple[list[SignedRecord], list[list[int]], list[tuple[int, int]]], publish_own: bool
) -> None:
    records, schedules, sessions = case
    replicas = [fresh(i) for i in range(len(schedules))]
    own: list[SignedRecord] = []
    for i, (state, schedule) in enumerate(zip(replicas, schedules, strict=True)):
        if publish_own:  # each replica also writes its own records, known only to itself so far
            own.append(state.update_self(outer_step=i))
            own.append(state.add_progress(samples=i + 1, tokens=1))
        for k in schedule:
            state.merge(records[k].data if k % 2 else records[k])  # as bytes or as objects
    for i, j in sessions:  # gossip-like random sessions, possibly a replica with itself
        anti_entropy(replicas[i], replicas[j])
    # Then enough anti-entropy to connect everyone: gather at replica 0, spread from it.
    for other in replicas[1:]:
        anti_entropy(replicas[0], other)
    for other in replicas[1:]:
        anti_entropy(replicas[0], other)

    delivered = {k for schedule in schedules for k in schedule}
    reference = state_of([records[k] for k in sorted(delivered)] + own)
    expected = snapshot(reference)
    for state in replicas:
        assert snapshot(state) == expected
        assert sum(state.rejected.values()) == 0


@PROPERTY_SETTINGS
@given(
    st.lists(signed_records(), max_size=10), st.lists(forged_records(), min_size=1, max_size=5), st.randoms()
)
def test_forged_records_are_rejected_counted_and_leave_no_trace(
    honest: list[SignedRecord], forged: list[bytes], rng: object
) -> None:
    mixed: list[SignedRecord | bytes] = [*honest, *forged]
    rng.shuffle(mixed)  # type: ignore[attr-defined]
    state = state_of(mixed)
    assert state.rejected[crdt.WRONG_SIGNER] == len(forged)
    assert snapshot(state) == snapshot(state_of(honest))


@PROPERTY_SETTINGS
@given(st.lists(signed_records(), max_size=12))
def test_save_and_load_preserve_a_replica_exactly(
    tmp_path_factory: object, records: list[SignedRecord]
) -> None:
    state = state_of(records)
    path = tmp_path_factory.mktemp("crdt") / "state.msgpack"  # type: ignore[attr-defined]
    state.save(path)
    restored = SwarmState.load(path, OBSERVERS[0], clock=lambda: NOW, suspect_after=30.0, gone_after=120.0)
    assert snapshot(restored) == snapshot(state)


def test_shared_verifier_cache_does_not_let_a_forgery_through() -> None:
    """Replicas may share one Verifier; a cached honest record must not vouch for a forged one."""
    verifier = Verifier()
    honest = sign_record(MemberRecord(AUTHOR_IDS[0], Timestamp(BASE_MS, 0)), AUTHORS[0])
    a = SwarmState(OBSERVERS[0], clock=lambda: NOW, verifier=verifier)
    b = SwarmState(OBSERVERS[1], clock=lambda: NOW, verifier=verifier)
    assert a.merge(honest)
    body = encode_body(MemberRecord(AUTHOR_IDS[0], Timestamp(BASE_MS + 1, 0), role="evil"))
    forged = msgpack.packb(
        {
            "v": 1,
            "body": body,
            "pubkey": AUTHORS[0].public_key.serialize(),
            "sig": msgpack.unpackb(honest.data)["sig"],
        },
        use_bin_type=True,
    )
    assert not b.merge(forged)
    assert b.rejected[crdt.BAD_SIGNATURE] == 1
