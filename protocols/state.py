"""``/starling/state/2.1.0``: anti-entropy for the swarm state, bucket hashes first, entries only where they differ.

Gossip (where it runs) spreads every new record quickly, but it is only an accelerator: a message can be
dropped (a full queue, a peer that joined a moment later, a partition). Anti-entropy is what guarantees
convergence. Every few seconds, and as soon as a connection opens, a node runs one session with a peer:

    initiator -> responder   IntroHello{version, swarm, manifest_hash, salt, buckets, record}
    responder -> initiator   Hello{..., the same salt, its buckets}  (or Error{code, reason, ..., referral} and close)
    --- the session ends here when every bucket hash matches (two converged replicas) ---
    responder -> initiator   Entries{digest}   its entries in the buckets that differ
    initiator -> responder   Entries{digest}   its entries in the buckets that differ
    responder -> initiator   Records{records, done} ...  what the initiator lacks, in bounded batches
    initiator -> responder   Records{records, done} ...  what the responder lacks

A digest is ``key -> order`` for every record held (:meth:`node.swarm.crdt.SwarmState.digest`). Version
1.0.0 sent the whole digest in each hello, one entry per member and counter: a session between two
replicas that already agreed cost both of them bytes in proportion to the swarm (33 kB/min per idle
daemon at 16 daemons, 62 at 32, the largest traffic of an idle swim-mode daemon: docs/benchmarks.md).
Now the digest is split into :data:`BUCKETS` buckets by a hash of the key, and a hello carries one
:data:`BUCKET_HASH_BYTES`-byte hash per bucket over its sorted ``(key, order)`` entries: a converged pair's
session is two hellos of constant size, whatever the swarm's size. Where buckets differ, only their entries
go (and none for a bucket the other side holds nothing in: it lacks all of ours there), and then the
records of those buckets that each side lacks, exactly what 1.0.0 would have moved (entries of equal
buckets are equal, and equal entries move no record). The hashes are keyed by a salt the initiator draws
for each session, so nobody can prepare records whose bucket hashes collide with another replica's (a
collision would hide a difference for one session only: the next salt differs).

Compatibility is checked before any state moves: both peers must be in the same swarm and, when both
know one, run the same run manifest. On a mismatch the responder answers with an :class:`Error` that
names both values and closes; both sides raise :class:`SyncRefused`, whose message names both hashes,
so each operator sees what differs. A side that knows no manifest yet (a fresh node) is compatible with
any: it learns the swarm's manifest through the session.

A responder that serves too many sessions refuses with code ``busy``, and its 2.0.0 :class:`Error`
carries a *referral*: up to :data:`MAX_REFERRAL_RECORDS` signed member records of other alive members
(never the asker's own; at most :data:`MAX_REFERRAL_BYTES` in all), preferably ones with addresses. The
initiator verifies and applies them exactly as records of a session (the caller sees what they did in
:attr:`SyncRefused.referred`). Why: a newcomer whose only connection is a busy bootstrap otherwise learns
nobody else to dial until a session gets through, which took two minutes at 64 daemons
(docs/benchmarks.md); with a referral each refusal names members it can dial at once. A 1.0.0 stream's
error is :class:`ErrorV1`, unchanged, and carries no referral.

On 2.1.0 the initiator's hello (:class:`IntroHello`) also carries its own signed member record, and a
responder takes it whether it serves the session or refuses it as busy (a record signed by anyone but the
initiator is not taken: :meth:`Replica.introduce`). Why: every newcomer of a swarm dials the same first node,
which soon refers them on rather than serve them; on 2.0.0 a refusal took nothing from the newcomer, so the
node referred every newcomer to the few members it had served first, and those became hubs that held 40-60
connections at a 64-daemon join while the rest waited (docs/benchmarks.md, "Scale: real daemons"). Now the
refusing node holds every newcomer that asked, and its referrals spread them over all of them. 2.0.0 is
2.1.0 without the record; a node serves and speaks both.

Swarms upgrade node by node: a node serves :data:`PROTOCOL_ID`, :data:`PROTOCOL_ID_2_0` and
:data:`PROTOCOL_ID_1_0` and asks for them in that order (multistream falls back on an older peer, one round
trip more per version); on a 2.0.0 stream, ``introduce=False``, the initiator's hello is a :class:`Hello`;
on a 1.0.0 stream, ``legacy=True``, the session is 1.0.0's: :class:`HelloV1` with the whole digest, then the
records.

Everything a peer sends is bounded before it is used: message sizes are checked before decoding (a
hello has a fixed size: its salt and bucket hashes are exact lengths), an entries message holds at most
``max_digest_entries`` entries, all in buckets that differ, a session carries at most ``max_records``
records in each direction (any rest follows in the next session), and every message sent or received has
its own deadline (:data:`STEP_TIMEOUT_S`) within one for the whole session (:data:`SESSION_TIMEOUT_S`); a
stalled peer raises :class:`trio.TooSlowError`. Two deadlines because a single short one for the whole
session fails exactly when anti-entropy matters most: on an overloaded machine, where gossip is late too,
each step of a session may take seconds although the peer is answering.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import trio
from libp2p.custom_types import TProtocol

from p2p.wire import ByteStream, ProtocolError, Reason, recv_as, send_msg, spec
from protocols.record import (
    MAX_ENVELOPE_BYTES,
    MAX_HASH_CHARS,
    ApplyResult,
    RecordError,
    decode_digest,
    encode_digest,
)

__all__ = [
    "BUCKETS",
    "BUCKET_HASH_BYTES",
    "BUSY",
    "DEFAULT_MAX_DIGEST_ENTRIES",
    "ERROR_MAX_BYTES",
    "HELLO_MAX_BYTES",
    "INTRO_HELLO_MAX_BYTES",
    "MANIFEST_MISMATCH",
    "SALT_BYTES",
    "SWARM_MISMATCH",
    "DEFAULT_MAX_RECORDS",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_RECORDS",
    "PROTOCOL_ID",
    "PROTOCOL_IDS",
    "PROTOCOL_ID_1_0",
    "PROTOCOL_ID_2_0",
    "SESSION_TIMEOUT_S",
    "STEP_TIMEOUT_S",
    "Entries",
    "Error",
    "ErrorV1",
    "Hello",
    "HelloV1",
    "IntroHello",
    "LocalInfo",
    "MAX_REFERRAL_BYTES",
    "MAX_REFERRAL_RECORDS",
    "Records",
    "Replica",
    "SessionResult",
    "SyncRefused",
    "bucket_hashes",
    "bucket_of",
    "check_compatible",
    "fit_referral",
    "initiate",
    "refuse_busy",
    "respond",
]

PROTOCOL_ID = TProtocol("/starling/state/2.1.0")
#: The previous versions, still served and spoken (module docstring): 2.0.0, whose initiator's hello carries
#: no record, and 1.0.0 (whole digests in the hellos).
PROTOCOL_ID_2_0 = TProtocol("/starling/state/2.0.0")
PROTOCOL_ID_1_0 = TProtocol("/starling/state/1.0.0")
#: What an initiator asks for, preferred first.
PROTOCOL_IDS = (PROTOCOL_ID, PROTOCOL_ID_2_0, PROTOCOL_ID_1_0)

T = TypeVar("T")

#: Deadline for each step of a session: one message sent or received. A peer silent this long is cut.
STEP_TIMEOUT_S = 10.0
#: Deadline for one whole session (both hellos and both record streams), however it progresses.
SESSION_TIMEOUT_S = 60.0
#: How long a busy refusal (with its referral) may take to write. Not 2 s: a crowded bootstrap node at a 64-daemon
#: join took longer than that to write one (its event loop was that busy), the write was cut, and the newcomer
#: read a closed stream instead of the members it could dial (docs/benchmarks.md, "Scale: real daemons",
#: 2026-11-27). The message is small (MAX_REFERRAL_BYTES at most), so it waits on this node's own loop, not on
#: the peer's window.
REFUSAL_WRITE_S = STEP_TIMEOUT_S
#: How long a busy refusal on 2.1.0 waits for the initiator's hello (its record) before it refuses without it.
#: The initiator sends its hello as soon as the stream is open, so it is normally read at once; a peer that
#: holds it back only costs this node the wait, within a refusal slot it does not hold.
INTRO_READ_S = 5.0
#: Records per batch message and bytes of records per batch: a batch is small enough that a receiver
#: verifying signatures never holds the event loop for long, large enough to amortise framing.
MAX_BATCH_RECORDS = 64
MAX_BATCH_BYTES = 256 * 1024
#: Default bounds on what one session may carry. A replica holds at most ``2 * max_members + 1``
#: records and ``max_tombstones`` more digest entries; the defaults cover SwarmState's defaults
#: (1024 members, 4096 tombstones) with room to spare.
DEFAULT_MAX_RECORDS = 4096
DEFAULT_MAX_DIGEST_ENTRIES = 8192
#: Buckets of a digest and the bytes of each bucket's hash in a hello. 32 buckets: a hello of about 330
#: bytes; one record changed since the last session costs the entries of one bucket (1/32 of the table),
#: not all. 8 bytes: an accidental collision (two different buckets, one hash) is a 2^-64 event per
#: bucket, and a deliberate one cannot be prepared (the salt is new for every session).
BUCKETS = 32
BUCKET_HASH_BYTES = 8
#: The initiator's random salt for the session's bucket hashes (the key of a keyed BLAKE2b).
SALT_BYTES = 16
#: Wire size of one digest entry at most: a key of up to 130 characters and up to five uint64s.
_DIGEST_ENTRY_BYTES = 192
_MAX_SWARM_CHARS = 256
_MAX_VERSION_CHARS = 64
_MAX_REASON_CHARS = 1024
#: A 2.0.0 hello, whatever the replica holds: the strings' limits, the salt and the bucket hashes.
HELLO_MAX_BYTES = 512 + _MAX_SWARM_CHARS + _MAX_VERSION_CHARS + MAX_HASH_CHARS + SALT_BYTES + BUCKETS * BUCKET_HASH_BYTES
#: A 2.1.0 initiator's hello: a 2.0.0 hello and one signed record.
INTRO_HELLO_MAX_BYTES = HELLO_MAX_BYTES + MAX_ENVELOPE_BYTES + 16
#: A busy refusal's referral (2.0.0): at most this many signed member records, of at most this many
#: bytes together. Eight members are enough for a newcomer to spread its dials beyond the bootstrap; 8 KiB
#: keeps the refusal small, since it is sent exactly when the responder is overloaded.
MAX_REFERRAL_RECORDS = 8
MAX_REFERRAL_BYTES = 8 * 1024
#: A 2.0.0 error message at most: its strings' limits and the referral, plus msgpack's overhead.
ERROR_MAX_BYTES = 256 + _MAX_REASON_CHARS + MAX_HASH_CHARS + _MAX_SWARM_CHARS + MAX_REFERRAL_BYTES + MAX_REFERRAL_RECORDS * 8
#: A batch message: the records, plus msgpack's per-item and per-message overhead.
_MAX_RECORDS_MSG_BYTES = MAX_BATCH_BYTES + MAX_BATCH_RECORDS * 8 + 256

# Error codes.
MANIFEST_MISMATCH = "manifest_mismatch"
SWARM_MISMATCH = "swarm_mismatch"
BUSY = "busy"


# --------------------------------------------------------------------------------------------------
# Messages


@dataclass(frozen=True)
class Hello:
    """Who the sender is (software version, swarm, run manifest) and a summary of what it holds: one
    keyed hash per bucket of its digest (:func:`bucket_hashes`), under the initiator's ``salt``."""

    KIND: ClassVar[str] = "hello"
    VERSION: ClassVar[int] = 2

    version: str = spec(max_len=_MAX_VERSION_CHARS)
    swarm: str = spec(min_len=1, max_len=_MAX_SWARM_CHARS)
    manifest_hash: str = spec(max_len=MAX_HASH_CHARS)  # "" while the sender knows no manifest
    salt: bytes = spec(min_len=SALT_BYTES, max_len=SALT_BYTES)  # the initiator's; the responder echoes it
    buckets: bytes = spec(min_len=BUCKETS * BUCKET_HASH_BYTES, max_len=BUCKETS * BUCKET_HASH_BYTES)


