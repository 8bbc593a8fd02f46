"""The signed record schema of the swarm state: record types, envelopes, signatures, order and digests.

What travels in ``/starling/state/1.0.0`` sessions (:mod:`protocols.state`) and on the gossipsub topic;
the replica that holds and merges these records is :class:`node.swarm.crdt.SwarmState` (see that module for the
merge rules, failure detection and the Sybil limits). This module is the wire format only, so that the
protocol layer does not depend on the daemon.

Records (one per key, the key derived from the record): ``m:<peer>`` :class:`MemberRecord` (last-writer-wins
by the author's hybrid logical clock, :mod:`protocols.hlc`), ``c:<peer>`` :class:`CounterRecord` (a peer's
entry of a grow-only counter) and ``manifest`` :class:`ManifestRecord` (the run manifest).

Ordering. Each signed record has an ``order`` tuple of integers: ``(wall_ms, logical, h)`` for member
and manifest records, ``(samples, tokens, wall_ms, logical, h)`` for counter records, where ``h`` is the
first 8 bytes of the SHA-256 of the signed body (a tie-break that makes the order total). The order is
also what a digest carries, so two replicas can tell who has the newer record without shipping it.

Signing. A record travels as an envelope ``{v, body, pubkey, sig}`` (msgpack). ``sig`` is the author's
libp2p signature over a domain tag plus the exact ``body`` bytes, and ``pubkey`` is the author's
serialized libp2p public key. A record is accepted only if the signature verifies *and* the peer ID
derived from ``pubkey`` is the peer the record describes: nobody can speak for another peer. Decoding is
strict: sizes are checked before decoding, every field's type and range is checked, unknown fields and
unknown versions are refused, and every failure is one exception type, :class:`RecordError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import msgpack
from libp2p.crypto.keys import KeyPair, PublicKey
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID

from p2p.framing import ProtocolError, unpack
from protocols.hlc import MAX_LOGICAL, MAX_WALL_MS, Timestamp

# --------------------------------------------------------------------------------------------------
# Format constants and limits

#: Version of the envelope, record body, digest and state-file formats.
FORMAT_VERSION = 1
#: Domain separation for signatures: a signature over a state record can never be replayed as a
#: signature over anything else the same key signs (and vice versa).
SIGNING_DOMAIN = b"starling/state-record/v1\x00"

MAX_ENVELOPE_BYTES = 12 * 1024
MAX_BODY_BYTES = 8 * 1024
MAX_PUBKEY_BYTES = 1024
MAX_SIGNATURE_BYTES = 1024
MAX_PEER_ID_CHARS = 128
MAX_ADDRS = 16
MAX_PARTNERS = 16  # recent averaging partners a member record names
MAX_ADDR_CHARS = 256
MAX_LABEL_CHARS = 32  # reachability, role
MAX_VERSION_CHARS = 64
MAX_HASH_CHARS = 128
MAX_TASK_CHARS = 256
MAX_UINT63 = 2**63 - 1
MAX_UINT64 = 2**64 - 1

MANIFEST_KEY = "manifest"
MEMBER_PREFIX = "m:"
COUNTER_PREFIX = "c:"

# Reasons a record is rejected (keys of SwarmState.rejected).
TOO_LARGE = "too_large"
MALFORMED = "malformed"
UNSUPPORTED_VERSION = "unsupported_version"
BAD_SIGNATURE = "bad_signature"
WRONG_SIGNER = "wrong_signer"
CLOCK_SKEW = "clock_skew"
CAPACITY = "capacity"
MANIFEST_REFUSED = "manifest_refused"  # a manifest this node's ManifestAuthority does not allow
SUBNET_LIMIT = "subnet_limit"  # a new identity from a network group that holds its share of the table


# --------------------------------------------------------------------------------------------------
# Errors


class RecordError(ValueError):
    """A record, envelope or digest that is not acceptable. ``reason`` is one of the module's reason
    constants (``malformed``, ``bad_signature``, ...) and is what rejection counters are keyed by."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------------------------------
# Field validation: one function per field type, each returns the normalised value or raises.

Validator = Callable[[str, object], object]


def _bad(name: str, problem: str) -> RecordError:
    return RecordError(MALFORMED, f"field {name!r} {problem}")


