"""Connection management: keep about `target` connections to swarm members, no more than `cap` for long.

Why our own manager: `host.connect()` costs at least 250 ms even on loopback (py-libp2p pitfall 4), so
dials run concurrently, each under its own deadline, and the manager's loop never waits for a dial. A
peer that fails gets an exponential back-off with jitter, so one dead or slow address never delays the
others and never turns into a retry storm. Bootstrap peers are ordinary candidates that are never
forgotten: an unreachable bootstrap address is retried with back-off, with a warning, not a crash.

A full node still hands out peers: a connection is not closed for the cap during its first
`PRUNE_GRACE_S` (go-libp2p's connection manager has the same grace period), long enough for the newcomer's
first state session, which gives it every member's signed record with its addresses, and its first DHT
lookups. Closing the newest connection at once, as this did before, left a node beyond a full bootstrap node's
cap no time to learn anyone (one of the reasons why 64 daemons on one bootstrap node knew 1.3 members on
average after 240 s: issue #24, bench/scale.py). The grace ends early once this node has served the
newcomer that session, or a referral to other members (:meth:`ConnManager.served`): it then has others to
dial, and a node every newcomer reaches at once (the bootstrap node, the first members they all learn of)
no longer holds twice its cap of them for 30 s.
Over the cap, the newest connections past their grace are closed first, so long-lived ones are kept (those
in their grace push none out). And a
peer whose connection ended within `STABLE_S` of opening (the other side was full and closed it, or
restarted) is redialed with the same back-off as a failed dial, not at the next tick: every node beyond a
full bootstrap node's cap redialed it twice a second, each time a Noise handshake on both sides.
The hard ceiling is the host's own connection limit (2 x `cap` in p2p/host.py).

At the host's limit (`limit`, 2 x `cap` by default as in node/daemon.py) the host refuses every inbound
connection before its handshake, and a newcomer that knows only this node learns nothing. So there the grace
period is cut to `CROWDED_GRACE_S` (enough for the first state session), and the oldest connections in
their grace are closed until one slot is free: with 12 daemons at `max_peers` 2 the bootstrap node's two
spare slots were each held for the full 30 s while nine others were refused, backing off to a minute.
And a node with no connection at all retries its bootstrap peers at least every `ISOLATED_RETRY_S`: a
refusal costs the refusing host a TCP accept and close, and a stranded node has nothing else to try.

A connection can be up and deliver nothing: at a 64-daemon join one newcomer per run sat 20-40 s on its
first connection to a crowded node, none of its pings acked and no state session completed, until that node
closed the connection for its cap; the redial then worked at once (docs/benchmarks.md, "Scale: real
daemons"; the stall is below Starling's protocols, in py-libp2p on a starved node, and was not found). So
where the daemon tells this manager what its protocols hear (``heard_from``: a SWIM message, a state
session's answer) and sets ``silent_after``, a node none of whose connections delivered anything for that
long (`SILENT_S`), counted from each connection's opening, closes them and dials again (its bootstrap peer
within seconds, as an isolated node, and any other member it knows). Only when every connection is silent: a
node with one connection that works is not stranded, and a node whose peers all stopped answering has
nothing to lose. Not right after a tick that ran late (this node's own loop starved: what its peers sent may
still be waiting to be read). The same for a node that is *stranded* (``stranded``: the daemon's replica
holds no member but this node) when its connections are all that old: at the join, nine newcomers held
their one connection to the bootstrap node for 25-45 s with SWIM's long-lived streams working and every new
stream (a state session, a dial-back) failing to open, so they heard their seed but learnt nobody.

Bootstrap peers are dialed first while the node is below its target, and with the target met only every
`BOOTSTRAP_REFRESH_S` (how two islands of a partitioned swarm find each other again). Redialing them
whenever the connection was gone, as this did before, kept every member coming back to the bootstrap node
it had outgrown: each return took one of its connection slots for a grace period, and with 12 daemons at
`max_peers` 2 the bootstrap node was at its host limit whenever a newcomer, who knows no one else, tried.

Sybil limits: at most `max_per_subnet` connections come from one network group (IPv4 /24, IPv6 /48, as
observed on the connection; loopback exempt), so that a thousand fresh identities from one machine
cannot take every connection slot; the newest connections of a crowded group are closed first, and
candidates in a group at its limit are not dialed. At most `MAX_CANDIDATES` candidates are remembered.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2p.netgroup import group_of, is_loopback_group, peer_ip
from p2p.status import BootstrapPeerStatus, ConnectionsStatus

log = logging.getLogger("starling.connmgr")

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 60.0
MAX_CONCURRENT_DIALS = 8
TICK_S = 0.5
#: A connection younger than this is not closed for the cap (see the module docstring).
PRUNE_GRACE_S = 30.0
#: The grace period while the host is at its connection limit (see the module docstring).
CROWDED_GRACE_S = 10.0
#: A node with no connections retries its bootstrap peers at least this often.
ISOLATED_RETRY_S = 5.0
#: With ``silent_after`` set (the daemon, in SWIM mode): connections silent this long are closed and redialed
#: when all are (see the module docstring). SWIM probes connected members every few seconds and each probe
#: is answered: a working connection is not this quiet.
SILENT_S = 15.0
#: A tick this much later than due: this node's loop was starved, and silence is not judged on it.
LATE_TICK_S = 2.0
#: The longest a close waits for ``on_closing`` (telling the peer; see there).
CLOSING_WAIT_S = 6.0  # more than node/swarm/swim_service.py's wait for the peer's notice back (5 s)
#: A connection that ended younger than this counts as a failed dial for the back-off.
STABLE_S = 2 * PRUNE_GRACE_S
#: With the target met, a bootstrap peer is redialed at most this often (see the module docstring).
BOOTSTRAP_REFRESH_S = 300.0
#: Candidates remembered at most (members learnt from the swarm state and the DHT); beyond it the
#: non-permanent ones that failed most are forgotten first (discovery brings live ones back).
MAX_CANDIDATES = 1024
MAX_ADDRS_PER_CANDIDATE = 16  # as many as a member record carries


def addr_group(addrs: Iterable[multiaddr.Multiaddr]) -> str | None:
    """The network group of the first IP address in `addrs` (None if there is none)."""
    for a in addrs:
        for proto in ("ip4", "ip6"):
            try:
                return group_of(a.value_for_protocol(proto))
            except Exception:  # not this protocol, or not an IP multiaddr at all
                continue
    return None


@dataclass
class Candidate:
    """A peer we may dial: its addresses and its dial history."""

    peer_id: ID
    addrs: list[multiaddr.Multiaddr]
    source: str  # "bootstrap", "dht", ...
    permanent: bool = False  # bootstrap peers are never forgotten
    failures: int = 0
    next_attempt: float = 0.0
    last_error: str = ""
    connected_since: float | None = None
    last_dialed: float = -math.inf
    warned: str = ""  # the cause (or error) last logged at WARNING: the same again is logged at INFO


@dataclass
class ConnManager:
    host: IHost
    target: int = 8
    cap: int = 32
    dial_timeout: float = 10.0
    #: The host's own connection limit (p2p/host.py's `max_connections`); 2 x `cap` when not given.
    limit: int | None = None
    on_connected: Callable[[ID], None] | None = None
    #: Awaited (at most `CLOSING_WAIT_S`) before each connection this manager closes (the cap, a crowded
    #: group): its loss is no news of the peer, and the peer is told so (node/swarm/swim_service.py's
    #: ``tell_closing``: neither side probes the member for it).
    on_closing: Callable[[ID], Awaitable[None]] | None = None
    # How to dial: host.connect by default; node/swarm/nat.py supplies one that also tries relay circuits,
    # which py-libp2p's swarm never dials by itself.
    dial: Callable[[PeerInfo], Awaitable[None]] | None = None
    clock: Callable[[], float] = time.monotonic
    #: Most connections from one network group (loopback exempt); see the module docstring.
    max_per_subnet: int = 16
    #: The observed IP of a connected peer (default: read from the host's connection).
    ip_of: Callable[[ID], str | None] | None = None
    #: Why dialling a peer failed, when its handshake (at or after the given time.monotonic) said more than
    #: py-libp2p's dial error (a wrong PeerID at that address, a likely swarm key mismatch: p2p/auth.py's
    #: `AccessControl.explain_dial`).
    explain: Callable[[ID, float], str | None] | None = None
    #: Close every connection once all of them delivered nothing for this long (None: never; see the module
    #: docstring and ``heard_from``).
    silent_after: float | None = None
    #: Whether this node is stranded: connected, yet knowing no member to dial (see the module docstring).
    stranded: Callable[[], bool] | None = None
    # Runtime state, not configuration: none of it is a constructor parameter (issue #53: a component's
    # state is its own, set up here, read through its methods and counters).
    candidates: dict[ID, Candidate] = field(init=False, default_factory=dict)
    subnet_pruned: int = field(init=False, default=0)  # connections closed: their group was over max_per_subnet
    cap_pruned: int = field(init=False, default=0)  # connections closed because we were over the cap
    silent_closed: int = field(init=False, default=0)  # closed because every connection was silent (silent_after)
    #: When a protocol last received something from each peer (``heard_from``); only connected peers' count.
    _heard: dict[ID, float] = field(init=False, default_factory=dict)
    _last_tick: float | None = field(init=False, default=None)
    #: Connected peers this node has served what a newcomer needs (a state session, or a referral: ``served``):
    #: over the cap, their connections need no grace period.
    _served: set[ID] = field(init=False, default_factory=set)
    #: Connections whose close is under way (it waits up to `CLOSING_WAIT_S` for ``on_closing``): not closed
    #: again, nor counted, meanwhile. Closing one twice closed it before the peer had been told.
    _disconnecting: set[ID] = field(init=False, default_factory=set)
    _dialing: set[ID] = field(init=False, default_factory=set)
    #: Dials under way that a ``redial`` waits for (set when the dial ends): one per peer being dialled.
    _dial_ended: dict[ID, trio.Event] = field(init=False, default_factory=dict)
    _wake: trio.Event = field(init=False, default_factory=trio.Event)
    _known_connected: set[ID] = field(init=False, default_factory=set)
    #: When each connected peer's connection was first seen (any direction, candidate or not).
    _since: dict[ID, float] = field(init=False, default_factory=dict)
    #: Each connected peer's network group, read once per connection: reading every connection's address
    #: on every tick (twice a second) was most of an idle manager's CPU.
    _groups: dict[ID, str] = field(init=False, default_factory=dict)

    # --- inputs ------------------------------------------------------------------------------------------

    def add_candidate(self, info: PeerInfo, *, source: str, permanent: bool = False) -> None:
        """Remember a peer to dial (from bootstrap config or discovery); its addresses are merged."""
        if info.peer_id == self.host.get_id():
            return
        cand = self.candidates.get(info.peer_id)
        if cand is None:
            if len(self.candidates) >= MAX_CANDIDATES and not self._forget_one() and not permanent:
                return
            cand = self.candidates[info.peer_id] = Candidate(info.peer_id, [], source, permanent)
            self._wake.set()
        cand.permanent = cand.permanent or permanent
        for a in info.addrs:
            if str(a) not in {str(x) for x in cand.addrs}:
                cand.addrs.append(a)
        del cand.addrs[:-MAX_ADDRS_PER_CANDIDATE]  # the newest are kept (a bootstrap peer that moved)

    def add_candidates(self, infos: Iterable[PeerInfo], *, source: str) -> None:
        for info in infos:
            self.add_candidate(info, source=source)

    def heard_from(self, peer_id: ID) -> None:
        """A protocol received something from ``peer_id`` over its connection (a SWIM message, a state
        session's answer or refusal): the connection delivers (see ``silent_after``)."""
        self._heard[peer_id] = self.clock()

    def _forget_one(self) -> bool:
        """Make room for a candidate: forget the non-permanent, unconnected one that failed most."""
        connected = set(self.connected())
        spare = [c for c in self.candidates.values() if not c.permanent and c.peer_id not in connected
                 and c.peer_id not in self._dialing]
        if not spare:
            return False
        del self.candidates[max(spare, key=lambda c: c.failures).peer_id]
        return True

    def _group(self, peer_id: ID) -> str:
        """A connected peer's network group, read from its connection once (see ``_groups``); a connection
        whose address cannot be read yet is read again next time."""
        group = self._groups.get(peer_id)
        if group is None:
            ip = (self.ip_of or (lambda p: peer_ip(self.host, p)))(peer_id)
            group = group_of(ip)
            if ip is not None:
                self._groups[peer_id] = group
        return group

    # --- views -------------------------------------------------------------------------------------------

    def connected(self) -> list[ID]:
        return [p for p in self.host.get_connected_peers() if p != self.host.get_id()]

    def crowded(self) -> bool:
        """Whether more peers are connected than the cap keeps (node/swarm/replicator.py refers newcomers on)."""
        return len(self.connected()) > self.cap

    def served(self, peer_id: ID) -> None:
        """This node has given ``peer_id`` what a newcomer needs from it (the swarm state's records, with the
        members' addresses, in a session; or a referral to members): over the cap its connection may be
        closed without waiting out `PRUNE_GRACE_S`. Why: at a 64-daemon join, every newcomer reached the
        bootstrap node, and the first few members each newcomer learnt of, at once; those held 40 to 63
        connections for the 30 s grace, answered probes late while 60 others leaned on them, and turned
        suspect in many views (docs/benchmarks.md, "Scale: real daemons"). A peer that has its records has
        others to dial."""
        if peer_id in self._known_connected or peer_id in self.host.get_connected_peers():
            self._served.add(peer_id)

    def below_target(self) -> bool:
        """Fewer connections than the target: whether other components (the DHT) may open new ones."""
        return len(self.connected()) < self.target

    def short_of_candidates(self) -> bool:
        """Below the target, with too few candidates never tried to reach it (the connections, the dials
        under way and the candidates not connected that have not failed since their last stable connection,
        together, fall short of the target): whether a DHT lookup could give this node anyone new to dial.
        Members' records, from state sessions, usually give every member at a join (p2p/discovery.py)."""
        connected = set(self.connected())
        if len(connected) >= self.target:
            return False
        fresh = sum(1 for c in self.candidates.values()
                    if c.peer_id not in connected and c.peer_id not in self._dialing and not c.failures and c.addrs)
        return len(connected) + len(self._dialing) + fresh < self.target

    def status(self) -> ConnectionsStatus:
        now = self.clock()
        return {
            "target": self.target,
            "cap": self.cap,
            "connected": len(self.connected()),
            "candidates": len(self.candidates),
            "dialing": len(self._dialing),
            "backing_off": sum(1 for c in self.candidates.values() if c.next_attempt > now),
            "max_per_subnet": self.max_per_subnet,
            "subnet_pruned": self.subnet_pruned,
            "cap_pruned": self.cap_pruned,
            "silent_closed": self.silent_closed,
        }

    def bootstrap_status(self) -> list[BootstrapPeerStatus]:
        """The bootstrap peers (and those of bootstrap files), connected or not, with why the last dial failed."""
        connected = set(self.connected())
        return [
            {
                "peer_id": str(c.peer_id),
                "addrs": [str(a) for a in c.addrs],
                "connected": c.peer_id in connected,
                "failures": c.failures,
                "last_error": "" if c.peer_id in connected else c.last_error,
            }
            for c in self.candidates.values()
            if c.permanent
        ]

    # --- the loop ----------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self._tick(nursery)
                with trio.move_on_after(TICK_S):
                    await self._wake.wait()
                self._wake = trio.Event()

    def _tick(self, nursery: trio.Nursery) -> None:
        connected = set(self.connected())
        now = self.clock()
        for peer_id in connected - self._known_connected:
            self._since[peer_id] = now
            cand = self.candidates.get(peer_id)
            if cand is not None:
                cand.next_attempt, cand.connected_since = 0.0, now
            if self.on_connected is not None:
                self.on_connected(peer_id)
        for peer_id in self._known_connected - connected:
            self._served.discard(peer_id)
            opened = self._since.pop(peer_id, now)
            self._groups.pop(peer_id, None)
            self._heard.pop(peer_id, None)
            cand = self.candidates.get(peer_id)
            if cand is not None:
                cand.connected_since = None
                if now - opened < STABLE_S:  # closed by a full peer (or a restart): back off before redialing
                    self._back_off(cand, f"the connection closed after {now - opened:.0f}s (the peer full, or restarting)")
        for peer_id in connected:  # a connection that has lasted clears its peer's failures
            cand = self.candidates.get(peer_id)
            if cand is not None and cand.failures and now - self._since[peer_id] >= STABLE_S:
                cand.failures = 0
        self._known_connected = connected
        if len(self._heard) > 2 * len(connected) + 64:  # heard of peers never seen connected: bounded
            self._heard = {p: t for p, t in self._heard.items() if p in connected}
        late = self._last_tick is not None and now - self._last_tick > TICK_S + LATE_TICK_S
        self._last_tick = now
        staying = connected - self._disconnecting
        if not late and (self._all_silent(staying, now) or self._stranded(staying, now)):
            self._close_silent(staying, nursery)
            return
        if len(staying) > self.cap:
            self._prune(staying, nursery)
            return
        full_groups = self._prune_crowded(staying, nursery)
        # Bootstrap peers are dialed first, and when the target is met only now and then (see the module docstring).
        # With the target met, only those are looked at: parsing every candidate's addresses twice a second
        # was idle work that grew with the swarm (every member is a candidate; issue #24).
        want = self.target - len(connected) - len(self._dialing)
        due = [
            c
            for c in self.candidates.values()
            if (want > 0 or (c.permanent and now - c.last_dialed >= BOOTSTRAP_REFRESH_S))
            and c.peer_id not in connected and c.peer_id not in self._dialing and c.next_attempt <= now and c.addrs
            and (c.permanent or addr_group(c.addrs) not in full_groups)
        ]
        random.shuffle(due)
        due.sort(key=lambda c: (not c.permanent, c.failures))
        for cand in due:
            if len(self._dialing) >= MAX_CONCURRENT_DIALS:
                break
            if want <= 0 and not (cand.permanent and now - cand.last_dialed >= BOOTSTRAP_REFRESH_S):
                continue
            want -= 1
            cand.last_dialed = now
            self._dialing.add(cand.peer_id)
            nursery.start_soon(self._dial, cand)

    def _all_silent(self, connected: set[ID], now: float) -> bool:
        """Whether every connection has delivered nothing for ``silent_after``, counted from its opening
        (something heard on an earlier connection to the same peer does not count)."""
        if self.silent_after is None or not connected:
            return False
        return all(
            now - max(self._since[p], self._heard.get(p, -math.inf)) >= self.silent_after for p in connected
        )

    def _stranded(self, connected: set[ID], now: float) -> bool:
        """Whether this node, with connections all ``silent_after`` old, is stranded (``stranded``)."""
        if self.silent_after is None or self.stranded is None or not connected:
            return False
        return all(now - self._since[p] >= self.silent_after for p in connected) and self.stranded()

    def _close_silent(self, connected: set[ID], nursery: trio.Nursery) -> None:
        """Close every (silent) connection; the next ticks see them gone and dial again, the bootstrap peers
        within `ISOLATED_RETRY_S` (see `_back_off`), and any other member known meanwhile."""
        for peer_id in connected:
            log.info("nothing delivered on any connection, or no member learnt, for %.0f s: closing the one "
                     "to %s and dialling again", self.silent_after, peer_id)
            self.silent_closed += 1
            self._start_disconnect(peer_id, nursery)

    def _limit(self) -> int:
        return self.limit if self.limit is not None else 2 * self.cap

    def _prune(self, connected: set[ID], nursery: trio.Nursery) -> None:
        """Close the newest non-bootstrap connections above the cap among those past their grace period.
        Connections in their grace period are let through above the cap (see the module docstring), and
        push no long-lived one out: each is closed once past its grace, if the node is still full. At the
        host's limit, the oldest of those in their grace past `CROWDED_GRACE_S` are closed too, until one
        slot is free for the next newcomer."""
        now = self.clock()
        kept = {p for p in connected if p in self.candidates and self.candidates[p].permanent}
        young = {p for p in connected if now - self._since.get(p, now) < PRUNE_GRACE_S and p not in self._served}
        excess = len(connected) - self.cap - len(young)
        victims = sorted(connected - young - kept, key=lambda p: -self._since[p])[:max(0, excess)]
        over_limit = len(connected) - len(victims) - (self._limit() - 1)
        if over_limit > 0:
            served = (p for p in young - kept if now - self._since.get(p, now) >= CROWDED_GRACE_S)
            victims += sorted(served, key=lambda p: self._since[p])[:over_limit]
        for peer_id in victims:
            log.debug("over the connection cap (%d): closing %s", self.cap, peer_id)
            self.cap_pruned += 1
            self._start_disconnect(peer_id, nursery)

    def _prune_crowded(self, connected: set[ID], nursery: trio.Nursery) -> set[str]:
        """Close the newest connections of any network group above `max_per_subnet` (bootstrap peers are
        kept); returns the groups at their limit, whose candidates are not dialed."""
        by_group: dict[str, list[ID]] = {}
        for peer_id in connected:
            by_group.setdefault(self._group(peer_id), []).append(peer_id)
        full = set()
        for group, peers in by_group.items():
            if is_loopback_group(group) or len(peers) < self.max_per_subnet:
                continue
            full.add(group)
            excess = len(peers) - self.max_per_subnet
            if excess <= 0:
                continue
            victims = sorted(
                (p for p in peers if not (p in self.candidates and self.candidates[p].permanent)),
                key=lambda p: -(self.candidates[p].connected_since or 0) if p in self.candidates else -math.inf,
            )[:excess]
            for peer_id in victims:
                log.debug("more than %d connections from %s: closing %s", self.max_per_subnet, group, peer_id)
                self.subnet_pruned += 1
                self._start_disconnect(peer_id, nursery)
        return full

    def _back_off(self, cand: Candidate, error: str) -> float:
        """Count a failure of ``cand`` (a failed dial, or a connection that did not last) and schedule its
        next attempt with exponential back-off and jitter; returns the delay. A node with no connection
        at all retries a bootstrap peer within `ISOLATED_RETRY_S` (see the module docstring)."""
        cand.last_error = error
        cand.failures += 1
        longest = ISOLATED_RETRY_S if cand.permanent and not self.connected() else BACKOFF_MAX_S
        delay = min(longest, BACKOFF_BASE_S * 2 ** (cand.failures - 1)) * random.uniform(0.8, 1.2)
        cand.next_attempt = self.clock() + delay
        return delay

    def _start_disconnect(self, peer_id: ID, nursery: trio.Nursery) -> None:
        self._disconnecting.add(peer_id)
        nursery.start_soon(self._disconnect, peer_id)

    async def _disconnect(self, peer_id: ID) -> None:
        try:
            await self._close(peer_id)
        finally:
            self._disconnecting.discard(peer_id)

    async def _close(self, peer_id: ID) -> None:
        if self.on_closing is not None:
            with trio.move_on_after(CLOSING_WAIT_S):
                await self.on_closing(peer_id)
        with trio.move_on_after(5):
            try:
                await self.host.disconnect(peer_id)
            except Exception as e:  # a peer already gone is fine
                log.debug("disconnect %s: %s", peer_id, e)

    async def redial(self, peer_id: ID) -> bool:
        """Dial ``peer_id`` now, whatever its back-off, and say whether it is connected after (at most
        ``dial_timeout``; a failure backs off as any dial's). SWIM asks this before it takes a dropped
        connection for news of the member (node/swarm/swim_service.py). False at once for a peer that is no
        candidate with addresses. A peer being dialled already (this manager redials a bootstrap peer as soon
        as its connection ends, while below its target) is not dialled twice: that dial's outcome is the
        answer. Why: False at once, without a dial, made SWIM take the drop for news and probe the member
        through helpers not connected to it (at a 64-daemon join a newcomer's redial of the bootstrap node said
        False within 30 ms and the probe turned the node suspect; whether its dial failed at once, the node
        full, or the manager was dialling it already, was not logged)."""
        if peer_id in self._dialing:
            ended = self._dial_ended.setdefault(peer_id, trio.Event())
            await ended.wait()
            return peer_id in self.connected()
        cand = self.candidates.get(peer_id)
        if cand is None or not cand.addrs:
            return False
        self._dialing.add(peer_id)  # (_dial takes it out)
        cand.last_dialed = self.clock()
        await self._dial(cand)
        return peer_id in self.connected()

    def _forget_failed_dial(self, peer_id: ID) -> None:
        """Take ``peer_id`` out of py-libp2p's negative cache before our own dial of it.

        py-libp2p refuses for 60 s to dial a peer whose every address failed once ("negative cache"), so a
        newcomer refused by a bootstrap node at its connection limit could not try again for a minute,
        whatever its back-off said; each of its retries failed at once and counted as a failure, pushing
        the back-off to a minute too. This manager's per-peer back-off decides when to redial.
        """
        network = getattr(self.host, "get_network", None)
        unblock = getattr(network() if network is not None else None, "unblock_peer", None)
        if unblock is not None:
            unblock(peer_id)

    async def _dial(self, cand: Candidate) -> None:
        try:
            ok = False
            error = f"timed out after {self.dial_timeout:.0f}s"
            started = time.monotonic()
            self._forget_failed_dial(cand.peer_id)
            with trio.move_on_after(self.dial_timeout):
                try:
                    await (self.dial or self.host.connect)(PeerInfo(cand.peer_id, list(cand.addrs)))
                    ok = True
                except Exception as e:  # libp2p raises many types for an unreachable peer
                    error = f"{type(e).__name__}: {e}"[:200]
            if ok:
                # `failures` is reset once the connection has lasted (see _tick): a full peer that accepts
                # and then closes must not reset the back-off with every dial.
                cand.next_attempt, cand.last_error, cand.warned = 0.0, "", ""
                log.debug("connected to %s (%s)", cand.peer_id, cand.source)
            else:
                # The handshake's verdict, where there was one: py-libp2p's own error (a timeout, "all addresses
                # failed", its negative cache) does not say that the wrong node or the wrong key answered.
                # A handshake of this attempt; or of an earlier one when py-libp2p's negative cache refused to
                # dial at all (else a stale cause would outlive a fix: a peer now down is not "the wrong key").
                since = 0.0 if "negative cache" in error else started
                cause = self.explain(cand.peer_id, since) if self.explain is not None else None
                delay = self._back_off(cand, cause or error)
                level = logging.DEBUG
                if cand.permanent:  # once at WARNING per cause (or error), then INFO while it lasts
                    level = logging.INFO if (cause or cand.last_error) == cand.warned else logging.WARNING
                    cand.warned = cause or cand.last_error
                log.log(
                    level,
                    "cannot reach %s peer %s at %s: %s; retrying in %.0fs",
                    cand.source,
                    cand.peer_id,
                    ", ".join(str(a) for a in cand.addrs),
                    cand.last_error,
                    delay,
                )
                if not cand.permanent and cand.failures >= 8:
                    del self.candidates[cand.peer_id]  # discovery will bring it back if it reappears
        finally:
            self._dialing.discard(cand.peer_id)
            ended = self._dial_ended.pop(cand.peer_id, None)
            if ended is not None:
                ended.set()
            self._wake.set()
