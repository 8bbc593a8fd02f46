"""``/starling/state/1.0.0``: anti-entropy for the swarm state, two digests and the records each side lacks.

Gossipsub spreads every new record quickly, but it is only an accelerator: a message can be dropped (a
full queue, a peer that joined a moment later, a partition). Anti-entropy is what guarantees
convergence. Every few seconds, and as soon as a connection opens, a node runs one session with a peer:

    initiator -> responder   Hello{version, swarm, manifest_hash, digest}
    responder -> initiator   Hello{...}  (or Error{code, reason, ...} and close, see below)
    responder -> initiator   Records{records, done} ...  what the initiator lacks, in bounded batches
    initiator -> responder   Records{records, done} ...  what the responder lacks

A digest is ``key -> order`` for every record held (:meth:`node.swarm.crdt.SwarmState.digest`), so each side
computes exactly which records the other lacks or holds an older version of. Records are signed by
their authors and verified on arrival; the stream itself is only a carrier, which is why a record
relayed by any peer is as good as one from its author.

Compatibility is checked before any state moves: both peers must be in the same swarm and, when both
know one, run the same run manifest. On a mismatch the responder answers with an :class:`Error` that
names both values and closes; both sides raise :class:`SyncRefused`, whose message names both hashes,
so each operator sees what differs. A side that knows no manifest yet (a fresh node) is compatible with
any: it learns the swarm's manifest through the session.

Everything is bounded: message sizes are checked before decoding, a session carries at most
``max_records`` records in each direction (any rest follows in the next session), and every message sent
or received has its own deadline (:data:`STEP_TIMEOUT_S`) within one for the whole session
(:data:`SESSION_TIMEOUT_S`); a stalled peer raises :class:`trio.TooSlowError`. Two deadlines because a
single short one for the whole session fails exactly when anti-entropy matters most: on an overloaded
machine, where gossip is late too, each step of a session may take seconds although the peer is answering.
"""

from __future__ import annotations

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
    "BUSY",
    "DEFAULT_MAX_DIGEST_ENTRIES",
    "MANIFEST_MISMATCH",
    "SWARM_MISMATCH",
    "DEFAULT_MAX_RECORDS",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_RECORDS",
    "PROTOCOL_ID",
    "SESSION_TIMEOUT_S",
    "STEP_TIMEOUT_S",
    "Error",
    "Hello",
    "LocalInfo",
    "Records",
    "Replica",
    "SessionResult",
    "SyncRefused",
    "check_compatible",
    "initiate",
    "refuse_busy",
    "respond",
]

PROTOCOL_ID = TProtocol("/starling/state/1.0.0")

T = TypeVar("T")

#: Deadline for each step of a session: one message sent or received. A peer silent this long is cut.
STEP_TIMEOUT_S = 10.0
#: Deadline for one whole session (both hellos and both record streams), however it progresses.
SESSION_TIMEOUT_S = 60.0
#: Records per batch message and bytes of records per batch: a batch is small enough that a receiver
#: verifying signatures never holds the event loop for long, large enough to amortise framing.
MAX_BATCH_RECORDS = 64
MAX_BATCH_BYTES = 256 * 1024
#: Default bounds on what one session may carry. A replica holds at most ``2 * max_members + 1``
#: records and ``max_tombstones`` more digest entries; the defaults cover SwarmState's defaults
#: (1024 members, 4096 tombstones) with room to spare.
DEFAULT_MAX_RECORDS = 4096
DEFAULT_MAX_DIGEST_ENTRIES = 8192
#: Wire size of one digest entry at most: a key of up to 130 characters and up to five uint64s.
_DIGEST_ENTRY_BYTES = 192
_MAX_SWARM_CHARS = 256
_MAX_VERSION_CHARS = 64
_MAX_REASON_CHARS = 1024
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
    """Who the sender is (software version, swarm, run manifest) and what it holds (encoded digest)."""

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
    """The responder refuses the session; it closes the stream after sending this."""

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


@dataclass(frozen=True)
class LocalInfo:
    """This node's side of the handshake."""

    version: str
    swarm: str
    manifest_hash: str  # "" while this node knows no run manifest


@dataclass(frozen=True)
class SessionResult:
    """What one session moved, from this node's point of view."""

    sent: int  # records sent to the peer
    received: int  # records received from the peer
    changed: int  # received records that changed the local state
    rejected: int  # received records the replica refused (forged, malformed, ...)
    peer_version: str
    peer_manifest_hash: str


class SyncRefused(Exception):
    """The session was refused (by either side) before any state moved.

    ``code`` is one of ``manifest_mismatch``, ``swarm_mismatch`` (the peer is incompatible) or ``busy``
    (try later). ``local`` and ``remote`` are the two values that differ (manifest hashes or swarm
    names); the message names both.
    """

    def __init__(self, code: str, *, local: str = "", remote: str = "", peer_version: str = "") -> None:
        self.code = code
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


