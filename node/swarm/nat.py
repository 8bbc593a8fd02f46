"""NAT traversal for a Starling node: reachability, circuit relay v2, hole punching, and the path to each peer.

One component, :class:`NatService`, because the four parts feed each other:

1. **Reachability.** Connected peers dial us back from a fresh connection (:mod:`protocols.dialback`);
   their answers give a verdict, ``public``, ``private`` or ``unknown``. Not asked in a node's first
   ``dialback_grace_s`` (a swarm starting together would dial each other back during its join).
2. **Relays.** A public node serves circuit relay v2 (py-libp2p's ``CircuitV2Protocol``) with limits on
   reservations, on bytes and duration per circuit, and on concurrent circuits. A node that is not
   public keeps reservations on ``max_reservations`` relays chosen among its directly connected peers,
   and :meth:`NatService.relay_addrs` gives the circuit addresses
   (``/ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/ME``) to advertise so that others can reach it.
3. **Hole punching.** DCUtR (py-libp2p's ``DCUtRProtocol``, run on every node) upgrades a relayed
   connection to a direct one by a TCP simultaneous open. It works through NATs that drop unsolicited
   SYNs and keep ports (home routers) and fails through those that answer with RST or randomise ports;
   the failure is recorded with its cause, and the peer stays relayed.
4. **Paths.** :meth:`NatService.path_of` says how we reach a peer (``direct``, ``hole-punched``,
   ``relayed``), with the RTT the connection's muxer measures (below) and the throughput reported by
   whoever moves bulk bytes. Bulk transfers must not go over ``relayed`` paths: a relay is a shared, rate-limited favour.

Two py-libp2p facts shape the code. ``BasicHost.get_addrs()`` truncates a circuit address at its first
``/p2p/`` component, so circuit addresses cannot travel in identify or DHT provider records (they would
turn into a wrong ``/ip4/R/tcp/P/p2p/ME``); they are advertised by the daemon in its member record
instead. And the swarm never dials ``/p2p-circuit`` addresses (``Swarm.dial_peer`` drops them), so
:meth:`NatService.dial` dials them itself through the relay and upgrades the relayed stream with
Noise and yamux like any other connection.

What is not the service's policy lives beside it: circuit addresses and HOP answers in
node/swarm/circuit.py, the DCUtR hooks that report a punch's outcome in node/swarm/holepunch.py. Why the
service stays one module, though long: the four parts share one view of the connections and each
other's state (the verdict decides relay service and reservations, the punches the paths).

The RTT shown is py-libp2p Yamux's own: each connection's muxer sends a PING frame 0.5 s after it starts
and every 30 s after (``Yamux.rtt``, smoothed). This service used to ping every connected peer with libp2p
ping every 15 s instead, each ping a new stream (multistream-select, a Yamux open and close, about 5 ms of
CPU for both sides): 3,100 such streams in a 64-daemon run (its join and a settled minute), queued at the
busiest nodes behind every other protocol's negotiations, for a figure only status shows (issue #24). A muxer PING frame is 12 bytes read
by the connection's own loop, and it passes over a relayed connection too, which keeps its circuit
carrying data as the pings did.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service

from node.status_schema import ConnectionPath, NatStatus, PeerPathStatus
from node.swarm.circuit import (
    connection_is_relayed,
    hop_ok,
    hop_status_name,
    is_circuit_addr,
    parse_circuit_addr,
    short_id,
    transport_part,
)
from node.swarm.holepunch import ReportingDCUtR, describe_punch_failure
from p2p.connmgr import ConnManager
from p2p.host import interface_ipv4_addrs
from protocols.dialback import (
    PROTOCOL_ID as DIALBACK_PROTOCOL_ID,
)
from protocols.dialback import (
    DialbackOutcome,
    DialbackService,
    DialStatus,
    Verdict,
    classify_dial_error,
    helpers_wanted,
    is_relayed_stream,
    protocol_unsupported,
    verdict,
)

log = logging.getLogger("starling.nat")

Reachability = Literal["public", "private", "unknown"]
Path = ConnectionPath  # declared with the status that reports it (node/status_schema.py)

RELAY_TIMEOUT_S = 10.0  # one RESERVE or CONNECT exchange with a relay
DIRECT_FIRST_S = 3.0  # in dial(): how long direct addresses get before the circuits (at least: `dial_budget_s`)
# A libp2p dial takes about 6 round trips (TCP, the security and muxer negotiations, Noise); a lost SYN is sent
# again after Linux's initial RTO of 1 s, a lost data packet after about 200 ms + 1 RTT.
DIAL_ROUND_TRIPS = 10  # the 6, with room for one lost data packet and jitter
SYN_RETRY_S = 1.0
MAX_BUDGET_RTT_S = 2.0  # a round trip read above this is no link we wait for (a muxer's stale sample)
UNKNOWN_RESERVE_AFTER_S = 30.0  # still unknown after this long: reserve relays anyway, as insurance
FAST_CHECK_S = 2.0  # loop period while reachability is unknown
REASK_HELPER_S = 10.0  # never ask the same helper again sooner (helpers rate-limit us too)
MAX_OUTCOMES = 32  # helpers remembered
# A refused reservation is retried after 5 s, then 10, 20, ... 600 s: short at first because a public
# node starts serving only once its own reachability verdict is in, seconds after we meet it.
RELAY_BACKOFF_S = 5.0
RELAY_BACKOFF_MAX_S = 600.0
MIN_RESERVATION_S = 120.0  # a reservation lifetime outside these bounds means a skewed clock
MAX_RESERVATION_S = 86400.0


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


def dial_budget_s(base_s: float, rtt_s: float | None) -> float:
    """How long a dial may take before we give up on it: `base_s`, or more where the round trips we measured
    make a healthy dial longer (`DIAL_ROUND_TRIPS` round trips and a lost SYN's retry).

    Why: the fixed 3 s that direct addresses got before a relay was tried, and that a dropped member got to be
    dialled again before SWIM probed it, is 1.4 s of round trips at 300 ms of RTT, 3.1 s with one lost SYN:
    a reachable peer would be reached through a relay (and then never average: bulk never crosses a relay)
    or probed through helpers (issue #50's audit of every wait at 300 ms, 50 ms of jitter and 1% loss)."""
    if rtt_s is None or not rtt_s > 0:
        return base_s
    return max(base_s, SYN_RETRY_S + DIAL_ROUND_TRIPS * min(rtt_s, MAX_BUDGET_RTT_S))


@dataclass
class NatConfig:
    """Relay, hole punching and reachability settings. Defaults suit a swarm of tens of nodes.

    Relays carry control traffic only (bulk tensors never go over a relay), so the per-circuit byte
    budget is small; a circuit that needs more should have been upgraded to a direct path. py-libp2p
    checks a circuit's age when data passes; the muxer's RTT pings (every 30 s, module docstring) keep
    data passing, so an idle circuit is also cut within 30 s of its deadline.
    """

    relay_service: Literal["auto", "on", "off"] = "auto"  # auto: serve while our reachability is public
    relay_client: Literal["auto", "always", "off"] = "auto"  # auto: hold reservations unless public
    max_reservations: int = 2  # relays a non-public node keeps a reservation on
    relay_max_reservations: int = 32  # reservations this node accepts as a relay
    relay_max_circuits: int = 4  # concurrent circuits per reserved peer
    relay_circuit_bytes: int = 16 << 20  # bytes per circuit, both directions together
    relay_circuit_seconds: int = 600  # lifetime of one circuit
    relay_reservation_ttl: int = 900  # a client refreshes at half of it
    hole_punch: bool = True
    dialback_interval: float = 300.0  # re-check reachability this often once known
    dialback_grace_s: float = 10.0  # no dial-back asked in a node's first seconds (see _check_reachability)

    def __post_init__(self) -> None:
        if self.relay_service not in ("auto", "on", "off"):
            raise ValueError(f"relay_service must be 'auto', 'on' or 'off', got {self.relay_service!r}")
        if self.relay_client not in ("auto", "always", "off"):
            raise ValueError(f"relay_client must be 'auto', 'always' or 'off', got {self.relay_client!r}")
        positive: dict[str, float] = {
            "relay_max_reservations": self.relay_max_reservations,
            "relay_max_circuits": self.relay_max_circuits,
            "relay_circuit_bytes": self.relay_circuit_bytes,
            "relay_circuit_seconds": self.relay_circuit_seconds,
            "relay_reservation_ttl": self.relay_reservation_ttl,
            "dialback_interval": self.dialback_interval,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 <= self.dialback_grace_s <= 300:
            raise ValueError(f"dialback_grace_s must be between 0 and 300, got {self.dialback_grace_s}")
        if not 0 <= self.max_reservations <= 8:
            raise ValueError(f"max_reservations must be between 0 and 8, got {self.max_reservations}")
        if self.relay_reservation_ttl < 60:
            raise ValueError(f"relay_reservation_ttl must be at least 60 s, got {self.relay_reservation_ttl}")

    def relay_limits(self) -> RelayLimits:
        return RelayLimits(
            duration=self.relay_circuit_seconds,
            data=self.relay_circuit_bytes,
            max_circuit_conns=self.relay_max_circuits,
            max_reservations=self.relay_max_reservations,
            reservation_ttl=self.relay_reservation_ttl,
        )


# --------------------------------------------------------------------------------------------------
# The service
# --------------------------------------------------------------------------------------------------


class RelayRefused(Exception):
    """A relay answered a RESERVE or CONNECT with a status other than OK."""


@dataclass
class Reservation:
    """A slot we hold on a relay; void as soon as our connection to the relay closes."""

    relay: ID
    addrs: list[multiaddr.Multiaddr]  # the relay's transport addresses
    reserved_at: float  # our monotonic clock
    lifetime: float  # seconds, from the relay's expiry time (sanitised against clock skew)
    limit_bytes: int = 0
    limit_seconds: int = 0

    def refresh_due(self, now: float) -> bool:
        return now >= self.reserved_at + self.lifetime / 2

    def expired(self, now: float) -> bool:
        return now >= self.reserved_at + self.lifetime


@dataclass
class _PeerPath:
    throughput_mbps: float | None = None
    punched: bool = False  # the direct connection came from a hole punch
    note: str = ""  # why a relayed peer is still relayed


class NatService:
    """Reachability verdict, relay service and reservations, hole punching, and per-peer paths.

    Run with ``await nursery.start(nat.run)`` after ``host.run(...)`` has started; call
    :meth:`peer_connected` from the connection manager's ``on_connected`` hook. ``reachability`` and
    ``reason`` (the latest notable event, as a sentence for the operator) are plain attributes.
    """

    def __init__(
        self,
        host: IHost,
        connmgr: ConnManager,
        config: NatConfig | None = None,
        *,
        psk: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`psk`: the host's swarm key (None: an open swarm), which the dial-back probes must present."""
        self.host = host
        self.connmgr = connmgr
        self.config = config if config is not None else NatConfig()
        self.clock = clock
        self.reachability: Reachability = "unknown"
        self.reason = "reachability not checked yet"
        self.verdict = Verdict("unknown", "reachability not checked yet")
        self.dialback = DialbackService(host, psk=psk)
        self.circuit = CircuitV2Protocol(host, limits=self.config.relay_limits(), allow_hop=False)
        self.dcutr = ReportingDCUtR(host, self._on_punch) if self.config.hole_punch else None
        self.serving_relay = False
        self.reservations: dict[ID, Reservation] = {}
        self.relay_circuits = 0  # circuits we relay right now
        self._relayed_for: set[ID] = set()  # peers that reserved with us (bounded by the relay limits)
        self._outcomes: dict[str, DialbackOutcome] = {}
        self._asked: dict[ID, float] = {}
        self._relay_next_try: dict[ID, tuple[float, float]] = {}  # relay -> (next attempt, current back-off)
        self._paths: dict[ID, _PeerPath] = {}
        self._started = clock()
        self._wake_reachability = trio.Event()
        self._wake_relays = trio.Event()

    # --- hooks and views -----------------------------------------------------------------------------

    def peer_connected(self, peer_id: ID) -> None:
        """A new peer is a new dial-back helper and relay candidate: look at it soon."""
        self._wake_reachability.set()
        self._wake_relays.set()

    def path_of(self, peer_id: ID | str) -> Path:
        """How we reach `peer_id` now: ``direct``, ``hole-punched``, ``relayed``, or ``none``."""
        pid = ID.from_base58(peer_id) if isinstance(peer_id, str) else peer_id
        direct, relayed = self._connection_kinds(pid)
        if direct:
            state = self._paths.get(pid)
            punching = self.dcutr is not None and pid in self.dcutr.punching
            return "hole-punched" if punching or (state is not None and state.punched) else "direct"
        return "relayed" if relayed else "none"

    def rtt_of(self, peer_id: ID) -> float | None:
        """Seconds: the smoothed RTT that the muxer of the connection on `peer_id`'s path has measured (a
        direct one where there is one, as for new streams); None before its first PING frame came back."""
        direct, _ = self._connection_kinds(peer_id)
        for conn in self.host.get_network().get_connections(peer_id):
            if getattr(conn, "is_closed", False) or connection_is_relayed(conn) == direct:
                continue
            rtt = getattr(getattr(conn, "muxed_conn", None), "rtt", None)
            seconds = rtt() if callable(rtt) else 0.0
            if isinstance(seconds, (int, float)) and seconds > 0:
                return float(seconds)
        return None

    def typical_rtt_s(self) -> float | None:
        """The median round trip of our connections as their muxers measured them (None: none measured): the
        prior for a peer we are not connected to, whose own round trip is unknown until we are."""
        rtts = [rtt for rtt in (self.rtt_of(peer) for peer in self._connected()) if rtt is not None]
        return statistics.median(rtts) if rtts else None

    def peers_status(self) -> list[PeerPathStatus]:
        """Per connected peer: path, RTT (ms) and throughput (Mbit/s) where measured."""
        self._forget_departed()
        out: list[PeerPathStatus] = []
        for peer_id in sorted(self._connected(), key=str):
            state = self._paths.get(peer_id, _PeerPath())
            rtt = self.rtt_of(peer_id)
            row: PeerPathStatus = {
                "peer_id": str(peer_id),
                "path": self.path_of(peer_id),
                "rtt_ms": round(rtt * 1000, 1) if rtt is not None else None,
            }
            if state.throughput_mbps is not None:
                row["throughput_mbps"] = round(state.throughput_mbps, 1)
            if row["path"] == "relayed" and state.note:
                row["note"] = state.note
            out.append(row)
        return out

    def relay_addrs(self) -> list[str]:
        """Circuit addresses through our current reservations, for the daemon to advertise."""
        me = self.host.get_id()
        return [
            f"{addr}/p2p/{r.relay}/p2p-circuit/p2p/{me}"
            for r in self.reservations.values()
            for addr in r.addrs
        ]

    def record_throughput(self, peer_id: ID | str, nbytes: int, seconds: float) -> None:
        """Report a finished bulk transfer (the averager calls this); kept as a smoothed Mbit/s."""
        if nbytes <= 0 or seconds <= 0:
            return
        pid = ID.from_base58(peer_id) if isinstance(peer_id, str) else peer_id
        if pid not in self._connected():
            return
        self._forget_departed()
        state = self._paths.setdefault(pid, _PeerPath())
        mbps = nbytes * 8 / seconds / 1e6
        old = state.throughput_mbps
        state.throughput_mbps = mbps if old is None else old + 0.5 * (mbps - old)

    def status(self) -> NatStatus:
        """For the daemon's status: verdict and reasons, relay service and relay slots, dial-back counts."""
        clients = [
            p for p in self._relayed_for if self.circuit.resource_manager.get_reservation(p) is not None
        ]
        return {
            "reachability": self.reachability,
            "reason": self.reason,
            "reachability_reason": self.verdict.reason,
            "relay_service": "serving" if self.serving_relay else "off",
            "relay_clients": len(clients),  # peers holding a reservation on us
            "relay_circuits": self.relay_circuits,  # circuits we relay now
            "relays": sorted(str(r) for r in self.reservations),  # relays we hold a slot on
            "relay_addrs": self.relay_addrs(),
            "dialback_helpers": len(self._outcomes),
            "dialbacks_served": self.dialback.served,
        }

    # --- dialing ---------------------------------------------------------------------------------------

    async def dial(self, info: PeerInfo) -> None:
        """Connect to a peer by its direct addresses, else through one of its circuit addresses.

        Raises ConnectionError naming every failure. The caller bounds the time (the connection
        manager's dial deadline); direct addresses get DIRECT_FIRST_S of it when circuits are known.
        """
        if self.host.get_network().get_connections(info.peer_id):
            return
        direct = [a for a in info.addrs if not is_circuit_addr(a)]
        circuits = [a for a in info.addrs if is_circuit_addr(a)]
        errors: list[str] = []
        if direct:
            first_s = dial_budget_s(DIRECT_FIRST_S, self.typical_rtt_s())
            try:
                with trio.fail_after(first_s if circuits else float("inf")):
                    await self.host.connect(PeerInfo(info.peer_id, direct))
                return
            except trio.TooSlowError:
                errors.append(f"direct: no answer within {first_s:.1f} s")
            except Exception as e:  # libp2p raises many types for an unreachable peer
                errors.append(f"direct: {classify_dial_error(e)[1]}")
        random.shuffle(circuits)
        for addr in circuits[:3]:
            try:
                await self.dial_circuit(addr)
                return
            except (ValueError, RelayRefused) as e:
                errors.append(str(e))
            except trio.TooSlowError:
                errors.append(f"{addr}: the relay did not answer within {RELAY_TIMEOUT_S:.0f} s")
            except Exception as e:
                errors.append(f"{addr}: {classify_dial_error(e)[1]}")
        raise ConnectionError("; ".join(errors) if errors else f"no address for {info.peer_id}")

    async def dial_circuit(self, addr: multiaddr.Multiaddr | str) -> None:
        """Open a relayed connection: HOP CONNECT on the relay, then Noise + yamux over that stream."""
        relay_addr, relay, dest = parse_circuit_addr(addr)
        if dest == self.host.get_id():
            raise ValueError(f"{addr}: that circuit address is our own")
        if not self.host.get_network().get_connections(relay):
            if relay_addr is None:
                raise ValueError(
                    f"{addr}: not connected to relay {short_id(relay)} and no address to dial it"
                )
            await self.host.connect(PeerInfo(relay, [relay_addr]))
        with trio.fail_after(RELAY_TIMEOUT_S):
            stream = await self._open_hop_stream(relay)
            try:
                await write_delimited_msg(
                    stream, HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=dest.to_bytes()))
                )
                resp = await read_delimited_msg(stream, HopMessage)
                if not hop_ok(resp):
                    raise RelayRefused(
                        f"relay {short_id(relay)} refused a circuit to {short_id(dest)}: {hop_status_name(resp)}"
                    )
                raw = RawConnection(
                    stream=stream,
                    initiator=True,
                    connection_type=ConnectionType.RELAYED,
                    addresses=[multiaddr.Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{dest}")],
                )
                await self.host.upgrade_outbound_connection(raw, dest)
            except BaseException:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await stream.reset()
                raise
        log.info("connected to %s through relay %s", short_id(dest), short_id(relay))

    # --- run -------------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.dialback.register()
        try:
            async with background_trio_service(self.circuit):
                if self.dcutr is not None:
                    async with background_trio_service(self.dcutr):
                        await self._run_loops(task_status)
                else:
                    await self._run_loops(task_status)
        finally:
            self._serve_relay(False)
            self.dialback.unregister()

    async def _run_loops(self, task_status: trio.TaskStatus[None]) -> None:
        """Two independent loops: a slow dial-back round must not delay reservations."""
        async with trio.open_nursery() as nursery:
            self._update_relay_service()
            task_status.started()
            nursery.start_soon(self._reachability_loop)
            nursery.start_soon(self._relay_loop)

    async def _reachability_loop(self) -> None:
        while True:
            await self._check_reachability()
            self._update_relay_service()
            with trio.move_on_after(FAST_CHECK_S if self.reachability == "unknown" else 10.0):
                await self._wake_reachability.wait()
            self._wake_reachability = trio.Event()

    async def _relay_loop(self) -> None:
        while True:
            await self._maintain_reservations()
            with trio.move_on_after(FAST_CHECK_S if self._reservations_short() else 10.0):
                await self._wake_relays.wait()
            self._wake_relays = trio.Event()

    # --- reachability ---------------------------------------------------------------------------------

    def _protocols_of(self, peer_id: ID) -> list[str]:
        """The protocols identify says `peer_id` speaks; none where the peerstore has no entry for it yet."""
        try:
            return list(self.host.get_peerstore().get_protocols(peer_id))
        except Exception:  # py-libp2p raises PeerStoreError for a peer it holds nothing of
            return []

    def _helpers(self) -> list[ID]:
        """Directly connected peers that may speak dial-back (identify says so, or has not said yet)."""
        out = []
        for peer_id in self._connected():
            if not self._connection_kinds(peer_id)[0]:
                continue
            protocols = self._protocols_of(peer_id)
            if protocols and DIALBACK_PROTOCOL_ID not in protocols:
                continue
            out.append(peer_id)
        return out

    async def _check_reachability(self) -> None:
        """Ask helpers to dial us back while the verdict is unknown or stale; not in the first
        ``dialback_grace_s`` after the start.

        Why the grace: each answer is a dial from a fresh connection (a Noise handshake on both sides, then
        every protocol's first streams), and in a swarm started together every newcomer asks at once, in the
        join. A traced 64-daemon join on this machine's 2 cores carried some 370 dial-back streams and their
        connections; with no dial-back in each node's first 10 s every member was known 17.5-24.6 s after
        the last start in four traced runs, against 20.1-29.1 s (docs/benchmarks.md, "Scale: real daemons").
        A node behind a NAT learns that it is private 10 s later; it reserves relays anyway once unknown for
        ``UNKNOWN_RESERVE_AFTER_S``."""
        now = self.clock()
        if now - self._started < self.config.dialback_grace_s:
            return
        helpers = self._helpers()
        stale = (
            now - max((o.at for o in self._outcomes.values()), default=-1e9) > self.config.dialback_interval
        )
        if self.reachability != "unknown" and not stale:
            return
        due = [h for h in helpers if now - self._asked.get(h, -1e9) >= REASK_HELPER_S]
        random.shuffle(due)
        ask = due[:helpers_wanted(self._outcomes.values())] if self.reachability == "unknown" else due[:2]
        if not ask:
            return
        offered = [str(a) for a in self.host.get_addrs() if not is_circuit_addr(a)]
        results: list[DialbackOutcome] = []

        async def one(helper: ID) -> None:
            self._asked[helper] = self.clock()
            results.append(await self.dialback.ask(helper, offered))

        async with trio.open_nursery() as nursery:
            for helper in ask:
                nursery.start_soon(one, helper)
        for o in results:
            log.debug("dial-back by %s: %s %s %s", short_id(o.helper), o.status.value, o.addr, o.detail)
            self._outcomes[o.helper] = o
        horizon = self.clock() - 3 * self.config.dialback_interval
        for key in [k for k, o in self._outcomes.items() if o.at < horizon]:
            del self._outcomes[key]
        while len(self._outcomes) > MAX_OUTCOMES:
            del self._outcomes[min(self._outcomes, key=lambda k: self._outcomes[k].at)]
        for peer_id in [p for p in self._asked if p not in set(helpers)]:
            if self.clock() - self._asked[peer_id] > REASK_HELPER_S:
                del self._asked[peer_id]
        available = len(set(map(str, helpers)) | set(self._outcomes))
        self._set_verdict(
            verdict(self._outcomes.values(), own_ips=set(interface_ipv4_addrs()), available=available)
        )

    def _set_verdict(self, new: Verdict) -> None:
        changed = new.reachability != self.reachability
        self.verdict = new
        if changed:
            self.reachability = new.reachability
            self.reason = f"reachability {new.reachability}: {new.reason}"
            log.info("%s", self.reason)
            self._wake_relays.set()  # reservations follow the verdict

    # --- relay service --------------------------------------------------------------------------------

    def _update_relay_service(self) -> None:
        mode = self.config.relay_service
        self._serve_relay(mode == "on" or (mode == "auto" and self.reachability == "public"))

    def _serve_relay(self, serve: bool) -> None:
        if serve == self.serving_relay:
            return
        self.serving_relay = serve
        if serve:
            self.host.set_stream_handler(HOP_PROTOCOL_ID, self._handle_hop)
            limits = self.config
            log.info(
                "serving circuit relay v2: up to %d reservations, %d circuits each, %d MiB and %d s per circuit",
                limits.relay_max_reservations,
                limits.relay_max_circuits,
                limits.relay_circuit_bytes >> 20,
                limits.relay_circuit_seconds,
            )
        else:
            self.host.remove_stream_handler(HOP_PROTOCOL_ID)
            log.info("stopped serving circuit relay")

    async def _handle_hop(self, stream: INetStream) -> None:
        """One HOP request per stream, handed to py-libp2p's relay; we add the checks it lacks.

        The library's own handler loops for more messages on the stream and logs an error when the
        client closes it after its one request, as every client does; it would also accept requests
        over relayed connections, which the spec forbids. We read one message and dispatch it.
        """
        peer_id = stream.muxed_conn.peer_id
        try:
            if not self.serving_relay or is_relayed_stream(stream):
                await self._hop_status(stream, StatusCode.PERMISSION_DENIED)
                return
            with trio.fail_after(RELAY_TIMEOUT_S):
                msg = await read_delimited_msg(stream, HopMessage)
            if msg.type == HopMessage.RESERVE:
                # Reserve for the authenticated peer only, never for a peer named in the message.
                msg.ClearField("peer")
                await self.circuit._handle_reserve(stream, msg)
                held = self.circuit.resource_manager.get_reservation
                if held(peer_id) is not None:
                    self._relayed_for.add(peer_id)
                if len(self._relayed_for) > 2 * self.config.relay_max_reservations:
                    self._relayed_for = {p for p in self._relayed_for if held(p) is not None}
                with trio.move_on_after(2):
                    await stream.close()
            elif msg.type == HopMessage.CONNECT:
                limit = self.config.relay_max_reservations * self.config.relay_max_circuits
                if self.relay_circuits >= limit:
                    await self._hop_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
                    return
                self.relay_circuits += 1
                try:
                    await self.circuit._handle_connect(stream, msg)  # returns when the circuit ends
                finally:
                    self.relay_circuits -= 1
            else:
                await self._hop_status(stream, StatusCode.UNEXPECTED_MESSAGE)
        except Exception as e:  # a broken or misbehaving client must not disturb the relay
            log.debug("relay request from %s: %s", short_id(peer_id), e)
            with trio.move_on_after(1):
                await stream.reset()

    async def _hop_status(self, stream: INetStream, code: StatusCode) -> None:
        with trio.move_on_after(2):
            await write_delimited_msg(
                stream, HopMessage(type=HopMessage.STATUS, status=to_proto_status(code))
            )
            await stream.close()

    # --- reservations (relay client) ------------------------------------------------------------------

    def _want_relays(self) -> bool:
        if self.config.relay_client != "auto":
            return self.config.relay_client == "always"
        if self.reachability == "private":
            return True
        return self.reachability == "unknown" and self.clock() - self._started >= UNKNOWN_RESERVE_AFTER_S

    def _reservations_short(self) -> bool:
        return self._want_relays() and len(self.reservations) < self.config.max_reservations

    async def _maintain_reservations(self) -> None:
        now = self.clock()
        for relay, r in list(self.reservations.items()):
            if r.expired(now):
                self._drop_reservation(relay, "expired")
            elif not self.host.get_network().get_connections(relay):
                self._drop_reservation(relay, "connection to the relay lost")
        if not self._want_relays():
            for relay in list(self.reservations):
                self._drop_reservation(relay, f"not needed: reachability is {self.reachability}")
            return
        due = [relay for relay, r in self.reservations.items() if r.refresh_due(now)]
        wanted = self.config.max_reservations - len(self.reservations)
        candidates = self._relay_candidates()[: max(0, wanted)]
        async with trio.open_nursery() as nursery:
            for relay in due + candidates:
                nursery.start_soon(self._try_reserve, relay)

    def _relay_candidates(self) -> list[ID]:
        """Directly connected peers to try as relays: those announcing the HOP protocol first."""
        now = self.clock()
        preferred: list[ID] = []
        others: list[ID] = []
        for peer_id in self._connected():
            if peer_id in self.reservations or self._relay_next_try.get(peer_id, (0.0, 0.0))[0] > now:
                continue
            if not self._connection_kinds(peer_id)[0]:
                continue
            (preferred if HOP_PROTOCOL_ID in self._protocols_of(peer_id) else others).append(peer_id)
        random.shuffle(preferred)
        random.shuffle(others)
        return preferred + others

    async def _try_reserve(self, relay: ID) -> None:
        refresh = relay in self.reservations
        try:
            r = await self.reserve(relay)
        except Exception as e:
            _, backoff = self._relay_next_try.get(relay, (0.0, RELAY_BACKOFF_S / 2))
            backoff = min(RELAY_BACKOFF_MAX_S, backoff * 2)
            self._relay_next_try[relay] = (self.clock() + backoff, backoff)
            while len(self._relay_next_try) > 256:
                del self._relay_next_try[min(self._relay_next_try, key=lambda p: self._relay_next_try[p][0])]
            text = str(e) if isinstance(e, RelayRefused) else f"{type(e).__name__}: {e}"
            log.debug("no reservation on %s: %s", short_id(relay), text)
            if refresh:
                self._drop_reservation(relay, f"refresh failed: {text}")
            return
        self._relay_next_try.pop(relay, None)
        self.reservations[relay] = r
        if not refresh:
            # Keep the relay connected and out of the connection manager's pruning while we hold a slot.
            self.connmgr.add_candidate(PeerInfo(relay, r.addrs), source="relay", permanent=True)
            self.reason = f"reserved a relay slot on {short_id(relay)}; reachable at {len(self.relay_addrs())} circuit address(es)"
            log.info("%s", self.reason)

    async def _open_hop_stream(self, relay: ID) -> INetStream:
        try:
            return await self.host.new_stream(relay, [HOP_PROTOCOL_ID])
        except Exception as e:
            if protocol_unsupported(e):
                raise RelayRefused(
                    f"{short_id(relay)} is not a relay (it does not serve circuit relay v2)"
                ) from None
            raise

    async def reserve(self, relay: ID) -> Reservation:
        """One RESERVE exchange with a connected relay; raises RelayRefused with the relay's answer.

        The background loop calls this; it does not record the reservation (the loop does).
        """
        with trio.fail_after(RELAY_TIMEOUT_S):
            stream = await self._open_hop_stream(relay)
            try:
                await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                resp = await read_delimited_msg(stream, HopMessage)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await stream.close()
        if not hop_ok(resp) or not resp.HasField("reservation"):
            raise RelayRefused(f"relay {short_id(relay)} refused a reservation: {hop_status_name(resp)}")
        addrs: list[multiaddr.Multiaddr] = []
        for raw in resp.reservation.addrs:
            try:
                addr = transport_part(multiaddr.Multiaddr(bytes(raw)))
            except Exception:
                addr = None
            if addr is not None and str(addr) not in {str(a) for a in addrs}:
                addrs.append(addr)
        if not addrs:  # fall back to the address we reach the relay at
            for conn in self.host.get_network().get_connections(relay):
                for a in conn.get_transport_addresses():
                    if (addr := transport_part(a)) is not None:
                        addrs.append(addr)
        if not addrs:
            raise RelayRefused(f"relay {short_id(relay)} gave no address to advertise")
        limit = resp.limit if resp.HasField("limit") else None
        # The expiry is the relay's unix time; a skewed clock on either side must not make us refresh
        # in a tight loop or hold a slot the relay has already forgotten.
        lifetime = resp.reservation.expire - time.time()
        if not MIN_RESERVATION_S <= lifetime <= MAX_RESERVATION_S:
            lifetime = MIN_RESERVATION_S
        return Reservation(
            relay=relay,
            addrs=addrs[:4],
            reserved_at=self.clock(),
            lifetime=lifetime,
            limit_bytes=int(limit.data) if limit is not None else 0,
            limit_seconds=int(limit.duration) if limit is not None else 0,
        )

    def _drop_reservation(self, relay: ID, why: str) -> None:
        if self.reservations.pop(relay, None) is None:
            return
        cand = self.connmgr.candidates.get(relay)
        if cand is not None and cand.source == "relay":
            cand.permanent = False
        self.reason = f"dropped the relay slot on {short_id(relay)}: {why}"
        log.info("%s", self.reason)

    # --- hole punching and paths ----------------------------------------------------------------------

    def _on_punch(self, peer_id: ID, ok: bool, errors: list[tuple[str, DialStatus, str]]) -> None:
        self._forget_departed()
        state = self._paths.setdefault(peer_id, _PeerPath())
        if ok:
            state.punched, state.note = True, ""
            self.reason = f"hole punching to {short_id(peer_id)} succeeded: direct connection"
            log.info("%s", self.reason)
        else:
            state.note = describe_punch_failure(peer_id, errors)
            self.reason = state.note
            log.info("%s", self.reason)

    def _connected(self) -> list[ID]:
        me = self.host.get_id()
        return [p for p in self.host.get_connected_peers() if p != me]

    def _connection_kinds(self, peer_id: ID) -> tuple[bool, bool]:
        """(has a direct connection, has a relayed connection) to `peer_id`."""
        direct = relayed = False
        for conn in self.host.get_network().get_connections(peer_id):
            if getattr(conn, "is_closed", False):
                continue
            if connection_is_relayed(conn):
                relayed = True
            else:
                direct = True
        return direct, relayed

    def _forget_departed(self) -> None:
        connected = set(self._connected())
        for peer_id in [p for p in self._paths if p not in connected]:
            del self._paths[peer_id]
