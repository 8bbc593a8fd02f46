"""Swarm discovery over the Kademlia DHT.

Every member of swarm S advertises itself as a *provider* of one key derived from S, and looks up the
other providers of that key. So a peer that knows only a bootstrap node ends up knowing every member:
the bootstrap node merely seeds its routing table. Lookups run fast at start-up, then settle to
`interval`, and back off from there (doubling, up to MAX_BACKOFF x `interval`) while they find no member
not found before: on a settled swarm a lookup every 10 s was 13% of a quiet daemon's traffic
(GET_PROVIDERS to every member, answered with every member's addresses), for nothing new. A new
connection wakes the loop and starts over while the node is below its target of connections.

Once the node has its target of connections the DHT is no longer how it meets members (their signed
records, with their addresses, come in state sessions and SWIM, and py-libp2p keeps only 20 providers
per key anyway), so it looks nothing up then (below: the DHT as the records' fallback). Measured with 16 idle daemons in
`node.membership = swim` (issue #24, bench/scale.py --profile): the DHT was 1.7 of the 1.9 MB each daemon
sent per minute, and with the muxer and Noise work those bytes cost, most of an idle daemon's CPU; and
what each lookup costs grows with N (more providers and closer peers per answer, each with a signed peer
record that the asker verifies, and more peers asked). Three things made it so and are changed here:

* a lookup that ran out of LOOKUP_TIMEOUT_S counted as failed even when peers had answered it, and a
  failed lookup never backs off: on a busy machine every lookup ran out, so every node looked up every
  `interval` for ever. Now only a lookup that no peer answered counts as failed;
* each lookup first walked the network for the peers closest to the key (an iterative FIND_NODE of its
  own, every answer 20 signed peer records) before asking up to MAX_PROVIDER_QUERIES of them for
  providers. GET_PROVIDERS answers carry closer peers themselves, so the lookup now starts from the
  routing table's closest peers and follows those answers, and it stops once a round of answers brings
  no provider not already found;
* provider records were re-announced every 60 s (a FIND_NODE walk and an ADD_PROVIDER to each of the 20
  closest peers) although their holders keep them for 48 hours: now every REPROVIDE_S, the first one
  paced as the next paragraph says (before, at every fast start-up round: ten announcements in a node's
  first 20 s).

At a join the DHT is only a fallback (issue #24). A newcomer's first state session gives it every member's
signed record with its addresses, which the connection manager dials; what the DHT cost at the same time
was most of the join's CPU. With 64 daemons on this machine's 2 cores, each newcomer's ten fast lookups and
its announcements (a closest-peer walk, then ADD_PROVIDER to 20 peers, dialling those it was not connected
to, each a Noise handshake and every protocol's first streams on both sides) went through the bootstrap
node while 63 others leaned on it: the join took 90 s, and 31 s with the lookups and announcements off
(docs/benchmarks.md, "Scale: real daemons"). So a node looks nothing up during its first
``LOOKUP_GRACE_S``, and then only while the connection manager is short of candidates to reach its
target (:meth:`p2p.connmgr.ConnManager.short_of_candidates`: a small swarm, or records that did not come).
Nor does py-libp2p's own maintenance loop, which walked the network as it started (:func:`skip_startup_refresh`).
It announces itself first once past that grace it is short of candidates too (where it needs the DHT, as
in a small swarm, others do); otherwise at a random time between ``PROVIDE_GRACE_S`` and
``PROVIDE_LATEST_S`` after its start, and then every ``REPROVIDE_S``. Not sooner: each announcement is a
closest-peer walk (answers of 20 signed peer records each, all verified) and an ADD_PROVIDER to the 20
peers closest to the key, the same 20 for every member; at a 64-daemon join, with the first announcement
at a node's target of connections or 30 s after its start, that was 2,600 DHT streams, half the join's
streams in its last 20 s, for records that serve later newcomers (py-libp2p keeps 20 providers per
key).

py-libp2p's DHT ignores `protocol_prefix` (pitfall 5), so two different swarms share one DHT; the key is
namespaced by the swarm name, and only peers that advertise that key become candidates.

The DHT opens connections only while the connection manager is below its target (:class:`DialGate`). Its
queries (closest peers, GET_PROVIDERS, ADD_PROVIDER) open a stream to each peer they ask, and py-libp2p
dials a peer it is not connected to: with 8 daemons at `node.max_peers` 2, four of five DHT-opened
connections were redials of peers the connection manager had just closed for the cap, each with a fresh
grace period, so every node stayed at the host's hard limit (2 x `max_peers`) and refused every newcomer
(issue #24: nodes that knew only the bootstrap node never got in). Above the target the DHT works over the
connections the node has; members are learnt from those (and from state sessions) all the same.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Callable, Sequence

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service

from p2p.connmgr import ConnManager
from p2p.status import DiscoveryStatus

log = logging.getLogger("starling.discovery")

LOOKUP_TIMEOUT_S = 10.0
FAST_INTERVAL_S = 2.0
FAST_ROUNDS = 10
#: No lookup in a node's first seconds: its first state session gives it the members (module docstring).
LOOKUP_GRACE_S = 10.0
#: A node's first announcement as a provider comes at a random time between these (seconds after its start),
#: unless it is short of candidates sooner (module docstring).
PROVIDE_GRACE_S = 60.0
PROVIDE_LATEST_S = 300.0
#: Seconds between two announcements of this node as a provider once started (the records' holders keep
#: them for 48 hours; see the module docstring).
REPROVIDE_S = 600.0
QUERY_TIMEOUT_S = 5.0
MAX_PROVIDER_QUERIES = 20
PROVIDER_QUERY_BATCH = 3  # peers asked for providers at once
MAX_BACKOFF = 8  # settled lookups that find nobody new space out to 8 x `interval` (80 s by default)
#: Distinct DHT keys whose providers this node stores for others (py-libp2p bounds providers per key, at
#: 20, but not the keys: a peer announcing random keys would grow the store without limit).
MAX_PROVIDER_KEYS = 1024
#: Peers remembered as found or added to the routing table (for logs and status only).
MAX_REMEMBERED_PEERS = 4096


def bound_provider_store(store: object) -> None:
    """Refuse provider records for new keys once the store holds MAX_PROVIDER_KEYS (keys held, the swarm's
    among them, keep working). Wraps the instance's `add_provider`, which the DHT's ADD_PROVIDER handler
    and our lookups both call."""
    add = store.add_provider  # type: ignore[attr-defined]
    providers = store.providers  # type: ignore[attr-defined]

    def bounded(key: bytes, provider: PeerInfo) -> None:
        if key not in providers and len(providers) >= MAX_PROVIDER_KEYS:
            return
        add(key, provider)

    store.add_provider = bounded  # type: ignore[attr-defined]


class DialRefused(Exception):
    """A DHT query would have dialled a new connection while the node already has its target."""


class DialGate:
    """What the DHT's query components see as the host: the host itself, except that ``new_stream`` to a
    peer this node is not connected to is refused (:class:`DialRefused`, before any dial) while the
    connection manager has its target of connections. See the module docstring for why."""

    def __init__(self, host: IHost, connmgr: ConnManager) -> None:
        self._host = host
        self._connmgr = connmgr
        self.refused = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._host, name)

    async def new_stream(self, peer_id: ID, protocol_ids: Sequence[TProtocol]) -> INetStream:
        if peer_id not in self._host.get_connected_peers() and not self._connmgr.below_target():
            self.refused += 1
            raise DialRefused(f"not dialling {peer_id} for the DHT: the node has its target of connections")
        return await self._host.new_stream(peer_id, protocol_ids)


def gate_dht_dials(dht: KadDHT, gate: DialGate) -> None:
    """Narrow, instance-level: the DHT components that open streams (queries, and the routing table's pings
    of a full bucket's oldest peer) use ``gate`` as their host."""
    for part in (dht.peer_routing, dht.provider_store, dht.value_store, dht.routing_table,
                 *dht.routing_table.buckets):
        part.host = gate


def skip_startup_refresh(dht: KadDHT) -> None:
    """Narrow, instance-level: the DHT's maintenance loop does not walk the network when it starts; its
    later refreshes (every ``ROUTING_TABLE_REFRESH_INTERVAL``, 10 minutes) run as before.

    py-libp2p 0.8.1's ``KadDHT._run_main_loop`` refreshes the routing table as soon as the service runs: an
    iterative FIND_NODE for this node's own id, then one for a random id in every non-empty bucket, each
    asking up to 20 peers and dialling those it is not connected to (while the node is below its target:
    :class:`DialGate`). At a join that is every newcomer's first seconds, the time this module keeps the
    DHT quiet for (module docstring: no lookup in ``LOOKUP_GRACE_S``): in a traced 64-daemon join on this
    machine's 2 cores the swarm opened 997 DHT streams, 82 without this refresh, and each newcomer's walk
    asked the bootstrap node first. The routing table does not need it: connected peers seed it
    (:meth:`SwarmDiscovery._add_connected_to_routing_table`), and this node's own lookups, when it is short
    of candidates, follow the closer peers that answers name."""
    refresh = dht.refresh_routing_table
    started = False

    async def refresh_after_start() -> None:
        nonlocal started
        if not started:
            started = True
            return
        await refresh()

    dht.refresh_routing_table = refresh_after_start


def swarm_key(swarm: str) -> str:
    """The DHT key (hex multihash, sha2-256) under which the members of `swarm` are providers."""
    digest = hashlib.sha256(f"/starling/v1/swarm/{swarm}".encode()).hexdigest()
    return "1220" + digest


class LookupPacer:
    """When the next lookup runs: every FAST_INTERVAL_S for the first FAST_ROUNDS, then every `interval`,
    doubling while lookups find nobody new, up to MAX_BACKOFF x `interval`; a lookup that finds a new
    member, or a wake (a new connection while below the target), brings it back to `interval`. (A node at
    its target of connections looks nothing up: :meth:`SwarmDiscovery.run`.)"""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.rounds = 0
        self.backoff = 1.0

    def after_lookup(self, *, found_new: bool) -> float:
        """Record a lookup; the seconds to wait before the next one."""
        self.rounds += 1
        if self.rounds < FAST_ROUNDS:
            return FAST_INTERVAL_S
        if found_new:
            self.backoff = 1.0
            return self.interval
        longest = self.interval * MAX_BACKOFF
        delay = min(self.interval * self.backoff, longest)
        self.backoff = min(self.backoff * 2, longest / self.interval)
        return delay

    def woken(self) -> None:
        self.backoff = 1.0


class ProvidePacer:
    """When this node announces itself as a provider: first once past LOOKUP_GRACE_S it is short of
    candidates (the DHT is then its way to more members, and in a small swarm everyone's: five daemons
    found each other there only once one announced), else at a random time between PROVIDE_GRACE_S and
    PROVIDE_LATEST_S after its start (not during the join: see the module docstring); then every
    REPROVIDE_S."""

    def __init__(self, start: float, rng: random.Random | None = None) -> None:
        self.start = start
        self.first = start + (rng or random).uniform(PROVIDE_GRACE_S, PROVIDE_LATEST_S)
        self.last = -math.inf

    def due(self, now: float, *, short: bool = False) -> bool:
        if self.last == -math.inf:
            return (short and now - self.start >= LOOKUP_GRACE_S) or now >= self.first
        return now - self.last >= REPROVIDE_S

    def done(self, now: float) -> None:
        self.last = now


class SwarmDiscovery:
    """Runs the DHT and feeds swarm members found in it to the connection manager."""

    def __init__(self, host: IHost, connmgr: ConnManager, swarm: str, *, interval: float = 10.0) -> None:
        self.host = host
        self.connmgr = connmgr
        self.swarm = swarm
        self.key = swarm_key(swarm)
        self.interval = interval
        self.dht = KadDHT(host, DHTMode.SERVER)
        self.dial_gate = DialGate(host, connmgr)
        gate_dht_dials(self.dht, self.dial_gate)
        bound_provider_store(self.dht.provider_store)
        skip_startup_refresh(self.dht)
        self.members_found: set[ID] = set()
        self.lookups = 0
        self.last_error = ""
        self.provides = 0
        self.lookups_skipped = 0  # lookups not run: the node had its connections, or candidates enough
        self._wake = trio.Event()
        self._in_table: set[ID] = set()

    def peer_connected(self, peer_id: ID) -> None:
        """Called by the connection manager: a fresh connection is a chance to refresh our records, while
        the node is still short of connections (this one included, it has at most its target). A node
        that has its target gains nothing from a lookup per newcomer that connects to it."""
        if len(self.connmgr.connected()) <= self.connmgr.target:
            self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.dht):
            task_status.started()
            pacer = LookupPacer(self.interval)
            start = trio.current_time()
            provider = ProvidePacer(start)
            while True:
                await self._add_connected_to_routing_table()
                now = trio.current_time()
                if provider.due(now, short=self.connmgr.short_of_candidates()):
                    if await self._provide():
                        provider.done(now)
                if now - start < LOOKUP_GRACE_S:
                    # Not woken by connections meanwhile: every newcomer is connecting to someone then.
                    await trio.sleep(start + LOOKUP_GRACE_S - now)
                    continue
                if self.connmgr.short_of_candidates():  # (so below its target)
                    delay = pacer.after_lookup(found_new=await self._lookup())
                else:  # the members' records gave enough to dial: nothing to look up (module docstring)
                    self.lookups_skipped += 1
                    delay = FAST_INTERVAL_S if self.connmgr.below_target() else self.interval
                with trio.move_on_after(delay):
                    await self._wake.wait()
                    pacer.woken()
                self._wake = trio.Event()

    async def _add_connected_to_routing_table(self) -> None:
        """Connected Starling peers all run the DHT in server mode, so they seed our routing table."""
        for peer_id in self.host.get_connected_peers():
            if peer_id in self._in_table:
                continue
            with trio.move_on_after(LOOKUP_TIMEOUT_S):
                try:
                    if await self.dht.add_peer(peer_id, skip_server_mode_check=True):
                        if len(self._in_table) >= MAX_REMEMBERED_PEERS:
                            self._in_table.clear()  # the worst case is adding a peer twice
                        self._in_table.add(peer_id)
                except Exception as e:
                    log.debug("routing table add %s: %s", peer_id, e)

    async def _provide(self) -> bool:
        if self.dht.get_routing_table_size() == 0:
            return False
        with trio.move_on_after(LOOKUP_TIMEOUT_S):
            try:
                self.provides += 1
                return bool(await self.dht.provide(self.key))
            except Exception as e:
                self.last_error = f"provide: {e}"
                log.debug("provide failed: %s", e)
        return False

    async def _lookup(self) -> bool:
        """One lookup of the swarm's providers, handed to the connection manager. True if it found a
        member this node did not know of (found before, a candidate of the connection manager, or
        connected), or failed: no peer answered it (a failed lookup is no sign that the swarm has
        settled; one that ran out of time after answers came is: see the module docstring).

        What a lookup found before its deadline is handed over even when it does not finish: on a loaded
        machine (16 daemons on 2 cores) no lookup finished within LOOKUP_TIMEOUT_S, and dropping their
        partial results meant that the DHT never gave a node a single member.
        """
        if self.dht.get_routing_table_size() == 0:
            return True
        found: dict[ID, PeerInfo] = {}
        answered: list[ID] = []
        with trio.move_on_after(LOOKUP_TIMEOUT_S):
            try:
                await self._find_providers(found, answered)
            except Exception as e:
                self.last_error = f"lookup: {e}"
                log.debug("find_providers failed: %s", e)
            else:
                self.lookups += 1
        failed = not answered
        new = False
        fresh = [p for p in found.values() if p.peer_id != self.host.get_id() and p.addrs]
        known = set(self.connmgr.candidates) | set(self.connmgr.connected())
        for p in fresh:
            if p.peer_id not in self.members_found:
                log.info("discovered swarm member %s", p.peer_id)
                new = new or p.peer_id not in known
            self.members_found.add(p.peer_id)
        if len(self.members_found) > MAX_REMEMBERED_PEERS:  # only a log and a status count: start over
            self.members_found = {p.peer_id for p in fresh}
        self.connmgr.add_candidates(fresh, source="dht")
        return new or failed

    async def _find_providers(self, found: dict[ID, PeerInfo], answered: list[ID]) -> None:
        """Providers of the swarm key, added to ``found`` as they come: what we hold locally plus an
        iterative network lookup; the peers that answered are added to ``answered``.

        py-libp2p's `find_providers` returns the local provider list whenever it is non-empty, and a node
        that provides the key always has itself in that list, so it would never ask the network again.
        We run the lookup ourselves, through the provider store's per-peer query: GET_PROVIDERS to the
        routing table's peers closest to the key, PROVIDER_QUERY_BATCH at a time, following the closer
        peers their answers name, until a batch's answers bring no provider not already found (or
        MAX_PROVIDER_QUERIES peers were asked). No separate closest-peer walk first: see the module
        docstring.
        """
        store = self.dht.provider_store
        key = bytes.fromhex(self.key)
        for p in store.get_providers(key):
            found[p.peer_id] = p
        closest = self.dht.routing_table.find_local_closest_peers(key, MAX_PROVIDER_QUERIES)
        queue = [p for p in closest if p != self.host.get_id()]
        queried: set[ID] = set()
        while queue and len(queried) < MAX_PROVIDER_QUERIES:
            batch, queue = queue[:PROVIDER_QUERY_BATCH], queue[PROVIDER_QUERY_BATCH:]
            closer: list[ID] = []
            before = len(found)

            async def ask(peer_id: ID, closer: list[ID] = closer) -> None:
                queried.add(peer_id)
                with trio.move_on_after(QUERY_TIMEOUT_S):
                    try:
                        providers, closer_peers = await store._get_providers_from_peer_with_closers(peer_id, key)
                    except Exception as e:
                        log.debug("GET_PROVIDERS from %s: %s", peer_id, e)
                        return
                    answered.append(peer_id)
                    for p in providers:
                        found.setdefault(p.peer_id, p)
                        store.add_provider(key, p)
                    closer.extend(closer_peers)

            async with trio.open_nursery() as nursery:
                for peer_id in batch:
                    nursery.start_soon(ask, peer_id)
            if answered and len(found) == before:
                return  # converged: this round of answers named no provider not already found
            for peer_id in closer:
                if peer_id not in queried and peer_id not in queue and peer_id != self.host.get_id():
                    queue.append(peer_id)

    def status(self) -> DiscoveryStatus:
        return {
            "members_found": len(self.members_found),
            "routing_table": self.dht.get_routing_table_size(),
            "lookups": self.lookups,
            "last_error": self.last_error,
            "dials_withheld": self.dial_gate.refused,
            "lookups_skipped": self.lookups_skipped,
        }


def make_on_connected(*callbacks: Callable[[ID], None]) -> Callable[[ID], None]:
    def on_connected(peer_id: ID) -> None:
        for cb in callbacks:
            cb(peer_id)

    return on_connected
