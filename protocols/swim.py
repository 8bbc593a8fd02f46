"""/starling/swim/1.0.0: the SWIM membership messages (node/swarm/membership.py) and their wire codec.

The messages are frozen dataclasses, here in the protocol layer so that the membership core (node/) and the
codec share them. In-process they name peers by small ints (the node's :class:`node.swarm.membership.Registry`
ids); on the wire by their peer ID bytes: :func:`encode` takes ``name_of(id) -> bytes`` and :func:`decode`
``id_of(bytes) -> int | None`` (None: this node will not hold that peer; the claim is skipped). Each claim
carries its author's signature (``Alive`` and ``Progress``: the member's; ``Suspect`` and ``Dead``: the
accuser's) over :func:`claim_bytes`; :func:`decode` drops a claim whose signature ``verify`` refuses, so the
core never sees a forged one, and relays forward the author's signature unchanged (``sig``).

Every message is one msgpack map ``{"v": 1, "t": type, ...}`` of at most ``MAX_MESSAGE_BYTES``, decoded with
allocation limits before anything is built; anything else (garbage, a wrong type or version, a field out of
range, more claims than ``MAX_UPDATES`` or ``MAX_ENTRIES``) is a :class:`p2p.wire.ProtocolError`, never
another exception. The ``size`` of each dataclass is what its wire form costs, counted for the benchmarks
without encoding (38-byte peer IDs, 64-byte signatures, a few bytes of msgpack framing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from p2p.wire import ProtocolError, Reason

__all__ = [
    "PROTOCOL_ID",
    "VERSION",
    "MAX_MESSAGE_BYTES",
    "MAX_UPDATES",
    "MAX_ENTRIES",
    "Ack",
    "Alive",
    "Dead",
    "Message",
    "Ping",
    "PingReq",
    "Progress",
    "Suspect",
    "SyncReply",
    "SyncRequest",
    "Update",
    "claim_bytes",
    "decode",
    "encode",
    "message_size",
]

PROTOCOL_ID = "/starling/swim/1.0.0"
VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024  # a join page of 256 signed entries is about 38 KiB
MAX_UPDATES = 16  # piggy-backed claims in one probe message (the core sends at most 8 by default)
MAX_ENTRIES = 512  # table entries in one sync message (the core sends at most 257 by default)
MAX_PEER_ID = 64  # bytes of a peer ID (ed25519 ones are 38)
MAX_SIG = 128  # bytes of a signature (ed25519 ones are 64)
MAX_SEQ = 2**32 - 1
MAX_CURSOR = 2**40

# What the wire carries (protocols' msgpack framing), for honest byte counts.
PEER_ID_BYTES = 38  # an ed25519 peer ID (identity multihash of the public key)
SIG_BYTES = 64  # an ed25519 signature
FRAME_BYTES = 8  # msgpack map header, message type, protocol version
SEQ_BYTES = 4
INC_BYTES = 4
MAX_UINT32 = 2**32 - 1


# ---------------------------------------------------------------------------------------------- updates


@dataclass(frozen=True, slots=True)
class Alive:
    """``member`` is alive at ``incarnation``: signed by the member (only it raises its incarnation)."""

    member: int
    incarnation: int
    sig: bytes = field(default=b"", compare=False, repr=False)

    size: ClassVar[int] = 1 + PEER_ID_BYTES + INC_BYTES + SIG_BYTES


@dataclass(frozen=True, slots=True)
class Suspect:
    """``accuser`` suspects ``member`` at ``incarnation``: signed by the accuser (confirmations are counted
    per accuser, so they must not be forgeable)."""

    member: int
    incarnation: int
    accuser: int
    sig: bytes = field(default=b"", compare=False, repr=False)

    size: ClassVar[int] = 1 + 2 * PEER_ID_BYTES + INC_BYTES + SIG_BYTES


@dataclass(frozen=True, slots=True)
class Dead:
    """``accuser`` declares ``member`` dead at ``incarnation``; ``accuser == member``: a graceful leave."""

    member: int
    incarnation: int
    accuser: int
    sig: bytes = field(default=b"", compare=False, repr=False)

    size: ClassVar[int] = 1 + 2 * PEER_ID_BYTES + INC_BYTES + SIG_BYTES


@dataclass(frozen=True, slots=True)
class Progress:
    """``member``'s training progress, version ``version`` (newer replaces older): signed by the member."""

    member: int
    version: int
    outer_step: int
    loss: float
    samples_per_s: float
    sig: bytes = field(default=b"", compare=False, repr=False)

    size: ClassVar[int] = 1 + PEER_ID_BYTES + INC_BYTES + 8 + 4 + 4 + SIG_BYTES  # wire bytes: a constant, so a class attribute