@dataclass(frozen=True)
class IntroHello(Hello):
    """2.1.0's initiator hello: a :class:`Hello` and the initiator's own signed member record (empty while it
    has none), which the responder takes even when it refuses the session as busy (module docstring)."""

    VERSION: ClassVar[int] = 3

    record: bytes = spec(max_len=MAX_ENVELOPE_BYTES, default=b"")


@dataclass(frozen=True)
class Entries:
    """The sender's digest entries in the buckets whose hashes differ (protocols.record.encode_digest())."""

    KIND: ClassVar[str] = "entries"
    VERSION: ClassVar[int] = 2

    digest: bytes = spec()  # bounded by the message size limit and max_digest_entries


@dataclass(frozen=True)
class HelloV1:
    """1.0.0's hello: who the sender is and its whole digest (``legacy`` sessions only)."""

    KIND: ClassVar[str] = "hello"
    VERSION: ClassVar[int] = 1

    version: str = spec(max_len=_MAX_VERSION_CHARS)
    swarm: str = spec(min_len=1, max_len=_MAX_SWARM_CHARS)
    manifest_hash: str = spec(max_len=MAX_HASH_CHARS)  # "" while the sender knows no manifest
    digest: bytes = spec()  # protocols.record.encode_digest(); bounded by the message size limit


