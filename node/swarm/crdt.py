"""Swarm state as signed CRDTs: every node holds the whole swarm view, any two nodes that talk converge.

There is no master and no lighthouse. Each node keeps a replica (:class:`SwarmState`) of a small set of
*signed records* and merges whatever records reach it, by gossip or by anti-entropy, in any order, any
number of times. The merge rule is a join (commutative, associative, idempotent), so replicas that have
seen the same records hold the same state, whatever the order of delivery.

This module is the replica; the records' wire format (types, envelopes, signing, order, digests) is
:mod:`protocols.record`, in the protocol layer, whose public names are re-exported here.

Records (one per key, the key derived from the record):

``m:<peer>`` :class:`MemberRecord`
    The peer's self-description: addresses, reachability, role, progress, loss, throughput, software
    version, manifest hash, heartbeat and a ``left`` flag (the departure marker of a graceful stop).
    Last-writer-wins by the author's hybrid logical clock (:mod:`protocols.hlc`).
``c:<peer>`` :class:`CounterRecord`
    The peer's entry of a grow-only counter: total samples and tokens it has trained. Merge keeps the
    *largest* entry, so a peer's contribution never shrinks, even if it restarts without its state.
    The swarm-wide total is the sum over peers.
``manifest`` :class:`ManifestRecord`
    The run manifest (task, model hash, optimizer hash, protocol version), written by the swarm's first
    node. Any key can sign a record, so *which* manifests a replica adopts is not decided by the record
    but by this node's configuration, its :class:`ManifestAuthority` (node/swarm/manifest_trust.py: the
    configured founder's, the configured hash, or trust on first use). Among the manifests the authority
    allows the *lowest* HLC wins (exact ties: lowest body hash), so replicas still converge. A refused
    manifest is counted (``manifest_refused``) and reported once (:meth:`SwarmState.take_manifest_refusals`).

Ordering, signing and strict decoding are the record schema's (:mod:`protocols.record`); forged,
unsigned, malformed and oversized records are dropped and counted in :attr:`SwarmState.rejected`.

Failure detection is a local view, not replicated state: a member not heard from for ``suspect_after``
seconds is ``suspect``, for ``gone_after`` seconds ``gone``; its record is kept (history). When it was last
heard from (:attr:`MemberView.last_seen`) is read from its newest record, on this node's clock:

* its author's heartbeat time, as long as the record arrived within ``suspect_after / 2`` of it: a record
  that reaches us late is old news;
* but never more than ``suspect_after / 2`` before the record arrived. A record that took longer (queued
  behind an overloaded event loop or relay, or stamped by a clock running behind ours) still proves that
  its author was alive recently, so a member whose records keep arriving, however late, stays alive, and
  the first fresh record makes a suspect member alive again. The price: a node that just started learns
  of a member that died less than ``gone_after`` ago as alive for ``suspect_after / 2``;
* and never after the record arrived: a peer whose clock runs ahead must not look alive for longer than
  it is heard from;
* except that a record more than ``gone_after`` older than its arrival is history (the last record of a
  long-gone member, passed on to a node that just joined): it counts from its heartbeat time alone.

The view is a function of the records held and their receipt times only, so replicas that hold the same
records at the same times agree on it, whatever the order of delivery.

Bounded memory: beyond ``max_members`` peers, the longest-gone (then longest-suspect) peers are evicted;
a small tombstone remembers what was evicted so that anti-entropy does not bring it straight back, and
evicted counter entries stay in the swarm-wide totals.

Sybil limits. Keys are free, addresses are not, so identities are counted per *network group* (the /24
or /48 of the connection that delivered them, :mod:`p2p.netgroup`; see :class:`Delivery`): a peer is
attributed to the group of whoever first handed us its records, and to its own group once it delivers
one of its records itself. One group may hold at most ``max_per_subnet`` peers (default a quarter of the
table); more new identities from it are refused (``subnet_limit``). When the table is full and every
member is alive, a newcomer takes the place of a member of the *most crowded* group (its freshest
identity that has not yet been held for ``gone_after``, else its newest), provided that group is larger
than the newcomer's: so a table filled with fresh identities from one IP still admits an honest newcomer
from another, and established members of small groups are never the ones to go.

The replica is plain synchronous code with an injectable clock; the daemon calls it from one trio task.

Why one module, though long: merging, the failure-detection view, the Sybil bounds (attribution,
eviction, tombstones) and the state file all read and write the one table of entries under one
invariant (a record is held, evicted or remembered as a tombstone, never two of these); apart, each
would reach into the others' private structure. What had a job of its own went: the record schema to
protocols/record.py, the manifest trust rule to node/swarm/manifest_trust.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from libp2p.crypto.keys import KeyPair

from node.swarm.manifest_trust import ManifestAuthority, ManifestMismatch, ManifestRefused
from p2p.fsutil import atomic_write_bytes
from protocols.hlc import HybridLogicalClock, Timestamp

# The signed record schema lives in the protocol layer (protocols/record.py); the replica uses it and
# re-exports its public names (__all__), so that code handling records and replicas needs one import.
from protocols.record import (
    _COUNT,
    BAD_SIGNATURE,
    CAPACITY,
    CLOCK_SKEW,
    COUNTER_PREFIX,
    FORMAT_VERSION,
    MALFORMED,
    MANIFEST_KEY,
    MANIFEST_REFUSED,
    MAX_ADDR_CHARS,
    MAX_ADDRS,
    MAX_BODY_BYTES,
    MAX_ENVELOPE_BYTES,
    MAX_HASH_CHARS,
    MAX_LABEL_CHARS,
    MAX_PARTNERS,
    MAX_PEER_ID_CHARS,
    MAX_PUBKEY_BYTES,
    MAX_SIGNATURE_BYTES,
    MAX_TASK_CHARS,
    MAX_UINT63,
    MAX_UINT64,
    MAX_VERSION_CHARS,
    MEMBER_PREFIX,
    SIGNING_DOMAIN,
    SUBNET_LIMIT,
    TOO_LARGE,
    UNSUPPORTED_VERSION,
    WRONG_SIGNER,
    ApplyResult,
    CounterRecord,
    Digest,
    Manifest,
    ManifestRecord,
    MemberRecord,
    Record,
    RecordError,
    SignedRecord,
    Validator,
    Verifier,
    _beats,
    _check_map,
    _check_version,
    _digest_arity,
    _float_field,
    _int_field,
    _newer,
    _pack,
    _unpack,
    decode_body,
    decode_digest,
    encode_body,
    encode_digest,
    join,
    peer_id_of,
    sign_record,
)

__all__ = [
    # the replica
    "MAX_REMEMBERED_REFUSALS",
    "Delivery",
    "StateFileError",
    "MemberState",
    "MemberView",
    "Totals",
    "SwarmState",
    # the record schema (protocols/record.py), re-exported
    "ApplyResult",
    "BAD_SIGNATURE",
    "CAPACITY",
    "CLOCK_SKEW",
    "COUNTER_PREFIX",
    "CounterRecord",
    "Digest",
    "FORMAT_VERSION",
    "MALFORMED",
    "MANIFEST_KEY",
    "MANIFEST_REFUSED",
    "MAX_ADDRS",
    "MAX_ADDR_CHARS",
    "MAX_BODY_BYTES",
    "MAX_ENVELOPE_BYTES",
    "MAX_HASH_CHARS",
    "MAX_LABEL_CHARS",
    "MAX_PARTNERS",
    "MAX_PEER_ID_CHARS",
    "MAX_PUBKEY_BYTES",
    "MAX_SIGNATURE_BYTES",
    "MAX_TASK_CHARS",
    "MAX_UINT63",
    "MAX_UINT64",
    "MAX_VERSION_CHARS",
    "MEMBER_PREFIX",
    "Manifest",
    "ManifestRecord",
    "MemberRecord",
    "Record",
    "RecordError",
    "SIGNING_DOMAIN",
    "SUBNET_LIMIT",
    "SignedRecord",
    "TOO_LARGE",
    "UNSUPPORTED_VERSION",
    "Validator",
    "Verifier",
    "WRONG_SIGNER",
    "decode_body",
    "decode_digest",
    "encode_body",
    "encode_digest",
    "join",
    "peer_id_of",
    "sign_record",
]

# --------------------------------------------------------------------------------------------------
# Replica limits

#: Distinct refused manifests (signer, hash) remembered so that each is reported once.
MAX_REMEMBERED_REFUSALS = 256


# --------------------------------------------------------------------------------------------------
# Deliveries and the state file


@dataclass(frozen=True)
class Delivery:
    """Who handed this replica some records: the peer (base58) and the network group (subnet,
    :func:`p2p.netgroup.group_of`) its connection comes from. What the Sybil limits count by."""

    peer_id: str
    group: str


class StateFileError(Exception):
    """The persisted swarm state cannot be read. The caller decides whether to start empty."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(
            f"swarm state file {path} {problem}; move it aside or delete it to start with an empty view"
        )
        self.path = path