def _int_field(lo: int, hi: int) -> Validator:
    def check(name: str, value: object) -> int:
        if type(value) is not int:  # `type is` also refuses bool, which is an int subclass
            raise _bad(name, f"must be an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise _bad(name, f"is {value}, outside [{lo}, {hi}]")
        return value

    return check


def _float_field(lo: float = -math.inf, *, optional: bool = False) -> Validator:
    def check(name: str, value: object) -> float | None:
        if value is None and optional:
            return None
        if type(value) is not float:
            raise _bad(name, f"must be a float, got {type(value).__name__}")
        if not math.isfinite(value) or value < lo:
            raise _bad(name, f"is {value}, must be finite and >= {lo}")
        return value

    return check


def _str_field(max_chars: int, min_chars: int = 0) -> Validator:
    def check(name: str, value: object) -> str:
        if type(value) is not str:
            raise _bad(name, f"must be a string, got {type(value).__name__}")
        if not min_chars <= len(value) <= max_chars:
            raise _bad(name, f"has {len(value)} characters, allowed {min_chars}..{max_chars}")
        return value

    return check


def _bool_field(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise _bad(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _addrs_field(name: str, value: object) -> tuple[str, ...]:
    if type(value) is not list:
        raise _bad(name, f"must be a list, got {type(value).__name__}")
    if len(value) > MAX_ADDRS:
        raise _bad(name, f"has {len(value)} entries, at most {MAX_ADDRS} allowed")
    check = _str_field(MAX_ADDR_CHARS, 1)
    return tuple(str(check(f"{name}[{i}]", item)) for i, item in enumerate(value))


def _hlc_field(name: str, value: object) -> Timestamp:
    if type(value) is not list or len(value) != 2:
        raise _bad(name, "must be a [wall_ms, logical] pair")
    wall = _int_field(0, MAX_WALL_MS)(f"{name}.wall_ms", value[0])
    logical = _int_field(0, MAX_LOGICAL)(f"{name}.logical", value[1])
    return Timestamp(int(wall), int(logical))


_PEER_ID = _str_field(MAX_PEER_ID_CHARS, 1)
_COUNT = _int_field(0, MAX_UINT63)


def _partners_field(name: str, value: object) -> tuple[str, ...]:
    if type(value) is not list:
        raise _bad(name, f"must be a list, got {type(value).__name__}")
    if len(value) > MAX_PARTNERS:
        raise _bad(name, f"has {len(value)} entries, at most {MAX_PARTNERS} allowed")
    return tuple(str(_PEER_ID(f"{name}[{i}]", item)) for i, item in enumerate(value))


# --------------------------------------------------------------------------------------------------
# Record types


@dataclass(frozen=True)
class Manifest:
    """What a swarm trains: two nodes may average only if their manifests are equal."""

    task: str
    model_hash: str
    optimizer_hash: str
    protocol_version: int

    @cached_property
    def hash(self) -> str:
        """SHA-256 (hex) over a canonical encoding of the four fields."""
        canonical = msgpack.packb(
            [FORMAT_VERSION, self.task, self.model_hash, self.optimizer_hash, self.protocol_version],
            use_bin_type=True,
        )
        return hashlib.sha256(canonical).hexdigest()

    def differences(self, other: Manifest) -> tuple[str, ...]:
        """Names of the fields in which ``other`` differs from this manifest."""
        names = ("task", "model_hash", "optimizer_hash", "protocol_version")
        return tuple(n for n in names if getattr(self, n) != getattr(other, n))


@dataclass(frozen=True)
class MemberRecord:
    """A peer's self-description, last-writer-wins by HLC. Only the peer itself can sign one."""

    kind: ClassVar[str] = "member"

    peer_id: str
    hlc: Timestamp
    addrs: tuple[str, ...] = ()
    reachability: str = "unknown"  # e.g. unknown / public / private / relayed
    role: str = "trainer"
    outer_step: int = 0
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None
    samples_per_s: float = 0.0
    version: str = ""
    manifest_hash: str = ""
    heartbeat: float = 0.0  # author's wall time (seconds) when it wrote the record
    left: bool = False  # departure marker: the peer stopped gracefully
    # Whom it averaged with over its recent outer steps (node/averaging/averager.py): every node can then see the
    # swarm's pairing graph, and `starling doctor` can tell when it has split into islands.
    partners: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return MEMBER_PREFIX + self.peer_id


@dataclass(frozen=True)
class CounterRecord:
    """A peer's entry in the swarm-wide grow-only counter: its running totals of work done."""

    kind: ClassVar[str] = "counter"

    peer_id: str
    hlc: Timestamp
    samples: int = 0
    tokens: int = 0

    @property
    def key(self) -> str:
        return COUNTER_PREFIX + self.peer_id


@dataclass(frozen=True)
class ManifestRecord:
    """The swarm's run manifest, signed by the node that founded the swarm."""

    kind: ClassVar[str] = "manifest"

    peer_id: str
    hlc: Timestamp
    task: str
    model_hash: str
    optimizer_hash: str
    protocol_version: int

    @property
    def key(self) -> str:
        return MANIFEST_KEY

    @property
    def manifest(self) -> Manifest:
        return Manifest(self.task, self.model_hash, self.optimizer_hash, self.protocol_version)


Record = MemberRecord | CounterRecord | ManifestRecord

_SCHEMAS: dict[str, tuple[type[Record], dict[str, Validator]]] = {
    MemberRecord.kind: (
        MemberRecord,
        {
            "peer_id": _PEER_ID,
            "hlc": _hlc_field,
            "addrs": _addrs_field,
            "reachability": _str_field(MAX_LABEL_CHARS),
            "role": _str_field(MAX_LABEL_CHARS),
            "outer_step": _COUNT,
            "step": _COUNT,
            "loss": _float_field(optional=True),
            "val_loss": _float_field(optional=True),
            "samples_per_s": _float_field(0.0),
            "version": _str_field(MAX_VERSION_CHARS),
            "manifest_hash": _str_field(MAX_HASH_CHARS),
            "heartbeat": _float_field(0.0),
            "left": _bool_field,
            "partners": _partners_field,
        },
    ),
    CounterRecord.kind: (
        CounterRecord,
        {"peer_id": _PEER_ID, "hlc": _hlc_field, "samples": _COUNT, "tokens": _COUNT},
    ),
    ManifestRecord.kind: (
        ManifestRecord,
        {
            "peer_id": _PEER_ID,
            "hlc": _hlc_field,
            "task": _str_field(MAX_TASK_CHARS),
            "model_hash": _str_field(MAX_HASH_CHARS),
            "optimizer_hash": _str_field(MAX_HASH_CHARS),
            "protocol_version": _int_field(0, 2**32 - 1),
        },
    ),
}


def _describe_keys(keys: Iterable[object]) -> str:
    shown = sorted(repr(k)[:40] for k in keys)
    return ", ".join(shown[:5]) + (", ..." if len(shown) > 5 else "")


def _check_map(m: Mapping[Any, Any], expected: Iterable[str], what: str) -> None:
    """Exact key set: missing and unknown keys are both refused (new fields mean a new version)."""
    expected = set(expected)
    keys = set(m)
    if keys != expected:
        problems = []
        if expected - keys:
            problems.append(f"missing {_describe_keys(expected - keys)}")
        if keys - expected:
            problems.append(f"unexpected {_describe_keys(keys - expected)}")
        raise RecordError(MALFORMED, f"{what}: {'; '.join(problems)}")


def _check_version(m: Mapping[Any, Any], what: str) -> None:
    if "v" not in m:
        raise RecordError(MALFORMED, f"{what} has no version field")
    if type(m["v"]) is not int or m["v"] != FORMAT_VERSION:
        raise RecordError(
            UNSUPPORTED_VERSION, f"{what} version {m['v']!r}, this node speaks {FORMAT_VERSION}"
        )


def _record_from_wire(m: Mapping[Any, Any]) -> Record:
    _check_version(m, "record")
    kind = m.get("kind")
    if not isinstance(kind, str) or kind not in _SCHEMAS:
        raise RecordError(MALFORMED, f"unknown record kind {kind!r}"[:120])
    cls, schema = _SCHEMAS[kind]
    _check_map(m, ["v", "kind", *schema], f"{kind} record")
    values = {name: check(name, m[name]) for name, check in schema.items()}
    return cls(**values)  # type: ignore[arg-type]


def record_to_wire(record: Record) -> dict[str, object]:
    wire: dict[str, object] = {"v": FORMAT_VERSION, "kind": record.kind}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        wire[f.name] = list(value) if isinstance(value, tuple) else value
    # Validate what we are about to sign with the very checks receivers apply, so a bad local value
    # fails here, loudly, instead of being silently dropped by every peer.
    _record_from_wire(wire)
    return wire


def _unpack(data: bytes, *, max_items: int, max_str: int, max_bin: int) -> object:
    """msgpack decode with allocation limits (p2p/framing.py's); any failure is a ``malformed`` RecordError."""
    try:
        return unpack(data, max_items=max_items, max_str=max_str, max_bin=max_bin)
    except Exception as exc:  # ProtocolError for what msgpack refuses; whatever else it raises is refused too
        cause = exc.__cause__ if isinstance(exc, ProtocolError) and exc.__cause__ is not None else exc
        raise RecordError(MALFORMED, f"not valid msgpack ({type(cause).__name__}: {str(cause)[:80]})") from None


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_body(record: Record) -> bytes:
    """The canonical body bytes of a record: what is signed and hashed."""
    return _pack(record_to_wire(record))


def decode_body(body: bytes) -> Record:
    """Strictly decode a record body (no signature check)."""
    if len(body) > MAX_BODY_BYTES:
        raise RecordError(TOO_LARGE, f"record body of {len(body)} bytes, limit {MAX_BODY_BYTES}")
    m = _unpack(body, max_items=64, max_str=MAX_TASK_CHARS * 4, max_bin=0)
    if not isinstance(m, dict):
        raise RecordError(MALFORMED, "record body is not a map")
    return _record_from_wire(m)


# --------------------------------------------------------------------------------------------------
# Signed records and verification


def _order_of(record: Record, body: bytes) -> tuple[int, ...]:
    h = int.from_bytes(hashlib.sha256(body).digest()[:8], "big")
    if isinstance(record, CounterRecord):
        return (record.samples, record.tokens, record.hlc.wall_ms, record.hlc.logical, h)
    return (record.hlc.wall_ms, record.hlc.logical, h)


@dataclass(frozen=True)
class SignedRecord:
    """A verified (or locally signed) record together with its exact wire bytes.

    Obtain one from :func:`sign_record` or :meth:`Verifier.decode`; ``data`` is what to publish.
    """

    data: bytes
    record: Record
    order: tuple[int, ...]

    @property
    def key(self) -> str:
        return self.record.key

    @property
    def kind(self) -> str:
        return self.record.kind

    @property
    def peer_id(self) -> str:
        return self.record.peer_id


def peer_id_of(public_key: PublicKey) -> str:
    """The base58 libp2p peer ID of a public key."""
    return ID.from_pubkey(public_key).to_base58()


def sign_record(record: Record, key_pair: KeyPair) -> SignedRecord:
    """Sign ``record`` with ``key_pair``, which must be the key of the peer the record describes."""
    author = peer_id_of(key_pair.public_key)
    if author != record.peer_id:
        raise ValueError(f"key of peer {author} cannot sign a record for peer {record.peer_id}")
    body = encode_body(record)
    signature = key_pair.private_key.sign(SIGNING_DOMAIN + body)
    envelope = {
        "v": FORMAT_VERSION,
        "body": body,
        "pubkey": key_pair.public_key.serialize(),
        "sig": signature,
    }
    return SignedRecord(_pack(envelope), record, _order_of(record, body))


class Verifier:
    """Decodes and verifies envelopes, caching verified results by content hash.

    Gossip and anti-entropy deliver the same bytes many times; the cache turns every repeat into one
    SHA-256 instead of a signature verification. Only successes are cached (bounded, LRU), so junk
    cannot evict much and a forged record is re-checked (and re-counted) every time.
    """

    def __init__(self, cache_size: int = 4096) -> None:
        self._cache: OrderedDict[bytes, SignedRecord] = OrderedDict()
        self._cache_size = cache_size
        self.verifications = 0  # signature checks actually performed (observable cache effect)

    def remember(self, signed: SignedRecord) -> None:
        """Seed the cache with a record this node signed itself."""
        self._store(hashlib.sha256(signed.data).digest(), signed)

    def _store(self, digest: bytes, signed: SignedRecord) -> None:
        self._cache[digest] = signed
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def decode(self, data: bytes) -> SignedRecord:
        """Decode an envelope, verify its signature and author; raise :class:`RecordError` if bad."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise RecordError(MALFORMED, f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_ENVELOPE_BYTES:
            raise RecordError(TOO_LARGE, f"record of {len(data)} bytes, limit {MAX_ENVELOPE_BYTES}")
        digest = hashlib.sha256(data).digest()
        cached = self._cache.get(digest)
        if cached is not None:
            self._cache.move_to_end(digest)
            return cached

        env = _unpack(data, max_items=8, max_str=16, max_bin=MAX_BODY_BYTES)
        if not isinstance(env, dict):
            raise RecordError(MALFORMED, "record envelope is not a map")
        _check_version(env, "envelope")
        _check_map(env, ["v", "body", "pubkey", "sig"], "envelope")
        body, pubkey, sig = env["body"], env["pubkey"], env["sig"]
        for name, value, limit in (
            ("body", body, MAX_BODY_BYTES),
            ("pubkey", pubkey, MAX_PUBKEY_BYTES),
            ("sig", sig, MAX_SIGNATURE_BYTES),
        ):
            if type(value) is not bytes or len(value) > limit:
                raise _bad(name, f"must be at most {limit} bytes")
        record = decode_body(body)

        try:
            public_key = deserialize_public_key(pubkey)
        except Exception as exc:  # protobuf, unknown key type, bad curve point, ...
            raise RecordError(MALFORMED, f"bad public key ({type(exc).__name__})") from None
        self.verifications += 1
        try:
            valid = bool(public_key.verify(SIGNING_DOMAIN + body, sig))
        except Exception:  # some key types raise on malformed signatures instead of returning False
            valid = False
        if not valid:
            raise RecordError(BAD_SIGNATURE, f"signature does not verify for the record of {record.peer_id}")
        author = peer_id_of(public_key)
        if author != record.peer_id:
            raise RecordError(WRONG_SIGNER, f"record for {record.peer_id} is signed by {author}")

        signed = SignedRecord(data, record, _order_of(record, body))
        self._store(digest, signed)
        return signed


def _newer(kind: str, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether order ``a`` wins over order ``b`` for a record of ``kind`` (manifest: lowest wins)."""
    return a < b if kind == ManifestRecord.kind else a > b


def join(a: SignedRecord, b: SignedRecord) -> SignedRecord:
    """The CRDT merge of two records for the same key: the winner.

    Member records: highest HLC. Counter entries: largest (samples, tokens), then HLC. Manifest: lowest
    HLC (the founder's). Equal orders (only possible for byte-different signatures of one body) fall
    back to the smaller envelope bytes, so the result never depends on argument order.
    """
    if a.key != b.key:
        raise ValueError(f"cannot join records for different keys {a.key!r} and {b.key!r}")
    if a.order != b.order:
        return a if _newer(a.kind, a.order, b.order) else b
    return a if a.data <= b.data else b


def _beats(a: SignedRecord, b: SignedRecord) -> bool:
    """Whether ``a`` strictly wins over ``b`` (a different record that the join picks)."""
    return a.data != b.data and join(a, b) is a


# --------------------------------------------------------------------------------------------------
# Digests (anti-entropy summaries)

Digest = dict[str, tuple[int, ...]]


def _digest_arity(key: str) -> int | None:
    if key == MANIFEST_KEY:
        return 3
    if key.startswith(MEMBER_PREFIX) and 1 <= len(key) - 2 <= MAX_PEER_ID_CHARS:
        return 3
    if key.startswith(COUNTER_PREFIX) and 1 <= len(key) - 2 <= MAX_PEER_ID_CHARS:
        return 5
    return None


def encode_digest(digest: Mapping[str, tuple[int, ...]]) -> bytes:
    """Wire form of a digest: ``{v, entries: {key: [order...]}}``."""
    return _pack({"v": FORMAT_VERSION, "entries": {k: list(v) for k, v in digest.items()}})


def decode_digest(data: bytes, *, max_entries: int = 65536) -> Digest:
    """Strictly decode a digest received from a peer; raises :class:`RecordError`."""
    limit = 64 + max_entries * (MAX_PEER_ID_CHARS + 64)
    if len(data) > limit:
        raise RecordError(TOO_LARGE, f"digest of {len(data)} bytes, limit {limit}")
    m = _unpack(data, max_items=max_entries, max_str=MAX_PEER_ID_CHARS + 2, max_bin=0)
    if not isinstance(m, dict):
        raise RecordError(MALFORMED, "digest is not a map")
    _check_version(m, "digest")
    _check_map(m, ["v", "entries"], "digest")
    entries = m["entries"]
    if not isinstance(entries, dict):
        raise RecordError(MALFORMED, "digest entries are not a map")
    out: Digest = {}
    for key, value in entries.items():
        arity = _digest_arity(key) if isinstance(key, str) else None
        if arity is None:
            raise RecordError(MALFORMED, f"bad digest key {key!r}"[:120])
        if type(value) is not list or len(value) != arity:
            raise RecordError(MALFORMED, f"digest entry {key!r} must be a list of {arity} integers"[:120])
        check = _int_field(0, MAX_UINT64)
        out[key] = tuple(int(check(f"digest[{key}]", x)) for x in value)
    return out


@dataclass(frozen=True)
class ApplyResult:
    changed: int = 0  # records that changed the state
    unchanged: int = 0  # duplicates and records older than what is held
    rejected: int = 0  # forged, malformed, too far in the future, or no room