@dataclass(frozen=True)
class Records:
    """One batch of encoded signed records; ``done`` marks the sender's last batch."""

    KIND: ClassVar[str] = "records"
    VERSION: ClassVar[int] = 1

    records: list[bytes] = spec(max_len=MAX_BATCH_RECORDS)
    done: bool = spec()


@dataclass(frozen=True)
class Error:
    """The responder refuses the session (2.0.0); it closes the stream after sending this.

    A ``busy`` refusal may carry a ``referral``: signed member records of other members, so that the
    initiator learns whom else to dial (module docstring). Bounded here, after the message size limit
    (:data:`ERROR_MAX_BYTES`) was checked before decoding: a peer sending more is refused as malformed.
    """

    KIND: ClassVar[str] = "error"
    VERSION: ClassVar[int] = 2

    code: str = spec(min_len=1, max_len=64)  # MANIFEST_MISMATCH, SWARM_MISMATCH, BUSY
    reason: str = spec(max_len=_MAX_REASON_CHARS)  # human-readable, for the initiator's log
    manifest_hash: str = spec(max_len=MAX_HASH_CHARS, default="")  # the responder's
    swarm: str = spec(max_len=_MAX_SWARM_CHARS, default="")  # the responder's
    referral: list[bytes] = spec(max_len=MAX_REFERRAL_RECORDS, default_factory=list)  # encoded signed records

    def __post_init__(self) -> None:
        for i, record in enumerate(self.referral):
            if len(record) > MAX_ENVELOPE_BYTES:
                raise ValueError(f"referral[{i}]: {len(record)} bytes, more than a record may have ({MAX_ENVELOPE_BYTES})")
        total = sum(len(r) for r in self.referral)
        if total > MAX_REFERRAL_BYTES:
            raise ValueError(f"referral: {total} bytes, more than {MAX_REFERRAL_BYTES}")


