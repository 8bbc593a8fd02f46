"""Replicate the swarm state (:mod:`node.swarm.crdt`) over libp2p: gossip for speed, anti-entropy for certainty.

Every node holds a full replica of the swarm state. :class:`StateReplicator` keeps it in step with the
rest of the swarm:

* **Heartbeat.** Every ``heartbeat_s`` it re-signs this node's member record from ``self_fields()``
  (progress, loss, addresses, ...). Peers judge liveness by these heartbeats (suspect, gone).
* **Or SWIM** (``node.membership = "swim"``: ``liveness`` given, :mod:`node.swarm.swim_service`). Liveness
  comes from SWIM's probes, not from heartbeats: the states shown and the averaging candidates are
  ``liveness(peer)``'s, and this node's record is re-signed only when a field other than the progress
  ones (``PROGRESS_FIELDS``) changes, or for progress at most every ``progress_every_s`` (default
  ``PROGRESS_EVERY_S``). The status's ``last_seen`` is SWIM's last evidence that the member lives
  (``last_heard``), not its record's age. The quiet-member probes of anti-entropy are off (records no
  longer come every heartbeat, so every member would look quiet); the rounds stay. The daemon runs it
  without gossip there (``gossip=False``, below).
* **Gossip.** The member records and the manifest this node writes are published on the gossipsub
  topic ``starling/<swarm>/state``; records from peers are merged as they arrive, in the topic
  validator, so a forged record is refused at the first honest hop instead of being forwarded through
  the swarm. Gossip is only an accelerator: a message may be dropped anywhere, and nothing relies on it.
  Counter entries (running totals nobody waits for) go by anti-entropy alone: in py-libp2p each gossip
  message costs every node milliseconds of CPU per copy received, and a trainer wrote one with every
  heartbeat, doubling the gossip a swarm of trainers spends its CPU on.
* **Or no gossip** (``gossip=False``: the daemon in SWIM mode). No gossipsub runs at all, and a record
  this node signs is pushed at once in sessions with ``PUSH_PEERS`` connected peers, then spreads with
  everyone's rounds. Why in SWIM mode: records change rarely there (liveness is SWIM's), so gossip's speed
  buys little, while its upkeep did not shrink with them: a pubsub stream to every peer, the mesh upkeep
  every second, IHAVE to peers outside the mesh and every copy of a record checked; at a 64-daemon join it
  was the largest traffic left (259 kB/min per daemon, docs/benchmarks.md).
* **Anti-entropy.** It runs ``/starling/state/2.0.0`` sessions (:mod:`protocols.state`; 1.0.0 with peers
  not upgraded yet): both sides' bucket hashes of their digests are exchanged, the entries of the buckets
  that differ, and each side sends what the other lacks; two converged replicas exchange only the hashes. This is what makes replicas converge, whatever
  gossip lost; a partition heals within one session after the halves reconnect. Sessions start at once
  on a new connection (one session, started by the side that dialled it: two crossing sessions
  sent a newcomer the whole table twice); every ``anti_entropy_s`` with the connected peer this node has not started one
  with for longest (so every peer is reached within one round per peer, not at random); and, as a
  probe, with any connected member not heard from for half of ``suspect_after`` (see
  :meth:`StateReplicator._quiet_peers`). The probes are what keep the member table right when gossip is
  not: a connected member that is alive answers before the failure detector calls it suspect.
* **Compatibility.** The session handshake carries the swarm name and run manifest hash. A peer that
  differs is refused, with an ERROR naming both hashes logged once per peer on both sides; it is
  reported by :meth:`StateReplicator.incompatible_peers` and never offered to the averager. Gossip
  relayed by a peer that has not passed the handshake yet (every peer, right after this node restarts)
  is limited to news about members this node already holds, and makes this node start the handshake
  with that peer; so an incompatible node cannot leak its state (or its manifest) into the swarm through
  gossip, and a restarted node is not deaf to gossip while its first sessions are under way.
* **Manifest.** When the swarm has no run manifest yet, a node with a local manifest founds it after its
  first successful session (or, alone, after a short grace period), unless the configuration names
  another founder (``node.founder``) or another hash (``node.manifest_hash``); a node whose manifest
  differs from the swarm's reports it in :attr:`StateReplicator.manifest_error`. Which manifests are
  adopted at all is the replica's :class:`node.swarm.manifest_trust.ManifestAuthority`; every refused
  one is logged once with both hashes and its signer. With no founder configured, the first manifest
  held is pinned to ``HOME/manifest.pin`` (trust on first use, node/swarm/manifest_trust.py), so that
  not even an empty state file lets another in.
* **Sybil limits.** Every record merged carries a :class:`node.swarm.crdt.Delivery`: the peer that handed it
  over and the network group (/24, /48) its connection comes from, for the replica's per-subnet limits.
* **Persistence.** The replica is saved atomically every ``save_s`` and on stop; :func:`load_state`
  restores it on start. A restarted node re-signs its record as soon as a peer shows it a newer one of
  its own (see :meth:`node.swarm.crdt.SwarmState.own_record_superseded`).
* **Graceful stop.** On cancellation the node publishes its departure (``left``), waits briefly for it
  to go out, and saves. That part is shielded from the cancellation and bounded in time.

Why one module, though long: gossip and anti-entropy are one job, keeping one replica in step, and lean on
each other: gossip from a peer that has not passed a session is limited and starts one, a session's
verdict decides whose gossip is merged, and both report into the same statistics and incompatible-peer
memory. The manifest's trust rule and its pin file are node/swarm/manifest_trust.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID as MESHSUB_V10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as MESHSUB_V11
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12 as MESHSUB_V12
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from node.status_schema import MemberStatus, ReplicaStatus, ReplicationStatus
from node.swarm.connections import Connections
from node.swarm.crdt import (
    Delivery,
    Manifest,
    ManifestRecord,
    MemberRecord,
    MemberState,
    MemberView,
    RecordError,
    SignedRecord,
    StateFileError,
    SwarmState,
)
from node.swarm.liveness import Liveness
from node.swarm.manifest_trust import ManifestMismatch, ManifestRefused, write_manifest_pin
from p2p.gossip import idontwant_for_large_messages_only, send_peer_record_once
from p2p.host import dialed_by_us
from p2p.limits import stop_receiving
from p2p.netgroup import group_of, peer_ip, stream_ip
from p2p.wire import LibP2PByteStream, ProtocolError
from protocols import state as protocol
from protocols.state import LocalInfo, SyncRefused

log = logging.getLogger("starling.replicator")


#: Gossipsub protocol versions offered, newest first. (1.3+ adds extension machinery we do not use.)
GOSSIP_PROTOCOLS = (MESHSUB_V12, MESHSUB_V11, MESHSUB_V10)
#: Mesh degree: enough redundancy that one slow peer does not delay a record, small enough that a
#: record costs each node a handful of sends.
GOSSIP_DEGREE, GOSSIP_DEGREE_LOW, GOSSIP_DEGREE_HIGH = 6, 4, 12

MAX_OUTBOUND_SESSIONS = 4  # anti-entropy sessions this node initiates at once
MAX_INBOUND_SESSIONS = 8  # sessions it serves at once; more are answered "busy"
# Of those, one peer's: an honest peer runs one session with us at a time (two while a crossing pair of
# sessions overlaps); a peer that kept all eight alive with empty record batches shut every other member
# out of anti-entropy for as long as it liked (per-subnet shares, p2p/netgroup.py, exempt loopback).
MAX_INBOUND_SESSIONS_PER_PEER = 2
OUTBOX_SIZE = 64  # records waiting to be published; beyond it they are dropped (anti-entropy carries them)
#: Members a busy refusal's referral is drawn among (:meth:`StateReplicator._referral`): 4x the referral's 8
#: records, so that with a quarter of the swarm alive and dialable it still fills, and bounded whatever N.
REFERRAL_DRAWS = 32
#: How often one member may be named in this node's referrals (:meth:`StateReplicator._referral`) within
#: ``REFERRAL_COUNT_S``: about the connections a newcomer dials (``node.target_peers``' default), so that
#: a member a crowded node names gets about that many newcomers' dials from it, not most of a join's.
MAX_TIMES_NAMED = 8
#: How long referrals are counted before the counts start over (a join's burst of newcomers lasts less), and
#: how many members are counted at most.
REFERRAL_COUNT_S = 60.0
REFERRALS_COUNTED = 4096
#: A member whose own hello brought this node its record within this long may be named in referrals although
#: the liveness in use (SWIM) has not heard of it yet (see :meth:`StateReplicator._referral`).
INTRODUCED_FRESH_S = 30.0
MAX_TRACKED_PEERS = 4096  # bound on the verified / incompatible peer memories
#: Opening a state stream (dial if needed, protocol negotiation). Not 10 s: at a 64-daemon join on one machine
#: the bootstrap node, which every newcomer's first session goes to, took 9-14 s to bring a new stream to its
#: handler during the first seconds; with 10 s half the newcomers gave up just before their answer (a referral)
#: came, opened another stream, and the bootstrap answered streams nobody read any more, 1-4 times per newcomer,
#: while they knew nobody for 30-65 s (docs/benchmarks.md, "Scale: real daemons", 2026-11-27). A node opens one
#: session with a peer at a time, so a longer wait holds no more of the peer than a retry would.
OPEN_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 10.0
PUBLISH_TIMEOUT_S = 5.0
GOODBYE_TIMEOUT_S = 4.0  # publishing the departure on stop (2 s was too short on a loaded machine)
STOP_TIMEOUT_S = 6.0  # everything done on stop, goodbye included (within the CLI's 9 s hard stop)
POLL_S = 1.0  # how often the anti-entropy loop looks for connections it was not told about
#: A node with one connection, refused "busy" by that peer with nobody new to dial, asks it again after
#: this long, doubling each time, up to ``anti_entropy_s`` (see :meth:`StateReplicator._retry_soon_if_stuck`).
REFUSED_RETRY_S = 1.5
PUSH_PEERS = 2  # without gossip: peers a record this node signs is pushed to at once (see _push)
#: Fields of the member record that change with every inner step: in SWIM mode a change of these alone
#: re-signs the record at most every ``progress_every_s``. (``outer_step`` is not one: the averager's
#: step-gap check reads it, and it changes once an outer step.)
PROGRESS_FIELDS = frozenset({"step", "loss", "val_loss", "samples_per_s"})
#: SWIM mode's least time between two records re-signed for progress alone. Why 30 s: status and the
#: pacing read step, loss and speed, which move slowly against it (an outer step is minutes on a real
#: model), while every copy of a record costs each node a signature check: 30 s is 1/15 of the 2 s
#: heartbeat's cost, and the same period as SWIM's own progress payload (MembershipConfig.progress_interval_s).
PROGRESS_EVERY_S = 30.0


def gossip_topic(swarm: str) -> str:
    return f"starling/{swarm}/state"


def load_state(path: Path, me: KeyPair, **kwargs: Any) -> SwarmState:
    """Restore the replica saved at ``path`` (an empty one if there is none).

    A file that cannot be read as a swarm state is moved aside (``<name>.corrupt``) with a warning and
    the node starts with an empty view: the swarm will resend everything through anti-entropy, so
    refusing to start would cost the operator more than the file is worth.
    """
    try:
        return SwarmState.load(path, me, **kwargs)
    except StateFileError as exc:
        aside = path.with_name(path.name + ".corrupt")
        try:
            path.replace(aside)
            log.warning("%s; moved it to %s and starting with an empty view", exc, aside)
        except OSError as move_error:
            log.warning(
                "%s; could not move it aside (%s); starting with an empty view", exc, move_error.strerror
            )
        return SwarmState(me, **kwargs)


class DeliveredReplica:
    """The replica as one session sees it: every record it merges is attributed to that session's peer
    and network group (see :class:`node.swarm.crdt.Delivery`)."""

    def __init__(self, state: SwarmState, delivery: Delivery) -> None:
        self.state = state
        self.delivery = delivery
        self.introduced = 0  # records new to this node that the peer's hello introduced

    def digest(self) -> Any:
        return self.state.digest()

    def missing_for(self, their_digest: Any) -> list[bytes]:
        return self.state.missing_for(their_digest)

    def apply(self, records: Any) -> Any:
        return self.state.apply(records, delivery=self.delivery)

    def introduce(self, record: bytes) -> bool:
        """Merge ``record`` if it is the session's peer's own member record (protocols/state.py, 2.1.0);
        whether it was new. One of another signer or kind is not taken: a hello introduces its sender."""
        try:
            signed = self.state.verify(record)  # a bad one is counted among the replica's rejections
        except RecordError:
            return False
        if signed.kind != MemberRecord.kind or signed.peer_id != self.delivery.peer_id:
            return False
        introduced = self.state.apply([signed], delivery=self.delivery).changed > 0
        self.introduced += introduced
        return introduced


@dataclass
class ReplicationStats:
    """Counters of what the replicator did, for status and metrics."""

    sessions_ok: int = 0
    session_failures: Counter[str] = field(default_factory=Counter)  # by reason: timeout, malformed, ...
    records_sent: int = 0  # through anti-entropy
    records_received: int = 0  # through anti-entropy (changed or not)
    records_changed: int = 0  # received through anti-entropy and new to this node
    gossip_published: int = 0
    gossip_received: int = 0  # gossip messages merged (any outcome)
    gossip_refused: int = 0  # forwarded by a peer that has not passed the handshake, or invalid
    gossip_dropped: int = 0  # own records not published because the outbox was full
    manifest_mismatches: int = 0  # refused sessions with incompatible peers (both directions)
    busy_refusals: int = 0  # inbound sessions answered "busy": all slots, or the peer's share, taken
    peer_share_refusals: int = 0  # of those, refused because the peer held its share (slots were left)
    referred_records: int = 0  # member records sent in the referrals of those refusals (2.0.0)
    referrals_received: int = 0  # records received in busy refusals' referrals (any outcome)
    referrals_changed: int = 0  # of those, new to this node
    newcomers_handed_on: int = 0  # of the busy refusals, newcomers referred on because this node was crowded
    introductions: int = 0  # of records_changed: initiators' own records taken from their hellos (2.1.0)
    saves: int = 0
    save_errors: int = 0
    last_save: float | None = None  # wall time

    def as_dict(self) -> ReplicationStatus:
        out = dataclasses.asdict(self)
        out["session_failures"] = dict(self.session_failures)
        return cast("ReplicationStatus", out)


@dataclass(frozen=True)
class ReplicationTiming:
    """How often a replicator heartbeats, runs anti-entropy and saves (see the module docstring), and how often
    SWIM mode re-signs a record for progress alone (``progress_every_s``). Each must be positive."""

    heartbeat_s: float = 2.0
    anti_entropy_s: float = 5.0
    save_s: float = 10.0
    progress_every_s: float = PROGRESS_EVERY_S

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")


class StateReplicator:
    """Keeps one node's :class:`SwarmState` replicated with its peers (see the module docstring).

    ``self_fields`` returns the fields of this node's member record (addrs, role, version, outer_step,
    step, loss, val_loss, samples_per_s, reachability, manifest_hash); it is called on every heartbeat.
    ``local_manifest`` returns the run manifest this node trains with (None for a network-only node).
    ``gossip=False`` runs no gossipsub (the node neither publishes nor receives), so it relies on
    anti-entropy alone, its own records pushed on change: the daemon's SWIM mode; tests also use it to
    prove that anti-entropy closes every gap.
    """

    def __init__(
        self,
        host: IHost,
        state: SwarmState,
        swarm: str,
        *,
        path: Path | None,
        self_fields: Callable[[], dict[str, Any]],
        local_manifest: Callable[[], Manifest | None] = lambda: None,
        timing: ReplicationTiming = ReplicationTiming(),
        gossip: bool = True,
        clock: Callable[[], float] = time.time,
        pin_path: Path | None = None,
        liveness: Liveness | None = None,
        connections: Connections | None = None,
        on_new_members: Callable[[], None] | None = None,
    ) -> None:
        self.host = host
        self.state = state
        self.swarm = swarm
        self.topic = gossip_topic(swarm)
        self.path = path
        self.self_fields = self_fields
        self.local_manifest = local_manifest
        self.heartbeat_s = timing.heartbeat_s
        self.anti_entropy_s = timing.anti_entropy_s
        self.save_s = timing.save_s
        self.gossip = gossip
        self._clock = clock
        #: SWIM mode: members' states (alive, suspect, gone) from the SWIM service, when it last heard from each
        #: (``last_seen`` in the status: a record re-signed only on change is no measure of it) and whom it
        #: never heard of (worth a dial, :meth:`members_to_dial`); None: gossip mode, states from heartbeats.
        self.liveness = liveness
        self.progress_every_s = timing.progress_every_s
        #: The node's connection manager, as this replicator tells and asks it (`Connections`; None: no
        #: manager, as in tests that exercise a replicator alone).
        self.connections = connections
        #: Called when a session or a busy refusal's referral brought records new to this node: the daemon
        #: hands members' addresses to its connection manager at once rather than at its next 5 s look
        #: (while it is short of connections: a newcomer whose first session gave it the members).
        self.on_new_members = on_new_members
        self._last_fields: dict[str, Any] | None = None  # what the last record signed here said
        self._last_signed = -math.inf
        #: Heartbeats that re-signed the record, and those that found nothing worth a signature (SWIM mode).
        self.heartbeats = Counter[str]()
        #: Where the trusted-on-first-use manifest is pinned (None: not persisted).
        self.pin_path = pin_path
        self.stats = ReplicationStats()
        #: Set when this node's manifest differs from the swarm's (it must not train with this swarm).
        self.manifest_error: ManifestMismatch | None = None
        #: The running pubsub service (None when not running); exposed for tests and diagnostics.
        self.pubsub: Pubsub | None = None

        self._me = host.get_id()
        # Peers that passed the handshake (gossip is accepted from them) and peers refused as
        # incompatible (with the reason); both bounded, oldest forgotten first.
        self._verified: OrderedDict[str, None] = OrderedDict()
        self._incompatible: OrderedDict[str, SyncRefused] = OrderedDict()
        #: How many of this node's referrals named each member (see _referral); at most REFERRALS_COUNTED.
        self._times_referred: Counter[str] = Counter()
        self._introduced_at: dict[str, float] = {}  # member -> when its own hello brought its record (new here)
        self._referrals_counted_since = -math.inf
        self._prompt: set[ID] = set()  # peers to sync with as soon as a session slot is free
        self._retry_at: dict[ID, float] = {}  # peers to sync with again then (a refusal with nobody new: _refused)
        self._empty_refusals: dict[ID, int] = {}  # such refusals in a row, by peer
        self._in_flight: set[ID] = set()
        self._known_connected: set[ID] = set()
        #: When this node last started a session with each connected peer (trio time).
        self._last_attempt: dict[ID, float] = {}
        self._inbound = 0
        self._inbound_by_peer: dict[ID, int] = {}  # bounded: at most MAX_INBOUND_SESSIONS entries
        self._wake = trio.Event()
        self._synced_once = False
        self._save_failing = False
        self._found_after = 0.0  # trio time after which a lone node founds the manifest
        self._outbox_send, self._outbox_recv = trio.open_memory_channel[bytes](OUTBOX_SIZE)
        # Limits derived from the replica's capacity: its digest and the records it may hold.
        self._max_digest_entries = max(
            protocol.DEFAULT_MAX_DIGEST_ENTRIES, 2 * state.max_members + state.max_tombstones + 1
        )
        self._max_records = max(protocol.DEFAULT_MAX_RECORDS, 2 * state.max_members + 1)

    # ---- inputs from the daemon -----------------------------------------------------------------

    def peer_connected(self, peer_id: ID) -> None:
        """A connection to ``peer_id`` opened: sync with it now, if this side opens the connection's first
        session (:meth:`_opens_first_session`; also retries a peer refused before, which may have restarted
        with the right configuration)."""
        if peer_id != self._me and self._opens_first_session(peer_id):
            self._prompt.add(peer_id)
            self._wake.set()

    def _opens_first_session(self, peer: ID) -> bool:
        """Whether this node, rather than ``peer``, starts the session a new connection between them gets:
        the side that dialled the connection; where that is not clear (connections both ways, or a direction
        py-libp2p did not record), the side with the smaller peer ID. Both sides compute the same answer.

        Why one side only: a session is symmetric (each side sends what the other lacks), and when both
        sides started one at once, the two crossed and a newcomer was sent the whole table twice, checking
        every record's signature twice; the node everyone dials first (the bootstrap) paid that for every
        newcomer. If this one session fails, the rounds reach the peer as they reach every other.

        Why the dialler: it is the side that wants the session (a newcomer dials the bootstrap node for the
        members; a member dials a candidate it was told of), and the side that accepted may be the node
        every newcomer dials. With the smaller ID deciding, a bootstrap node opened the first session to
        every newcomer whose ID was larger, four at a time, each a full session (the initiator is served, it
        cannot refer the newcomer on as a crowded responder does), while those newcomers waited: at a
        64-daemon join all twelve that knew nobody 16 s after the last start were of them
        (docs/benchmarks.md, "Scale: real daemons"). A dial-back prober (protocols/dialback.py), a throwaway
        host that speaks no state protocol, is a dialler too: the node it probes opens nothing to it."""
        dialed = dialed_by_us(self.host, peer)
        return dialed if dialed is not None else self._me.to_bytes() < peer.to_bytes()

    def refresh(self) -> None:
        """Re-sign and publish this node's member record now (e.g. right after an outer step) rather
        than at the next heartbeat. (SWIM mode: if it is worth a signature, see :meth:`_worth_signing`;
        a new outer step is.)"""
        self._heartbeat()

    def add_progress(self, samples: int = 0, tokens: int = 0) -> None:
        """Add work done by this node to the swarm-wide counter. The new entry is not gossiped:
        anti-entropy carries it within a few rounds (see the module docstring)."""
        self.state.add_progress(samples, tokens)

    # ---- views ----------------------------------------------------------------------------------

    def incompatible_peers(self) -> set[str]:
        """Peer IDs (base58) refused as incompatible: another swarm or another run manifest."""
        return set(self._incompatible)

    def alive_members(self) -> list[MemberView]:
        """Averaging candidates: alive members other than this node, not known to be incompatible,
        and whose published manifest hash (when both are known) equals this node's."""
        return self._compatible_members(MemberState.ALIVE)

    def partner_candidates(self) -> list[MemberView]:
        """Members an averager may pair with: :meth:`alive_members` and the suspect ones too.

        Suspect is not dead: on a slow link a probe's answer waits behind the node's own transfers, and a
        trainer behind a 0.08 Mbit/s link suspected its three partners in turn (bench/wan.py, one-slow at
        0.4 Mbit/s), found "no other trainer to pair with" and stepped solo at once while all three trained.
        A member that is really gone is declared so within the suspicion timeout; until then a request to
        it fails like any other (a back-off, and the round's other partners)."""
        return self._compatible_members(MemberState.ALIVE, MemberState.SUSPECT)

    def members_to_dial(self) -> list[MemberView]:
        """Members worth a connection: those :meth:`alive_members` would list, and the suspect ones too.

        A suspect member is the one a connection helps most: its records stopped arriving by whatever
        path brought them, and a direct connection brings a session with it (and the probes of
        ``_quiet_peers``). With alive members only, a node on a loaded machine, where most members looked
        suspect, was given nobody to dial and stayed with the connections it had.
        """
        dial = self._compatible_members(MemberState.ALIVE, MemberState.SUSPECT)
        if self.liveness is None:
            return dial
        # SWIM mode: SWIM hears of members only through connections (its seed's table at the join, then
        # news along connections), so members whose records came by a state session but whom SWIM never
        # heard of showed as gone and were never dialled: at a 64-daemon join most nodes held one or two
        # connections for a minute. A connection is how SWIM meets them; one it holds dead is not dialled.
        unheard = self._compatible_members(MemberState.GONE)
        return dial + [view for view in unheard if self.liveness.unheard_of(view.peer_id)]

    def members(self, now: float | None = None) -> list[MemberView]:
        """Every member held, with its state as this node shows it (:meth:`_shown`)."""
        return [self._shown(view) for view in self.state.members(self._clock() if now is None else now)]

    def _shown(self, view: MemberView) -> MemberView:
        """``view`` with its state as this node shows it: from the heartbeats (the replica's own view) or, in
        SWIM mode, from ``liveness`` (a departure and this node itself excepted)."""
        if self.liveness is None or view.state is MemberState.LEFT:
            return view
        me = view.peer_id == self.state.peer_id
        return dataclasses.replace(view, state=MemberState.ALIVE if me else self.liveness.member_state(view.peer_id))

    def _compatible(self, view: MemberView, ours: str) -> bool:
        """Whether ``view`` is another member that may average with us: not this node, not known to be
        incompatible, and of our manifest ``ours`` where both are known."""
        return (view.peer_id != self.state.peer_id
                and view.peer_id not in self._incompatible
                and (not ours or not view.record.manifest_hash or view.record.manifest_hash == ours))

    def _compatible_members(self, *states: MemberState) -> list[MemberView]:
        ours = self._manifest_hash()
        return [view for view in self.members() if view.state in states and self._compatible(view, ours)]

    def status(self) -> ReplicaStatus:
        """``{"members": [...], "swarm_totals": {...}}`` for ``starling status --json``."""
        now = self._clock()
        views = self.members(now)
        members = [self._member_status(view, now) for view in views]
        by_state = Counter(view.state.value for view in views)
        totals = self.state.counters()
        swarm_manifest = self.state.manifest
        return {
            "members": members,
            "swarm_totals": {
                "members": {s.value: by_state.get(s.value, 0) for s in MemberState},
                "samples": totals.samples,
                "tokens": totals.tokens,
                "rejected": dict(self.state.rejected),
                "manifest_hash": swarm_manifest.hash if swarm_manifest is not None else None,
                "manifest_founder": self.state.manifest_signer(),
                "manifest_authority": self.state.authority.describe(),
                "manifest_error": str(self.manifest_error) if self.manifest_error is not None else None,
                # Peers held per network group, the largest few: what the Sybil limits see.
                "member_groups": dict(list(self.state.groups().items())[:5]),
                "crowd_evictions": self.state.crowd_evictions,
                "clock_capped": self.state.clock_capped,
                "incompatible_peers": sorted(self._incompatible),
                "incompatible": [
                    {"peer_id": peer, "field": "swarm" if exc.code == protocol.SWARM_MISMATCH else "manifest",
                     "theirs": exc.remote, "ours": exc.local, "version": exc.peer_version,
                     "differs": self._manifest_differences(exc)}
                    for peer, exc in sorted(self._incompatible.items())
                ],
                "our_manifest": _manifest_fields(self.local_manifest() or swarm_manifest),
                "replication": self.stats.as_dict(),
            },
        }

    def _manifest_differences(self, exc: SyncRefused) -> list[str]:
        """Which manifest fields differ between this node and a refused peer, where both manifests are known
        here: the peer runs the swarm's manifest (held in the replica) and this node its own. [] otherwise (the
        state protocol's hello carries only the peer's manifest hash)."""
        swarm, local = self.state.manifest, self.local_manifest()
        if exc.code != protocol.MANIFEST_MISMATCH or swarm is None or local is None or exc.remote != swarm.hash:
            return []
        return list(swarm.differences(local))

    def _member_status(self, view: MemberView, now: float) -> MemberStatus:
        r = view.record
        last_seen = view.last_seen
        if self.liveness is not None:
            heard = self.liveness.last_heard(r.peer_id)
            last_seen = heard if heard is not None else last_seen
        return {
            "peer_id": r.peer_id,
            "self": r.peer_id == self.state.peer_id,
            "state": view.state.value,
            "role": r.role,
            "version": r.version,
            "outer_step": r.outer_step,
            "step": r.step,
            "loss": r.loss,
            "val_loss": r.val_loss,
            "samples_per_s": r.samples_per_s,
            "partners": list(r.partners),
            "reachability": r.reachability,
            "addrs": list(r.addrs),
            "manifest_hash": r.manifest_hash,
            "incompatible": r.peer_id in self._incompatible,
            "last_seen": round(last_seen, 3),
            "last_seen_s": round(max(0.0, now - last_seen), 1),
            # The author's clock against ours, for `starling doctor`'s clock check.
            "heartbeat": round(r.heartbeat, 3),
            "received_at": round(view.received_at, 3),
        }

    # ---- running --------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the state protocol, run gossip and the periodic loops until cancelled.

        The work lives in :meth:`_serve`, shielded from cancellation: when this task is cancelled it
        only tells :meth:`_serve` to stop, which then says goodbye and saves within ``STOP_TIMEOUT_S``.
        (Shielding this task's own code would not be enough: pubsub's sender tasks, which carry the
        goodbye to the peers, would be cancelled with it.)
        """
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(self._serve, stop)
                task_status.started()
                await trio.sleep_forever()
            finally:
                stop.set()

    async def _serve(
        self, stop: trio.Event, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with trio.CancelScope(shield=True) as scope:
                self._found_after = trio.current_time() + 2 * self.anti_entropy_s
                self._heartbeat(force=True)  # our own record exists before anyone asks for it
                self.host.set_stream_handler(protocol.PROTOCOL_ID, self._handle_stream)
                self.host.set_stream_handler(protocol.PROTOCOL_ID_2_0, self._handle_stream_2_0)
                self.host.set_stream_handler(protocol.PROTOCOL_ID_1_0, self._handle_legacy_stream)
                try:
                    async with self._gossip_service() as (pubsub, subscription):
                        self.pubsub = pubsub
                        async with trio.open_nursery() as loops:
                            if pubsub is not None:
                                # Pubsub learns of connections from network events; peers that were already
                                # connected before it existed must be introduced to it explicitly.
                                for peer in self._connected():
                                    loops.start_soon(self._introduce, pubsub, peer)
                                loops.start_soon(self._drain, subscription)
                                loops.start_soon(self._publisher, pubsub)
                            loops.start_soon(self._heartbeat_loop)
                            loops.start_soon(self._anti_entropy_loop)
                            loops.start_soon(self._save_loop)
                            task_status.started()
                            await stop.wait()
                            scope.deadline = trio.current_time() + STOP_TIMEOUT_S
                            loops.cancel_scope.cancel()
                        await self._goodbye(pubsub)
                finally:
                    self.pubsub = None
                    for protocol_id in protocol.PROTOCOL_IDS:
                        self.host.remove_stream_handler(protocol_id)
        finally:
            self._save()

    @asynccontextmanager
    async def _gossip_service(self) -> AsyncIterator[tuple[Pubsub | None, Any]]:
        """The running pubsub service and this node's subscription to the state topic; ``(None, None)``
        without gossip: then no gossipsub runs at all (no stream to every peer, no mesh upkeep every
        second, no IHAVE), since a node that neither publishes nor receives on the topic has no use for it.
        """
        if not self.gossip:
            yield None, None
            return
        pubsub, router = self._make_pubsub()
        async with background_trio_service(pubsub), background_trio_service(router):
            with trio.fail_after(STARTUP_TIMEOUT_S):
                await pubsub.wait_until_ready()
            pubsub.set_topic_validator(self.topic, self._validate_gossip, False)
            subscription = await pubsub.subscribe(self.topic)
            yield pubsub, subscription

    def _make_pubsub(self) -> tuple[Pubsub, GossipSub]:
        """Gossipsub tuned per py-libp2p-notes pitfall 6: 1 s heartbeat (the default 120 s leaves the
        mesh unbuilt for minutes) and no silent per-peer rate limit (the default drops a busy peer's
        records without a word).

        And the signed peer record sent once per stream, not with every message, and no IDONTWANT for a
        member record (p2p/gossip.py: only for messages of 1 KiB and more, as go-libp2p).

        And sequence numbers that a restart cannot reuse. A gossip message's ID is (author, seqno), and
        py-libp2p starts the seqno at the current time in whole seconds, adding one per message. A node
        that published more than one message a second (heartbeats under a second, or under 2 s when
        trainers also gossiped their counter entries) and restarts would reuse IDs its peers saw in its
        previous life, and they would drop its new records as duplicates: for 2 minutes (seen-message
        cache), without merging them for 5 (validation cache). Starting at the time in nanoseconds, as
        go-libp2p does, puts every life's numbers past the previous one's.
        """
        router = GossipSub(
            protocols=list(GOSSIP_PROTOCOLS),
            degree=GOSSIP_DEGREE,
            degree_low=GOSSIP_DEGREE_LOW,
            degree_high=GOSSIP_DEGREE_HIGH,
            heartbeat_initial_delay=0.1,
            heartbeat_interval=1,
            spam_protection_enabled=False,
        )
        pubsub = Pubsub(self.host, router)
        send_peer_record_once(pubsub)
        idontwant_for_large_messages_only(router)
        pubsub.counter = max(pubsub.counter, time.time_ns())
        return pubsub, router

    async def _introduce(self, pubsub: Pubsub, peer: ID) -> None:
        with trio.move_on_after(STARTUP_TIMEOUT_S):
            await pubsub.ensure_peer_stream(peer, timeout=STARTUP_TIMEOUT_S)

    def _connected(self) -> set[ID]:
        return {p for p in self.host.get_connected_peers() if p != self._me}

    # ---- local writes and gossip ----------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await trio.sleep(self.heartbeat_s)
            self._heartbeat()

    def _heartbeat(self, *, force: bool = False) -> None:
        fields = self.self_fields()
        if force or self._worth_signing(fields):
            self.heartbeats["signed"] += 1
            try:
                signed = self.state.update_self(**fields)
            except ValueError as exc:  # a value peers would refuse: keep the previous record, say why
                log.error("cannot publish this node's member record: %s", exc)
            else:
                self._last_fields, self._last_signed = dict(fields), self._clock()
                self._publish(signed)
        else:
            self.heartbeats["skipped"] += 1
        self._check_manifest()

    def _worth_signing(self, fields: dict[str, Any]) -> bool:
        """Gossip mode: always (the record is the heartbeat). SWIM mode: when a field other than progress
        changed, or progress did and the last record is ``progress_every_s`` old."""
        last = self._last_fields
        if self.liveness is None or last is None:
            return True
        changed = {k for k in fields.keys() | last.keys() if fields.get(k) != last.get(k)}
        if changed - PROGRESS_FIELDS:
            return True
        return bool(changed) and self._clock() - self._last_signed >= self.progress_every_s

    def _check_manifest(self) -> None:
        """Found the swarm's manifest if nobody has and the configuration lets this node, or notice that
        ours differs from the swarm's; report refused manifests and pin the trusted one."""
        self._report_refusals()
        self._pin_manifest()
        local = self.local_manifest()
        if local is None:
            return
        authority = self.state.authority
        if self.state.manifest is None:
            # The configured hash, or the one pinned on first use: the swarm's, though not held right now.
            expected = authority.manifest_hash or ("" if authority.configured else authority.pinned)
            if expected and local.hash != expected:
                exc = ManifestMismatch(expected, local.hash)
                if self.manifest_error is None or self.manifest_error.swarm_hash != exc.swarm_hash:
                    where = "node.manifest_hash" if authority.manifest_hash else str(self.pin_path or "manifest.pin")
                    log.error("%s (the swarm's manifest is fixed by %s)", exc, where)
                self.manifest_error = exc
                return
            if not self.state.may_found(local):
                return  # another node (node.founder) founds; its manifest arrives by anti-entropy
            # Wait for a first sync, so that a node joining an existing swarm adopts its manifest
            # rather than racing it with its own; a lone node founds after a grace period.
            if self._synced_once or trio.current_time() >= self._found_after:
                try:
                    signed = self.state.set_manifest(local)
                except ManifestRefused as exc:  # may_found said yes; keep the node up whatever happens
                    log.error("%s", exc)
                    return
                if signed is not None:
                    log.info("founded the swarm's run manifest %s", local.hash)
                    self._publish(signed)
                    self._pin_manifest()
            return
        try:
            self.state.check_manifest(local)
        except ManifestMismatch as exc:
            if self.manifest_error is None or self.manifest_error.swarm_hash != exc.swarm_hash:
                log.error("%s", exc)
            self.manifest_error = exc
        else:
            self.manifest_error = None

    def _report_refusals(self) -> None:
        """Log each manifest the replica refused (once per signer and hash): an attack or a misconfigured
        node, which the operator must hear about; both hashes and the signer are named."""
        for refusal in self.state.take_manifest_refusals():
            log.warning("%s", refusal)

    def _pin_manifest(self) -> None:
        """Trust on first use: persist the manifest this node holds, so that a lost or deleted state file
        does not let another one in (only when no founder or hash is configured)."""
        authority = self.state.authority
        swarm = self.state.manifest
        if authority.configured or swarm is None or authority.pinned == swarm.hash:
            return
        if self.pin_path is not None:
            try:
                write_manifest_pin(self.pin_path, self.swarm, swarm.hash)
            except OSError as exc:  # once: the replica holds it either way, for as long as this run lasts
                log.warning("cannot pin the run manifest %s in %s: %s; it is trusted until the daemon stops",
                            swarm.hash, self.pin_path, exc.strerror or exc)
            else:
                log.info("trusting run manifest %s (signed by %s) from now on; pinned in %s",
                         swarm.hash, self.state.manifest_signer(), self.pin_path)
        self.state.authority = dataclasses.replace(authority, pinned=swarm.hash)

    def _publish(self, signed: SignedRecord) -> None:
        if not self.gossip:
            self._push()
            return
        try:
            self._outbox_send.send_nowait(signed.data)
        except trio.WouldBlock:
            self.stats.gossip_dropped += 1

    def _push(self) -> None:
        """Without gossip: start sessions now with ``PUSH_PEERS`` connected peers (those synced with longest
        ago), so that a record this node just signed leaves at once rather than with the next round, and
        spreads from there as every node's rounds carry it. Cheap where it is used: in swim mode a record is
        signed only when it changes."""
        candidates = self._candidates(self._connected())
        random.shuffle(candidates)
        candidates.sort(key=lambda p: self._last_attempt.get(p, -math.inf))
        if candidates:
            self._prompt.update(candidates[:PUSH_PEERS])
            self._wake.set()

    async def _publisher(self, pubsub: Pubsub) -> None:
        async for data in self._outbox_recv:
            with trio.move_on_after(PUBLISH_TIMEOUT_S):
                try:
                    await pubsub.publish(self.topic, data)
                    self.stats.gossip_published += 1
                except Exception as exc:  # py-libp2p raises assorted types; anti-entropy covers the loss
                    log.debug("gossip publish failed: %s", exc)

    def _validate_gossip(self, forwarder: ID, message: rpc_pb2.Message) -> bool:
        """Gossipsub topic validator, and the point where gossip is merged into the replica.

        Returning False keeps gossipsub from delivering and forwarding the message: records the replica
        refuses (forged, malformed, too far in the future) and records a peer that has not passed the
        handshake may not bring (see :meth:`_admit_unverified`) go no further than this node.
        """
        if forwarder != self._me and forwarder.to_base58() not in self._verified:
            if not self._admit_unverified(forwarder, message.data):
                self.stats.gossip_refused += 1
                return False
        self.stats.gossip_received += 1
        delivery = None
        if forwarder != self._me:
            delivery = Delivery(forwarder.to_base58(), group_of(peer_ip(self.host, forwarder)))
        result = self.state.apply([message.data], delivery=delivery)
        if result.rejected:
            self.stats.gossip_refused += 1
            self._report_refusals()
            return False
        if result.changed:
            self._pin_manifest()
        self._reassert_if_superseded()
        return True

    def _admit_unverified(self, forwarder: ID, data: bytes) -> bool:
        """Whether to merge a gossip record relayed by a peer that has not passed the handshake yet.

        After a restart that is every peer until the first sessions complete, which takes long on a
        loaded machine; refusing everything meanwhile left a restarted node deaf to gossip and showing
        live members as suspect. What a node of another run could leak is its manifest and its own
        members, so only member and counter records of peers this replica already holds are taken; the
        rest waits for the handshake, which this starts (at most once per probe interval per peer).
        """
        peer = forwarder.to_base58()
        if peer in self._incompatible:
            return False
        if trio.current_time() - self._last_attempt.get(forwarder, -math.inf) >= self._probe_spacing():
            self._prompt.add(forwarder)
            self._wake.set()
        try:
            signed = self.state.verify(data)
        except RecordError:
            return False  # counted in the replica's rejections
        author = signed.peer_id
        return signed.kind != ManifestRecord.kind and self.state.holds(author) and author not in self._incompatible

    def _reassert_if_superseded(self) -> None:
        """Re-sign this node's record at once if a peer just showed it a newer one of its own (a record
        of its previous life, signed before a restart with a clock ahead of today's), rather than leave
        that old record in every table until the next heartbeat."""
        if self.state.own_record_superseded():
            self._heartbeat(force=True)

    async def _drain(self, subscription: Any) -> None:
        """Keep the subscription queue empty (it holds 32 messages and drops the rest with a warning);
        the records were already merged by the validator."""
        async for _message in subscription:
            pass

    async def _goodbye(self, pubsub: Pubsub | None) -> None:
        """Tell the swarm we are leaving, within GOODBYE_TIMEOUT_S: publish the departure marker and wait
        until pubsub's per-peer queues are empty (publish() only enqueues, and the queues die with the
        service), and at the same time hand it to every connected peer in an anti-entropy session, so that
        a gossip message lost on a busy machine does not leave peers to find out by suspicion."""
        signed = self.state.depart()
        with trio.move_on_after(GOODBYE_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                if pubsub is not None:
                    nursery.start_soon(self._publish_departure, pubsub, signed.data)
                # Every connected peer, even one with a session in flight: that session may have sent our
                # record before the departure was signed, and then neither carrier would bring it.
                for peer in self._connected():
                    self._in_flight.add(peer)
                    nursery.start_soon(self._sync_with, peer)

    async def _publish_departure(self, pubsub: Pubsub, data: bytes) -> None:
        try:
            await pubsub.publish(self.topic, data)
        except Exception as exc:  # best effort: the anti-entropy sessions carry it too
            log.debug("publishing the departure failed: %s", exc)
            return
        while any(len(queue) for queue in pubsub.peer_queues.values()):
            await trio.sleep(0.02)
        await trio.sleep(0.05)  # the sender tasks have popped the message; let them write it

    # ---- anti-entropy ---------------------------------------------------------------------------

    def _manifest_hash(self) -> str:
        local = self.local_manifest()
        if local is not None:
            return local.hash
        swarm = self.state.manifest
        return swarm.hash if swarm is not None else ""

    def _local_info(self) -> LocalInfo:
        me = self.state.member(self.state.peer_id)
        return LocalInfo(me.record.version if me else "", self.swarm, self._manifest_hash(),
                         self.state.member_data(self.state.peer_id) or b"")

    async def _anti_entropy_loop(self) -> None:
        async with trio.open_nursery() as sessions:
            next_round = trio.current_time()
            while True:
                connected = self._connected()
                # Connections nobody told us about (e.g. inbound ones) are synced with promptly too.
                self._prompt |= {p for p in connected - self._known_connected if self._opens_first_session(p)}
                self._known_connected = connected
                self._last_attempt = {p: t for p, t in self._last_attempt.items() if p in connected}
                now = trio.current_time()
                if self.liveness is None:  # SWIM probes members itself; records no longer show who is quiet
                    self._prompt |= self._quiet_peers(connected, now)
                for peer, at in list(self._retry_at.items()):
                    if now >= at or peer not in connected:
                        del self._retry_at[peer]
                        if peer in connected:
                            self._prompt.add(peer)
                if now >= next_round:
                    peer = self._least_recently_synced(connected)
                    if peer is not None:
                        self._prompt.add(peer)
                    next_round = now + self.anti_entropy_s * random.uniform(0.8, 1.2)
                for peer in list(self._prompt):
                    if len(self._in_flight) >= MAX_OUTBOUND_SESSIONS:
                        break
                    self._prompt.discard(peer)
                    if peer in connected and peer not in self._in_flight:
                        self._in_flight.add(peer)
                        self._last_attempt[peer] = now
                        sessions.start_soon(self._sync_with, peer)
                self._prompt &= connected
                with trio.move_on_at(min(next_round, now + POLL_S)):
                    await self._wake.wait()
                self._wake = trio.Event()

    def _candidates(self, connected: set[ID]) -> list[ID]:
        return [p for p in connected if p not in self._in_flight and p.to_base58() not in self._incompatible]

    def _least_recently_synced(self, connected: set[ID]) -> ID | None:
        """The peer for this round: the one this node started a session with longest ago (never comes
        first; ties at random). With random picks a given one of six peers went six rounds unvisited a
        third of the time; this reaches each within one round per peer."""
        candidates = self._candidates(connected)
        if not candidates:
            return None
        random.shuffle(candidates)
        return min(candidates, key=lambda p: self._last_attempt.get(p, -math.inf))

    def _probe_spacing(self) -> float:
        """The least time between two sessions this node starts with the same peer outside the rounds."""
        return min(self.anti_entropy_s, self.state.suspect_after / 4)

    def _quiet_peers(self, connected: set[ID], now: float) -> set[ID]:
        """Connected members to probe: not heard from for half of ``suspect_after`` and no new record of
        theirs received for a quarter of it, and not tried within the probe spacing.

        Without probes, a member's liveness rests on gossip; anti-entropy with one peer per round brings
        news of everyone too slowly for the failure detector (with gossip lost and the defaults' ratio of
        5 s rounds to a 15 s suspect time, some node listed a live member as not alive in a fifth of the
        polls: docs/reliability.md). A probe asks the quiet member itself, whose record is never more
        than a heartbeat old. The receipt condition spares members whose records keep arriving, only
        late (an overloaded machine): probing them would add sessions where they cost the most.
        """
        wall = self._clock()
        suspect_after = self.state.suspect_after
        spacing = self._probe_spacing()
        quiet = set()
        for peer in self._candidates(connected):
            if now - self._last_attempt.get(peer, -math.inf) < spacing:
                continue
            view = self.state.member(peer.to_base58(), wall)  # not a member yet: the rounds reach it
            if (
                view is not None
                and view.state is not MemberState.LEFT
                and wall - view.last_seen > suspect_after / 2
                and wall - view.received_at > suspect_after / 4
            ):
                quiet.add(peer)
        return quiet

    async def _sync_with(self, peer: ID) -> None:
        try:
            with trio.move_on_after(OPEN_TIMEOUT_S) as open_scope:
                try:
                    stream = await self.host.new_stream(peer, list(protocol.PROTOCOL_IDS))
                except Exception as exc:  # py-libp2p raises many types for a peer it cannot reach
                    self.stats.session_failures["open"] += 1
                    log.debug("cannot open a state stream to %s: %s", peer, exc)
                    self._retry_soon_if_alone(peer)
                    return
            if open_scope.cancelled_caught:
                self.stats.session_failures["timeout"] += 1
                return
            negotiated = str(stream.get_protocol())
            legacy = negotiated == protocol.PROTOCOL_ID_1_0  # a peer not upgraded yet
            introduce = negotiated == protocol.PROTOCOL_ID  # (2.0.0: a peer not upgraded to 2.1.0)
            # Under the protocol's own deadlines.
            await self._session(peer, stream, initiator=True, legacy=legacy, introduce=introduce)
        finally:
            self._in_flight.discard(peer)
            self._wake.set()

    async def _handle_legacy_stream(self, stream: INetStream) -> None:
        """Stream handler of ``/starling/state/1.0.0``, for peers not upgraded yet (protocols/state.py)."""
        await self._handle_stream(stream, legacy=True, introduce=False)

    async def _handle_stream_2_0(self, stream: INetStream) -> None:
        """Stream handler of ``/starling/state/2.0.0``, for peers not upgraded to 2.1.0 yet."""
        await self._handle_stream(stream, introduce=False)

    async def _handle_stream(self, stream: INetStream, *, legacy: bool = False, introduce: bool = True) -> None:
        """Stream handler of ``/starling/state/2.1.0`` (runs in libp2p's task, one per session)."""
        peer = stream.muxed_conn.peer_id
        full = self._inbound >= MAX_INBOUND_SESSIONS
        over_share = self._inbound_by_peer.get(peer, 0) >= MAX_INBOUND_SESSIONS_PER_PEER
        referral: Sequence[bytes] | None = None
        handed_on = False
        if not (full or over_share) and self._hands_on(peer, legacy):
            referral = self._referral(peer.to_base58())
            # Else served (see _hands_on). On 2.1.0 the refusal learns the newcomer from its hello, so any
            # members to name are worth more than a session; on 2.0.0 only a full referral is.
            handed_on = len(referral) >= (1 if introduce else protocol.MAX_REFERRAL_RECORDS)
        if full or over_share or handed_on:
            self.stats.busy_refusals += 1
            self.stats.peer_share_refusals += over_share and not full
            self.stats.newcomers_handed_on += handed_on
            byte_stream = LibP2PByteStream(stream)
            if referral is None:
                referral = () if legacy else self._referral(peer.to_base58())
            self.stats.referred_records += len(referral)
            # On 2.1.0 the refusal still takes the newcomer's own record from its hello: later newcomers are
            # referred to it (protocols/state.py, _referral).
            replica = self._replica_for(peer, stream) if introduce else None
            try:
                await protocol.refuse_busy(byte_stream, self._local_info(), referral=referral, legacy=legacy,
                                           introduced_to=replica)
            except ProtocolError:
                pass
            else:
                if handed_on and self.connections is not None:
                    self.connections.served(peer)
            finally:
                if replica is not None:
                    self._count_introduced(replica)
            await _close(byte_stream, graceful=True)
            return
        self._inbound += 1
        self._inbound_by_peer[peer] = self._inbound_by_peer.get(peer, 0) + 1
        try:
            await self._session(peer, stream, initiator=False, legacy=legacy, introduce=introduce)
        finally:
            self._inbound -= 1
            left = self._inbound_by_peer.pop(peer) - 1
            if left:
                self._inbound_by_peer[peer] = left

    def _hands_on(self, peer: ID, legacy: bool) -> bool:
        """Whether ``peer`` may be referred on (a busy refusal with its referral) although a session slot is
        free: this node is crowded and holds no record of the peer, a newcomer that would be sent the whole
        table. :meth:`_handle_stream` then refers it on if the referral names anyone (on 2.0.0 only if it is
        full, :data:`protocols.state.MAX_REFERRAL_RECORDS` members); else it serves the session.

        Why refer: every newcomer dials the bootstrap node first, so at a 64-daemon join it held 63
        connections, and each newcomer's first session asked it for all 63 records; with eight such sessions
        at once on a starved machine they timed out one after another (10 s a step), while the newcomers, whose
        only connection it was, learnt nobody else to dial for a minute (docs/benchmarks.md, "Scale"). A
        referral costs one message and names members the newcomer can dial and sync with at once; the crowded
        node closes most of these connections for its cap anyway. Not on 1.0.0, whose refusal carries no
        referral.

        Why only a full referral: a refusal takes nothing from the newcomer, so a crowded node that refers
        everyone on never learns the newcomers' records, and its referrals stay as short as its table. At a
        64-daemon join every newcomer connects within seconds, before the bootstrap node holds anyone: it held
        2 member records from 0 to 46 s after the last start while it referred 51 newcomers on, each to those
        same 2 members, and half the swarm knew nobody for 40-60 s. While this node holds fewer members to
        refer than a referral carries, the whole table is that small, so the session costs little, and it
        brings this node the newcomer's record, which the next newcomers are referred to. On 2.1.0 the
        refusal brings it too (the newcomer's hello carries it), so a shorter referral is enough there."""
        return (not legacy and self.connections is not None and not self.state.holds(peer.to_base58())
                and self.connections.crowded())

    def _referral(self, asker: str) -> list[bytes]:
        """Records for a busy refusal's referral (protocols/state.py): alive members other than this node
        and the asker, drawn at random among :data:`REFERRAL_DRAWS` members, those that publish addresses
        first (a newcomer can dial them), then those this node has named in the fewest referrals; none
        named :data:`MAX_TIMES_NAMED` times already within :data:`REFERRAL_COUNT_S` (the referral is then
        shorter, or empty).

        The fewest, and a cap: a referral's members are whom the newcomer dials, and at a 64-daemon join the
        bootstrap node refers most newcomers within seconds, while it holds a handful of members. Drawn at
        random, the members it held first were named again and again, each became a hub of 40-60
        connections whose sessions and probes queued, and newcomers waited on them; counted alone, the
        handful were still named 20-30 times each when 50 newcomers came within 3 s. With the cap, each
        refusal names those not yet named enough, and adds the newcomer it refuses (its hello's record) to
        those the next ones are named.

        Random, so that the newcomers a busy bootstrap refuses spread their dials over the swarm. A sample,
        not every member's view sorted: a crowded bootstrap refers every newcomer, so at a 64-daemon join
        this ran once per joiner on the node the join already starves, and built, shuffled and sorted all N
        members' views each time to keep 8. Now the work per refusal is at most ``REFERRAL_DRAWS`` views
        (plus a copy of the member IDs to draw from), whatever N."""
        me = self.state.peer_id
        drawn = self.state.sample_member_ids(REFERRAL_DRAWS, exclude=(me, asker))
        now, ours = self._clock(), self._manifest_hash()
        held = (self.state.member(pid, now) for pid in drawn)
        views = [view for view in (self._shown(v) for v in held if v is not None)
                 if (view.state is MemberState.ALIVE or self._just_introduced(view, now))
                 and self._compatible(view, ours)]
        named = self._times_referred
        if len(named) > REFERRALS_COUNTED or now - self._referrals_counted_since > REFERRAL_COUNT_S:
            named.clear()  # a new burst of newcomers, or counts of members long gone: even again
            self._referrals_counted_since = now
        views = [view for view in views if named[view.peer_id] < MAX_TIMES_NAMED]
        views.sort(key=lambda view: (not view.record.addrs, named[view.peer_id]))  # stable: random among ties
        chosen = [(view.peer_id, data) for view in views if (data := self.state.member_data(view.peer_id))]
        referral = protocol.fit_referral(data for _, data in chosen)
        taken = set(referral)
        for peer_id, data in chosen:
            if data in taken:
                named[peer_id] += 1
        return referral

    def _just_introduced(self, view: MemberView, now: float) -> bool:
        """Whether ``view``'s member, shown gone, introduced itself to this node (its hello carried its record,
        new here) within ``INTRODUCED_FRESH_S``: alive for a referral, though SWIM has not heard of it yet.

        Why: at a 64-daemon join the bootstrap node refused 55 newcomers within two seconds, each hello
        bringing the newcomer's record, while its SWIM, whose streams with each newcomer were still being
        negotiated, held 29 members alive and showed the other 23 it held records of as gone. Referrals
        named SWIM's alive members only: a newcomer refused in that burst got an empty one, and knew
        nobody until the connection manager redialled the bootstrap 15 s later. A record its author handed
        over itself on a live connection seconds ago is evidence that it lives; a member that died since
        costs the newcomer a failed dial."""
        if view.state is not MemberState.GONE:
            return False
        at = self._introduced_at.get(view.peer_id)
        return at is not None and now - at < INTRODUCED_FRESH_S

    def _replica_for(self, peer: ID, stream: INetStream) -> DeliveredReplica:
        """The replica as a session with ``peer`` on ``stream`` sees it (the Sybil limits count by both)."""
        return DeliveredReplica(self.state, Delivery(peer.to_base58(), group_of(stream_ip(stream))))

    async def _session(
        self, peer: ID, stream: INetStream, *, initiator: bool, legacy: bool = False, introduce: bool = False
    ) -> None:
        """One session on an open stream, either side; records the outcome, never raises for the peer's
        failures."""
        byte_stream = LibP2PByteStream(stream)
        side = protocol.initiate if initiator else protocol.respond
        graceful = False
        replica = self._replica_for(peer, stream)
        try:
            result = await side(
                byte_stream,
                replica,
                self._local_info(),
                max_records=self._max_records,
                max_digest_entries=self._max_digest_entries,
                legacy=legacy,
                introduce=introduce,
            )
        except SyncRefused as exc:
            graceful = True  # the Error message must reach the initiator before the stream closes
            self._heard(peer)
            self._refused(peer.to_base58(), exc)
            if initiator:
                self._retry_soon_if_stuck(peer, exc)
        except ProtocolError as exc:
            self.stats.session_failures[exc.reason.value] += 1
            log.debug("state session with %s failed: %s", peer, exc)
        except trio.TooSlowError:
            self.stats.session_failures["timeout"] += 1
            log.debug("state session with %s timed out", peer)
        except Exception as exc:
            # py-libp2p's muxers occasionally raise outside the IOException tree that LibP2PByteStream
            # normalises; whatever a peer or its transport does must not take the replicator down.
            self.stats.session_failures["error"] += 1
            log.warning("unexpected error in a state session with %s: %r", peer, exc, exc_info=True)
        else:
            graceful = True
            self._heard(peer)
            self._empty_refusals.pop(peer, None)
            self._synced(peer.to_base58(), result)
        finally:
            self._count_introduced(replica)
            self._report_refusals()
            self._pin_manifest()
            await _close(byte_stream, graceful=graceful)

    def _count_introduced(self, replica: DeliveredReplica) -> None:
        """A record a hello introduced came through anti-entropy too, and was new: counted as one of those.
        Its author is remembered as just heard from, for referrals (``INTRODUCED_FRESH_S``)."""
        if replica.introduced:
            now = self._clock()
            introduced = self._introduced_at
            introduced.pop(replica.delivery.peer_id, None)  # (re-inserted last: the dict stays in time order)
            while len(introduced) >= REFERRALS_COUNTED:  # the oldest first, fresh or not: a bound, not a cache
                del introduced[next(iter(introduced))]
            introduced[replica.delivery.peer_id] = now
        self.stats.introductions += replica.introduced
        self.stats.records_received += replica.introduced
        self.stats.records_changed += replica.introduced

    def _heard(self, peer: ID) -> None:
        if self.connections is not None:
            self.connections.heard_from(peer)

    def _synced(self, peer: str, result: protocol.SessionResult) -> None:
        self.stats.sessions_ok += 1
        if self.connections is not None:
            self.connections.served(ID.from_base58(peer))
        self.stats.records_sent += result.sent
        self.stats.records_received += result.received
        self.stats.records_changed += result.changed
        if result.changed and self.on_new_members is not None:
            self.on_new_members()
        _remember(self._verified, peer, None)
        self._reassert_if_superseded()
        if self._incompatible.pop(peer, None) is not None:
            log.info(
                "peer %s is compatible again (manifest %s)", peer, result.peer_manifest_hash or "unknown"
            )
        if not self._synced_once:
            self._synced_once = True
            self._check_manifest()

    def _retry_soon_if_stuck(self, peer: ID, exc: SyncRefused) -> None:
        """After a busy refusal that named nobody new, ask ``peer`` again within ``REFUSED_RETRY_S`` (doubling
        while such refusals go on, up to ``anti_entropy_s``) where it is this node's only connection.

        Why: a newcomer's only connection is the node it bootstrapped from, which refuses it at a join (busy,
        or crowded), naming members to dial instead. Refused in the join's first second, before that node
        holds anyone, or once every member it holds was named its share of times, the referral names
        nobody; the newcomer then had nobody to dial and nothing to sync until its next round, and its next
        session queued behind the bootstrap node's others: at a 64-daemon join three newcomers, refused so,
        still knew nobody 17 s after the last start, when the other 60 knew nearly everyone. A second later
        the node holds the newcomers that arrived meanwhile (each introduced by its hello) and names them."""
        if exc.code != "busy" or (exc.referred is not None and exc.referred.changed):
            self._empty_refusals.pop(peer, None)
            return
        self._retry_soon_if_alone(peer)

    def _retry_soon_if_alone(self, peer: ID) -> None:
        """Schedule the next session with ``peer`` (see :meth:`_retry_soon_if_stuck`) where it is this node's
        only connection; a state stream that could not be opened on it is retried so too."""
        if self._connected() - {peer}:
            return  # others to sync with: the rounds reach them
        n = self._empty_refusals[peer] = self._empty_refusals.get(peer, 0) + 1
        if len(self._empty_refusals) > 4 * MAX_OUTBOUND_SESSIONS:
            self._empty_refusals = {peer: n}
        delay = min(self.anti_entropy_s, REFUSED_RETRY_S * 2 ** (n - 1)) * random.uniform(0.8, 1.2)
        self._retry_at[peer] = trio.current_time() + delay
        self._wake.set()

    def _refused(self, peer: str, exc: SyncRefused) -> None:
        if exc.referred is not None:  # the rejected ones are counted by the replica (state.rejected)
            self.stats.referrals_received += exc.referred.changed + exc.referred.unchanged + exc.referred.rejected
            self.stats.referrals_changed += exc.referred.changed
            if exc.referred.changed and self.on_new_members is not None:
                self.on_new_members()
        if not exc.incompatible:
            self.stats.session_failures[exc.code] += 1
            return
        self.stats.manifest_mismatches += 1
        self._verified.pop(peer, None)
        previous = self._incompatible.get(peer)
        if previous is None or (previous.code, previous.remote) != (exc.code, exc.remote):
            log.error("peer %s: %s; it is excluded from state sync and averaging", peer, exc)
        _remember(self._incompatible, peer, exc)

    # ---- persistence ----------------------------------------------------------------------------

    async def _save_loop(self) -> None:
        while True:
            await trio.sleep(self.save_s)
            self._save()

    def _save(self) -> None:
        """Save the replica (synchronously: it is small, and a snapshot must not see concurrent merges)."""
        if self.path is None:
            return
        try:
            self.state.save(self.path)
        except OSError as exc:
            self.stats.save_errors += 1
            if not self._save_failing:  # once per streak of failures, not every save_s
                log.warning("cannot save the swarm state to %s: %s", self.path, exc.strerror or exc)
            self._save_failing = True
        else:
            self._save_failing = False
            self.stats.saves += 1
            self.stats.last_save = self._clock()


def _manifest_fields(manifest: Manifest | None) -> dict[str, str | int] | None:
    if manifest is None:
        return None
    return {"task": manifest.task, "model_hash": manifest.model_hash, "optimizer_hash": manifest.optimizer_hash,
            "protocol_version": manifest.protocol_version}


def _remember(table: OrderedDict[str, Any], key: str, value: Any) -> None:
    """Insert or refresh ``key`` in a bounded LRU table."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_TRACKED_PEERS:
        table.popitem(last=False)


async def _close(stream: LibP2PByteStream, *, graceful: bool) -> None:
    """Close a session's stream (reset it after a failure); bounded, and done even when cancelled. Nothing
    is read from it afterwards: what the peer still sends is dropped, not buffered."""
    stop_receiving(stream.stream)
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            if graceful:
                await stream.aclose()
            else:
                await stream.reset()
        except Exception as exc:  # the stream is finished either way
            log.debug("closing a state stream: %s", exc)
