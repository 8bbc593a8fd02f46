"""SWIM membership, sans-io: liveness by probing a few peers, news piggy-backed on the probes (issue #24).

Why: today every node re-signs its member record every ``heartbeat_s`` and every other node receives and
checks it (:mod:`node.swarm.replicator`), so each node's membership cost grows with N and the swarm's with
N squared. Here each node does a *fixed* amount of work per protocol period whatever N is:

* **Probing** (SWIM, Das et al. 2002). Every ``period_s`` a node pings one member, taken in a round-robin
  over its member table whose order is redrawn every round (so every member is probed by someone about
  once a period, and a dead one is found within two rounds of this node at worst). No ack within
  ``ack_timeout_s``: it asks ``indirect_k`` other members to ping the target for it (``PingReq``), so that
  one bad path (a lossy link, a NAT between the two) does not make a live member suspect. No ack by
  ``probe_timeout_s``: the target becomes *suspect*. A member this node probed less than ``probe_spacing_s``
  ago is passed over: where a node may send to few members (a daemon probes connected members only), the
  round-robin would otherwise ping the same few every period; a newcomer connected to its seed alone pinged
  it every second, 63 pings a second at the seed of a 64-daemon join (issue #24). And where no helper could
  be asked (the node may send to the target alone), one missed ack is no suspicion: the node's local health
  rises (below), and the target is suspected after ``lonely_misses`` such probes in a row with nothing heard
  from it between them. At that join, 155 of the 221 probes that failed were a newcomer's of the seed, its
  only connection, which answered late while 63 others joined through it; each made the seed suspect in the
  newcomer's view and spread. A member whose every neighbour can ask a helper is judged as before, and in a
  swarm of two a hung member is still suspected, ``lonely_misses`` probes later.
* **Suspicion with incarnations.** A suspect is not dead yet: the claim spreads, and the suspect, hearing
  it, *refutes* by raising its incarnation number (only a member ever raises its own) and spreading that.
  A live member's newer incarnation beats any suspect or dead claim about an older one; a dead member may
  only come back with a higher incarnation than the one it died at.
* **Lifeguard suspicion timeout** (HashiCorp memberlist, Lifeguard paper). A suspicion turns into death
  after a timeout that starts at ``suspicion_max_mult`` x the minimum and shrinks, as other members
  independently suspect the same incarnation, towards the minimum ``suspicion_mult x max(1, log10 N) x
  period_s`` (reached at ``suspicion_mult - 2`` confirmations; only that many travel on, as in memberlist,
  since more would shorten nothing and each costs every node slots). Why: one node with a bad link alone
  takes long to kill anyone; several agreeing take little; and the time grows with log N because the
  refutation needs log N periods to reach the suspect and come back.
* **Local health** (Lifeguard). A node whose own event loop runs late (a starved machine), that had to
  refute a suspicion of itself, or whose probe failed with no helper to ask (memberlist's rule where no
  helper can nack: nobody could tell whether the target or this node failed) raises its local health score
  (0 to ``max_local_health``); each ack lowers it. Its probe timeouts and its probe period are stretched by (1 + score), and the time its loop could not
  run is given back to the probes and suspicions under way (:meth:`Membership.note_lag`): an ack that sits
  unread in a stalled node's socket is not the member's silence. A probe that nobody could carry (the
  daemon sends only to connected members: no connection to the target, no helper) is no evidence either.
* **Other traffic is evidence too** (Erlang distribution's rule: any data received counts as a tick). A
  daemon tells the core whether a member's connections delivered anything, on any protocol, since a time
  (``heard_since``). A probe with no ack by its direct deadline, or by its final one, where the member did
  send something after the ping went, ends there: no helpers asked, no suspicion (``alive_by_traffic``);
  a helper running an indirect probe acks for the target on the same evidence. Why: on a starved machine
  a busy member's ack waits behind its other frames. At a 64-daemon join on two cores the seed's pings
  reached its SWIM handler 1 to 9 s after the newcomers wrote them (traced: Yamux took each frame in late,
  and the handler read it later still; the seed's timer loop was never more than 0.24 s late), nearly
  every newcomer suspected it, and in three failed probes of four the seed's connection had delivered
  other data during the probe. A crashed member sends nothing and a hung one nothing new: both are
  probed, and suspected, as before.
* **Slow answers are waited for as long as they take** (TCP's retransmission timer, RFC 6298). Every
  answer to a request of this node (an ack of its ping, a sync reply, "busy" included, and a late answer
  after the probe gave up) times the member that gave it, and the swarm as a whole; where the smoothed
  time plus four mean deviations, of that member's answers or of everyone's, passes the ack timeout, the
  next direct ping of the member waits that long (at most ``max_answer_wait_s``) before helpers are asked,
  and the final deadline moves with it. Why: at a 64-daemon join on two cores the members' answers took
  1.5 to 6 s for ten seconds (the bootstrap node's the longest), their connections silent meanwhile (so
  traffic was no evidence), and each run a prober suspected one of them; the claim reached every view. A
  joiner times its seed by the join's page request. Only slow members are held one by one (at most
  ``max_slow_members``): a member answering in time costs nothing. A request still unanswered counts
  too, as an answer of the time it has waited so far: a member that slows down has answered nothing
  late yet, and at that join a newcomer's ping of the bootstrap node failed while its page request of
  seconds before was still pending.
* **Dissemination.** Every state change (alive / suspect / dead claims) enters a bounded broadcast queue
  and rides on the probe traffic (pings, ping-reqs and acks) already being sent, the least transmitted
  first, each retransmitted ``retransmit_mult x ceil(log10(N + 1))`` times, at most ``max_updates`` updates
  and ``max_piggyback_bytes`` per message. A node that learns something new queues it in turn (infection
  style), so news reaches everyone in O(log N) periods while no message grows. The budget is fixed, so
  where churn is a share of N the news outgrows it at some N and each update is then sent fewer times:
  dissemination slows (and a few nodes miss an update) before any node's traffic grows. The defaults
  carry 10,000 members at 1% churn a minute (bench/scale_sim.py).
* **Progress** (outer step, loss, samples/s) is a small signed, versioned per-member payload on a second
  queue that fills only the room the membership news leaves in each message (at most ``progress_bytes``). A
  node republishes its own at most every ``progress_interval_s``. So a node's traffic is bounded per node,
  not per member: every message is about as full at 1,000 members as at 10,000; what N changes is how much
  of the others' progress each node holds and how old it is (bench/scale_sim.py measures both).
* **Joins** go through a seed: the joiner announces itself to the seed (whose ``Alive`` news spreads by
  gossip) and pulls the swarm's table in pages, by hash bucket of the peer names (:class:`Registry`), which
  every node computes alike: page k is asked of a random member already known, one page per
  ``join_page_s``, each at most ``join_page_entries`` entries (the first asks for the whole hash space, so a
  swarm of up to that many members comes in one page), the bucket span then adapted so that pages come
  about half full; a joiner answered "busy" asks again after exponentially longer waits (up to
  ``join_busy_max_s``). A full view costs the joiner O(N) once; each member serves at most ``sync_serve_per_s``
  pages a second (excess answered "busy", asked elsewhere) and, spread this way, a handful per join swarm-
  wide rather than the seed serving all N. Entries a sync hands over are applied but not gossiped on (the
  swarm knows them; a joiner re-sending its whole table would crowd out its own announcement). A member
  that missed a join's gossip learns of it when the joiner probes it: for its first ``join_announce_s`` a
  joiner's pings carry its own ``Alive`` (one claim of 107 bytes), and the member that learns of it so
  spreads the news again; later, only from a push-pull slice (slow at large N).
* **Push-pull** for convergence after partitions (what gossip alone cannot heal: each half has declared
  the other dead and no longer probes it). Every ``pushpull_s`` a node exchanges a *slice* of its table
  (``pushpull_entries`` entries from a cursor that walks its table) with one random member, in one try
  out of ``pushpull_dead_every`` with a member it holds dead (the other side of a partition). Both
  messages also carry the sender's view of the receiver, so a member wrongly held suspect or dead
  refutes it at once. Bounded slices (not memberlist's full-state push-pull, whose bytes per node grow
  with N even with its interval scaled by log N) keep each node's push-pull bytes per minute constant;
  the cost is that a full sweep of a table takes N / pushpull_entries exchanges, so a partition heals by
  refutation (fast) and gossip of what the slices find (slower as N grows), not in one exchange.

Everything a peer sends is hostile until bounded: updates past ``max_updates`` in a message are dropped;
the member table holds at most ``max_members`` (dead ones evicted first, else newcomers refused); an
incarnation may jump at most ``MAX_INCARNATION_JUMP`` past what is held; suspect and dead claims count
only when their accuser is a member (or, for a departure, the member itself) and are ignored about unknown
members; a sender that is not a member may only announce itself; a suspect or dead claim about ourselves
is refuted, never adopted. Signatures are the wire codec's (:mod:`protocols.swim`, where the messages are
defined): each claim is signed by its author (``Alive`` and ``Progress`` by the member, ``Suspect`` /
``Dead`` by the accuser), relays forward the author's signature, and ``protocols.swim.decode`` drops a claim
whose signature its ``verify`` refuses before it reaches this core; the sizes count the 64 signature bytes.

Memory: the simulation holds 10,000 nodes with a full view each in one process, so the table is columns
(``bytearray`` / ``array``) indexed by small ints that a :class:`Registry` assigns to peer names (the
simulation shares one registry across its nodes; a daemon holds its own and its codec maps names to ids),
and the probe order is an affine permutation of the id space redrawn each round (offset, stride) rather
than a materialised shuffled list: about 21 bytes per member held, and no Python object per member.

The core is plain synchronous code: no trio, no libp2p, no clock (``now`` is passed in), randomness from
an injected ``random.Random``. ``tick(now)`` and ``receive(now, message)`` return the messages to send as
``(destination id, message)`` pairs; ``next_wakeup()`` says when ``tick`` must run next.

Why one module, though long: probing, suspicion, dissemination, joins and push-pull are one state machine
over one member table, each reading and changing the same columns and queues; the wire messages live in
:mod:`protocols.swim` and the transport in the daemon, so what is here is that one job.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# The messages are the protocol layer's (protocols/swim.py, with their wire codec); re-exported here.
from protocols.swim import (
    MAX_UINT32,
    Ack,
    Alive,
    Dead,
    Message,
    Ping,
    PingReq,
    Progress,
    Suspect,
    SyncReply,
    SyncRequest,
    Update,
    message_size,
)

__all__ = [
    "ALIVE",
    "DEAD",
    "SUSPECT",
    "UNKNOWN",
    "Ack",
    "Alive",
    "Dead",
    "Membership",
    "MembershipConfig",
    "Message",
    "Ping",
    "PingReq",
    "Progress",
    "Registry",
    "Suspect",
    "SyncReply",
    "SyncRequest",
    "Update",
    "message_size",
]

UNKNOWN, ALIVE, SUSPECT, DEAD = 0, 1, 2, 3
STATE_NAMES = {UNKNOWN: "unknown", ALIVE: "alive", SUSPECT: "suspect", DEAD: "dead"}

#: Most an incarnation (or progress version) may run ahead of what this node holds: an honest member raises
#: its own by one per refutation; a claim far ahead is a replay from another life or a game, and adopting it
#: would let one sender burn the counter.
MAX_INCARNATION_JUMP = 1 << 16


#: The hash space joiners page through (see :class:`Registry`).
BUCKETS = 1 << 16

#: Requests remembered for timing their answers (see :meth:`Membership._sample`): a few seconds of a node's
#: pings, relayed pings and sync requests.
MAX_ASKED = 64


def bucket_of(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big")


class Registry:
    """Peer names interned to small ints, so that tables are columns and messages carry ints in-process.

    The simulation shares one registry across all its nodes (one copy of each name); a daemon holds its own,
    bounded by its member table, and its codec maps names on the wire to ids and back."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        #: Each peer's place in a hash space every node computes alike (``BUCKETS`` buckets of the sha256
        #: of its name): a joiner pages through the swarm's tables by it, asking a different member each page.
        self.buckets = array("H")

        self._free: list[int] = []  # ids released (:meth:`release`), reused before new ones

    def intern(self, name: str) -> int:
        pid = self._ids.get(name)
        if pid is None:
            if self._free:
                pid = self._ids[name] = self._free.pop()
                self._names[pid] = name
                self.buckets[pid] = bucket_of(name)
            else:
                pid = self._ids[name] = len(self._names)
                self._names.append(name)
                self.buckets.append(bucket_of(name))
        return pid

    def release(self, pid: int) -> None:
        """Forget the name of ``pid`` and reuse the id for the next new name (a daemon's registry, whose
        dead members are forgotten: the core must have forgotten ``pid`` first, :meth:`Membership.forget`)."""
        name = self._names[pid]
        if self._ids.get(name) == pid:
            del self._ids[name]
            self._names[pid] = ""
            self._free.append(pid)

    def name(self, pid: int) -> str:
        return self._names[pid]

    def __len__(self) -> int:
        """Names held now (released ids not counted)."""
        return len(self._ids)