@dataclass(frozen=True)
class ErrorV1:
    """1.0.0's refusal (``legacy`` sessions only): as :class:`Error`, without a referral."""

    KIND: ClassVar[str] = "error"
    VERSION: ClassVar[int] = 1

    code: str = spec(min_len=1, max_len=64)  # MANIFEST_MISMATCH, SWARM_MISMATCH, BUSY
    reason: str = spec(max_len=_MAX_REASON_CHARS)  # human-readable, for the initiator's log
    manifest_hash: str = spec(max_len=MAX_HASH_CHARS, default="")  # the responder's
    swarm: str = spec(max_len=_MAX_SWARM_CHARS, default="")  # the responder's


# --------------------------------------------------------------------------------------------------
# Interface to the replica and results


class Replica(Protocol):
    """What a session needs from the local replica (:class:`node.swarm.crdt.SwarmState` provides it)."""

    def digest(self) -> Mapping[str, tuple[int, ...]]: ...

    def missing_for(self, their_digest: Mapping[str, tuple[int, ...]]) -> list[bytes]: ...

    def apply(self, records: Iterable[bytes]) -> ApplyResult: ...

    def introduce(self, record: bytes) -> bool:
        """Merge ``record`` if it is the session's peer's own member record (a 2.1.0 initiator's hello);
        whether it was new. Anything else (another signer, another kind, a bad signature) is not taken."""
        ...


@dataclass(frozen=True)
class LocalInfo:
    """This node's side of the handshake."""

    version: str
    swarm: str
    manifest_hash: str  # "" while this node knows no run manifest
    #: This node's own encoded signed member record, which a 2.1.0 initiator's hello carries (b"": none yet).
    record: bytes = b""


@dataclass(frozen=True)
class SessionResult:
    """What one session moved, from this node's point of view."""

    sent: int  # records sent to the peer
    received: int  # records received from the peer
    changed: int  # received records that changed the local state
    rejected: int  # received records the replica refused (forged, malformed, ...)
    peer_version: str
    peer_manifest_hash: str
    differing_buckets: int = -1  # buckets whose hashes differed (2.0.0); -1 on a 1.0.0 session


class SyncRefused(Exception):
    """The session was refused (by either side) before any state moved.

    ``code`` is one of ``manifest_mismatch``, ``swarm_mismatch`` (the peer is incompatible) or ``busy``
    (try later). ``local`` and ``remote`` are the two values that differ (manifest hashes or swarm
    names); the message names both. ``referred`` is what the records of a busy refusal's referral did
    to the initiator's replica (None: the refusal carried none).
    """

    def __init__(
        self,
        code: str,
        *,
        local: str = "",
        remote: str = "",
        peer_version: str = "",
        referred: ApplyResult | None = None,
    ) -> None:
        self.code = code
        self.referred = referred
        self.local = local
        self.remote = remote
        self.peer_version = peer_version
        runs = f" (it runs starling {peer_version})" if peer_version else ""
        if code == MANIFEST_MISMATCH:
            message = (
                f"run manifest mismatch: the peer{runs} has manifest {remote}, this node has {local}; "
                f"nodes with different task, model config, optimizer config or protocol version cannot "
                f"share a swarm"
            )
        elif code == SWARM_MISMATCH:
            message = f"swarm mismatch: the peer{runs} is in swarm {remote!r}, this node in {local!r}"
        else:
            message = f"the peer refused the state sync ({code})"
        super().__init__(message)

    @property
    def incompatible(self) -> bool:
        """Whether the peer can never sync with this node as configured (not merely busy)."""
        return self.code in (MANIFEST_MISMATCH, SWARM_MISMATCH)