def check_compatible(local: LocalInfo, peer: Hello) -> SyncRefused | None:
    """The reason this node and a peer that sent ``peer`` must not share state, or None."""
    if peer.swarm != local.swarm:
        return SyncRefused(SWARM_MISMATCH, local=local.swarm, remote=peer.swarm, peer_version=peer.version)
    if local.manifest_hash and peer.manifest_hash and local.manifest_hash != peer.manifest_hash:
        return SyncRefused(
            MANIFEST_MISMATCH, local=local.manifest_hash, remote=peer.manifest_hash, peer_version=peer.version
        )
    return None


# --------------------------------------------------------------------------------------------------
# The two sides


def _hello_max_bytes(max_digest_entries: int) -> int:
    return (
        1024
        + _MAX_SWARM_CHARS
        + _MAX_VERSION_CHARS
        + MAX_HASH_CHARS
        + max_digest_entries * _DIGEST_ENTRY_BYTES
    )


def _hello(replica: Replica, local: LocalInfo) -> Hello:
    return Hello(local.version, local.swarm, local.manifest_hash, encode_digest(replica.digest()))


def _their_digest(hello: Hello, max_entries: int) -> dict[str, tuple[int, ...]]:
    try:
        return decode_digest(hello.digest, max_entries=max_entries)
    except RecordError as exc:
        raise ProtocolError(Reason.MALFORMED, f"digest: {exc}") from None


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


async def initiate(
    stream: ByteStream,
    replica: Replica,
    local: LocalInfo,
    *,
    timeout_s: float = SESSION_TIMEOUT_S,
    step_timeout_s: float = STEP_TIMEOUT_S,
    max_records: int = DEFAULT_MAX_RECORDS,
    max_digest_entries: int = DEFAULT_MAX_DIGEST_ENTRIES,
) -> SessionResult:
    """Run the initiator's side of one session over ``stream`` (opened on :data:`PROTOCOL_ID`).

    Raises :class:`SyncRefused` if the peer is incompatible or busy, :class:`ProtocolError` if it
    breaks the protocol or the stream fails, :class:`trio.TooSlowError` when one step takes longer than
    ``step_timeout_s`` or the whole session longer than ``timeout_s``. The caller closes (or, after an
    error, resets) the stream.
    """
    hello_max = _hello_max_bytes(max_digest_entries)
    steps = _Steps(stream, step_timeout_s)
    with trio.fail_after(timeout_s):
        await steps.send(_hello(replica, local), max_bytes=hello_max)
        reply = await steps.recv((Hello, Error), max_bytes=hello_max)
        if isinstance(reply, Error):
            if reply.code == MANIFEST_MISMATCH:
                raise SyncRefused(MANIFEST_MISMATCH, local=local.manifest_hash, remote=reply.manifest_hash)
            if reply.code == SWARM_MISMATCH:
                raise SyncRefused(SWARM_MISMATCH, local=local.swarm, remote=reply.swarm)
            raise SyncRefused(reply.code[:64])
        # The responder checked too, but a node must not take state from a peer it considers
        # incompatible, whatever the peer thinks.
        problem = check_compatible(local, reply)
        if problem is not None:
            raise problem
        theirs = _their_digest(reply, max_digest_entries)
        received = await _receive_records(steps, replica, max_records)
        sent = await _send_records(steps, replica.missing_for(theirs)[:max_records])
    return SessionResult(sent, *received, peer_version=reply.version, peer_manifest_hash=reply.manifest_hash)


async def respond(
    stream: ByteStream,
    replica: Replica,
    local: LocalInfo,
    *,
    timeout_s: float = SESSION_TIMEOUT_S,
    step_timeout_s: float = STEP_TIMEOUT_S,
    max_records: int = DEFAULT_MAX_RECORDS,
    max_digest_entries: int = DEFAULT_MAX_DIGEST_ENTRIES,
) -> SessionResult:
    """Run the responder's side of one session (the stream handler of :data:`PROTOCOL_ID`).

    On an incompatible peer, answers with an :class:`Error` naming both values, then raises
    :class:`SyncRefused`. Other failures as for :func:`initiate`. The caller closes the stream.
    """
    hello_max = _hello_max_bytes(max_digest_entries)
    steps = _Steps(stream, step_timeout_s)
    with trio.fail_after(timeout_s):
        hello = await steps.recv(Hello, max_bytes=hello_max)
        problem = check_compatible(local, hello)
        if problem is not None:
            reason = f"{problem.code}: the responder has {problem.local!r}, the initiator {problem.remote!r}"
            error = Error(problem.code, _clip(reason), manifest_hash=local.manifest_hash, swarm=local.swarm)
            await steps.send(error)
            raise problem
        theirs = _their_digest(hello, max_digest_entries)
        await steps.send(_hello(replica, local), max_bytes=hello_max)
        sent = await _send_records(steps, replica.missing_for(theirs)[:max_records])
        received = await _receive_records(steps, replica, max_records)
    return SessionResult(sent, *received, peer_version=hello.version, peer_manifest_hash=hello.manifest_hash)


async def refuse_busy(stream: ByteStream, local: LocalInfo) -> None:
    """Tell an initiator that this node serves too many sessions right now (it retries later)."""
    with trio.move_on_after(2.0):
        await send_msg(
            stream, Error(BUSY, "too many concurrent state sessions", local.manifest_hash, local.swarm)
        )


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