# ------------------------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class MembershipConfig:
    period_s: float = 1.0  # one probe per period
    ack_timeout_s: float = 0.5  # a direct ack later than this: ask others (WAN round trips reach 400 ms)
    probe_timeout_s: float = 2.0  # no ack, direct or indirect, by then: suspect
    probe_spacing_s: float = 4.0  # a member probed less than this long ago is passed over (see the docstring)
    lookup_suspect_after_s: float = 5.0  # a member suspect this long may be looked up (see look_up)
    lonely_misses: int = 3  # failed probes in a row with no helper to ask before a suspicion (see the docstring)
    indirect_k: int = 3  # members asked to probe for us
    suspicion_mult: int = 4  # minimum suspicion timeout = mult x max(1, log10 N) x period_s
    suspicion_max_mult: int = 6  # the timeout starts at this times the minimum
    retransmit_mult: int = 4  # each update is sent mult x ceil(log10(N + 1)) times by each node
    max_updates: int = 16  # updates piggy-backed on one message (sent and accepted)
    max_piggyback_bytes: int = 2048  # bytes of updates piggy-backed on one message
    progress_bytes: int = 2048  # of those, at most this much progress (it fills what membership news leaves)
    progress_interval_s: float = 30.0  # this node republishes its progress at most this often
    max_queue: int = 1024  # membership updates waiting to be (re)sent; the most sent are dropped first
    max_progress_queue: int = 256  # progress updates waiting to be (re)sent
    max_members: int = 16384  # the member table, dead members included
    dead_retention_s: float = 600.0  # a dead member is remembered this long (stale alive claims stay out)
    pushpull_s: float = 30.0  # one push-pull exchange per this many seconds
    pushpull_entries: int = 32  # table entries in one push-pull message
    pushpull_dead_every: int = 4  # one push-pull out of this many goes to a member held dead, if any
    join_page_entries: int = 256  # table entries per page of a joiner's sync
    join_page_s: float = 0.5  # one page request per this many seconds while joining
    # Hash buckets a joiner's first page request covers (then adapted): the whole space, since the server
    # cuts a page at ``join_page_entries`` anyway. Starting at 1/64 of it, a joiner of a 64-member swarm asked
    # ~7 pages of its seed (the span doubling from nearly empty pages), and in a daemon, where a joiner
    # connected to its seed alone can ask nobody else, 63 joiners at once waited on the seed's
    # ``sync_serve_per_s`` for minutes (docs/benchmarks.md, "SWIM in the daemon").
    join_span: int = BUCKETS
    join_busy_max_s: float = 8.0  # a joiner answered "busy" asks again after up to this long (see _receive_sync)
    join_announce_s: float = 120.0  # a joiner's probes carry its own Alive this long after joining
    sync_timeout_s: float = 3.0  # a sync request unanswered this long is sent again (joining)
    sync_serve_per_s: float = 4.0  # pages this node serves per second at most (token bucket)
    max_relays: int = 32  # indirect probes this node runs for others at once
    max_local_health: int = 8  # Lifeguard's local health score caps here: timeouts and period x (1 + score)
    max_answer_wait_s: float = 8.0  # a slow member's direct ack is waited for at most this long (see _sample)
    max_slow_members: int = 256  # members whose answer times this node keeps (only slow ones are kept)


def _smoothed(est: tuple[float, float] | None, took: float) -> tuple[float, float]:
    """RFC 6298's estimator: (smoothed time, mean deviation) after one more sample ``took`` (the first sets
    the time, and half of it the deviation; then gains 1/8 and 1/4)."""
    if est is None:
        return took, took / 2
    srtt, var = est
    return 0.875 * srtt + 0.125 * took, 0.75 * var + 0.25 * abs(srtt - took)


@dataclass(slots=True)
class _Probe:
    target: int
    deadline_direct: float
    deadline: float
    indirect: bool = False
    direct: bool = True  # the direct ping could go (the target is one this node may send to)
    helpers: int = 0  # indirect probes sent
    sent: float = 0.0  # when the direct ping went (evidence of life since then counts: see heard_since)
    stretch: float = 0.0  # how much longer than the ack timeout the direct ack is waited for (see _answer_wait)