# --------------------------------------------------------------------------------------------------
# The replica


class MemberState(StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"  # heartbeat older than suspect_after
    GONE = "gone"  # heartbeat older than gone_after; record kept as history
    LEFT = "left"  # the peer published a departure


@dataclass(frozen=True)
class MemberView:
    """A member as this node currently sees it."""

    record: MemberRecord
    state: MemberState
    last_seen: float  # local wall-clock seconds when this node last heard from it (see the module doc)
    received_at: float  # local wall-clock seconds when this version of its record arrived

    @property
    def peer_id(self) -> str:
        return self.record.peer_id


@dataclass(frozen=True)
class Totals:
    """Swarm-wide totals of the grow-only counter."""

    samples: int
    tokens: int




#: Where a record being stored comes from: written here, received from a peer, or read from the state file.
_Origin = Literal["local", "remote", "file"]


@dataclass
class _Entry:
    signed: SignedRecord
    received_at: float  # local wall time when this version arrived


@dataclass(frozen=True)
class _Tombstone:
    order: tuple[int, ...]
    samples: int = 0
    tokens: int = 0


@dataclass
class _Standing:
    """Where a held peer came from and since when: what the Sybil limits judge it by."""

    group: str  # network group it is attributed to; "" = none known (our own, or from the state file)
    verified: bool  # the peer itself delivered one of its records from that group
    first_seen: float  # local time this replica first admitted the peer


# Names update_self accepts; peer_id, hlc, heartbeat and left are managed by the replica.
_SELF_FIELDS = frozenset(f.name for f in dataclasses.fields(MemberRecord)) - {
    "peer_id",
    "hlc",
    "heartbeat",
    "left",
}
_FLOAT_FIELDS = frozenset({"samples_per_s"})
_OPTIONAL_FLOAT_FIELDS = frozenset({"loss", "val_loss"})


class SwarmState:
    """One node's replica of the swarm state.

    Local writes (:meth:`update_self`, :meth:`depart`, :meth:`add_progress`, :meth:`set_manifest`)
    return the :class:`SignedRecord` to publish (``.data``). Incoming records go through
    :meth:`merge` / :meth:`apply`. Anti-entropy between two nodes A and B::

        B sends encode_digest(B.digest())
        A sends A.missing_for(decode_digest(...))   -> B.apply(those records)
        (and the same the other way round)

    ``max_members`` bounds the number of peers held (self included, and never evicted);
    ``max_tombstones`` (default ``4 * max_members``) bounds the memory of evicted peers;
    ``max_per_subnet`` (default a quarter of ``max_members``) bounds the peers one network group may
    place in the table; ``authority`` decides which run manifests are adopted (default: trust on first
    use). See the module docstring for both.
    """

    def __init__(
        self,
        me: KeyPair,
        *,
        suspect_after: float = 30.0,
        gone_after: float = 120.0,
        max_members: int = 1024,
        max_tombstones: int | None = None,
        max_drift_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        verifier: Verifier | None = None,
        max_per_subnet: int | None = None,
        authority: ManifestAuthority | None = None,
    ) -> None:
        if not 0 < suspect_after < gone_after:
            raise ValueError(f"need 0 < suspect_after < gone_after, got {suspect_after} and {gone_after}")
        if max_members < 1:
            raise ValueError(f"max_members must be at least 1, got {max_members}")
        if max_per_subnet is not None and max_per_subnet < 1:
            raise ValueError(f"max_per_subnet must be at least 1, got {max_per_subnet}")
        self._me = me
        self.peer_id = peer_id_of(me.public_key)
        self.suspect_after = suspect_after
        self.gone_after = gone_after
        self.max_members = max_members
        self.max_tombstones = 4 * max_members if max_tombstones is None else max_tombstones
        self._clock = clock
        self._hlc = HybridLogicalClock(clock, max_drift_s=max_drift_s)
        self._verifier = verifier if verifier is not None else Verifier()
        self._members: dict[str, _Entry] = {}
        self._counters: dict[str, _Entry] = {}
        self._manifest: _Entry | None = None
        self._tombstones: OrderedDict[str, _Tombstone] = OrderedDict()
        self._retired = [0, 0]  # samples, tokens of evicted counter entries
        self._own_superseded = False  # a newer record of our own arrived from a peer (see own_record_superseded)
        #: Rejected records by reason (``malformed``, ``bad_signature``, ``wrong_signer``, ...).
        self.rejected: Counter[str] = Counter()
        self.max_per_subnet = max(1, max_members // 4) if max_per_subnet is None else max_per_subnet
        #: Which run manifests this replica adopts (see :class:`ManifestAuthority`).
        self.authority = authority if authority is not None else ManifestAuthority()
        self._standing: dict[str, _Standing] = {}  # every peer held (members and counters)
        self._group_sizes: Counter[str] = Counter()
        #: Members evicted to make room for a newcomer from a less crowded network group.
        self.crowd_evictions = 0
        #: Records of others dated more than MAX_LEAD_S ahead of our clock: kept, but our clock stopped at
        #: the bound (protocols/hlc.py).
        self.clock_capped = 0
        self._refusals: list[ManifestRefused] = []  # not yet taken by take_manifest_refusals
        self._refused_seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def _now(self) -> float:
        return float(self._clock())

    # ---- local writes ---------------------------------------------------------------------------

    def _sign_and_store(self, record: Record) -> SignedRecord:
        signed = sign_record(record, self._me)
        self._verifier.remember(signed)
        self._store(signed, received_at=self._now(), origin="local")
        return signed

    def update_self(self, **fields: Any) -> SignedRecord:
        """Publish a new version of this node's member record (fields not given keep their value).

        Also the heartbeat: call it periodically even with no changes. A non-finite ``loss`` or
        ``val_loss`` is published as ``None`` (unknown). Raises ``ValueError`` for unknown fields or
        values peers would refuse (:class:`RecordError` is a ``ValueError``).
        """
        unknown = set(fields) - _SELF_FIELDS
        if unknown:
            raise ValueError(f"update_self: unknown or managed fields {sorted(unknown)}")
        for name in _OPTIONAL_FLOAT_FIELDS & fields.keys():
            value = fields[name]
            fields[name] = float(value) if value is not None and math.isfinite(value) else None
        for name in _FLOAT_FIELDS & fields.keys():
            fields[name] = float(fields[name])
        for name in ("addrs", "partners"):
            if name in fields:
                fields[name] = tuple(fields[name])
        return self._write_self(fields, left=False)

    def depart(self) -> SignedRecord:
        """Publish the departure marker (state ``left``); call on a graceful stop.

        A later :meth:`update_self` (a restart) makes the node a live member again.
        """
        return self._write_self({}, left=True)

    def _write_self(self, fields: dict[str, Any], *, left: bool) -> SignedRecord:
        current = self._members.get(self.peer_id)
        base = current.signed.record if current else MemberRecord(self.peer_id, Timestamp(0, 0))
        assert isinstance(base, MemberRecord)
        record = dataclasses.replace(base, **fields, hlc=self._hlc.now(), heartbeat=self._now(), left=left)
        return self._sign_and_store(record)

    def add_progress(self, samples: int = 0, tokens: int = 0) -> SignedRecord:
        """Add work done by this node to its counter entry and return the record to publish."""
        if samples < 0 or tokens < 0:
            raise ValueError(f"progress must not be negative, got samples={samples} tokens={tokens}")
        current = self._counters.get(self.peer_id)
        base = current.signed.record if current else CounterRecord(self.peer_id, Timestamp(0, 0))
        assert isinstance(base, CounterRecord)
        record = CounterRecord(
            self.peer_id, self._hlc.now(), samples=base.samples + samples, tokens=base.tokens + tokens
        )
        return self._sign_and_store(record)

    def set_manifest(self, manifest: Manifest) -> SignedRecord | None:
        """Found the swarm with ``manifest`` unless it already has one.

        Call it after the first sync with the bootstrap peers (or with none, for the first node). If the
        swarm already has a manifest, nothing is published: returns ``None`` when it is equal and raises
        :class:`ManifestMismatch` when it differs. Raises :class:`ManifestRefused` when this node's
        :attr:`authority` would not adopt the manifest (another node is the founder, or the configured
        hash differs).
        """
        if self._manifest is not None:
            self.check_manifest(manifest)
            return None
        record = ManifestRecord(
            self.peer_id,
            self._hlc.now(),
            manifest.task,
            manifest.model_hash,
            manifest.optimizer_hash,
            manifest.protocol_version,
        )
        why = self.authority.refusal(record, None)
        if why is not None:
            raise ManifestRefused(manifest.hash, self.peer_id, why, None)
        return self._sign_and_store(record)

    def may_found(self, manifest: Manifest) -> bool:
        """Whether this node may found the swarm with ``manifest`` (see :meth:`set_manifest`)."""
        record = ManifestRecord(self.peer_id, Timestamp(0, 0), manifest.task, manifest.model_hash,
                                manifest.optimizer_hash, manifest.protocol_version)
        return self.authority.refusal(record, None) is None

    def take_manifest_refusals(self) -> list[ManifestRefused]:
        """Manifests refused since the last call, each distinct (signer, hash) once: for the log."""
        taken, self._refusals = self._refusals, []
        return taken

    def _refuse_manifest(self, record: ManifestRecord, why: str) -> None:
        self.rejected[MANIFEST_REFUSED] += 1
        key = (record.peer_id, record.manifest.hash)
        if key in self._refused_seen:
            return
        self._refused_seen[key] = None
        while len(self._refused_seen) > MAX_REMEMBERED_REFUSALS:
            self._refused_seen.popitem(last=False)
        held = self.manifest
        if len(self._refusals) < MAX_REMEMBERED_REFUSALS:
            self._refusals.append(
                ManifestRefused(key[1], record.peer_id, why, held.hash if held is not None else None)
            )

    # ---- merging --------------------------------------------------------------------------------

    def merge(self, record: SignedRecord | bytes, *, delivery: Delivery | None = None) -> bool:
        """Merge one record from anywhere; True if it changed the state.

        Every record is verified (signature and author), also ones passed as :class:`SignedRecord`;
        repeats are cheap (cache). Rejected records are counted in :attr:`rejected`, never raised.
        A newer record of this node's own, signed in an earlier run, is stored like any other; the
        next :meth:`update_self` (the periodic heartbeat) supersedes it. ``delivery`` says who handed
        it over, from which network group (the Sybil limits count by it; None: no attribution).
        """
        return self._merge(record, delivery) == "changed"

    def verify(self, record: SignedRecord | bytes) -> SignedRecord:
        """Decode and verify a record without merging it (to look at it first); a record that fails is
        counted in :attr:`rejected` and the :class:`RecordError` raised."""
        data = record.data if isinstance(record, SignedRecord) else record
        try:
            return self._verifier.decode(data)
        except RecordError as exc:
            self.rejected[exc.reason] += 1
            raise

    def member_count(self) -> int:
        """Member records held, this node's own included if it wrote one (cheap: no views built)."""
        return len(self._members)

    def holds(self, peer_id: str) -> bool:
        """Whether this replica holds a member or counter record of ``peer_id``."""
        return peer_id in self._members or peer_id in self._counters

    def own_record_superseded(self) -> bool:
        """Whether, since the last call, a peer sent a record of this node's own that is newer than the one
        it last wrote (and clears the flag).

        That happens after a restart when the previous life's last records were signed with a clock
        ahead of this one (an HLC that had adopted a faster peer's time) and never reached the state file:
        until this node writes again, peers keep showing that old record. The caller re-signs at once
        (:meth:`update_self`): having merged the newer record, the HLC now issues timestamps above it.
        """
        superseded, self._own_superseded = self._own_superseded, False
        return superseded

    def apply(
        self, records: Iterable[SignedRecord | bytes], *, delivery: Delivery | None = None
    ) -> ApplyResult:
        """Merge a batch (e.g. what a peer sent in anti-entropy) and summarise what happened."""
        outcomes = Counter(self._merge(r, delivery) for r in records)
        return ApplyResult(outcomes["changed"], outcomes["unchanged"], outcomes["rejected"])

    def _merge(self, record: SignedRecord | bytes, delivery: Delivery | None = None) -> str:
        data = record.data if isinstance(record, SignedRecord) else record
        try:
            signed = self._verifier.decode(data)
        except RecordError as exc:
            self.rejected[exc.reason] += 1
            return "rejected"
        return self._store(signed, received_at=self._now(), origin="remote", delivery=delivery)

    def _store(
        self, signed: SignedRecord, *, received_at: float, origin: _Origin, delivery: Delivery | None = None
    ) -> str:
        """Insert a verified record if it wins; returns "changed", "unchanged" or "rejected".

        Only records from peers are checked for drift: the state file's were accepted once already (the
        clock may have moved since), and our own records are exempt: if this host's clock is now behind
        the one that signed our earlier records, adopting their timestamps is the only way our next
        records can supersede them.
        """
        record = signed.record
        if origin == "remote" and record.peer_id != self.peer_id and self._hlc.too_far_ahead(record.hlc):
            self.rejected[CLOCK_SKEW] += 1
            return "rejected"
        # Observe every verified timestamp: after a restart this is how the node learns that its own
        # earlier records exist and makes its next ones newer. Another node's moves our clock at most
        # MAX_LEAD_S ahead of ours (protocols/hlc.py): the record is kept, but one peer's clock far
        # ahead cannot date our own records towards the skew limit, where peers behind would refuse them.
        if record.peer_id == self.peer_id:
            self._hlc.adopt(record.hlc)
        elif self._hlc.follow(record.hlc):
            self.clock_capped += 1

        if isinstance(record, ManifestRecord):
            why = self.authority.refusal(record, self.manifest)
            if why is not None:
                self._refuse_manifest(record, why)
                return "rejected"
            if self._manifest is not None and not _beats(signed, self._manifest.signed):
                return "unchanged"
            self._manifest = _Entry(signed, received_at)
            return "changed"

        table = self._members if isinstance(record, MemberRecord) else self._counters
        pid = record.peer_id
        if pid in self._standing:
            self._attribute(pid, delivery)
        current = table.get(pid)
        if current is not None:
            if not _beats(signed, current.signed):
                return "unchanged"
            table[pid] = _Entry(signed, received_at)
            if pid == self.peer_id and origin == "remote":
                self._own_superseded = True
            return "changed"

        tomb = self._tombstones.get(signed.key)
        if tomb is not None and not _newer(signed.kind, signed.order, tomb.order):
            return "unchanged"  # evicted here on purpose; do not let anti-entropy resurrect it
        is_new_peer = pid not in self._standing
        if is_new_peer:
            group = delivery.group if delivery is not None else ""
            verified = delivery is not None and delivery.peer_id == pid
            if pid != self.peer_id and group and self._group_sizes[group] >= self.max_per_subnet:
                self.rejected[SUBNET_LIMIT] += 1  # that network group holds its share of the table
                return "rejected"
            # Make room; if nobody can go, refuse the newcomer (but never this node's own records).
            if self._peer_count() >= self.max_members and not self._evict_one(group) and pid != self.peer_id:
                self.rejected[CAPACITY] += 1
                return "rejected"
            self._standing[pid] = _Standing(group, verified, received_at)
            self._group_sizes[group] += 1
        if tomb is not None:  # the peer is back with newer state: its entry is live again
            del self._tombstones[signed.key]
            self._retired[0] -= tomb.samples
            self._retired[1] -= tomb.tokens
        table[pid] = _Entry(signed, received_at)
        return "changed"

    def _attribute(self, pid: str, delivery: Delivery | None) -> None:
        """Move a held peer to the network group it proves it is in: its own connection's, once it
        delivers one of its own records; or its first deliverer's, if it had no group yet."""
        if delivery is None:
            return
        standing = self._standing[pid]
        if delivery.peer_id == pid:
            if standing.verified and standing.group == delivery.group:
                return
            new = _Standing(delivery.group, True, standing.first_seen)
        elif not standing.group and not standing.verified:
            new = _Standing(delivery.group, False, standing.first_seen)
        else:
            return
        self._group_sizes[standing.group] -= 1
        if self._group_sizes[standing.group] <= 0:
            del self._group_sizes[standing.group]
        self._group_sizes[new.group] += 1
        self._standing[pid] = new

    # ---- anti-entropy ---------------------------------------------------------------------------

    def digest(self) -> Digest:
        """Compact summary ``key -> order`` of everything held (evicted keys included, so peers do not
        resend them)."""
        out: Digest = {key: tomb.order for key, tomb in self._tombstones.items()}
        for entry in self._entries():
            out[entry.signed.key] = entry.signed.order
        return out

    def missing_for(self, their_digest: Mapping[str, tuple[int, ...]]) -> list[bytes]:
        """Encoded records the peer with ``their_digest`` lacks or holds an older version of.

        ``their_digest`` must come from :func:`decode_digest` (or :meth:`digest`).
        """
        out = []
        for entry in self._entries():
            signed = entry.signed
            theirs = their_digest.get(signed.key)
            if theirs is None or _newer(signed.kind, signed.order, tuple(theirs)):
                out.append(signed.data)
        return out

    def _entries(self) -> Iterable[_Entry]:
        if self._manifest is not None:
            yield self._manifest
        yield from self._members.values()
        yield from self._counters.values()

    # ---- views ----------------------------------------------------------------------------------

    def _state_of(self, last_seen: float, left: bool, now: float) -> MemberState:
        if left:
            return MemberState.LEFT
        age = now - last_seen
        if age > self.gone_after:
            return MemberState.GONE
        if age > self.suspect_after:
            return MemberState.SUSPECT
        return MemberState.ALIVE

    def _last_seen(self, entry: _Entry) -> float:
        """When this node last heard from the member (the rules are in the module docstring)."""
        record = entry.signed.record
        assert isinstance(record, MemberRecord)
        stamped = min(record.heartbeat, entry.received_at)
        if entry.received_at - record.heartbeat > self.gone_after:
            return stamped  # history, not news
        return max(stamped, entry.received_at - self.late_news_s)

    @property
    def late_news_s(self) -> float:
        """The most a member's newest record counts as older than its receipt (see the module doc)."""
        return self.suspect_after / 2

    def _view(self, entry: _Entry, now: float) -> MemberView:
        record = entry.signed.record
        assert isinstance(record, MemberRecord)
        last_seen = self._last_seen(entry)
        return MemberView(record, self._state_of(last_seen, record.left, now), last_seen, entry.received_at)

    def members(self, now: float | None = None) -> list[MemberView]:
        """Every member held (self included), sorted by peer ID, with its liveness state."""
        now = self._now() if now is None else now
        return [self._view(self._members[pid], now) for pid in sorted(self._members)]

    def sample_member_ids(self, k: int, *, exclude: Collection[str] = ()) -> list[str]:
        """Up to ``k`` IDs of members held (self included unless excluded), drawn at random without
        replacement, in random order: for callers that need a few members, not all of them (building a view
        is the per-member cost; drawing costs a copy of the IDs)."""
        ids = list(self._members)
        drawn = random.sample(ids, min(k + len(exclude), len(ids)))
        return [pid for pid in drawn if pid not in exclude][:k]

    def member_data(self, peer_id: str) -> bytes | None:
        """The encoded signed member record held for ``peer_id`` (to hand on, e.g. in a busy refusal's
        referral: protocols/state.py), or None."""
        entry = self._members.get(peer_id)
        return None if entry is None else entry.signed.data

    def member(self, peer_id: str, now: float | None = None) -> MemberView | None:
        entry = self._members.get(peer_id)
        return None if entry is None else self._view(entry, self._now() if now is None else now)

    def counters(self) -> Totals:
        """Swarm-wide samples and tokens trained (evicted peers' entries included)."""
        samples, tokens = self._retired
        for entry in self._counters.values():
            record = entry.signed.record
            assert isinstance(record, CounterRecord)
            samples += record.samples
            tokens += record.tokens
        return Totals(samples, tokens)

    @property
    def manifest(self) -> Manifest | None:
        """The swarm's run manifest, if this node knows one."""
        if self._manifest is None:
            return None
        record = self._manifest.signed.record
        assert isinstance(record, ManifestRecord)
        return record.manifest

    def manifest_signer(self) -> str | None:
        """The PeerID that signed the swarm's manifest this node holds (None while it knows none)."""
        return None if self._manifest is None else self._manifest.signed.peer_id

    def check_manifest(self, local: Manifest | str) -> None:
        """Raise :class:`ManifestMismatch` if ``local`` (a manifest or its hash) is not the swarm's.

        Does nothing while the swarm's manifest is unknown.
        """
        if self._manifest is None:
            return
        record = self._manifest.signed.record
        assert isinstance(record, ManifestRecord)
        swarm = record.manifest
        local_hash = local.hash if isinstance(local, Manifest) else local
        if local_hash != swarm.hash:
            fields = swarm.differences(local) if isinstance(local, Manifest) else ()
            raise ManifestMismatch(swarm.hash, local_hash, founder=record.peer_id, fields=fields)

    # ---- bounds ---------------------------------------------------------------------------------

    def _peer_count(self) -> int:
        return len(self._standing)

    def groups(self) -> dict[str, int]:
        """Peers held per network group ("" = not attributed: this node, the state file's), largest
        first: what the Sybil limits see."""
        return dict(self._group_sizes.most_common())

    def _evict_one(self, newcomer_group: str = "") -> bool:
        """Make room for a newcomer from ``newcomer_group``: evict the peer longest gone (or left), else
        longest suspect; with every member alive, one of the most crowded network group's (see
        :meth:`_evict_crowded`). Never this node."""
        if self._evict_absent():
            return True
        return self._evict_crowded(newcomer_group)

    def _evict_crowded(self, newcomer_group: str) -> bool:
        """With every member alive, make room for a newcomer at the expense of the most crowded group.

        The victim's group must hold at least two more peers than the newcomer's, so that the swap
        leaves it no smaller than the newcomer's: identities from one crowded subnet give way to one from
        a rarer subnet, never the other way round, and two peers of one group never displace each other
        (that would only churn). Within the group, peers held for less than ``gone_after`` (fresh) go
        before established ones, the newest first. Returns False (the newcomer is refused) when no group
        qualifies.
        """
        now = self._now()
        need = self._group_sizes[newcomer_group] + 2
        best: tuple[tuple[int, bool, float, str], str] | None = None
        for pid, standing in self._standing.items():
            size = self._group_sizes[standing.group]
            if pid == self.peer_id or standing.group == newcomer_group or size < need:
                continue
            established = now - standing.first_seen >= self.gone_after
            key = (-size, established, -standing.first_seen, pid)
            if best is None or key < best[0]:
                best = (key, pid)
        if best is None:
            return False
        self._evict(best[1])
        self.crowd_evictions += 1
        return True

    def _evict_absent(self) -> bool:
        """Evict the peer longest gone (or left), else longest suspect; never an alive peer or self."""
        now = self._now()
        candidates = []
        for pid in self._members.keys() | self._counters.keys():
            if pid == self.peer_id:
                continue
            if pid in self._members:
                view = self._view(self._members[pid], now)
                state, last_seen = view.state, view.last_seen
            else:  # only a counter entry so far: judge it by when it arrived
                last_seen = self._counters[pid].received_at
                state = self._state_of(last_seen, False, now)
            if state is not MemberState.ALIVE:
                rank = 1 if state is MemberState.SUSPECT else 0
                candidates.append((rank, last_seen, pid))
        if not candidates:
            return False
        self._evict(min(candidates)[2])
        return True

    def _evict(self, pid: str) -> None:
        standing = self._standing.pop(pid, None)
        if standing is not None:
            self._group_sizes[standing.group] -= 1
            if self._group_sizes[standing.group] <= 0:
                del self._group_sizes[standing.group]
        member = self._members.pop(pid, None)
        if member is not None:
            self._tombstones[member.signed.key] = _Tombstone(member.signed.order)
        counter = self._counters.pop(pid, None)
        if counter is not None:
            record = counter.signed.record
            assert isinstance(record, CounterRecord)
            self._tombstones[counter.signed.key] = _Tombstone(
                counter.signed.order, record.samples, record.tokens
            )
            self._retired[0] += record.samples
            self._retired[1] += record.tokens
        self._trim_tombstones()

    def _trim_tombstones(self) -> None:
        while len(self._tombstones) > self.max_tombstones:
            # The oldest memory of an eviction goes; its counter contribution stays in the totals. Should
            # that peer's old entry ever come back it would be counted twice: a bounded, rare error.
            self._tombstones.popitem(last=False)

    # ---- persistence ----------------------------------------------------------------------------

    def _max_file_bytes(self) -> int:
        records = 2 * self.max_members + 2
        return 1024 + records * (MAX_ENVELOPE_BYTES + 32) + self.max_tombstones * (MAX_PEER_ID_CHARS + 96)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state atomically: temp file in the same directory, fsync, rename, fsync dir."""
        path = Path(path)
        snapshot = {
            "v": FORMAT_VERSION,
            "format": "starling-swarm-state",
            "records": [[e.signed.data, e.received_at] for e in self._entries()],
            "tombstones": [[k, list(t.order), t.samples, t.tokens] for k, t in self._tombstones.items()],
            "retired": list(self._retired),
        }
        data = _pack(snapshot)
        atomic_write_bytes(Path(path), data)

    @classmethod
    def load(cls, path: str | os.PathLike[str], me: KeyPair, **kwargs: Any) -> SwarmState:
        """Restore a state saved by :meth:`save`; a missing file gives an empty state.

        Raises :class:`StateFileError` if the file is unreadable or not a state file. Records in it are
        re-verified; any that fail are dropped and counted in :attr:`rejected`.
        """
        path = Path(path)
        state = cls(me, **kwargs)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return state
        except OSError as exc:
            raise StateFileError(path, f"cannot be read ({exc.strerror})") from None
        if size > state._max_file_bytes():
            raise StateFileError(path, f"is {size} bytes, more than this configuration can hold")
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise StateFileError(path, f"cannot be read ({exc.strerror})") from None
        try:
            snapshot = state._parse_snapshot(raw)
        except RecordError as exc:
            raise StateFileError(path, f"is not a valid swarm state file ({exc.detail})") from None

        records, tombstones, retired = snapshot
        now = state._now()
        for key, order, samples, tokens in tombstones:
            state._tombstones[key] = _Tombstone(order, samples, tokens)
        state._trim_tombstones()
        state._retired = list(retired)
        for data, received_at in records:
            try:
                signed = state._verifier.decode(data)
            except RecordError as exc:
                state.rejected[exc.reason] += 1
                continue
            # Receipt times from a clock that has since gone backwards are capped at now.
            state._store(signed, received_at=min(received_at, now), origin="file")
        return state

    def _parse_snapshot(
        self, raw: bytes
    ) -> tuple[list[tuple[bytes, float]], list[tuple[str, tuple[int, ...], int, int]], tuple[int, int]]:
        items = max(2 * self.max_members + 2, self.max_tombstones) + 16
        snap = _unpack(raw, max_items=items, max_str=MAX_PEER_ID_CHARS + 32, max_bin=MAX_ENVELOPE_BYTES)
        if not isinstance(snap, dict):
            raise RecordError(MALFORMED, "top level is not a map")
        _check_version(snap, "state file")
        _check_map(snap, ["v", "format", "records", "tombstones", "retired"], "state file")
        if snap["format"] != "starling-swarm-state":
            raise RecordError(MALFORMED, f"format is {snap['format']!r}"[:120])
        if type(snap["records"]) is not list or type(snap["tombstones"]) is not list:
            raise RecordError(MALFORMED, "records and tombstones must be lists")
        records = []
        for item in snap["records"]:
            if type(item) is not list or len(item) != 2 or type(item[0]) is not bytes:
                raise RecordError(MALFORMED, "a record entry is not [bytes, received_at]")
            received_at = _float_field(0.0)("received_at", item[1])
            records.append((item[0], float(received_at)))  # type: ignore[arg-type]
        tombstones = []
        for item in snap["tombstones"]:
            if type(item) is not list or len(item) != 4 or not isinstance(item[0], str):
                raise RecordError(MALFORMED, "a tombstone is not [key, order, samples, tokens]")
            key, order = item[0], item[1]
            arity = _digest_arity(key)
            if arity is None or type(order) is not list or len(order) != arity:
                raise RecordError(MALFORMED, f"bad tombstone for {key!r}"[:120])
            check = _int_field(0, MAX_UINT64)
            order_t = tuple(int(check("tombstone order", x)) for x in order)
            tombstones.append((key, order_t, int(_COUNT("samples", item[2])), int(_COUNT("tokens", item[3]))))
        retired = snap["retired"]
        if type(retired) is not list or len(retired) != 2:
            raise RecordError(MALFORMED, "retired must be [samples, tokens]")
        return records, tombstones, (int(_COUNT("samples", retired[0])), int(_COUNT("tokens", retired[1])))