Update = Alive | Suspect | Dead | Progress
_SMALLEST = Alive.size


# --------------------------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Ping:
    """A probe; ``target`` is who the sender means (a ping that reaches someone else is not acked)."""

    sender: int
    seq: int
    target: int
    updates: tuple[Update, ...] = ()

    @property
    def size(self) -> int:
        return FRAME_BYTES + SEQ_BYTES + PEER_ID_BYTES + sum(u.size for u in self.updates)


@dataclass(frozen=True, slots=True)
class PingReq:
    """Please ping ``target`` for me and pass its ack on (SWIM's indirect probe)."""

    sender: int
    seq: int
    target: int
    updates: tuple[Update, ...] = ()

    @property
    def size(self) -> int:
        return FRAME_BYTES + SEQ_BYTES + PEER_ID_BYTES + sum(u.size for u in self.updates)


@dataclass(frozen=True, slots=True)
class Ack:
    """The answer to a ping (or, from an intermediary, the news that the target answered)."""

    sender: int
    seq: int
    updates: tuple[Update, ...] = ()

    @property
    def size(self) -> int:
        return FRAME_BYTES + SEQ_BYTES + sum(u.size for u in self.updates)


@dataclass(frozen=True, slots=True)
class SyncRequest:
    """A push-pull (``cursor`` -1: answer with a slice from your own walking cursor) or a joiner's page
    request (``cursor`` >= 0: the entries of your table whose peers hash into buckets [cursor, until); every
    node computes the buckets alike, so a joiner asks a different member for each page). Carries a slice of the sender's table and
    the sender's view of the receiver (so that a member held suspect or dead refutes at once)."""

    sender: int
    seq: int
    cursor: int
    entries: tuple[Alive | Suspect | Dead, ...] = ()
    view_of_you: Alive | Suspect | Dead | None = None
    until: int = 0  # a page request: the end of the hash-bucket range [cursor, until) asked for

    @property
    def size(self) -> int:
        you = self.view_of_you.size if self.view_of_you is not None else 1
        return FRAME_BYTES + SEQ_BYTES + 8 + 4 + you + sum(u.size for u in self.entries)


@dataclass(frozen=True, slots=True)
class SyncReply:
    """The answer: a slice of the table, where to continue (-1: the end), ``busy`` if refused for now."""

    sender: int
    seq: int
    next_cursor: int
    entries: tuple[Alive | Suspect | Dead, ...] = ()
    view_of_you: Alive | Suspect | Dead | None = None
    busy: bool = False

    @property
    def size(self) -> int:
        you = self.view_of_you.size if self.view_of_you is not None else 1
        return FRAME_BYTES + SEQ_BYTES + 8 + 1 + you + sum(u.size for u in self.entries)


Message = Ping | PingReq | Ack | SyncRequest | SyncReply


def message_size(message: Message) -> int:
    """Bytes the message's payload takes on the wire (stream framing and transport headers not counted)."""
    return message.size


# --------------------------------------------------------------------------------------------- the codec

_ALIVE, _SUSPECT, _DEAD, _PROGRESS = 1, 2, 3, 4
_PING, _PING_REQ, _ACK, _SYNC_REQUEST, _SYNC_REPLY = 1, 2, 3, 4, 5

NameOf = Callable[[int], bytes]
IdOf = Callable[[bytes], "int | None"]
Verify = Callable[[bytes, bytes, bytes], bool]  # (signer's peer ID, claim bytes, signature)