@dataclass(slots=True)
class _Relay:
    """An indirect probe this node runs for another member (a ``PingReq``)."""
    requester: int
    seq: int  # the requester's
    target: int
    sent: float  # when our ping of the target went
    deadline: float
    check_at: float  # when to look next for other traffic from the target (see heard_since)


@dataclass(slots=True)
class _Suspicion:
    incarnation: int
    start: float
    deadline: float
    accusers: set[int] = field(default_factory=set)


_SMALLEST = Alive.size


class _Queue:
    """A transmit-limited broadcast queue (memberlist's TransmitLimitedQueue, in tiers of transmit count):
    one entry per member (a newer claim replaces an older one), least transmitted first, newest first
    within a tier; the most transmitted entries are dropped first when it is full."""

    __slots__ = ("tiers", "where", "cap")

    def __init__(self, cap: int) -> None:
        self.tiers: list[dict[int, Update]] = [{}]
        self.where: dict[int, int] = {}  # member -> tier
        self.cap = cap

    def __len__(self) -> int:
        return len(self.where)

    def put(self, update: Update) -> None:
        member = update.member
        tier = self.where.pop(member, None)
        if tier is not None:
            del self.tiers[tier][member]
        self.tiers[0][member] = update
        self.where[member] = 0
        while len(self.where) > self.cap:
            for t in range(len(self.tiers) - 1, -1, -1):
                if self.tiers[t]:
                    dropped, _ = self.tiers[t].popitem()
                    del self.where[dropped]
                    break

    def take(self, limit: int, max_count: int, max_bytes: int) -> list[Update]:
        """Up to ``max_count`` updates of at most ``max_bytes`` together; each taken is sent once more, and
        dropped after its ``limit``-th transmission. Scans a few entries past what fits, no more: the cost
        per message stays constant however long the queue."""
        out: list[Update] = []
        where = self.where
        if not where:
            return out
        used = taken = 0
        moved: list[tuple[int, Update]] = []  # reinserted after the walk, so none is taken twice
        tiers = self.tiers
        for t, tier in enumerate(tiers):
            if not tier:
                continue
            picked: list[int] = []
            misses = 0
            for member, update in reversed(tier.items()):
                size = update.size
                if used + size > max_bytes:
                    misses += 1
                    if misses > 4:
                        break
                    continue
                used += size
                out.append(update)
                picked.append(member)
                taken += 1
                if taken >= max_count:
                    break
            nxt = t + 1
            for member in picked:
                update = tier.pop(member)
                if nxt < limit:
                    moved.append((nxt, update))
                    where[member] = nxt
                else:
                    del where[member]
            if taken >= max_count or max_bytes - used < _SMALLEST:
                break
        for nxt, update in moved:
            if len(tiers) <= nxt:
                tiers.append({})
            tiers[nxt][update.member] = update
        return out

    def drop(self, member: int) -> None:
        tier = self.where.pop(member, None)
        if tier is not None:
            del self.tiers[tier][member]


Sends = list[tuple[int, Message]]
ChangeHook = Callable[[int, int, int, float], None]  # (member, old state, new state, now)


