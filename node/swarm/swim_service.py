"""The SWIM membership core (:mod:`node.swarm.membership`) run over libp2p: ``node.membership = "swim"`` (issue #24).

Why: with ``node.membership = "gossip"`` every node re-signs its member record every ``heartbeat_s`` and every
node checks every other's, so each node's membership CPU grows with N. Here liveness comes from SWIM's
probes instead, a fixed amount of work per node whatever N is; the member records (addresses, role,
progress) are re-signed only when they change (:class:`node.swarm.replicator.StateReplicator` with
``liveness`` set), and the replicator asks this service whether a member is alive.

Transport (docs/benchmarks.md, "Scale: SWIM's transport"): one long-lived stream per connected peer costs
6.2 ms of CPU per round trip, a new stream per message 10.9 and a new connection 27.8. So:

* Each node keeps one *outbound* stream on ``/starling/swim/1.0.0`` to each connected peer that speaks it,
  opened when the connection appears, and writes its messages to that peer there, length-prefixed
  (:class:`p2p.wire.PlainFrameChannel`); what a peer sends arrives on the peer's own outbound stream, read
  by :meth:`SwimService._handle_stream`. Two one-way streams per pair, no tie-breaking between two nodes
  that open at once. Each peer's outbox is a bounded channel: a message that does not fit is dropped
  (SWIM tolerates loss; a slow peer must not hold this node's memory).
* Probing is restricted to connected members (``Membership.can_probe``): the probe target, the helpers of
  an indirect probe and the push-pull partner. A message to a member that is not connected is dropped,
  never dialled. So an indirect probe succeeds through a helper that is connected to the target.
* A dropped connection is itself news: the member is probed at once (``Membership.probe``). Its direct
  ping cannot go out, the indirect ones go through helpers; if none of them reaches it either, it becomes
  suspect, then dead after SWIM's suspicion timeout (a live member refutes as soon as the suspicion reaches
  it through any connection it has). Without this, a member that died took its connections with it and
  nobody would probe it again. First, though, the member is dialled again (``SwimService.redial``, at most
  ``REDIAL_S``): a connection made with it proves it alive (its key answered the handshake), and only a
  failed dial makes the drop news. Why: at 64-daemon joins connections ended under both of their nodes
  (py-libp2p's muxer ending on both sides, seconds apart, with no close by either connection manager), and
  each probed the other through helpers not connected to it; a pair of live members held each other
  suspect, in every view, until they refuted. Three exceptions, since none is evidence of death: a connection this node
  closed itself (the connection manager's cap: ``tell_closing``, wired to ``ConnManager.on_closing``) is
  not probed, and its probes under way are dropped; a connection on which the SWIM streams never came up
  is not probed either (a peer that dialled and gave up mid-handshake: py-libp2p registered the
  connection here, then the dialler cancelled its own side; at a 64-daemon join such drops, probed through
  helpers not connected to the member, turned live members suspect after the join); and a probe that
  nobody could carry (no connection to the member, no other member connected to ask) ends without
  suspicion, to be tried again when a connection appears (``Membership.recheck``). The other side of a
  close is told too: before the connection manager closes a connection for its cap it sends the peer a
  *closing notice* (an ``Ack`` of sequence number 0, which no probe uses, so a node not upgraded ignores
  it) and waits up to ``CLOSING_WAIT_S`` for the peer's own notice back (:meth:`SwimService.tell_closing`).
  A peer that gets one takes the drop that follows as this node's own close: no probe. Why: the peer whose connection a full node
  closed probed it at once, with no direct path and helpers connected to it but not to the full node (who
  drop a ping they cannot send), so the probe failed and the full node turned suspect in every view for a
  poll. At a 64-daemon join, 40 of the 50 probes that followed a dropped connection were newcomers probing
  the bootstrap node that had closed them for its cap (docs/benchmarks.md, "Scale: real daemons"). The
  notice back is what makes the close wait until the peer has read it, so that the drop never reaches the
  peer before the notice does.
* A starved event loop (a saturated machine) must not read as silent members: the timer loop measures how
  late it wakes and gives that time back to the probes and suspicions under way, and Lifeguard's local
  health score stretches the timeouts while it runs late (``Membership.note_lag``).
* A peer joins the table once an outbound stream to it has negotiated the protocol (so a peer that does
  not speak SWIM is never probed and declared dead): the first one is this node's seed (``join``: its
  table is pulled page by page), later ones are held alive (``preload``) and probed.

Signatures: every claim is signed by its author (:mod:`protocols.swim`) with this node's ed25519 key. The
core builds claims without signatures; before a message is encoded, claims this node authored are signed
(and the signature cached: one signature per incarnation, not per message), and claims by others get the
author's signature from a cache filled by every verified claim received (the core rebuilds ``Alive``
entries of other members for push-pull and joins; one whose signature this node never saw is left out).
Received claims are verified once: a bounded cache of verified (signer, bytes, signature) triples spares
the re-sends of the same claim, which SWIM's dissemination makes most of what arrives.

Hostile peers: every read has a deadline (an idle inbound stream is closed after ``IDLE_TIMEOUT_S``; its
sender reopens one when it next has something to say), every write too; a peer that sends anything the
codec refuses (:class:`p2p.wire.ProtocolError`) has its stream reset and its new streams refused for
``GARBAGE_BAN_S``, as the other protocols close a stream on garbage; the daemon goes on. The registry of
peer names is bounded (``max_members``): claims about peers beyond it are skipped by the codec; the names
of members the core forgot (dead for ``dead_retention_s``, or never admitted) are given back
(:meth:`SwimService.reclaim`), and past 7/8 of the bound the members dead longest are forgotten early, so
that churn never fills it.

What it did is in ``status["swim"]`` (:meth:`SwimService.status`); ``last_heard`` gives the status's
``last_seen`` of each member, SWIM's last evidence that it lives.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from node.status_schema import SwimStatus
from node.swarm.connections import SwimConnections
from node.swarm.crdt import MemberState
from node.swarm.membership import (
    ALIVE,
    DEAD,
    STATE_NAMES,
    SUSPECT,
    UNKNOWN,
    Membership,
    MembershipConfig,
    Registry,
)
from p2p.host import dialed_by_us, last_data_from
from p2p.wire import LibP2PByteStream, PlainFrameChannel, ProtocolError, Reason, close_quietly
from protocols import swim
from protocols.swim import Ack, Alive, Dead, Message, Ping, PingReq, Progress, Suspect

log = logging.getLogger("starling.swim")

PROTOCOL_ID = swim.PROTOCOL_ID
OPEN_TIMEOUT_S = 10.0  # opening a stream (protocol negotiation) to a connected peer
WRITE_TIMEOUT_S = 5.0  # one frame written
IDLE_TIMEOUT_S = 60.0  # an inbound stream with nothing for this long is closed (its sender reopens one)
REOPEN_S = 5.0  # the least time between two outbound streams opened to the same peer
GARBAGE_BAN_S = 60.0  # a peer that sent garbage: its new streams are refused this long
CLOSED_HERE_S = 10.0  # a connection this node closed and saw drop within this long: not news of the member
CLOSING_SEQ = 0  # an Ack of this sequence number is a closing notice (no probe uses it: sequences start at 1)
#: The longest a close waits for the peer's notice back (a peer not upgraded sends none). Why this long: at a
#: 64-daemon join the bootstrap node, starved, answered notices 1.3 s after they were sent; newcomers that closed
#: their connection to it after 1 s took its notice with the connection (never read), and it probed each of them
#: as news, through helpers not connected to them, and turned live members suspect after the join.
CLOSING_WAIT_S = 5.0
#: How long a dropped connection's member may take to be dialled again before the drop is news (see
#: SwimService.redial): a crashed process refuses at once; a host gone makes the dial wait this long.
REDIAL_S = 3.0
RECENT_SUSPECTS = 16  # members last turned suspect here, kept for the status (``recent_suspects``)
CONNECTIONS_POLL_S = 0.5  # how often the connected set is read (a new or a dropped connection)
LAG_ALLOWANCE_S = 0.05  # a timer loop this late is on time (scheduling noise, a message being handled)
OUTBOX = 32  # messages waiting for one peer's stream; more are dropped
LOOKUPS_PER_CALL = 8  # members never heard of asked about at most per look_up call (see SwimService.look_up)
#: The same member is asked about again after the first of these, doubling up to the second. Why it starts
#: short: at a join the member asked may not have heard of the newcomer yet either; at 10 s, single views
#: missed a newcomer for several seconds after every other view held it (64-daemon join, issue #24). A member gone
#: for good costs one small request at 2.5, 5, 10, ... s, then one every 5 min.
LOOKUP_WAIT_S = (2.5, 300.0)
CATCH_UP_S = 10.0  # the least time between two pulls of the table for members never heard of (see look_up)
MAX_INBOUND = 128  # inbound streams served at once (one per peer; a peer's newer one replaces its older)
MAX_MEMBERS = 4096  # peer names this node interns (its member table, dead ones included; see reclaim)
RECLAIM_AT = 7 / 8  # of MAX_MEMBERS names held: the members dead longest are forgotten early
SIG_CACHE = 16384  # cached claim signatures (own and others')
VERIFIED_CACHE = 16384  # cached verified claims
ED25519_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])  # identity multihash of a protobuf ed25519 key

#: Why a message was not sent (the service's counters of the same names).
DROP_REASONS = ("not_connected", "no_stream", "outbox_full", "too_large")
#: Connections that dropped and closing notices (``status["swim"]["closes"]``): drops taken as a close (this
#: node's own, or at the peer's notice), drops probed as news, drops of connections whose SWIM streams never
#: came up (not news), drops whose member was dialled again at once (not news), notices sent, notices
#: received (not answers).
CLOSE_COUNTERS = ("closed_here", "disconnect_probes", "unready_drops", "redialled", "closing_notices_sent",
                  "closing_notices_received")

_STATES = {ALIVE: MemberState.ALIVE, SUSPECT: MemberState.SUSPECT, DEAD: MemberState.GONE}

Claim = Alive | Suspect | Dead | Progress


def _claim_key(claim: Claim) -> tuple[Any, ...]:
    if isinstance(claim, Alive):
        return (1, claim.member, claim.incarnation)
    if isinstance(claim, Suspect | Dead):
        return (2 if isinstance(claim, Suspect) else 3, claim.member, claim.incarnation, claim.accuser)
    return (4, claim.member, claim.version, claim.outer_step, claim.loss, claim.samples_per_s)


def timing(period_s: float, ack_timeout_s: float, suspicion_mult: int) -> MembershipConfig:
    """The core's configuration from the daemon's options (``node.swim_period_s``, ``node.swim_ack_timeout_s``,
    ``node.swim_suspicion_mult``); the rest stays at the core's defaults. The final probe deadline is 4 x the
    ack timeout, as the defaults' 0.5 s and 2 s: an indirect probe's round trip has twice the hops of a
    direct one, and each may wait behind a busy event loop."""
    return MembershipConfig(period_s=period_s, ack_timeout_s=ack_timeout_s, probe_timeout_s=4 * ack_timeout_s,
                            suspicion_mult=suspicion_mult)


def _claim_ids(key: tuple[Any, ...]) -> tuple[int, ...]:
    """The member ids a :func:`_claim_key` names: the member, and the accuser of a suspect or dead claim."""
    return (key[1], key[3]) if key[0] in (2, 3) else (key[1],)


class SwimService:
    """One daemon's SWIM membership over libp2p (see the module docstring).

    ``member_state(peer_id)`` is what the replicator shows for a member: alive, suspect, or gone (held dead,
    or not known to SWIM at all). ``counters`` counts what happened (for tests and diagnostics)."""

    def __init__(self, host: IHost, key_pair: KeyPair, *, config: MembershipConfig | None = None,
                 max_members: int = MAX_MEMBERS, rng: random.Random | None = None,
                 connections: SwimConnections | None = None, redial_s: Callable[[], float] | None = None) -> None:
        self.host = host
        self._me = host.get_id()
        self._private = Ed25519PrivateKey.from_private_bytes(key_pair.private_key.to_bytes()[:32])
        self.max_members = max_members
        self.registry = Registry()
        self.counters: Counter[str] = Counter()
        self._ids: dict[bytes, int] = {}  # peer ID bytes -> id
        self._by_name: dict[str, int] = {}  # base58 -> id
        self._peers: list[ID] = []  # id -> peer ID
        self._heard: dict[int, float] = {}  # member id -> trio time of the last evidence it lives (last_heard)
        self._reaped: set[int] = set()  # members the core forgot since the last reclaim
        self._lookups: dict[str, tuple[float, float]] = {}  # member never heard of -> (next look-up, wait)
        self._catch_up_at = -math.inf  # no pull of the table for members never heard of before then
        me = self._intern(self._me)
        assert me is not None
        self.core = Membership(me, trio.current_time() if _in_trio() else 0.0, rng or random.Random(),
                               config, on_change=self._changed, registry=self.registry)
        self.core.can_probe = self._can_probe
        self.core.on_probe_failed = self._probe_failed
        self.core.heard_since = self._heard_since
        self.lag_s = 0.0  # how late the timer loop last woke (this node's own event loop, starved or busy)
        self.max_lag_s = 0.0
        self._disconnected_at: dict[int, float] = {}
        self._closing: dict[ID, float] = {}  # peers whose connection is closing (here, or at their notice), since when
        #: Called with each peer a message arrived from: its connection delivers (`connections`' ``heard_from``,
        #: which drops connections that deliver nothing).
        self.on_heard: Callable[[ID], None] | None = connections.heard_from if connections is not None else None
        #: Awaited (at most ``REDIAL_S``) before a dropped connection counts as news: dial the member again, True
        #: if connected after (`connections`' ``redial``). None: probed at once.
        self.redial: Callable[[ID], Awaitable[bool]] | None = connections.redial if connections is not None else None
        #: How long that dial may take (None: ``REDIAL_S``); the daemon gives the NAT service's budget, longer
        #: where our connections' round trips are long (node/swarm/nat.py, ``dial_budget_s``).
        self.redial_s = redial_s
        self._redialing: set[ID] = set()
        self._notices: dict[ID, trio.Event] = {}  # closes waiting for the peer's notice back (tell_closing)
        #: Members last turned suspect here (any accuser): peer -> wall time, the last ``RECENT_SUSPECTS``, so
        #: that a suspicion refuted between two status reads still shows (``status["swim"]["recent_suspects"]``).
        self._recent_suspects: OrderedDict[str, float] = OrderedDict()
        self._connected: set[ID] = set()
        self._connected_ids: set[int] = set()
        self._speaks: set[ID] = set()  # peers whose outbound stream negotiated the protocol
        self._ready: set[ID] = set()  # connected peers whose two streams were both up once (see _can_probe)
        self._joined = False
        self._outboxes: dict[ID, trio.MemorySendChannel[bytes]] = {}
        self._opened_at: dict[ID, float] = {}
        self._inbound: dict[ID, trio.CancelScope] = {}
        self._banned: dict[ID, float] = {}
        self._sigs: OrderedDict[tuple[Any, ...], bytes] = OrderedDict()
        self._verified: OrderedDict[tuple[bytes, bytes, bytes], None] = OrderedDict()
        self._keys: dict[bytes, Ed25519PublicKey] = {}
        self._kick = trio.Event()
        self._kicked_at = math.inf
        self._nursery: trio.Nursery | None = None

    # ---- views ------------------------------------------------------------------------------------

    def member_state(self, peer_id: str) -> MemberState:
        pid = self._by_name.get(peer_id)
        if pid is None:
            return MemberState.GONE
        if pid == self.core.me:
            return MemberState.ALIVE
        return _STATES.get(self.core.state_of(pid), MemberState.GONE)

    def status(self) -> SwimStatus:
        """``status["swim"]``: what the service and its core did since start (node/status_schema.py)."""
        core, mine = self.core.counters, self.counters
        dropped = {reason: mine[reason] for reason in DROP_REASONS}
        held = Counter(STATE_NAMES[self.core.state_of(pid)] for pid in self._ids.values())
        return {
            "probes": core["probes"],
            "indirect_probes": core["indirect_probes"],
            "acks": core["acks"],
            "alive_by_traffic": core["alive_by_traffic"],
            "waits_stretched": core["waits_stretched"],
            "slow_members": self.core.slow_members,
            "answer_wait_s": round(self.core.answer_wait(), 3),
            "suspects_raised": core["suspected"],
            "suspects_seen": mine["became_suspect"],
            "recent_suspects": dict(self._recent_suspects),
            "no_evidence": core["no_evidence"],
            "refutations": core["refuted"],
            "declared_dead": core["declared_dead"],
            "messages_sent": mine["sent"],
            "messages_received": mine["received"],
            "messages_dropped": sum(dropped.values()),
            "dropped": dropped,
            "closes": {key: mine[key] for key in CLOSE_COUNTERS},
            "bytes_sent": mine["bytes_sent"],
            "bytes_received": mine["bytes_received"],
            "members": {name: held.get(name, 0) for name in ("alive", "suspect", "dead")},
            "names": len(self._ids),
            "local_health": self.core.local_health,
            "loop_lag_max_s": round(self.max_lag_s, 3),
        }

    def last_heard(self, peer_id: str) -> float | None:
        """When (wall time) this node last had SWIM's evidence that ``peer_id`` lives: a message from it, an
        ack to a probe of it (direct or through a helper), its introduction, or news that made it alive here
        (a join, a refutation). None if none since this node started. Why not the record's age: in swim mode a
        record is re-signed only when it changes, so its age says nothing of the member's liveness."""
        pid = self._by_name.get(peer_id)
        if pid is None:
            return None
        if pid == self.core.me:
            return time.time()
        heard = self._heard.get(pid)
        return None if heard is None else time.time() - (trio.current_time() - heard)

    def unheard_of(self, peer_id: str) -> bool:
        """Whether SWIM never heard of a member (not: holds it dead), for the replicator's members to dial
        (node/swarm/liveness.py)."""
        return self.state_name(peer_id) == "unknown"

    def state_name(self, peer_id: str) -> str:
        """The core's own word for a member (alive, suspect, dead, unknown)."""
        pid = self._by_name.get(peer_id)
        return STATE_NAMES[self.core.state_of(pid)] if pid is not None else "unknown"

    def look_up(self, peer_ids: Iterable[str]) -> int:
        """Ask connected members about members SWIM has never heard of, holds dead, or has held suspect for a
        while although the swarm state holds their signed records (``peer_ids``, base58;
        :meth:`Membership.look_up` says why), at most
        ``LOOKUPS_PER_CALL`` a call; the same member again only after a wait that doubles from 2.5 s to 5 min,
        so that a member that crashed long ago (forgotten here, its record kept) is not asked about forever
        every few seconds. Where more members SWIM never heard of are due than one call asks about, the
        table is pulled again instead, page by page from a random member (:meth:`Membership.catch_up`), at
        most every ``CATCH_UP_S``; and while a pull is under way (a join's too), members never heard of wait
        for it. Returns the requests sent."""
        now = trio.current_time()
        names = [name for name in peer_ids][: self.max_members]
        wanted = set(names)
        self._lookups = {name: due for name, due in self._lookups.items() if name in wanted}
        due: list[tuple[str, str]] = []
        # While a pull of the table is under way (a join, a catch-up), members never heard of wait for it: they
        # are what it brings. At a 64-daemon join, joiners whose pull waited on their seed's "busy" answers
        # looked members up 8 at a time meanwhile, nearly all from the seed (the one member they could send
        # to): 350 requests on the seed, the most loaded daemon of the join.
        pulling = self.core.pulling
        for name in names:
            state = self.state_name(name)
            if state not in ("unknown", "dead", "suspect") or self._lookups.get(name, (-math.inf, 0.0))[0] > now:
                continue
            if state == "unknown" and pulling:
                continue
            if state == "suspect" and (self.core.suspected_for(self._by_name[name], now) or 0.0) < \
                    self.core.config.lookup_suspect_after_s:
                continue  # a young suspicion: its refutation is likely on its way
            due.append((name, state))
        sends: list[tuple[int, Message]] = []
        unknown = [name for name, state in due if state == "unknown"]
        if len(unknown) > LOOKUPS_PER_CALL and now >= self._catch_up_at:
            sends = self.core.catch_up(now)
            if sends:
                self._catch_up_at = now + CATCH_UP_S
                for name in unknown:
                    self._waited(name, now)
                due = [(name, state) for name, state in due if state != "unknown"]
        pids: list[int] = []
        for name, _ in due:
            if len(pids) >= LOOKUPS_PER_CALL:
                break
            try:
                peer = ID.from_base58(name)
            except Exception:  # not a peer ID (records are checked, but this must not raise for one)
                continue
            pid = self._intern(peer)
            if pid is None:
                break  # the registry is full
            pids.append(pid)
            self._waited(name, now)
        sends += self.core.look_up(pids, now)
        self._dispatch(sends)
        return len(sends)

    def _waited(self, name: str, now: float) -> None:
        """``name`` was asked about now: not again before its wait (doubled) is over."""
        wait = min(LOOKUP_WAIT_S[1], 2 * self._lookups.get(name, (0.0, LOOKUP_WAIT_S[0] / 2))[1])
        self._lookups[name] = (now + wait, wait)

    # ---- names and signatures ---------------------------------------------------------------------

    def _intern(self, peer: ID) -> int | None:
        raw = peer.to_bytes()
        pid = self._ids.get(raw)
        if pid is None:
            if len(self._ids) >= self.max_members:
                return None
            name = peer.to_base58()
            pid = self.registry.intern(name)
            self._ids[raw], self._by_name[name] = pid, pid
            if pid < len(self._peers):
                self._peers[pid] = peer  # an id given back by reclaim
            else:
                self._peers.append(peer)
        return pid

    def reclaim(self, now: float) -> int:
        """Give back the names of peers the core no longer holds (dead and reaped after ``dead_retention_s``,
        or never admitted), so that a long-running swarm with churn does not fill the registry: memberlist
        forgets dead nodes after a reclaim time too. Beyond ``RECLAIM_AT`` of ``max_members`` names, the
        members dead longest are reaped early to make room. A connected peer keeps its name. Run from the
        timer loop, never while a message is being decoded (its claims' ids must stay what they were).
        Returns how many names were given back."""
        if len(self._ids) >= RECLAIM_AT * self.max_members:
            for _ in range(len(self._ids) - self._forgettable() - int(RECLAIM_AT * self.max_members) + 1):
                if not self.core.forget_oldest_dead(now):
                    break
        elif not self._reaped:
            return 0
        self._reaped.clear()
        freed: set[int] = set()
        for raw, pid in list(self._ids.items()):
            peer = self._peers[pid]
            if peer in self._connected or peer in self._inbound or peer in self._outboxes or not self.core.forget(pid):
                continue  # a peer we hold a connection or a stream with keeps its name
            del self._ids[raw]
            del self._by_name[peer.to_base58()]
            self.registry.release(pid)
            self._disconnected_at.pop(pid, None)
            self._heard.pop(pid, None)
            freed.add(pid)
        if freed:
            # Cached signatures name members by id: none may be attached to the claims of the id's next owner.
            self._sigs = OrderedDict((k, sig) for k, sig in self._sigs.items() if not freed.intersection(_claim_ids(k)))
            self.counters["names_reclaimed"] += len(freed)
        return len(freed)

    def _forgettable(self) -> int:
        return sum(1 for pid in self._ids.values() if self.core.state_of(pid) == UNKNOWN and pid != self.core.me)

    def _id_of(self, raw: bytes) -> int | None:
        pid = self._ids.get(raw)
        if pid is not None:
            return pid
        if len(raw) != 38 or not raw.startswith(ED25519_PREFIX):
            return None  # not an ed25519 peer ID: its claims could not be verified anyway
        return self._intern(ID(raw))

    def _name_of(self, pid: int) -> bytes:
        return self._peers[pid].to_bytes()

    def _verify(self, signer: bytes, data: bytes, sig: bytes) -> bool:
        key3 = (signer, data, sig)
        if key3 in self._verified:
            self.counters["verify_cached"] += 1
            return True
        key = self._keys.get(signer)
        if key is None:
            if len(signer) != 38 or not signer.startswith(ED25519_PREFIX):
                return False
            if len(self._keys) >= self.max_members:
                self._keys.clear()
            key = self._keys[signer] = Ed25519PublicKey.from_public_bytes(signer[-32:])
        self.counters["verified"] += 1
        try:
            key.verify(sig, data)
        except InvalidSignature:
            self.counters["bad_signature"] += 1
            return False
        self._verified[key3] = None
        if len(self._verified) > VERIFIED_CACHE:
            self._verified.popitem(last=False)
        return True

    def _remember_sig(self, claim: Claim) -> None:
        if claim.sig:
            key = _claim_key(claim)
            self._sigs[key] = claim.sig
            self._sigs.move_to_end(key)
            if len(self._sigs) > SIG_CACHE:
                self._sigs.popitem(last=False)

    def _signed(self, claim: Claim | None) -> Claim | None:
        """``claim`` with its author's signature: ours made now (once), another's from the cache, or None."""
        if claim is None or claim.sig:
            return claim
        key = _claim_key(claim)
        sig = self._sigs.get(key)
        if sig is None:
            me = self.core.me
            author = claim.accuser if isinstance(claim, Suspect | Dead) else claim.member
            if author != me:
                self.counters["unsigned_left_out"] += 1
                return None
            sig = self._private.sign(swim.claim_bytes(claim, self._name_of))
            self.counters["signed"] += 1
            self._sigs[key] = sig
            if len(self._sigs) > SIG_CACHE:
                self._sigs.popitem(last=False)
        return dataclasses.replace(claim, sig=sig)

    def _signed_all(self, claims: Iterable[Any]) -> tuple[Any, ...]:
        return tuple(c for c in (self._signed(c) for c in claims) if c is not None)

    def _sign_message(self, message: Message) -> Message:
        if isinstance(message, Ping | PingReq | Ack):
            return dataclasses.replace(message, updates=self._signed_all(message.updates))
        you = self._signed(message.view_of_you)
        assert not isinstance(you, Progress)
        return dataclasses.replace(message, entries=self._signed_all(message.entries), view_of_you=you)

    def _remember_claims(self, message: Message) -> None:
        if isinstance(message, Ping | PingReq | Ack):
            claims: Iterable[Claim] = message.updates
        else:
            claims = [*message.entries, *([message.view_of_you] if message.view_of_you is not None else [])]
        for claim in claims:
            self._remember_sig(claim)

    # ---- the core's hooks ---------------------------------------------------------------------------

    def closing(self, peer: ID) -> None:
        """This node is closing its connection to ``peer`` itself (the connection manager's cap): when it
        drops, that is not news of the member, and it is not probed for it."""
        if len(self._closing) >= self.max_members:
            now = trio.current_time()
            self._closing = {p: t for p, t in self._closing.items() if t > now - CLOSED_HERE_S}
        self._closing[peer] = trio.current_time()
        pid = self._ids.get(peer.to_bytes())
        if pid is not None:
            self.core.abandon(pid)  # a probe under way may lose its ping or its ack to the close

    async def tell_closing(self, peer: ID) -> None:
        """This node is about to close its connection to ``peer`` (the connection manager's cap): mark it as
        :meth:`closing` does, send the peer a closing notice and wait (at most ``CLOSING_WAIT_S``) for its
        notice back, which says it has read ours (see the module docstring). Told wherever our stream to
        it is up or opening, whether or not its stream to us has reached us yet: at a 64-daemon join the
        bootstrap node, starved, had not yet taken in the streams of newcomers it closed for its cap, so it
        told none of them, while their side was up; each took the drop for news, probed the node through
        helpers it answered too late, and turned it suspect."""
        self.closing(peer)
        if peer not in self._outboxes or peer in self._notices:
            return  # no stream to tell it on, or already telling it
        answered = self._notices[peer] = trio.Event()
        try:
            if self._send_notice(peer):
                with trio.move_on_after(CLOSING_WAIT_S):
                    await answered.wait()
        finally:
            del self._notices[peer]

    def _send_notice(self, peer: ID) -> bool:
        outbox = self._outboxes.get(peer)
        if outbox is None:
            return False
        try:
            outbox.send_nowait(swim.encode(Ack(self.core.me, CLOSING_SEQ), self._name_of))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self.counters["closing_notices_sent"] += 1
        return True

    def _noticed(self, peer: ID, now: float) -> None:
        """A closing notice from ``peer``: the answer to ours, or its own close, which we take as ours (not
        news when it drops) and answer."""
        answered = self._notices.get(peer)
        if answered is not None:
            answered.set()
            return
        self.counters["closing_notices_received"] += 1
        if self._closing.get(peer, -math.inf) > now - CLOSED_HERE_S:
            return  # marked already (both sides closing at once): no answer to an answer
        self.closing(peer)
        self._send_notice(peer)

    def _can_probe(self, pid: int) -> bool:
        """Whether this node may send to ``pid`` as a probe target, a helper or a push-pull partner: it is
        connected, and both one-way streams are up: ours to it (the ping's path) and its own to us (the
        ack's). Why both: while a new connection's streams are still being negotiated (seconds on a busy
        machine, as at a join where every node opens streams to several new peers at once), a ping or its
        ack waits in an outbox, and a member probed then turned suspect although alive (see _check_ready)."""
        return pid in self._connected_ids and self._peers[pid] in self._ready

    def _heard_since(self, pid: int, since: float) -> bool:
        """Whether a connection with member ``pid`` delivered data since ``since`` (any protocol: see the core's
        "Other traffic is evidence too")."""
        return pid < len(self._peers) and last_data_from(self.host, self._peers[pid]) > since

    def _check_ready(self, peer: ID) -> None:
        """Both streams with ``peer`` are up: it may be probed from now on, while its connection lasts (a
        stream that ends later does not take it out: a member that died with its connection still listed
        here must go on being probed, which is what finds it dead)."""
        if peer in self._speaks and peer in self._inbound:
            self._ready.add(peer)

    def _probe_failed(self, pid: int, direct: bool, helpers: int, now: float) -> None:
        dropped = self._disconnected_at.get(pid)
        log.info("no ack from %s: direct ping %s, %d helpers asked; %s; this node's loop %.2f s late (max %.2f)",
                 self._peers[pid] if pid < len(self._peers) else pid, "sent" if direct else "impossible", helpers,
                 f"its connection dropped {now - dropped:.1f} s ago" if dropped is not None else "connected",
                 self.lag_s, self.max_lag_s)

    def _changed(self, pid: int, old: int, new: int, now: float) -> None:
        if pid < len(self._peers):
            log.debug("member %s: %s -> %s", self._peers[pid], STATE_NAMES[old], STATE_NAMES[new])
        self.counters[f"became_{STATE_NAMES[new]}"] += 1
        if new == UNKNOWN:
            self._reaped.add(pid)  # its name is given back at the next reclaim
        elif new == ALIVE:
            self._heard[pid] = now  # news that it lives: a join, a refutation
        if new == SUSPECT and pid < len(self._peers):
            name = self._peers[pid].to_base58()
            self._recent_suspects.pop(name, None)
            self._recent_suspects[name] = time.time()
            while len(self._recent_suspects) > RECENT_SUSPECTS:
                self._recent_suspects.popitem(last=False)
            log.info("member %s suspect (was %s); this node's loop %.2f s late (max %.2f)", self._peers[pid],
                     STATE_NAMES[old], self.lag_s, self.max_lag_s)

    # ---- running ------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the protocol, keep a stream to every connected peer and run the core's timers, until
        cancelled."""
        self.host.set_stream_handler(PROTOCOL_ID, self._handle_stream)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._watch_connections)
                nursery.start_soon(self._timers)
                task_status.started()
        finally:
            self._nursery = None
            self.host.remove_stream_handler(PROTOCOL_ID)
            for scope in list(self._inbound.values()):
                scope.cancel()

    def _wake(self) -> None:
        """Run the core's timers now (news arrived, a peer joined or left)."""
        self._kicked_at = min(self._kicked_at, trio.current_time())
        self._kick.set()

    async def _timers(self) -> None:
        while True:
            wake = self.core.next_wakeup()
            now = trio.current_time()
            # At least 10 ms between ticks: a timer the core left in the past must not spin the event loop.
            at = max(min(wake, now + 1.0), now + 0.01)
            with trio.move_on_at(at):
                await self._kick.wait()
            # How late this loop runs: from when it was due (its timer, or the first kick since it last ran)
            # to now. Time this node could not listen is not a member's silence (Membership.note_lag).
            woke = trio.current_time()
            self.lag_s = max(0.0, woke - min(at, self._kicked_at))
            self.max_lag_s = max(self.max_lag_s, self.lag_s)
            self._kicked_at = math.inf
            self._kick = trio.Event()
            self.core.note_lag(self.lag_s - LAG_ALLOWANCE_S, woke)
            self._dispatch(self.core.tick(woke))
            self.reclaim(woke)

    async def _watch_connections(self) -> None:
        """py-libp2p tells no one of a closed connection: the connected set is read twice a second."""
        while True:
            now_connected = {p for p in self.host.get_connected_peers() if p != self._me}
            gone = self._connected - now_connected
            gone_ready = gone & self._ready  # (before the line below forgets them)
            new = now_connected - self._connected
            self._connected = now_connected
            self._ready &= now_connected
            self._connected_ids = {pid for pid in (self._ids.get(p.to_bytes()) for p in now_connected)
                                   if pid is not None}
            now = trio.current_time()
            for peer in new:
                if self._opens_first(peer):
                    self._open(peer, now)
            for pid in self._connected_ids:  # a member whose stream of ours ended: a new one (at most every REOPEN_S)
                if self._peers[pid] not in self._outboxes and pid != self.core.me:
                    self._open(self._peers[pid], now)
            if new:
                self._dispatch(self.core.recheck(now))  # perhaps a member to ask now
            for peer in gone:
                self._speaks.discard(peer)
                self._ready.discard(peer)
                outbox = self._outboxes.pop(peer, None)
                if outbox is not None:
                    outbox.close()
                pid = self._ids.get(peer.to_bytes())
                if self._closing.pop(peer, -math.inf) > now - CLOSED_HERE_S:
                    # This node closed it (its connection manager, for the cap): no news of the member, and a
                    # probe of it under way may have lost its ping or its ack to the close.
                    self.counters["closed_here"] += 1
                    if pid is not None:
                        self.core.abandon(pid)
                elif pid is not None and peer not in gone_ready:
                    # Its SWIM streams never came up on it (one that dialled and gave up mid-handshake, whose
                    # connection py-libp2p registered here first): no path this node ever had, so no news of
                    # the member; members whose streams to it were up probe it when their connections drop.
                    self.counters["unready_drops"] += 1
                elif pid is not None:
                    self._dropped(peer, pid, now)
            await trio.sleep(CONNECTIONS_POLL_S)

    def _dropped(self, peer: ID, pid: int, now: float) -> None:
        """A connection to member ``pid`` dropped that neither side closed knowingly: dial it again first
        (:attr:`redial`), and probe it only if that fails. A probe of it under way lost its direct path with
        the connection: it is dropped, and the redial decides (a 64-daemon join had one turn the member
        suspect through helpers not connected to it while the redial was under way)."""
        if self.redial is None or self._nursery is None:
            self._probe_dropped(pid, now)
        elif peer not in self._redialing:
            self.core.abandon(pid)
            self._redialing.add(peer)
            self._nursery.start_soon(self._redial_or_probe, peer, self.redial)

    def _probe_dropped(self, pid: int, now: float) -> None:
        self.counters["disconnect_probes"] += 1
        self._disconnected_at[pid] = now
        self._dispatch(self.core.probe(pid, now))
        self._wake()

    async def _redial_or_probe(self, peer: ID, redial: Callable[[ID], Awaitable[bool]]) -> None:
        back = False
        try:
            with trio.move_on_after(self.redial_s() if self.redial_s is not None else REDIAL_S):
                back = await redial(peer)
        except Exception as exc:  # whatever a dial raises must not end the service: the probe decides
            log.debug("redial of %s: %r", peer, exc)
        finally:
            self._redialing.discard(peer)
        if back:
            self.counters["redialled"] += 1
            return
        pid = self._ids.get(peer.to_bytes())
        if pid is not None:
            self._probe_dropped(pid, trio.current_time())

    def _opens_first(self, peer: ID) -> bool:
        """Whether to open our stream to a newly connected ``peer`` at once, rather than when its own stream
        to us arrives (:meth:`_handle_stream`): yes, unless the peer dialled the connection and SWIM has
        never heard of it. Why: a node's reachability check has peers dial it back from throwaway hosts
        that speak the dial-back protocol alone (protocols/dialback.py); a stream to one of those can only
        fail, and at a 64-daemon join such opens were most of SWIM's 150-470 failed ones. A member that
        dials us opens its own stream at once (it dialled: this rule says so on its side), and ours follows."""
        return dialed_by_us(self.host, peer) is not False or self._ids.get(peer.to_bytes()) is not None

    def _open(self, peer: ID, now: float) -> trio.MemorySendChannel[bytes] | None:
        """The peer's outbox, starting its writer (which opens the stream) if there is none."""
        outbox = self._outboxes.get(peer)
        if outbox is not None:
            return outbox
        if self._nursery is None or now - self._opened_at.get(peer, -math.inf) < REOPEN_S:
            return None
        self._opened_at[peer] = now
        if len(self._opened_at) > 4 * self.max_members:
            self._opened_at = {p: t for p, t in self._opened_at.items() if p in self._connected}
        send, recv = trio.open_memory_channel[bytes](OUTBOX)
        self._outboxes[peer] = send
        self._nursery.start_soon(self._writer, peer, send, recv)
        return send

    async def _writer(self, peer: ID, send: trio.MemorySendChannel[bytes],
                      recv: trio.MemoryReceiveChannel[bytes]) -> None:
        stream: INetStream | None = None
        try:
            with trio.move_on_after(OPEN_TIMEOUT_S):
                try:
                    stream = await self.host.new_stream(peer, [PROTOCOL_ID])
                except Exception as exc:  # py-libp2p raises many types for a peer that cannot or will not
                    self.counters["open_failed"] += 1
                    log.debug("no swim stream to %s: %s", peer, exc)
            if stream is None:
                return
            self._speaks.add(peer)
            self._check_ready(peer)
            self._introduce(peer)
            channel = PlainFrameChannel(LibP2PByteStream(stream), max_frame_size=swim.MAX_MESSAGE_BYTES)
            async with recv:
                async for frame in recv:
                    with trio.fail_after(WRITE_TIMEOUT_S):
                        await channel.send(frame)
                    self.counters["sent"] += 1
                    self.counters["bytes_sent"] += len(frame)
        except (ProtocolError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.counters["write_failed"] += 1
            log.debug("swim stream to %s ended: %r", peer, exc)
        except Exception as exc:  # whatever the muxer raises for a dead stream must not end the service
            self.counters["write_failed"] += 1
            log.debug("swim stream to %s failed: %r", peer, exc)
        finally:
            if self._outboxes.get(peer) is send:
                del self._outboxes[peer]
            send.close()
            if stream is not None:
                await close_quietly(stream)

    def _introduce(self, peer: ID) -> None:
        """A peer that speaks the protocol: our seed if it is the first, else a member to probe."""
        pid = self._intern(peer)
        if pid is None:
            return
        self._connected_ids.add(pid)
        now = trio.current_time()
        self._heard[pid] = now  # it negotiated our protocol just now
        if not self._joined:
            self._joined = True
            self._dispatch(self.core.join(pid, now))
        elif self.core.state_of(pid) not in (ALIVE, SUSPECT, DEAD):
            self.core.preload([pid], now)
        self._wake()

    def _dispatch(self, sends: list[tuple[int, Message]]) -> None:
        now = trio.current_time()
        for pid, message in sends:
            peer = self._peers[pid] if 0 <= pid < len(self._peers) else None
            if peer is None or peer not in self._connected:
                self.counters["not_connected"] += 1
                continue
            outbox = self._open(peer, now)
            if outbox is None:
                self.counters["no_stream"] += 1
                continue
            try:
                data = swim.encode(self._sign_message(message), self._name_of)
            except ValueError as exc:
                self.counters["too_large"] += 1
                log.debug("swim message not sent: %s", exc)
                continue
            try:
                outbox.send_nowait(data)
            except trio.WouldBlock:
                self.counters["outbox_full"] += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.counters["no_stream"] += 1

    async def _handle_stream(self, stream: INetStream) -> None:
        """Stream handler of ``/starling/swim/1.0.0``: a peer's outbound stream, read until it ends."""
        peer = stream.muxed_conn.peer_id
        now = trio.current_time()
        banned_until = self._banned.get(peer)
        if banned_until is not None and now < banned_until:
            self.counters["refused_banned"] += 1
            await close_quietly(stream, reset=True)
            return
        self._banned.pop(peer, None)
        pid = self._intern(peer)
        if pid is None or (len(self._inbound) >= MAX_INBOUND and peer not in self._inbound):
            self.counters["refused_full"] += 1
            await close_quietly(stream, reset=True)
            return
        older = self._inbound.pop(peer, None)
        if older is not None:
            older.cancel()
        if peer not in self._outboxes:  # a peer that dialled us: our stream follows its own (see _opens_first)
            self._open(peer, now)
        garbage = False
        channel = PlainFrameChannel(LibP2PByteStream(stream), max_frame_size=swim.MAX_MESSAGE_BYTES)
        with trio.CancelScope() as scope:
            self._inbound[peer] = scope
            self._check_ready(peer)
            try:
                while True:
                    data = b""
                    with trio.move_on_after(IDLE_TIMEOUT_S):
                        data = await channel.recv()
                    if not data:
                        break  # idle, or closed by the peer
                    self.counters["bytes_received"] += len(data)
                    pid = self._intern(peer)  # (the same id as long as this stream lives: see reclaim)
                    if pid is None:
                        break
                    message = swim.decode(data, pid, self._id_of, self._verify)
                    self.counters["received"] += 1
                    self._remember_claims(message)
                    now = trio.current_time()
                    self._heard[pid] = now
                    if self.on_heard is not None:
                        self.on_heard(peer)
                    if isinstance(message, Ack) and message.seq == CLOSING_SEQ:
                        self._noticed(peer, now)
                        continue
                    target = self.core.probe_target(message.seq) if isinstance(message, Ack) else None
                    self._dispatch(self.core.receive(now, message))
                    if target is not None and self.core.probe_target(message.seq) is None:
                        self._heard[target] = now  # the ack of our probe of it (direct, or a helper's)
                    self._wake()
            except ProtocolError as exc:
                if exc.reason not in (Reason.CLOSED, Reason.TRUNCATED, Reason.BROKEN):
                    garbage = True
                    self.counters["garbage"] += 1
                    self._banned[peer] = trio.current_time() + GARBAGE_BAN_S
                    if len(self._banned) > self.max_members:
                        self._banned = {p: t for p, t in self._banned.items() if t > now}
                    log.warning("dropped the swim stream of %s: %s", peer, exc)
            except Exception as exc:  # a reset stream, a muxer error: the peer's sender reopens
                self.counters["read_failed"] += 1
                log.debug("swim stream from %s ended: %r", peer, exc)
        if self._inbound.get(peer) is scope:
            del self._inbound[peer]
        await close_quietly(stream, reset=garbage)


def _in_trio() -> bool:
    try:
        trio.current_time()
    except RuntimeError:
        return False
    return True