def _claim_wire(update: Update, name_of: NameOf) -> list[Any]:
    if isinstance(update, Alive):
        return [_ALIVE, name_of(update.member), update.incarnation]
    if isinstance(update, Suspect | Dead):
        kind = _SUSPECT if isinstance(update, Suspect) else _DEAD
        return [kind, name_of(update.member), update.incarnation, name_of(update.accuser)]
    return [_PROGRESS, name_of(update.member), update.version, update.outer_step, float(update.loss),
            float(update.samples_per_s)]


def claim_bytes(update: Update, name_of: NameOf) -> bytes:
    """What a claim's author signs: its wire form without the signature, prefixed by the protocol id."""
    return PROTOCOL_ID.encode() + msgpack.packb(_claim_wire(update, name_of), use_bin_type=True)


def _encode_claim(update: Update, name_of: NameOf) -> list[Any]:
    return [*_claim_wire(update, name_of), update.sig]


def encode(message: Message, name_of: NameOf) -> bytes:
    """The wire bytes of ``message`` (the sender is the stream's authenticated peer, not in the bytes)."""
    m: dict[str, Any] = {"v": VERSION, "s": message.seq}
    if isinstance(message, Ping | PingReq):
        m["t"] = _PING if isinstance(message, Ping) else _PING_REQ
        m["g"] = name_of(message.target)
        m["u"] = [_encode_claim(u, name_of) for u in message.updates]
    elif isinstance(message, Ack):
        m["t"] = _ACK
        m["u"] = [_encode_claim(u, name_of) for u in message.updates]
    else:
        m["t"] = _SYNC_REQUEST if isinstance(message, SyncRequest) else _SYNC_REPLY
        m["c"] = message.cursor if isinstance(message, SyncRequest) else message.next_cursor
        if isinstance(message, SyncRequest):
            m["w"] = message.until
        m["e"] = [_encode_claim(u, name_of) for u in message.entries]
        m["y"] = _encode_claim(message.view_of_you, name_of) if message.view_of_you is not None else None
        if isinstance(message, SyncReply):
            m["b"] = message.busy
    data = msgpack.packb(m, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a swim message of {len(data)} bytes, limit {MAX_MESSAGE_BYTES}")
    return data


def _bad(detail: str) -> ProtocolError:
    return ProtocolError(Reason.BAD_FIELD, f"swim: {detail}")


def _int(value: object, lo: int, hi: int, what: str) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(f"{what} must be an integer in [{lo}, {hi}]")
    return value


def _bin(value: object, hi: int, what: str) -> bytes:
    if type(value) is not bytes or not 1 <= len(value) <= hi:
        raise _bad(f"{what} must be 1..{hi} bytes")
    return value


def _float(value: object, what: str) -> float:
    if type(value) is not float or not math.isfinite(value):
        raise _bad(f"{what} must be a finite float")
    return value


_SHAPES = {_ALIVE: 4, _SUSPECT: 5, _DEAD: 5, _PROGRESS: 7}


def _decode_claim(raw: object, id_of: IdOf, verify: Verify | None) -> Update | None:
    """One claim, strictly; None when this node skips it (a peer it will not hold, a failed signature)."""
    if type(raw) is not list or not raw or type(raw[0]) is not int or raw[0] not in _SHAPES or len(raw) != _SHAPES[raw[0]]:
        raise _bad("a claim must be a list [kind, ...] of its kind's length")
    kind = raw[0]
    member_name = _bin(raw[1], MAX_PEER_ID, "a peer ID")
    number = _int(raw[2], 0, MAX_SEQ, "an incarnation or version")
    sig = _bin(raw[-1], MAX_SIG, "a signature")
    accuser_name = _bin(raw[3], MAX_PEER_ID, "an accuser") if kind in (_SUSPECT, _DEAD) else None
    if kind == _PROGRESS:
        step = _int(raw[3], 0, MAX_SEQ, "an outer step")
        loss, sps = _float(raw[4], "a loss"), _float(raw[5], "samples/s")
    member = id_of(member_name)
    accuser = id_of(accuser_name) if accuser_name is not None else None
    if member is None or (accuser_name is not None and accuser is None):
        return None
    update: Update
    if kind == _ALIVE:
        update = Alive(member, number, sig)
    elif kind == _PROGRESS:
        update = Progress(member, number, step, loss, sps, sig)
    else:
        assert accuser is not None
        update = (Suspect if kind == _SUSPECT else Dead)(member, number, accuser, sig)
    if verify is not None:
        signer = accuser_name if accuser_name is not None else member_name
        unsigned = PROTOCOL_ID.encode() + msgpack.packb(raw[:-1], use_bin_type=True)
        if not verify(signer, unsigned, sig):
            return None
    return update


def _claims(raw: object, cap: int, id_of: IdOf, verify: Verify | None, what: str) -> tuple[Any, ...]:
    if type(raw) is not list or len(raw) > cap:
        raise _bad(f"{what} must be a list of at most {cap} claims")
    out = [_decode_claim(c, id_of, verify) for c in raw]
    return tuple(c for c in out if c is not None)


_KEYS = {
    _PING: {"v", "t", "s", "g", "u"}, _PING_REQ: {"v", "t", "s", "g", "u"}, _ACK: {"v", "t", "s", "u"},
    _SYNC_REQUEST: {"v", "t", "s", "c", "e", "y", "w"}, _SYNC_REPLY: {"v", "t", "s", "c", "e", "y", "b"},
}


def decode(data: bytes, sender: int, id_of: IdOf, verify: Verify | None = None) -> Message:
    """Strictly decode a message from ``sender`` (the stream's authenticated peer, as an id).

    Raises :class:`p2p.wire.ProtocolError` for anything that is not a valid message; skips (without error)
    claims about peers ``id_of`` refuses and claims whose signature ``verify`` refuses."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(Reason.TOO_LARGE, f"swim: a message of {len(data)} bytes, limit {MAX_MESSAGE_BYTES}")
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, max_str_len=8,
                            max_bin_len=MAX_PEER_ID + MAX_SIG, max_array_len=MAX_ENTRIES, max_map_len=8,
                            max_ext_len=0)
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, ExtraData, StackError, ...)
        raise ProtocolError(Reason.MALFORMED, f"swim: not valid msgpack ({type(exc).__name__})") from None
    if type(m) is not dict:
        raise ProtocolError(Reason.MALFORMED, "swim: a message must be a map")
    if m.get("v") != VERSION or type(m.get("v")) is not int:
        raise ProtocolError(Reason.BAD_VERSION if "v" in m else Reason.MALFORMED,
                            f"swim: version {m.get('v')!r}, this node speaks {VERSION}")
    kind = m.get("t")
    if type(kind) is not int or kind not in _KEYS or set(m) != _KEYS[kind]:
        raise ProtocolError(Reason.BAD_KIND, "swim: unknown message type or fields")
    seq = _int(m["s"], 0, MAX_SEQ, "seq")
    if kind in (_PING, _PING_REQ):
        target = id_of(_bin(m["g"], MAX_PEER_ID, "target"))
        updates = _claims(m["u"], MAX_UPDATES, id_of, verify, "updates")
        if target is None:
            target = -1  # a peer this node does not hold: the ping is not for it
        return (Ping if kind == _PING else PingReq)(sender, seq, target, updates)
    if kind == _ACK:
        return Ack(sender, seq, _claims(m["u"], MAX_UPDATES, id_of, verify, "updates"))
    cursor = _int(m["c"], -1, MAX_CURSOR, "cursor")
    entries = _claims(m["e"], MAX_ENTRIES, id_of, verify, "entries")
    if any(isinstance(e, Progress) for e in entries):
        raise _bad("sync entries are membership claims")
    you = _decode_claim(m["y"], id_of, verify) if m["y"] is not None else None
    if isinstance(you, Progress):
        raise _bad("a view of the receiver is a membership claim")
    if kind == _SYNC_REQUEST:
        return SyncRequest(sender, seq, cursor, entries, you, _int(m["w"], 0, MAX_CURSOR, "until"))
    busy = m["b"]
    if type(busy) is not bool:
        raise _bad("busy must be a boolean")
    return SyncReply(sender, seq, cursor, entries, you, busy)