class Membership:
    """One node's SWIM membership: its member table, probes, suspicions and broadcast queues."""

    def __init__(self, me: int, now: float, rng: random.Random, config: MembershipConfig | None = None,
                 on_change: ChangeHook | None = None, registry: Registry | None = None) -> None:
        self.me = me
        self._buckets = registry.buckets if registry is not None else None
        self.config = config or MembershipConfig()
        self.rng = rng
        self.on_change = on_change
        self.incarnation = 0
        self.counters: Counter[str] = Counter()
        #: Lifeguard's local health multiplier (memberlist's "awareness"): 0 when this node is healthy, raised
        #: when its own event loop runs late (:meth:`note_lag`) or it had to refute a suspicion of itself,
        #: lowered by each ack it gets. Probe timeouts and the probe period are stretched by (1 + it): a node
        #: that cannot answer in time is the likeliest not to hear answers in time either.
        self.local_health = 0
        # The table, as columns indexed by member id (grown on demand).
        self._state = bytearray()
        self._inc = array("I")
        self._pver = array("I")
        self._pstep = array("I")
        self._ploss = array("f")
        self._psps = array("f")
        self._probed = array("d")  # when this node last started a probe of each member
        self._live = 0  # alive + suspect, me excluded
        self._held = 0  # any state but UNKNOWN, me excluded
        self._dead_t = array("d")  # when members died, in order (for retention), with _dead_id, from _dead_head
        self._dead_id = array("I")
        self._dead_head = 0
        self._suspicions: dict[int, _Suspicion] = {}
        self._probes: dict[int, _Probe] = {}
        self._relays: dict[int, _Relay] = {}  # our seq -> the indirect probe we run for another member
        #: Our requests that the member asked answers itself (pings, sync requests), by seq: (member, when sent),
        #: the latest ``MAX_ASKED``; kept after a probe ends, so that a late answer still times the member.
        self._asked: dict[int, tuple[int, float]] = {}
        #: Members whose answers came slowly: (smoothed answer time, its mean deviation), at most
        #: ``max_slow_members``; a member answering within the ack timeout is not kept (see :meth:`_sample`).
        self._slow: dict[int, tuple[float, float]] = {}
        #: The same estimate over every answer from any member: how slowly the swarm answers this node now.
        self._overall: tuple[float, float] | None = None
        self._seq = 0
        self._queue = _Queue(self.config.max_queue)
        self._progress_queue = _Queue(self.config.max_progress_queue)
        # Probe order: an affine permutation (offset + i * stride) mod size of the id space, redrawn each round.
        self._round_size = 0
        self._round_pos = 0
        self._round_offset = 0
        self._round_stride = 1
        self._next_probe = now + rng.random() * self.config.period_s
        self._next_pushpull = now + rng.random() * self.config.pushpull_s
        self._pushpulls = 0
        self._pp_cursor = 0
        # Joining: who serves the page asked for, the hash-space cursor and span, when to ask (again).
        self._join_server: int | None = None
        self._join_cursor = 0
        self._join_span = self.config.join_span
        self._join_next = math.inf
        self._join_seq = -1
        self._join_busy = 0  # "busy" answers in a row to this joiner's page requests
        self._catching_up = False  # the page pull under way is a catch-up (see catch_up), not the join
        self._sync_tokens = self.config.sync_serve_per_s
        self._sync_tokens_t = now
        self._my_progress: Progress | None = None
        self._progress_due = now
        self._progress_pending: tuple[int, float, float] | None = None
        self._left = False
        self._announce_until = -math.inf  # a joiner's probes carry its own Alive until then
        #: Members held without news of them going out (``preload`` one by one, a join's seed): the first
        #: ``Alive`` claim about one is gossiped even if it says nothing new here. A daemon holds a peer as soon
        #: as it connects; without this, its announcement arriving after that was old news, and members not
        #: connected to it never heard of it (before a push-pull slice came by).
        self._silent: set[int] = set()
        #: Members whose last probe was no evidence (nobody could carry it), probed again by :meth:`recheck`.
        self._unverified: set[int] = set()
        #: Members whose last probes failed with no helper to ask, and how many in a row (see :meth:`tick`).
        self._lonely: dict[int, int] = {}
        #: Which members this node may send to directly (None: all). A daemon sets it to "connected to me"
        #: (node/swarm/swim_service.py): probes, helpers of indirect probes and push-pull partners are then
        #: drawn among connected members only, since a message to anyone else would cost a new connection.
        self.can_probe: Callable[[int], bool] | None = None
        #: Called when a probe ends with no ack: (target, whether the direct ping could go, helpers asked, now).
        self.on_probe_failed: Callable[[int, bool, int, float], None] | None = None
        #: Whether anything arrived from a member since a time (None: nothing but SWIM's own acks counts). A
        #: daemon says whether any of its connections with the member delivered data since then, on any
        #: protocol (see :meth:`tick`).
        self.heard_since: Callable[[int, float], bool] | None = None
        self._grow(me)
        self._set(me, ALIVE, 0, now)
        self._queue.put(Alive(me, 0))

    # ------------------------------------------------------------------------------------------ the table

    def _grow(self, pid: int) -> None:
        if pid < len(self._state):
            return
        extra = max(pid + 1 - len(self._state), min(len(self._state) // 4, 1024), 16)
        self._state.extend(bytes(extra))
        zeros = bytes(4 * extra)
        self._inc.frombytes(zeros)
        self._pver.frombytes(zeros)
        self._pstep.frombytes(zeros)
        self._ploss.frombytes(zeros)
        self._psps.frombytes(zeros)
        self._probed.extend([-math.inf] * extra)

    def _set(self, pid: int, state: int, inc: int, now: float) -> None:
        old = self._state[pid]
        self._silent.discard(pid)  # (preload and join add it again after this)
        if pid != self.me:
            self._live += (state in (ALIVE, SUSPECT)) - (old in (ALIVE, SUSPECT))
            self._held += (state != UNKNOWN) - (old != UNKNOWN)
        self._state[pid] = state
        self._inc[pid] = inc
        if state == DEAD and old != DEAD:
            self._dead_t.append(now)
            self._dead_id.append(pid)
        if state != SUSPECT:
            self._suspicions.pop(pid, None)
        if old != state and self.on_change is not None:
            self.on_change(pid, old, state, now)

    def preload(self, members: Iterable[int], now: float) -> None:
        """Hold ``members`` alive at incarnation 0 without announcing them (a simulation's converged start).
        ``range(0, n)`` takes a fast path: columns filled in bulk, no per-member work."""
        if isinstance(members, range) and members.start == 0 and members.step == 1:
            n = members.stop
            self._grow(n - 1)
            self._state[:n] = bytes([ALIVE]) * n
            self._live = self._held = n - (1 if self.me < n else 0)
            return
        for pid in members:
            if pid != self.me:
                self._grow(pid)
                if self._state[pid] == UNKNOWN:
                    self._set(pid, ALIVE, 0, now)
                    self._silent.add(pid)

    def forget(self, pid: int) -> bool:
        """Drop every trace of ``pid``, which this node holds as unknown (never heard of, or dead and reaped
        after ``dead_retention_s``), so that its id may name another peer (a daemon's registry is bounded:
        node/swarm/swim_service.py). False, and nothing done, for a member held in any other state."""
        if pid == self.me or pid >= len(self._state) or self._state[pid] != UNKNOWN:
            return False
        self._inc[pid] = self._pver[pid] = self._pstep[pid] = 0
        self._ploss[pid] = self._psps[pid] = 0.0
        self._queue.drop(pid)
        self._progress_queue.drop(pid)
        self._silent.discard(pid)
        self._unverified.discard(pid)
        self._lonely.pop(pid, None)
        self._slow.pop(pid, None)
        for seq in [seq for seq, (member, _) in self._asked.items() if member == pid]:
            del self._asked[seq]
        self._probed[pid] = -math.inf
        self._suspicions.pop(pid, None)
        for seq in [seq for seq, p in self._probes.items() if p.target == pid]:
            del self._probes[seq]
        return True

    def forget_oldest_dead(self, now: float) -> bool:
        """Treat the member dead longest as reaped now (before ``dead_retention_s``): room for a newcomer."""
        return self._evict_one_dead(now)

    def queued_news(self) -> int:
        """How many updates wait in the broadcast queue (each still to ride on some messages)."""
        return len(self._queue)

    def suspected_for(self, member: int, now: float) -> float | None:
        """How long ``member`` has been suspect here (None when it is not)."""
        s = self._suspicions.get(member)
        return None if s is None else now - s.start

    def suspicion(self, member: int) -> tuple[float, int] | None:
        """The running suspicion of `member`: (when it turns into death, how many members accused it), or
        None when it is not suspect."""
        s = self._suspicions.get(member)
        return None if s is None else (s.deadline, len(s.accusers))

    def state_of(self, pid: int) -> int:
        return self._state[pid] if pid < len(self._state) else UNKNOWN

    def incarnation_of(self, pid: int) -> int:
        return self._inc[pid] if pid < len(self._state) else 0

    def members(self) -> list[int]:
        """Members this node holds alive or suspect (SWIM: a suspect is still a member), itself included."""
        if self._left:
            return []
        state = self._state
        out = [i for i in range(len(state)) if state[i] == ALIVE or state[i] == SUSPECT]
        return out

    def progress_of(self, pid: int) -> Progress | None:
        if pid >= len(self._state) or self._pver[pid] == 0:
            return None
        return Progress(pid, self._pver[pid], self._pstep[pid], self._ploss[pid], self._psps[pid])

    @property
    def slow_members(self) -> int:
        """Members held slow: their answers' estimate stretches the wait for their acks (see :meth:`_answer_wait`)."""
        return len(self._slow)

    def answer_wait(self) -> float:
        """How long a direct ping of a member never timed would wait now: 0 where the configured ack timeout
        holds, else what every member's answers took lately (see :meth:`_answer_wait`), for status."""
        return self._wait_by(self._overall)

    @property
    def size(self) -> int:
        """Members held (alive, suspect or dead), this node included."""
        return self._held + 1

    @property
    def live_count(self) -> int:
        return self._live + 1

    def _retransmit_limit(self) -> int:
        return self.config.retransmit_mult * max(1, math.ceil(math.log10(self._live + 2)))

    def _suspicion_bounds(self) -> tuple[float, float, int]:
        n = self._live + 1
        lo = self.config.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.config.period_s
        k = self.config.suspicion_mult - 2
        if n - 2 < k:
            k = 0
        return lo, lo * self.config.suspicion_max_mult, k

    def _suspicion_deadline(self, s: _Suspicion) -> float:
        lo, hi, k = self._suspicion_bounds()
        confirmations = len(s.accusers) - 1
        if k <= 0:
            return s.start + lo
        frac = math.log(confirmations + 1) / math.log(k + 1)
        return s.start + max(lo, hi - frac * (hi - lo))

    # ------------------------------------------------------------------------------------ local actions

    def set_progress(self, outer_step: int, loss: float, samples_per_s: float, now: float) -> None:
        """This node's progress; published now if ``progress_interval_s`` has passed since the last, else at
        the next tick after it (the newest values then)."""
        self._progress_pending = (outer_step, loss, samples_per_s)
        if now >= self._progress_due:
            self._publish_progress(now)

    def _publish_progress(self, now: float) -> None:
        if self._progress_pending is None:
            return
        step, loss, sps = self._progress_pending
        self._progress_pending = None
        version = (self._my_progress.version if self._my_progress else 0) + 1
        self._my_progress = Progress(self.me, version, min(max(step, 0), MAX_UINT32), loss, sps)
        self._store_progress(self._my_progress)
        self._progress_queue.put(self._my_progress)
        self._progress_due = now + self.config.progress_interval_s

    def join(self, seed: int, now: float) -> Sends:
        """Join through ``seed``: announce ourselves to it and pull its table, page by page."""
        if seed == self.me:
            return []
        self._grow(seed)
        if self._state[seed] == UNKNOWN:
            self._set(seed, ALIVE, 0, now)
            self._silent.add(seed)
        self._join_server, self._join_cursor = seed, 0
        self._announce_until = now + self.config.join_announce_s
        return self._join_request(now, seed)

    @property
    def pulling(self) -> bool:
        """Whether a pull of the table is under way (a join's, or a catch-up's: see :meth:`catch_up`)."""
        return self._join_server is not None

    def catch_up(self, now: float) -> Sends:
        """Pull the swarm's table again, page by page as a joiner does, starting at a random member this node
        may send to; nothing while a pull is under way (or none can be asked).

        Why: a joiner's first page is its seed's table at that moment. At a 64-daemon join a seed answered
        while it held half the swarm; the joiner, done, learnt the other half from gossip and look-ups, a
        few members every 5 s: 28 members unknown to it 17 s after the last start, 5 still at 27 s, while
        every other view held them
        (a daemon asks for this when its swarm state holds more members SWIM never heard of than its
        look-ups cover: node/swarm/swim_service.py). One page from a member that has caught up costs its
        server one ``sync_serve_per_s`` token, as a look-up does."""
        if self._left or self._join_server is not None:
            return []
        picked = self._random_members(1, set())
        if not picked:
            return []
        self._join_cursor, self._join_span, self._join_busy = 0, self.config.join_span, 0
        self._catching_up = True
        self.counters["catch_ups"] += 1
        return self._join_request(now, picked[0])

    def _join_request(self, now: float, server: int | None = None) -> Sends:
        """Ask for the next page of the swarm's table: the seed first, then a random member each page (so
        that no member serves a joiner's whole O(N) view), resent to another one if unanswered."""
        if server is None:
            picked = self._random_members(1, set())
            server = picked[0] if picked else self._join_server
        if server is None:
            return []
        self._join_server = server
        self._seq += 1
        self._join_seq = self._seq
        self._join_next = now + self.config.sync_timeout_s  # resent if unanswered
        self.counters["join_pages_asked"] += 1
        until = min(self._join_cursor + self._join_span, BUCKETS)
        self._ask(self._seq, server, now)
        return [(server, SyncRequest(self.me, self._seq, self._join_cursor, (Alive(self.me, self.incarnation),),
                                     until=until))]

    def leave(self, now: float) -> None:
        """A graceful departure: our own dead claim goes out on the next messages; we probe no more."""
        self._queue.put(Dead(self.me, self.incarnation, self.me))
        self._left = True

    # ----------------------------------------------------------------------------------------- timers

    def next_wakeup(self) -> float:
        t = min(self._next_probe, self._next_pushpull, self._join_next)
        for p in self._probes.values():
            t = min(t, p.deadline if p.indirect else p.deadline_direct)
        for s in self._suspicions.values():
            t = min(t, s.deadline)
        for r in self._relays.values():
            t = min(t, r.deadline, r.check_at)
        if self._progress_pending is not None:
            t = min(t, self._progress_due)
        return t

    def tick(self, now: float) -> Sends:
        out: Sends = []
        if self._left:
            return out
        # Probes: the direct deadline passed -> indirect; the final one -> suspect.
        ok = self.can_probe
        heard = self.heard_since
        for seq, p in list(self._probes.items()):
            if p.direct and ok is not None and not ok(p.target):
                p.direct = False  # its connection dropped meanwhile: the ping may never have arrived
                if not p.indirect:  # so its ack is not waited for longer: the helpers are asked now (their
                    p.deadline_direct -= p.stretch  # acks still take as long as the member's answers do)
            if (now >= p.deadline_direct or now >= p.deadline) and heard is not None and heard(p.target, p.sent):
                # No ack in time, but the member sent this node something else since the ping went: its
                # process runs, and its answers wait behind its other traffic (see the module docstring).
                del self._probes[seq]
                self.counters["alive_by_traffic"] += 1
                self._lonely.pop(p.target, None)
                continue
            if not p.indirect and now >= p.deadline_direct:
                p.indirect = True
                out.extend(self._indirect(seq, p))
            if p.indirect and now >= p.deadline:
                del self._probes[seq]
                if self.on_probe_failed is not None:
                    self.on_probe_failed(p.target, p.direct, p.helpers, now)
                if not p.direct and p.helpers == 0:
                    # Nobody was asked: the ping could not go (no connection to it) and no member could be
                    # asked to try. Silence that nobody could have broken says nothing about the member; it
                    # is probed again once this node has a member to ask (:meth:`recheck`).
                    self.counters["no_evidence"] += 1
                    self._unverified.add(p.target)
                    continue
                if p.helpers == 0:
                    # Only our own ping went, and nobody could tell us whether it or we failed (memberlist's
                    # rule where no helper can nack: any failed probe counts against this node's health).
                    # A joiner connected to an overloaded seed alone otherwise suspected it every 2 s.
                    self.local_health = min(self.config.max_local_health, self.local_health + 1)
                    # And one such miss is no suspicion yet: ``lonely_misses`` in a row, with nothing heard
                    # from the member between them, are (see the module docstring).
                    misses = self._lonely.get(p.target, 0) + 1
                    if misses < self.config.lonely_misses:
                        self._lonely[p.target] = misses
                        self.counters["lonely_misses"] += 1
                        continue
                self._lonely.pop(p.target, None)
                self._suspect(p.target, now)
        for seq, r in list(self._relays.items()):
            if now >= r.check_at and heard is not None and heard(r.target, r.sent):
                # The same evidence for a member that asked us: the target lives, its ack is only late.
                del self._relays[seq]
                self.counters["relayed_alive_by_traffic"] += 1
                out.append((r.requester, Ack(self.me, r.seq, self._piggyback())))
            elif now >= r.deadline:
                del self._relays[seq]
            elif now >= r.check_at:
                r.check_at = now + self.config.ack_timeout_s / 2
        for pid, s in list(self._suspicions.items()):
            if now >= s.deadline:
                self.counters["declared_dead"] += 1
                self._set(pid, DEAD, s.incarnation, now)
                self._queue.put(Dead(pid, s.incarnation, self.me))
        self._reap(now)
        if self._progress_pending is not None and now >= self._progress_due:
            self._publish_progress(now)
        if now >= self._join_next and self._join_server is not None:
            out.extend(self._join_request(now))
        if now >= self._next_probe:
            self._next_probe = max(self._next_probe + (1 + self.local_health) * self.config.period_s, now)
            target = self._next_target(now)
            if target is not None:
                out.extend(self._start_probe(target, now))
        if now >= self._next_pushpull:
            self._next_pushpull = now + self.config.pushpull_s
            out.extend(self._pushpull(now))
        return out

    def probe_target(self, seq: int) -> int | None:
        """The member this node's running probe ``seq`` is of (None: no such probe, or it ended)."""
        p = self._probes.get(seq)
        return None if p is None else p.target

    def abandon(self, pid: int) -> None:
        """Drop the running probes of ``pid``: whatever they find is no evidence (a daemon closed the
        connection to it itself, for its connection cap; the ping or its ack may have been cut)."""
        for seq in [seq for seq, p in self._probes.items() if p.target == pid]:
            del self._probes[seq]
            self.counters["probes_abandoned"] += 1

    def recheck(self, now: float) -> Sends:
        """Probe again the members whose last probe nobody could carry (see :meth:`tick`); a daemon calls it
        when a connection appears, which may give it a member to ask."""
        out: Sends = []
        unverified, self._unverified = self._unverified, set()
        for pid in unverified:
            out.extend(self.probe(pid, now))
        return out

    def look_up(self, pids: Iterable[int], now: float) -> Sends:
        """Ask members this node may send to about members it has never heard of or holds dead: for each, one
        page request of that member's hash bucket alone, to a random member (answered as a joiner's page is,
        within the server's ``sync_serve_per_s``; the reply's entries are applied like any page's). A request
        about a member held dead carries this node's claim of its death, which the server takes as gossip.

        Why: a member hears of a joiner, and of a refutation, by gossip whose retransmissions are limited. At
        a 64-daemon join on a starved machine one that missed a joiner held it unknown, and one that declared
        a member dead and missed its refutation held it dead, until a push-pull slice happened to carry it, a
        minute and more, although a daemon knew the member from its signed record in the swarm state (which
        names the members to look up here). The reply brings the member's newer incarnation where the server
        holds one; where it holds the same, our death claim reaches the server and spreads from there, until
        the member hears it and refutes (SWIM's own way). A bucket holds about N / 65,536 members: the reply
        is one entry or a few. Members held alive, and this node, are skipped.

        A member held suspect for ``lookup_suspect_after_s`` is asked about too, with no claim carried: at a
        64-daemon join single views held a member suspect for 30 s (then dead) after every other view had its
        refutation, which the gossip's limited retransmissions never brought them. The reply's newer
        incarnation ends the suspicion; where the server holds none, the suspicion runs its course."""
        out: Sends = []
        if self._left:
            return out
        for pid in pids:
            state = self.state_of(pid)
            if pid == self.me or state not in (UNKNOWN, DEAD, SUSPECT):
                continue
            if state == SUSPECT and (self.suspected_for(pid, now) or 0.0) < self.config.lookup_suspect_after_s:
                continue
            server = self._random_members(1, set())  # (pid itself is not alive: never drawn)
            if not server:
                break
            self._seq += 1
            self.counters["lookups"] += 1
            self._ask(self._seq, server[0], now)
            bucket = self._bucket(pid)
            ours = self._entry(pid) if state != SUSPECT else None
            out.append((server[0], SyncRequest(self.me, self._seq, bucket, (ours,) if ours is not None else (),
                                               until=bucket + 1)))
        return out

    def note_lag(self, lag_s: float, now: float) -> None:
        """This node's own event loop ran ``lag_s`` late (a daemon measures it where its timers wake).

        Why: on a starved machine an ack may sit unread in this node's socket while the timer that declares
        the probe failed runs first; the time this node could not listen is not the member's silence. So
        every running probe and suspicion gets that time back, and a lag of half an ack timeout or more
        raises the local health score (Lifeguard), which stretches the timeouts of the probes to come."""
        if lag_s <= 0:
            return
        for p in self._probes.values():
            p.deadline_direct += lag_s
            p.deadline += lag_s
        for s in self._suspicions.values():
            s.start += lag_s
            s.deadline += lag_s
        if lag_s >= self.config.ack_timeout_s / 2:
            self.counters["late_loop"] += 1
            self.local_health = min(self.config.max_local_health, self.local_health + 1)

    def probe(self, pid: int, now: float) -> Sends:
        """Probe ``pid`` now, outside the round-robin (a daemon does when its connection to a member drops:
        with probes among connected members only, nobody would otherwise probe a member that died and
        took its connections with it). Nothing if it is not a member or a probe of it is under way."""
        if self._left or pid == self.me or self.state_of(pid) not in (ALIVE, SUSPECT):
            return []
        if any(p.target == pid for p in self._probes.values()):
            return []
        return self._start_probe(pid, now)

    def _start_probe(self, target: int, now: float) -> Sends:
        self._seq += 1
        self.counters["probes"] += 1
        self._probed[target] = now
        ok = self.can_probe
        c = self.config
        scale = 1 + self.local_health
        can = ok is None or ok(target)
        # A slow member's direct ack is waited for longer (see _answer_wait). Where the ping cannot go, the
        # helpers are asked at once, as for any member, but their acks are waited for that much longer: they
        # relay the slow member's own answers to their pings.
        wait = max(0.0, self._answer_wait(target, now) - scale * c.ack_timeout_s)
        if wait:
            self.counters["waits_stretched"] += 1  # (only where the estimate outlasts local health's stretch)
        stretch = wait if can else 0.0
        direct = scale * c.ack_timeout_s + stretch
        self._probes[self._seq] = _Probe(target, now + direct,
                                         now + scale * c.probe_timeout_s + wait,
                                         direct=can, sent=now, stretch=stretch)
        if can:  # (a ping that cannot go is no request the member could answer: see _pending_since)
            self._ask(self._seq, target, now)
        updates = self._piggyback()
        if now < self._announce_until and not any(u.member == self.me for u in updates):
            # A joiner introduces itself to every member it probes at first: whoever its gossip
            # missed learns of it from the probe, and spreads the news again.
            updates = (Alive(self.me, self.incarnation), *updates[:self.config.max_updates - 1])
        return [(target, Ping(self.me, self._seq, target, updates))]

    # ------------------------------------------------------------------------------ answer times

    def _ask(self, seq: int, member: int, now: float) -> None:
        """Remember that request ``seq`` to ``member`` went now (the latest ``MAX_ASKED`` are kept)."""
        self._asked[seq] = (member, now)
        if len(self._asked) > MAX_ASKED:
            del self._asked[next(iter(self._asked))]  # the oldest (seqs are asked in order)

    def _answered(self, seq: int, sender: int, now: float) -> None:
        """``sender`` answered our request ``seq`` (in time or not): time it."""
        asked = self._asked.get(seq)
        if asked is not None and asked[0] == sender:
            del self._asked[seq]
            self._sample(sender, now - asked[1])
            # A member answers our requests in the order they reached it (one stream), so its requests asked
            # before this one and still unanswered were lost (a dropped connection took them): no longer
            # pending (see _pending_since).
            for older in [q for q, (member, sent) in self._asked.items() if member == sender and sent <= asked[1]]:
                del self._asked[older]

    def _sample(self, pid: int, took: float) -> None:
        """One answer of ``pid`` took ``took`` seconds: update its estimate, TCP's retransmission timer's
        (RFC 6298: a smoothed time and its mean deviation, gains 1/8 and 1/4; the first sample sets the time,
        and half of it the deviation), and the estimate over every member's answers. A member is held one by
        one only from an answer past the ack timeout, and dropped once its estimate is within it (no longer
        wait needed); where ``max_slow_members`` are held, the one timed longest ago goes."""
        c = self.config
        self._overall = _smoothed(self._overall, took)
        est = self._slow.pop(pid, None)
        if est is None and took <= c.ack_timeout_s:
            return  # (in time: not held, so a WAN's round trips cost nothing, the simulation's 10,000 views included)
        srtt, var = _smoothed(est, took)
        if srtt + 4 * var <= c.ack_timeout_s:
            return
        self._slow[pid] = (srtt, var)  # (re)inserted last: the dict's order is the order of the latest samples
        if len(self._slow) > c.max_slow_members:
            del self._slow[next(iter(self._slow))]
            self.counters["slow_members_forgotten"] += 1

    def _answer_wait(self, pid: int, now: float | None = None) -> float:
        """How long a direct ping of ``pid`` may wait for its ack by what answers took so far: the smoothed
        answer time plus four mean deviations, of ``pid``'s answers where it is held slow, and of every
        member's (the larger), at most ``max_answer_wait_s``; 0 where that is within the ack timeout (the
        configured timeouts hold).

        Why: on a starved machine a busy member answers, late. At a 64-daemon join on two cores the bootstrap
        node's acks took 1.5 to 3.3 s for 10 s (the probe gives up at 2 s), and a prober that had timed it so
        still suspected it at its next probe, and the suspicion spread to every view. A member held slow
        costs its death being found later by the difference (at most ``max_answer_wait_s`` plus the
        indirect stage), by probers that timed it slow, and the estimate follows its answers back down once
        they are quick.

        Every member's answers too: in that join every member's answers came late (a tenth of them past 3 to
        6 s), and a prober's first ping of a member, which it had never timed, was suspected as often as
        the bootstrap node. A machine that answers slowly stretches its probes of everyone until its
        answers are quick again, as Lifeguard's local health does for a node that fails to hear in time. A
        hostile member answering late can so delay the detection of others' deaths by this node, by at
        most ``max_answer_wait_s``, and only while its late answers outweigh the others' quick ones.

        And a request still unanswered (at ``now``; see :meth:`_pending_since`): it has waited that long
        already, so the member's answers take at least that long now, which no answer can say before it
        comes. It counts as a first answer of that time would (RFC 6298: the time plus twice it as
        deviation). Why: at a 64-daemon join the bootstrap node slowed down as the newcomers came; a newcomer
        pinged it with a 2 s wait, its estimate quick from an earlier answer, while its page request of 5 s
        before was still unanswered. Every such page and ack came, 4 to 8 s after it went."""
        since = self._pending_since(pid, now) if now is not None else None
        waited = (now - since, (now - since) / 2) if now is not None and since is not None else None
        return self._wait_by(self._slow.get(pid), self._overall, waited)

    def _pending_since(self, pid: int, now: float) -> float | None:
        """When the oldest request of ours that ``pid`` has not answered yet went, or None. Requests are
        remembered only while ``MAX_ASKED`` newer ones have not pushed them out, those asked before one the
        member answered since are forgotten (it answers in order: they were lost), and one older than
        ``max_answer_wait_s + probe_timeout_s`` is taken for lost, not slow: a dead member's last requests
        stretch its probes by at most ``max_answer_wait_s``, for that long."""
        horizon = now - self.config.max_answer_wait_s - self.config.probe_timeout_s
        return min((sent for member, sent in self._asked.values() if member == pid and sent >= horizon), default=None)

    def _wait_by(self, *estimates: tuple[float, float] | None) -> float:
        """The largest smoothed time plus four deviations of ``estimates``, at most ``max_answer_wait_s``; 0
        where that is within the ack timeout."""
        wait = max((srtt + 4 * var for srtt, var in filter(None, estimates)), default=0.0)
        return 0.0 if wait <= self.config.ack_timeout_s else min(self.config.max_answer_wait_s, wait)

    def _next_target(self, now: float) -> int | None:
        state, size = self._state, len(self._state)
        ok = self.can_probe
        recent = now - self.config.probe_spacing_s
        for _ in range(2):  # the rest of this round, then one fresh round
            while self._round_pos < self._round_size:
                pid = (self._round_offset + self._round_pos * self._round_stride) % self._round_size
                self._round_pos += 1
                if pid != self.me and pid < size and (state[pid] == ALIVE or state[pid] == SUSPECT) and (
                        ok is None or ok(pid)) and self._probed[pid] <= recent:
                    return pid
            self._new_round()
        return None

    def _new_round(self) -> None:
        size = len(self._state)
        self._round_size, self._round_pos = size, 0
        self._round_offset = self.rng.randrange(size)
        stride = self.rng.randrange(1, size) if size > 1 else 1
        while math.gcd(stride, size) != 1:
            stride += 1
        self._round_stride = stride

    def _random_members(self, k: int, exclude: set[int]) -> list[int]:
        """Up to k distinct random members held alive (rejection sampling: cheap while most are alive)."""
        state, size = self._state, len(self._state)
        ok = self.can_probe
        out: list[int] = []
        if k <= 0 or self._live <= len(exclude):
            return out
        for _ in range(8 * k + 8):
            pid = self.rng.randrange(size)
            if state[pid] == ALIVE and pid != self.me and pid not in exclude and pid not in out and (
                    ok is None or ok(pid)):
                out.append(pid)
                if len(out) == k:
                    break
        if len(out) < k and ok is not None:
            # A daemon may send to its connected members only, a few of the table: 16 draws found the one
            # other member a joiner was connected to among 64 a fifth of the time, and its probes of its seed
            # asked no helper. So draw from those it may send to, found by one pass over the table.
            rest = [pid for pid in range(size) if state[pid] == ALIVE and pid != self.me and pid not in exclude
                    and pid not in out and ok(pid)]
            out.extend(self.rng.sample(rest, min(k - len(out), len(rest))))
        return out

    def _indirect(self, seq: int, p: _Probe) -> Sends:
        helpers = self._random_members(self.config.indirect_k, {p.target})
        p.helpers = len(helpers)
        self.counters["indirect_probes"] += 1
        return [(h, PingReq(self.me, seq, p.target, self._piggyback())) for h in helpers]

    def _suspect(self, pid: int, now: float) -> None:
        if self._state[pid] not in (ALIVE, SUSPECT):
            return
        inc = self._inc[pid]
        self.counters["suspected"] += 1
        self._apply(Suspect(pid, inc, self.me), self.me, now)

    def _reap(self, now: float) -> None:
        """Forget members dead for longer than ``dead_retention_s``."""
        horizon = now - self.config.dead_retention_s
        t, ids = self._dead_t, self._dead_id
        while self._dead_head < len(t) and t[self._dead_head] < horizon:
            pid = ids[self._dead_head]
            self._dead_head += 1
            if self._state[pid] == DEAD:
                self._set(pid, UNKNOWN, 0, now)
        if self._dead_head > 1024 and self._dead_head * 2 > len(t):
            del t[:self._dead_head]
            del ids[:self._dead_head]
            self._dead_head = 0

    def _evict_one_dead(self, now: float) -> bool:
        t, ids = self._dead_t, self._dead_id
        while self._dead_head < len(t):
            pid = ids[self._dead_head]
            self._dead_head += 1
            if self._state[pid] == DEAD:
                self._set(pid, UNKNOWN, 0, now)
                return True
        return False

    # --------------------------------------------------------------------------------- dissemination

    def _piggyback(self) -> tuple[Update, ...]:
        c = self.config
        limit = self._retransmit_limit()
        ups = self._queue.take(limit, c.max_updates, c.max_piggyback_bytes)
        room = min(c.max_piggyback_bytes - sum(u.size for u in ups), c.progress_bytes)
        if len(ups) < c.max_updates and room > 0 and self._progress_queue:
            ups.extend(self._progress_queue.take(limit, c.max_updates - len(ups), room))
        return tuple(ups)

    def _entry(self, pid: int) -> Alive | Suspect | Dead | None:
        state = self._state[pid] if pid < len(self._state) else UNKNOWN
        if state == ALIVE:
            return Alive(pid, self._inc[pid] if pid != self.me else self.incarnation)
        if state == SUSPECT:
            return Suspect(pid, self._inc[pid], self.me)
        if state == DEAD:
            return Dead(pid, self._inc[pid], self.me)
        return None

    def _slice(self, start: int, count: int) -> tuple[list[Alive | Suspect | Dead], int]:
        """Up to ``count`` entries of this table from id ``start`` on; and where to continue (-1: the end)."""
        out: list[Alive | Suspect | Dead] = []
        state, size = self._state, len(self._state)
        pid = max(start, 0)
        while pid < size and len(out) < count:
            if state[pid] != UNKNOWN:
                entry = self._entry(pid)
                if entry is not None:
                    out.append(entry)
            pid += 1
        return out, (pid if pid < size else -1)

    def _bucket(self, pid: int) -> int:
        if self._buckets is not None:
            return self._buckets[pid]
        return bucket_of(str(pid))

    def _page(self, lo: int, hi: int, count: int) -> tuple[list[Alive | Suspect | Dead], int]:
        """The entries whose hash bucket is in [lo, hi), at most ``count`` (the lowest buckets, whole
        buckets only); and the bucket to continue from (-1: the end of the hash space)."""
        state = self._state
        lo, hi = max(lo, 0), min(hi, BUCKETS)
        if self._buckets is not None:
            b = self._buckets
            found = [(b[pid], pid) for pid in range(len(state)) if state[pid] != UNKNOWN and lo <= b[pid] < hi]
        else:
            found = [(self._bucket(pid), pid) for pid in range(len(state))
                     if state[pid] != UNKNOWN and lo <= self._bucket(pid) < hi]
        nxt = hi
        if len(found) > count:
            found.sort()
            cut = found[count][0]
            if cut == lo:  # one bucket holds more than a page: send a page of it and move on
                cut = lo + 1
            found = [f for f in found[:count] if f[0] < cut]
            nxt = cut
        entries = [e for e in (self._entry(pid) for _, pid in found) if e is not None]
        return entries, (-1 if nxt >= BUCKETS else nxt)

    def _pushpull(self, now: float) -> Sends:
        self._pushpulls += 1
        partner: int | None = None
        if self._pushpulls % self.config.pushpull_dead_every == 0:
            dead = [pid for pid in self._dead_id[self._dead_head:][-64:] if self._state[pid] == DEAD]
            if dead:
                partner = self.rng.choice(dead)
        if partner is None:
            members = self._random_members(1, set())
            partner = members[0] if members else None
        if partner is None:
            return []
        entries, nxt = self._slice(self._pp_cursor, self.config.pushpull_entries)
        self._pp_cursor = 0 if nxt < 0 else nxt
        self._seq += 1
        self.counters["pushpulls"] += 1
        self._ask(self._seq, partner, now)
        return [(partner, SyncRequest(self.me, self._seq, -1, (Alive(self.me, self.incarnation), *entries),
                                      self._entry(partner)))]

    # ---------------------------------------------------------------------------------------- receive

    def _is_member(self, pid: int) -> bool:
        return pid == self.me or (pid < len(self._state) and self._state[pid] in (ALIVE, SUSPECT))

    def receive(self, now: float, message: Message) -> Sends:
        """Handle one message from ``message.sender`` (authenticated by the transport)."""
        if self._left:
            return []
        sender = message.sender
        if sender == self.me:
            return []
        out: Sends = []
        self._lonely.pop(sender, None)  # it lives: its misses so far were this node's, or the path's
        if isinstance(message, SyncRequest | SyncReply):
            return self._receive_sync(now, message)
        self._absorb(message.updates, sender, now)
        if isinstance(message, Ping):
            if message.target == self.me:
                updates = self._piggyback()
                if self.state_of(sender) in (SUSPECT, DEAD):
                    # It probes us, so it lives: tell it what we hold, so that it refutes at once.
                    view = self._entry(sender)
                    assert view is not None
                    updates = (view, *updates[:self.config.max_updates - 1])
                out.append((sender, Ack(self.me, message.seq, updates)))
        elif isinstance(message, PingReq):
            if len(self._relays) >= self.config.max_relays or message.target == self.me:
                self.counters["relays_refused"] += 1
            elif self._is_member(sender):
                self._seq += 1
                # The relayed ping waits as a probe's direct one does: the larger of the ack timeout and
                # the estimate, then the rest of the probe timeout (so a late ack is still forwarded).
                stretch = max(0.0, self._answer_wait(message.target, now) - self.config.ack_timeout_s)
                if stretch:
                    self.counters["waits_stretched"] += 1
                wait = self.config.probe_timeout_s + stretch
                self._relays[self._seq] = _Relay(sender, message.seq, message.target, now, now + wait,
                                                 now + self.config.ack_timeout_s / 2 if self.heard_since else math.inf)
                self._ask(self._seq, message.target, now)
                out.append((message.target, Ping(self.me, self._seq, message.target, self._piggyback())))
        elif isinstance(message, Ack):
            self._answered(message.seq, sender, now)
            probe = self._probes.get(message.seq)
            if probe is not None and (sender == probe.target or probe.indirect):
                del self._probes[message.seq]
                self.counters["acks"] += 1
                self.local_health = max(0, self.local_health - 1)
            relay = self._relays.pop(message.seq, None)
            if relay is not None:
                out.append((relay.requester, Ack(self.me, relay.seq, self._piggyback())))
        return out

    def _receive_sync(self, now: float, message: SyncRequest | SyncReply) -> Sends:
        sender = message.sender
        entries = message.entries
        cap = max(self.config.join_page_entries, self.config.pushpull_entries) + 1
        if len(entries) > cap:
            self.counters["updates_over_cap"] += len(entries) - cap
            entries = entries[:cap]
        self._absorb(entries, sender, now, limit=cap, transfer=True)
        you = message.view_of_you
        if you is not None and you.member == self.me and not isinstance(you, Progress) and (
                self.state_of(sender) != UNKNOWN):
            # From a member, or from one held dead (the other side of a partition, whose claim about us is
            # how the halves find out): refute. A stranger's claims about us are not worth an incarnation.
            self._about_me(you, now)
        if isinstance(message, SyncReply):
            self._answered(message.seq, sender, now)
            if message.seq == self._join_seq and sender == self._join_server:
                if message.busy:
                    # Another member, soon; but a joiner whose only reachable member is a busy seed (in a
                    # daemon, one connected to its seed alone) backs off: asking every join_page_s, 63
                    # joiners sent their seed ~126 requests a second it could only answer "busy".
                    self._join_busy += 1
                    wait = min(self.config.join_busy_max_s, self.config.join_page_s * 2 ** (self._join_busy - 1))
                    self._join_next = now + wait * self.rng.uniform(0.5, 1.0)
                elif message.next_cursor < 0 or message.next_cursor >= BUCKETS:
                    self._join_busy = 0
                    self._join_server, self._join_next, self._join_seq = None, math.inf, -1
                    self.counters["caught_up" if self._catching_up else "joined"] += 1
                    self._catching_up = False
                else:
                    self._join_busy = 0
                    if message.next_cursor <= self._join_cursor:
                        self.counters["join_page_stuck"] += 1
                        self._join_cursor += 1
                    else:
                        # Adapt the span so that a page comes about half full: fewer requests, none cut.
                        n = len(message.entries)
                        if n < self.config.join_page_entries // 4:
                            self._join_span = min(BUCKETS, self._join_span * 2)
                        elif n > self.config.join_page_entries // 2:
                            self._join_span = max(1, self._join_span // 2)
                        self._join_cursor = message.next_cursor
                    self._join_next = now + self.config.join_page_s
            return []
        # A request: serve a page (a joiner's cursor, or our own walking cursor for a push-pull).
        self._sync_tokens = min(self.config.sync_serve_per_s,
                                self._sync_tokens + (now - self._sync_tokens_t) * self.config.sync_serve_per_s)
        self._sync_tokens_t = now
        if self._sync_tokens < 1:
            self.counters["sync_busy"] += 1
            return [(sender, SyncReply(self.me, message.seq, message.cursor, (), self._entry(sender), busy=True))]
        self._sync_tokens -= 1
        if message.cursor >= 0:
            self.counters["pages_served"] += 1
            entries_out, nxt = self._page(message.cursor, message.until, self.config.join_page_entries)
        else:
            entries_out, nxt = self._slice(self._pp_cursor, self.config.pushpull_entries)
            self._pp_cursor = 0 if nxt < 0 else nxt
        return [(sender, SyncReply(self.me, message.seq, nxt, (Alive(self.me, self.incarnation), *entries_out),
                                   self._entry(sender)))]

    def _absorb(self, updates: Iterable[Update], sender: int, now: float, limit: int | None = None,
                transfer: bool = False) -> None:
        """Apply what a peer sent, within the caps. ``transfer``: table entries from a sync, whose members
        new to us are not news to the swarm (not gossiped on: a joiner would flood its queue with the whole
        table and crowd out its own announcement)."""
        cap = self.config.max_updates if limit is None else limit
        member = self._is_member(sender)
        state, incs, pver = self._state, self._inc, self._pver
        size = len(state)
        for i, update in enumerate(updates):
            if i >= cap:
                self.counters["updates_over_cap"] += 1
                continue
            pid = update.member
            # Fast path: old news (most of what arrives once a swarm is settled).
            if 0 <= pid < size and pid != self.me:
                if isinstance(update, Progress):
                    if update.version <= pver[pid] and member:
                        continue
                elif isinstance(update, Alive):
                    if update.incarnation <= incs[pid] and state[pid] != UNKNOWN:
                        if pid in self._silent and update.incarnation == incs[pid] and state[pid] == ALIVE:
                            self._silent.discard(pid)  # held quietly so far: the swarm hears of it now
                            self._queue.put(update)
                        continue
                elif state[pid] == DEAD and update.incarnation <= incs[pid]:
                    continue
            if not member and not (isinstance(update, Alive) and update.member == sender):
                # A non-member may only announce itself (a joiner); the rest waits until it is one.
                self.counters["from_non_member"] += 1
                continue
            # A sync's own announcement of its sender (a joiner's, to its seed) is news for the swarm, as the
            # module docstring says; only the table entries it hands over are not.
            self_announced = pid == sender and isinstance(update, Alive)
            self._apply(update, sender, now, gossip=not transfer or self_announced or self.state_of(pid) != UNKNOWN)
            if not member:
                member = self._is_member(sender)

    def _apply(self, update: Update, sender: int, now: float, gossip: bool = True) -> None:
        pid = update.member
        if isinstance(update, Progress):
            self._apply_progress(update)
            return
        inc = update.incarnation
        if pid < 0 or inc < 0 or inc > MAX_UINT32 - 1:
            self.counters["malformed"] += 1
            return
        if pid == self.me:
            self._about_me(update, now)
            return
        self._grow(pid)
        state, held = self._state[pid], self._inc[pid]
        if inc > held + MAX_INCARNATION_JUMP:
            self.counters["incarnation_jump"] += 1
            return
        if isinstance(update, Alive):
            if state == UNKNOWN:
                if self._held + 1 >= self.config.max_members and not self._evict_one_dead(now):
                    self.counters["table_full"] += 1
                    return
            elif inc <= held:
                return  # old news (an alive claim never beats a suspicion of the same incarnation)
            self._set(pid, ALIVE, inc, now)
            if gossip:
                self._queue.put(update)
            return
        accuser = update.accuser
        if isinstance(update, Dead) and accuser == pid:
            pass  # a member's own departure
        elif not self._is_member(accuser):
            self.counters["accuser_not_member"] += 1
            return
        if state == UNKNOWN or state == DEAD or inc < held:
            return
        if isinstance(update, Suspect):
            if state == SUSPECT and inc == held:
                s = self._suspicions.get(pid)
                if s is not None and accuser not in s.accusers and len(s.accusers) <= self._suspicion_bounds()[2]:
                    # Up to k independent confirmations count and travel on (memberlist's rule): more would
                    # shorten nothing, and each one re-sent costs every node a slot per message.
                    s.accusers.add(accuser)
                    s.deadline = self._suspicion_deadline(s)
                    self._queue.put(update)
                return
            self._set(pid, SUSPECT, inc, now)
            s = _Suspicion(inc, now, now, {accuser})
            s.deadline = self._suspicion_deadline(s)
            self._suspicions[pid] = s
            self._queue.put(update)
            return
        # Dead
        self._set(pid, DEAD, inc, now)
        self._queue.put(update)
        self._progress_queue.drop(pid)

    def _about_me(self, update: Alive | Suspect | Dead, now: float) -> None:
        if isinstance(update, Alive):
            if update.incarnation > self.incarnation:
                # Our own alive claim from an earlier life (a restart that lost its counter): go past it.
                self._refute(update.incarnation, now)
            return
        if isinstance(update, Dead) and update.accuser == self.me:
            return
        if update.incarnation >= self.incarnation:
            self.counters["refuted"] += 1
            # Suspected although alive: this node answered too late for someone (Lifeguard).
            self.local_health = min(self.config.max_local_health, self.local_health + 1)
            self._refute(update.incarnation, now)

    def _refute(self, incarnation: int, now: float) -> None:
        self.incarnation = min(incarnation + 1, MAX_UINT32 - 1)
        self._inc[self.me] = self.incarnation
        self._queue.put(Alive(self.me, self.incarnation))

    def _apply_progress(self, update: Progress) -> None:
        pid = update.member
        if pid == self.me or not self._is_member(pid):
            if pid != self.me:
                self.counters["progress_of_non_member"] += 1
            return
        held = self._pver[pid]
        if update.version <= held:
            return
        if update.version > held + MAX_INCARNATION_JUMP or update.version > MAX_UINT32 or not (
                0 <= update.outer_step <= MAX_UINT32) or not (math.isfinite(update.loss)
                                                              and math.isfinite(update.samples_per_s)):
            self.counters["malformed"] += 1
            return
        self._store_progress(update)
        self._progress_queue.put(update)

    def _store_progress(self, p: Progress) -> None:
        pid = p.member
        self._pver[pid] = p.version
        self._pstep[pid] = p.outer_step
        self._ploss[pid] = p.loss
        self._psps[pid] = p.samples_per_s