def check_compatible(local: LocalInfo, peer: Hello | HelloV1) -> SyncRefused | None:
    """The reason this node and a peer that sent ``peer`` must not share state, or None."""
    if peer.swarm != local.swarm:
        return SyncRefused(SWARM_MISMATCH, local=local.swarm, remote=peer.swarm, peer_version=peer.version)
    if local.manifest_hash and peer.manifest_hash and local.manifest_hash != peer.manifest_hash:
        return SyncRefused(
            MANIFEST_MISMATCH, local=local.manifest_hash, remote=peer.manifest_hash, peer_version=peer.version
        )
    return None


# --------------------------------------------------------------------------------------------------
# Buckets


@functools.lru_cache(maxsize=16384)
def bucket_of(key: str) -> int:
    """The bucket of a digest key: a hash of the key, not keyed, so that it is the same on every node
    (cached: the keys are the replica's own, bounded by its table, plus at most a session's worth)."""
    return hashlib.blake2b(key.encode(), digest_size=4).digest()[0] % BUCKETS


def bucket_hashes(digest: Mapping[str, tuple[int, ...]], salt: bytes) -> bytes:
    """One keyed BLAKE2b hash of :data:`BUCKET_HASH_BYTES` bytes per bucket, concatenated: over the
    bucket's ``(key, order)`` entries sorted by key, each length-prefixed, so that two digests hash alike
    in a bucket exactly when their entries there are equal (collisions aside)."""
    groups: list[list[str]] = [[] for _ in range(BUCKETS)]
    for key in digest:
        groups[bucket_of(key)].append(key)
    out = bytearray()
    for keys in groups:
        h = hashlib.blake2b(key=salt, digest_size=BUCKET_HASH_BYTES)
        for key in sorted(keys):
            order = digest[key]
            raw = key.encode()
            h.update(struct.pack(f">HB{len(order)}Q", len(raw), len(order), *order))
            h.update(raw)
        out += h.digest()
    return bytes(out)


def _new_salt() -> bytes:
    """A session's salt (a module function so that the fuzzers can script a responder's echo)."""
    return secrets.token_bytes(SALT_BYTES)


def _empty_hash(salt: bytes) -> bytes:
    return hashlib.blake2b(key=salt, digest_size=BUCKET_HASH_BYTES).digest()


def _split(hashes: bytes) -> list[bytes]:
    return [hashes[i : i + BUCKET_HASH_BYTES] for i in range(0, BUCKETS * BUCKET_HASH_BYTES, BUCKET_HASH_BYTES)]


@dataclass(frozen=True)
class _Comparison:
    """Where two replicas' bucket hashes differ, from one side's point of view."""

    mine: dict[str, tuple[int, ...]]  # this side's digest when it hashed it
    differ: frozenset[int]  # buckets whose hashes differ
    theirs_empty: frozenset[int]  # of those, the buckets the peer holds nothing in

    def entries_to_send(self) -> dict[str, tuple[int, ...]]:
        """Our entries in the differing buckets, except where the peer holds nothing (it lacks them all)."""
        wanted = self.differ - self.theirs_empty
        return {k: v for k, v in self.mine.items() if bucket_of(k) in wanted}

    def their_digest(self, entries: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The peer's whole digest as far as it matters here: ours where the buckets match, and the
        entries it sent where they differ; so :meth:`Replica.missing_for` picks only records of the
        differing buckets, without a change to the replica's interface."""
        out = {k: v for k, v in self.mine.items() if bucket_of(k) not in self.differ}
        out.update(entries)
        return out


def _compare(mine: dict[str, tuple[int, ...]], my_hashes: bytes, their_hashes: bytes, salt: bytes) -> _Comparison:
    ours, theirs, empty = _split(my_hashes), _split(their_hashes), _empty_hash(salt)
    differ = frozenset(i for i in range(BUCKETS) if ours[i] != theirs[i])
    return _Comparison(mine, differ, frozenset(i for i in differ if theirs[i] == empty))


# --------------------------------------------------------------------------------------------------
# The two sides


def _digest_max_bytes(max_digest_entries: int) -> int:
    return (
        1024
        + _MAX_SWARM_CHARS
        + _MAX_VERSION_CHARS
        + MAX_HASH_CHARS
        + max_digest_entries * _DIGEST_ENTRY_BYTES
    )


def _hello_v1(replica: Replica, local: LocalInfo) -> HelloV1:
    return HelloV1(local.version, local.swarm, local.manifest_hash, encode_digest(replica.digest()))


def _their_digest(data: bytes, max_entries: int) -> dict[str, tuple[int, ...]]:
    try:
        return decode_digest(data, max_entries=max_entries)
    except RecordError as exc:
        raise ProtocolError(Reason.MALFORMED, f"digest: {exc}") from None


def _their_entries(entries: Entries, comparison: _Comparison, max_entries: int) -> dict[str, tuple[int, ...]]:
    """The peer's entries, refused unless every one lies in a bucket whose hashes differ: entries
    elsewhere are news this side did not ask for (and could only be a peer's attempt to make it work)."""
    theirs = _their_digest(entries.digest, max_entries)
    for key in theirs:
        if bucket_of(key) not in comparison.differ:
            raise ProtocolError(Reason.MALFORMED, f"entries: {key[:64]!r} lies in bucket {bucket_of(key)}, whose hashes match")
    return theirs


class _Steps:
    """Sends and receives of one session, each under its own deadline (see the module docstring)."""

    def __init__(self, stream: ByteStream, step_timeout_s: float) -> None:
        self.stream = stream
        self.timeout_s = step_timeout_s

    async def send(self, msg: Any, *, max_bytes: int = _MAX_RECORDS_MSG_BYTES) -> None:
        with trio.fail_after(self.timeout_s):
            await send_msg(self.stream, msg, max_bytes=max_bytes)

    async def recv(self, types: type[T] | tuple[type[T], ...], *, max_bytes: int = _MAX_RECORDS_MSG_BYTES) -> T:
        with trio.fail_after(self.timeout_s):
            return await recv_as(self.stream, types, max_bytes=max_bytes)


def _refusal(reply: Error | ErrorV1, local: LocalInfo, replica: Replica | None = None) -> SyncRefused:
    """The initiator's exception for a responder's error; a busy refusal's referral is applied to
    ``replica`` first, as records of a session are (verified one by one; a bad one is rejected and
    counted). Another code's referral is ignored: an incompatible peer's records are not taken."""
    if reply.code == MANIFEST_MISMATCH:
        return SyncRefused(MANIFEST_MISMATCH, local=local.manifest_hash, remote=reply.manifest_hash)
    if reply.code == SWARM_MISMATCH:
        return SyncRefused(SWARM_MISMATCH, local=local.swarm, remote=reply.swarm)
    referred = None
    if reply.code == BUSY and isinstance(reply, Error) and reply.referral and replica is not None:
        referred = replica.apply(reply.referral)
    return SyncRefused(reply.code[:64], referred=referred)


async def initiate(
    stream: ByteStream,
    replica: Replica,
    local: LocalInfo,
    *,
    timeout_s: float = SESSION_TIMEOUT_S,
    step_timeout_s: float = STEP_TIMEOUT_S,
    max_records: int = DEFAULT_MAX_RECORDS,
    max_digest_entries: int = DEFAULT_MAX_DIGEST_ENTRIES,
    legacy: bool = False,
    introduce: bool = False,
) -> SessionResult:
    """Run the initiator's side of one session over ``stream``: opened on :data:`PROTOCOL_ID` with
    ``introduce`` (the hello carries ``local.record``), on :data:`PROTOCOL_ID_2_0` without, or on
    :data:`PROTOCOL_ID_1_0` with ``legacy``.

    Raises :class:`SyncRefused` if the peer is incompatible or busy, :class:`ProtocolError` if it
    breaks the protocol or the stream fails, :class:`trio.TooSlowError` when one step takes longer than
    ``step_timeout_s`` or the whole session longer than ``timeout_s``. The caller closes (or, after an
    error, resets) the stream.
    """
    steps = _Steps(stream, step_timeout_s)
    with trio.fail_after(timeout_s):
        if legacy:
            return await _initiate_v1(steps, replica, local, max_records, max_digest_entries)
        salt = _new_salt()
        mine = dict(replica.digest())
        my_hashes = bucket_hashes(mine, salt)
        if introduce:
            hello = IntroHello(local.version, local.swarm, local.manifest_hash, salt, my_hashes, local.record)
            await steps.send(hello, max_bytes=INTRO_HELLO_MAX_BYTES)
        else:
            await steps.send(Hello(local.version, local.swarm, local.manifest_hash, salt, my_hashes), max_bytes=HELLO_MAX_BYTES)
        reply: Hello | Error = await steps.recv((Hello, Error), max_bytes=max(HELLO_MAX_BYTES, ERROR_MAX_BYTES))
        if isinstance(reply, Error):
            raise _refusal(reply, local, replica)
        # The responder checked too, but a node must not take state from a peer it considers
        # incompatible, whatever the peer thinks.
        problem = check_compatible(local, reply)
        if problem is not None:
            raise problem
        if reply.salt != salt:
            raise ProtocolError(Reason.MALFORMED, "hello: the responder hashed its buckets with another salt")
        comparison = _compare(mine, my_hashes, reply.buckets, salt)
        if not comparison.differ:
            return _result(0, (0, 0, 0), reply, comparison)
        digest_max = _digest_max_bytes(max_digest_entries)
        theirs = _their_entries(await steps.recv(Entries, max_bytes=digest_max), comparison, max_digest_entries)
        await steps.send(Entries(encode_digest(comparison.entries_to_send())), max_bytes=digest_max)
        # Chosen before the responder's records arrive: it sent no entries where we held nothing, so
        # what it sends now would look missing on its side afterwards, and go straight back.
        outgoing = replica.missing_for(comparison.their_digest(theirs))[:max_records]
        received = await _receive_records(steps, replica, max_records)
        sent = await _send_records(steps, outgoing)
    return _result(sent, received, reply, comparison)


async def respond(
    stream: ByteStream,
    replica: Replica,
    local: LocalInfo,
    *,
    timeout_s: float = SESSION_TIMEOUT_S,
    step_timeout_s: float = STEP_TIMEOUT_S,
    max_records: int = DEFAULT_MAX_RECORDS,
    max_digest_entries: int = DEFAULT_MAX_DIGEST_ENTRIES,
    legacy: bool = False,
    introduce: bool = False,
) -> SessionResult:
    """Run the responder's side of one session (the stream handler of :data:`PROTOCOL_ID` with ``introduce``,
    of :data:`PROTOCOL_ID_2_0` without, or of :data:`PROTOCOL_ID_1_0` with ``legacy``).

    On an incompatible peer, answers with an :class:`Error` naming both values, then raises
    :class:`SyncRefused`. Other failures as for :func:`initiate`. The caller closes the stream.
    """
    steps = _Steps(stream, step_timeout_s)
    with trio.fail_after(timeout_s):
        if legacy:
            return await _respond_v1(steps, replica, local, max_records, max_digest_entries)
        hello = await _recv_hello(steps, introduce)
        await _refuse_if_incompatible(steps, local, hello)
        if isinstance(hello, IntroHello) and hello.record:
            replica.introduce(hello.record)  # before the digest: then it is not sent back as missing here
        mine = dict(replica.digest())
        my_hashes = bucket_hashes(mine, hello.salt)
        await steps.send(
            Hello(local.version, local.swarm, local.manifest_hash, hello.salt, my_hashes), max_bytes=HELLO_MAX_BYTES
        )
        comparison = _compare(mine, my_hashes, hello.buckets, hello.salt)
        if not comparison.differ:
            return _result(0, (0, 0, 0), hello, comparison)
        digest_max = _digest_max_bytes(max_digest_entries)
        await steps.send(Entries(encode_digest(comparison.entries_to_send())), max_bytes=digest_max)
        theirs = _their_entries(await steps.recv(Entries, max_bytes=digest_max), comparison, max_digest_entries)
        sent = await _send_records(steps, replica.missing_for(comparison.their_digest(theirs))[:max_records])
        received = await _receive_records(steps, replica, max_records)
    return _result(sent, received, hello, comparison)


async def _recv_hello(steps: _Steps, introduce: bool) -> Hello:
    """The initiator's hello: an :class:`IntroHello` on 2.1.0, a :class:`Hello` on 2.0.0."""
    if introduce:
        return await steps.recv(IntroHello, max_bytes=INTRO_HELLO_MAX_BYTES)
    return await steps.recv(Hello, max_bytes=HELLO_MAX_BYTES)


def _result(sent: int, received: tuple[int, int, int], peer: Hello, comparison: _Comparison) -> SessionResult:
    return SessionResult(sent, *received, peer_version=peer.version, peer_manifest_hash=peer.manifest_hash,
                         differing_buckets=len(comparison.differ))


async def _refuse_if_incompatible(steps: _Steps, local: LocalInfo, hello: Hello | HelloV1) -> None:
    problem = check_compatible(local, hello)
    if problem is not None:
        reason = f"{problem.code}: the responder has {problem.local!r}, the initiator {problem.remote!r}"
        kind = ErrorV1 if isinstance(hello, HelloV1) else Error
        error = kind(problem.code, _clip(reason), manifest_hash=local.manifest_hash, swarm=local.swarm)
        await steps.send(error)
        raise problem


async def _initiate_v1(
    steps: _Steps, replica: Replica, local: LocalInfo, max_records: int, max_digest_entries: int
) -> SessionResult:
    """1.0.0's initiator: both whole digests, then the records each side lacks."""
    hello_max = _digest_max_bytes(max_digest_entries)
    await steps.send(_hello_v1(replica, local), max_bytes=hello_max)
    reply: HelloV1 | ErrorV1 = await steps.recv((HelloV1, ErrorV1), max_bytes=hello_max)
    if isinstance(reply, ErrorV1):
        raise _refusal(reply, local)
    problem = check_compatible(local, reply)
    if problem is not None:
        raise problem
    theirs = _their_digest(reply.digest, max_digest_entries)
    received = await _receive_records(steps, replica, max_records)
    sent = await _send_records(steps, replica.missing_for(theirs)[:max_records])
    return SessionResult(sent, *received, peer_version=reply.version, peer_manifest_hash=reply.manifest_hash)


async def _respond_v1(
    steps: _Steps, replica: Replica, local: LocalInfo, max_records: int, max_digest_entries: int
) -> SessionResult:
    """1.0.0's responder."""
    hello_max = _digest_max_bytes(max_digest_entries)
    hello = await steps.recv(HelloV1, max_bytes=hello_max)
    await _refuse_if_incompatible(steps, local, hello)
    theirs = _their_digest(hello.digest, max_digest_entries)
    await steps.send(_hello_v1(replica, local), max_bytes=hello_max)
    sent = await _send_records(steps, replica.missing_for(theirs)[:max_records])
    received = await _receive_records(steps, replica, max_records)
    return SessionResult(sent, *received, peer_version=hello.version, peer_manifest_hash=hello.manifest_hash)


async def refuse_busy(
    stream: ByteStream,
    local: LocalInfo,
    *,
    referral: Sequence[bytes] = (),
    legacy: bool = False,
    introduced_to: Replica | None = None,
) -> None:
    """Tell an initiator that this node serves too many sessions right now (it retries later).

    On 2.0.0 and 2.1.0, ``referral`` (encoded signed member records of other members, never the
    initiator's) goes with it, as many as fit :data:`MAX_REFERRAL_RECORDS` and :data:`MAX_REFERRAL_BYTES` in
    the given order; on a 1.0.0 stream (``legacy``) the refusal is 1.0.0's, without one. On 2.1.0, given
    ``introduced_to``, the initiator's hello is read first (it sent it at once; at most
    :data:`INTRO_READ_S`) and its record introduced to that replica unless the initiator is incompatible:
    the refusal takes the newcomer's record although it serves no session (module docstring). A hello that
    is late or malformed is given up on; the refusal goes either way.
    """
    if introduced_to is not None and not legacy:
        with trio.move_on_after(INTRO_READ_S):
            try:
                hello = await recv_as(stream, IntroHello, max_bytes=INTRO_HELLO_MAX_BYTES)
            except ProtocolError:
                pass
            else:
                if hello.record and check_compatible(local, hello) is None:
                    introduced_to.introduce(hello.record)
    reason = "too many concurrent state sessions"
    msg: Error | ErrorV1
    if legacy:
        msg = ErrorV1(BUSY, reason, local.manifest_hash, local.swarm)
    else:
        msg = Error(BUSY, reason, local.manifest_hash, local.swarm, referral=fit_referral(referral))
    with trio.move_on_after(REFUSAL_WRITE_S):
        await send_msg(stream, msg, max_bytes=ERROR_MAX_BYTES)


def fit_referral(records: Iterable[bytes]) -> list[bytes]:
    """The first of ``records`` that fit a referral's bounds, in order (one too large is skipped)."""
    out: list[bytes] = []
    total = 0
    for record in records:
        if len(out) == MAX_REFERRAL_RECORDS:
            break
        if len(record) > MAX_ENVELOPE_BYTES or total + len(record) > MAX_REFERRAL_BYTES:
            continue
        out.append(record)
        total += len(record)
    return out


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _batches(records: Sequence[bytes]) -> Iterable[list[bytes]]:
    """Split records into batches of at most MAX_BATCH_RECORDS records and MAX_BATCH_BYTES bytes."""
    batch: list[bytes] = []
    size = 0
    for record in records:
        if len(record) > MAX_ENVELOPE_BYTES:
            continue  # nothing a replica holds is this large; never send what the peer must refuse
        if batch and (len(batch) == MAX_BATCH_RECORDS or size + len(record) > MAX_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(record)
        size += len(record)
    if batch:
        yield batch


async def _send_records(steps: _Steps, records: Sequence[bytes]) -> int:
    """Send ``records`` in batches; the last message (possibly empty) has ``done`` set."""
    batches = list(_batches(records)) or [[]]
    for i, batch in enumerate(batches):
        await steps.send(Records(batch, done=i == len(batches) - 1))
    return sum(len(b) for b in batches)


async def _receive_records(steps: _Steps, replica: Replica, max_records: int) -> tuple[int, int, int]:
    """Receive batches until ``done`` and merge each; returns (received, changed, rejected)."""
    received = changed = rejected = 0
    while True:
        batch = await steps.recv(Records)
        received += len(batch.records)
        if received > max_records:
            raise ProtocolError(Reason.TOO_LARGE, f"more than {max_records} records in one session")
        result = replica.apply(batch.records)
        changed += result.changed
        rejected += result.rejected
        if batch.done:
            return received, changed, rejected
