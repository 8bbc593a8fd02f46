"""Reachability by dial-back: peers dial us from a fresh connection and we check that they got through.

Why not libp2p's AutoNAT v1: its dial-back reuses the connection the request arrived on, so a node behind
a NAT is told it is public (shared/design/py-libp2p-notes.md, pitfall 7). Here the helper dials from a
*throwaway host with a fresh key*, which has no connection to anyone, so the only way its dial can arrive
is through the asker's address from the outside, exactly what a future peer would have to do.

Protocol ``/starling/dialback/1.0.0`` (msgpack messages framed by :mod:`p2p.wire`)::

    asker  --DialbackRequest{nonce, addrs}-->  helper            (existing connection)
    helper's throwaway host  --DialbackProbe{nonce}-->  asker    (NEW connection, fresh key)
    asker  --ProbeAck{ok}-->  helper's throwaway host
    helper --DialbackResult{status, addr, observed_ip}--> asker  (existing connection)

Truthfulness, point by point:

* The asker believes its own handler, not the helper: a dial-back counts as *reached* only if the probe
  carrying the nonce arrived on a direct connection from a peer other than the helper. A helper that
  claims success without a probe is reported as ``unverified`` and not counted.
* The helper dials only the IP it observes the asker at (the source address of the existing
  connection), never an arbitrary address from the request: a node behind a NAT is therefore dialed at
  its NAT's public address, where unsolicited SYNs are dropped (home routers) or answered with RST
  (hostile ones), and nobody can use a helper to make it connect to third parties. When no offered
  address has that IP, the helper tries the observed IP with the offered ports (a port forward).
* A helper on the asker's own LAN sees the asker's interface address and would reach it; the verdict
  discounts such confirmations when another helper saw us at a different (NAT) address.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Literal

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.exceptions import MultiselectClientError

from p2p.host import build_host
from p2p.wire import LibP2PByteStream, ProtocolError, recv_as, send_msg, spec

log = logging.getLogger("starling.dialback")

PROTOCOL_ID = TProtocol("/starling/dialback/1.0.0")
NONCE_BYTES = 16
MAX_ADDRS = 8  # candidate addresses an asker may offer
MAX_ADDR_LEN = 256
MAX_TARGETS = 2  # addresses a helper dials per request, concurrently
MAX_MSG_BYTES = 4096
DIAL_TIMEOUT_S = 5.0  # a helper's dial (TCP + Noise + stream) to one target
ASK_MARGIN_S = 10.0  # the asker waits the helper's dial deadline plus this (reads, probe exchange)
READ_TIMEOUT_S = 5.0  # any single message on a dial-back stream
MAX_CONCURRENT_SERVES = 4  # dial-backs a helper runs at once; more are answered "busy"
MIN_SERVE_INTERVAL_S = 5.0  # per asker: a helper is not a free port scanner
MAX_PENDING = 64  # outstanding requests of one asker


class DialStatus(StrEnum):
    """What happened to one dial-back request, as seen by the asker."""

    REACHED = "reached"  # our handler received the nonce on a fresh connection
    REFUSED = "refused"  # the target answered with RST (e.g. a NAT that rejects unsolicited SYNs)
    TIMEOUT = "timeout"  # no answer within the deadline (e.g. a NAT that drops unsolicited SYNs)
    UNREACHABLE = "unreachable"  # no route to the target
    FAILED = "failed"  # connected, but not to us (handshake failed, another peer id, ...)
    NO_ADDRESS = "no_address"  # we offered nothing the helper could dial
    BUSY = "busy"  # the helper declined: too many dial-backs, or we asked too often
    RELAYED = "relayed"  # the helper only knows us through a relay, so it cannot observe our address
    UNVERIFIED = "unverified"  # the helper claims success but no probe reached us: not believed
    ERROR = "error"  # the helper did not answer properly (no protocol, broken stream, timeout)


#: Statuses that say something about *our* reachability; the others are about the helper.
CONCLUSIVE_FAILURES = frozenset(
    {DialStatus.REFUSED, DialStatus.TIMEOUT, DialStatus.UNREACHABLE, DialStatus.FAILED, DialStatus.NO_ADDRESS}
)
#: Which failure explains the most when a helper tried several targets.
_FAILURE_RANK = [DialStatus.REFUSED, DialStatus.TIMEOUT, DialStatus.UNREACHABLE, DialStatus.FAILED, DialStatus.ERROR]


# --------------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DialbackRequest:
    KIND: ClassVar[str] = "dialback_request"
    VERSION: ClassVar[int] = 1
    nonce: bytes = spec(min_len=NONCE_BYTES, max_len=NONCE_BYTES)
    addrs: tuple[str, ...] = spec(max_len=MAX_ADDRS)

    def __post_init__(self) -> None:
        for addr in self.addrs:
            if len(addr) > MAX_ADDR_LEN:
                raise ValueError(f"address of {len(addr)} characters, limit {MAX_ADDR_LEN}")


@dataclass(frozen=True)
class DialbackProbe:
    KIND: ClassVar[str] = "dialback_probe"
    VERSION: ClassVar[int] = 1
    nonce: bytes = spec(min_len=NONCE_BYTES, max_len=NONCE_BYTES)


@dataclass(frozen=True)
class ProbeAck:
    KIND: ClassVar[str] = "dialback_probe_ack"
    VERSION: ClassVar[int] = 1
    ok: bool


@dataclass(frozen=True)
class DialbackResult:
    KIND: ClassVar[str] = "dialback_result"
    VERSION: ClassVar[int] = 1
    status: DialStatus
    addr: str = spec(max_len=MAX_ADDR_LEN, default="")
    observed_ip: str = spec(max_len=64, default="")
    detail: str = spec(max_len=200, default="")


@dataclass(frozen=True)
class DialbackOutcome:
    """One helper's answer to one request, with the asker's own verification folded in."""

    helper: str  # the helper's peer id (base58)
    status: DialStatus
    addr: str = ""  # the address the helper dialed
    observed_ip: str = ""  # where the helper sees us
    detail: str = ""
    at: float = 0.0  # time.monotonic() when the answer arrived

    @property
    def conclusive(self) -> bool:
        return self.status is DialStatus.REACHED or self.status in CONCLUSIVE_FAILURES


# --------------------------------------------------------------------------------------------------
# Pure helpers: target selection, error classification, verdict
# --------------------------------------------------------------------------------------------------


def _ip_and_port(addr: multiaddr.Multiaddr) -> tuple[str, str, int] | None:
    """(ip protocol, ip, tcp port) of /ip4|ip6/X/tcp/P[/p2p/..], or None for anything else."""
    protos = [p.name for p in addr.protocols()]
    if len(protos) < 2 or protos[0] not in ("ip4", "ip6") or protos[1] != "tcp":
        return None
    if any(p not in ("ip4", "ip6", "tcp", "p2p") for p in protos) or "p2p-circuit" in str(addr):
        return None
    try:
        return protos[0], addr.value_for_protocol(protos[0]), int(addr.value_for_protocol("tcp"))
    except (ValueError, TypeError):
        return None


def select_targets(offered: Sequence[str], observed_ip: str) -> list[multiaddr.Multiaddr]:
    """The addresses a helper dials: offered ones at the observed IP, else the observed IP at offered ports.

    Never any other IP, so a request cannot turn a helper into a scanner of third parties. Malformed,
    non-TCP and circuit addresses are ignored.
    """
    try:
        observed = ipaddress.ip_address(observed_ip)
    except ValueError:
        return []
    proto = "ip4" if observed.version == 4 else "ip6"
    exact: list[multiaddr.Multiaddr] = []
    ports: list[int] = []
    for text in offered[:MAX_ADDRS]:
        try:
            parsed = _ip_and_port(multiaddr.Multiaddr(text))
        except Exception:  # the multiaddr library raises several unrelated types
            continue
        if parsed is None or not 0 < parsed[2] < 65536:
            continue
        _, ip, port = parsed
        if port not in ports:
            ports.append(port)
        if ip == str(observed):
            target = multiaddr.Multiaddr(f"/{proto}/{observed}/tcp/{port}")
            if str(target) not in {str(t) for t in exact}:
                exact.append(target)
    if exact:
        return exact[:MAX_TARGETS]
    return [multiaddr.Multiaddr(f"/{proto}/{observed}/tcp/{port}") for port in ports[:MAX_TARGETS]]


def _exception_tree(exc: BaseException) -> Iterator[BaseException]:
    """exc, its causes/contexts and the members of exception groups, each once (bounded).

    py-libp2p nests the socket error several levels down and collects per-address failures in its own
    ``MultiError`` (an ``errors`` list), so all three ways of nesting are followed.
    """
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < 64:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        members = getattr(e, "errors", None)
        if isinstance(members, (list, tuple)):
            todo.extend(m for m in members if isinstance(m, BaseException))
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)


def protocol_unsupported(exc: BaseException) -> bool:
    """True if a new_stream() failed only because the peer does not speak the protocol."""
    return any(
        isinstance(e, MultiselectClientError) and "not supported" in str(e) for e in _exception_tree(exc)
    )


def classify_dial_error(exc: BaseException) -> tuple[DialStatus, str]:
    """Map the many exception types a failed libp2p dial raises to what they mean on the network."""
    tree = list(_exception_tree(exc))
    for e in tree:
        if isinstance(e, ConnectionRefusedError) or (
            isinstance(e, OSError) and e.errno == errno.ECONNREFUSED
        ):
            return DialStatus.REFUSED, "connection refused (answered with RST)"
    for e in tree:
        if isinstance(e, OSError) and e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return DialStatus.UNREACHABLE, "no route to host"
    for e in tree:
        if isinstance(e, (trio.TooSlowError, TimeoutError)):
            return DialStatus.TIMEOUT, "no answer"
    return DialStatus.FAILED, f"{type(exc).__name__}: {exc}"[:200]


@dataclass(frozen=True)
class Verdict:
    reachability: Literal["public", "private", "unknown"]
    reason: str


#: Conclusive answers that must agree for a verdict where more than one helper is available (:func:`verdict`).
AGREEING_ANSWERS = 2


def latest_per_helper(outcomes: Iterable[DialbackOutcome]) -> dict[str, DialbackOutcome]:
    """Each helper's latest answer: only that one counts."""
    latest: dict[str, DialbackOutcome] = {}
    for o in outcomes:
        if o.helper not in latest or o.at >= latest[o.helper].at:
            latest[o.helper] = o
    return latest


def helpers_wanted(outcomes: Iterable[DialbackOutcome]) -> int:
    """How many helpers a round of the reachability check asks while the verdict is unknown: as many as the
    verdict still needs (``AGREEING_ANSWERS`` conclusive answers that agree), at least one.

    Why not more: each ask is a probe, a connection of its own from a throwaway host (a Noise handshake and
    identify both ways; the asker opens no state or SWIM stream to it, as it did once: the dialler opens
    those, node/swarm/replicator.py and swim_service.py). At a
    64-daemon join every new connection woke the check while the verdict was unknown, and rounds of three
    asks made 3.4 per node, about 216 of the join's 677 connections (issue #24)."""
    latest = latest_per_helper(outcomes).values()
    reached = sum(1 for o in latest if o.status is DialStatus.REACHED)
    failed = sum(1 for o in latest if o.status in CONCLUSIVE_FAILURES)
    return max(1, AGREEING_ANSWERS - max(reached, failed))


def verdict(outcomes: Iterable[DialbackOutcome], *, own_ips: Collection[str], available: int) -> Verdict:
    """Reachability from the latest outcome per helper.

    public: at least 2 distinct helpers reached us (1 when only 1 helper is available); private: every
    conclusive answer is a failure (at least 2 of them, or 1 when only 1 helper is available); unknown
    otherwise. A confirmation from a helper that saw us at one of our own interface addresses while
    another helper saw us elsewhere comes from our LAN, not from the outside, and is not counted.
    """
    latest = latest_per_helper(outcomes)
    conclusive = [o for o in latest.values() if o.conclusive]
    behind_nat = any(o.observed_ip and o.observed_ip not in own_ips for o in conclusive)
    reached = [o for o in conclusive if o.status is DialStatus.REACHED]
    lan = [o for o in reached if behind_nat and o.observed_ip in own_ips]
    reached = [o for o in reached if o not in lan]
    failed = [o for o in conclusive if o.status in CONCLUSIVE_FAILURES]
    # A LAN helper's view says nothing about the outside, so it does not count as an available helper.
    need = 1 if max(available - len(lan), len(conclusive) - len(lan)) <= 1 else AGREEING_ANSWERS
    lan_note = f"; {len(lan)} confirmation(s) from our own LAN ignored" if lan else ""
    if len(reached) >= need:
        where = sorted({o.observed_ip for o in reached if o.observed_ip})
        at = f" at {', '.join(where)}" if where else ""
        return Verdict(
            "public", f"{len(reached)} of {len(conclusive)} peers dialed us back from a fresh connection{at}"
        )
    if failed and not reached and len(failed) >= need:
        first = failed[0]
        why = " ".join(filter(None, [first.addr, first.status.value])) + (
            f": {first.detail}" if first.detail else ""
        )
        return Verdict(
            "private", f"{len(failed)} of {len(conclusive)} peers could not dial us back ({why}){lan_note}"
        )
    if not conclusive:
        unverified = [o for o in latest.values() if o.status is DialStatus.UNVERIFIED]
        note = f"; {len(unverified)} unverified claim(s) ignored" if unverified else ""
        return Verdict("unknown", f"no peer has dialed us back yet{note}")
    return Verdict(
        "unknown",
        f"{len(reached)} of {len(conclusive)} peers dialed us back; need {need} confirmations or consistent failures{lan_note}",
    )


# --------------------------------------------------------------------------------------------------
# The service: asks, serves, and receives probes
# --------------------------------------------------------------------------------------------------


def is_relayed_stream(stream: INetStream) -> bool:
    """True if the stream runs over a /p2p-circuit connection (its source address is the relay's)."""
    conn = getattr(stream, "muxed_conn", None)
    try:
        if conn is not None and conn.get_connection_type() == ConnectionType.RELAYED:
            return True
    except Exception:
        pass
    for obj in (conn, getattr(conn, "secured_conn", None)):
        getter = getattr(obj, "get_transport_addresses", None)
        if callable(getter):
            try:
                if any("/p2p-circuit" in str(a) for a in getter() or []):
                    return True
            except Exception:
                continue
    return False


def _throwaway_host(psk: str | None = None) -> IHost:
    """A host with a brand-new key and no listeners: its connections are fresh by construction.

    `psk` is the swarm key of a private swarm: without it the asker's host refuses the probe's handshake
    (p2p/auth.py) and every keyed node would be judged private, the fast side channel unused.
    """
    return build_host(create_new_key_pair(), max_connections=4, dial_timeout=DIAL_TIMEOUT_S, psk=psk)


def _note_tcp_opened(host: IHost) -> trio.Event:
    """An event set once a connection of `host` (a throwaway prober) reaches its security handshake, that
    is, once a TCP connection opened. Wraps the upgrader of this one host instance (as p2p/auth.py does for
    the node's own host); a host without one is left alone and the event never set."""
    opened = trio.Event()
    get_network = getattr(host, "get_network", None)  # a test's stand-in prober may have none
    upgrader = getattr(get_network(), "upgrader", None) if get_network is not None else None
    upgrade_security = getattr(upgrader, "upgrade_security", None)
    if upgrade_security is None:
        return opened

    async def noting(raw_conn: Any, is_initiator: bool, peer_id: Any = None) -> Any:
        opened.set()
        return await upgrade_security(raw_conn, is_initiator, peer_id)

    upgrader.upgrade_security = noting
    return opened


@dataclass
class _Pending:
    helper: ID
    received: bool = False


class DialbackService:
    """Both roles of ``/starling/dialback/1.0.0``: asking peers, and dialing them back when asked.

    Register the handler with :meth:`register` once the host runs; :meth:`ask` needs no background task.
    """

    def __init__(
        self,
        host: IHost,
        *,
        dial_timeout: float = DIAL_TIMEOUT_S,
        psk: str | None = None,
        make_prober: Callable[[], IHost] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`psk`: the swarm key `host` was built with (None: an open swarm); the throwaway hosts that dial
        back use it too, or no keyed peer could accept them."""
        self.host = host
        self.dial_timeout = dial_timeout
        self.ask_timeout = dial_timeout + ASK_MARGIN_S
        self.make_prober = make_prober if make_prober is not None else (lambda: _throwaway_host(psk))
        self.clock = clock
        self.served = 0  # dial-backs performed for others
        self._pending: dict[bytes, _Pending] = {}
        self._serving = trio.Semaphore(MAX_CONCURRENT_SERVES)
        self._last_served: OrderedDict[ID, float] = OrderedDict()

    def register(self) -> None:
        self.host.set_stream_handler(PROTOCOL_ID, self._handle)

    def unregister(self) -> None:
        self.host.remove_stream_handler(PROTOCOL_ID)

    # --- asker ---------------------------------------------------------------------------------------

    async def ask(self, helper: ID, addrs: Sequence[str]) -> DialbackOutcome:
        """Ask `helper` to dial us back at one of `addrs`; never raises for a misbehaving helper."""
        if len(self._pending) >= MAX_PENDING:
            return self._outcome(helper, DialStatus.ERROR, detail="too many requests in flight")
        nonce = secrets.token_bytes(NONCE_BYTES)
        pending = self._pending[nonce] = _Pending(helper)
        offered = tuple(a for a in addrs if len(a) <= MAX_ADDR_LEN)[:MAX_ADDRS]
        try:
            with trio.move_on_after(self.ask_timeout):
                result = await self._exchange(helper, DialbackRequest(nonce=nonce, addrs=offered))
                if pending.received:
                    return self._outcome(helper, DialStatus.REACHED, result.addr, result.observed_ip)
                status = DialStatus.UNVERIFIED if result.status is DialStatus.REACHED else result.status
                return self._outcome(helper, status, result.addr, result.observed_ip, result.detail)
            return self._outcome(
                helper, DialStatus.ERROR, detail=f"no answer within {self.ask_timeout:.0f} s"
            )
        except ProtocolError as e:
            return self._outcome(helper, DialStatus.ERROR, detail=f"protocol error: {e}")
        except Exception as e:  # no such protocol, connection lost, ...: the helper's problem, not ours
            if protocol_unsupported(e):
                return self._outcome(helper, DialStatus.ERROR, detail="the peer does not speak dial-back")
            return self._outcome(helper, DialStatus.ERROR, detail=f"{type(e).__name__}: {e}"[:200])
        finally:
            del self._pending[nonce]

    async def _exchange(self, helper: ID, request: DialbackRequest) -> DialbackResult:
        stream = LibP2PByteStream(await self.host.new_stream(helper, [PROTOCOL_ID]))
        try:
            await send_msg(stream, request)
            return await recv_as(stream, DialbackResult, MAX_MSG_BYTES)
        finally:
            with trio.move_on_after(2):
                await stream.aclose()

    def _outcome(
        self, helper: ID, status: DialStatus, addr: str = "", observed_ip: str = "", detail: str = ""
    ) -> DialbackOutcome:
        return DialbackOutcome(str(helper), status, addr, observed_ip, detail, self.clock())

    # --- both roles: one handler, two kinds of first message -----------------------------------------

    async def _handle(self, stream: INetStream) -> None:
        wrapped = LibP2PByteStream(stream)
        try:
            with trio.fail_after(self.ask_timeout):  # the whole conversation, a dial-back included
                with trio.fail_after(READ_TIMEOUT_S):
                    first: Any = await recv_as(wrapped, (DialbackRequest, DialbackProbe), MAX_MSG_BYTES)
                if isinstance(first, DialbackProbe):
                    await self._accept_probe(stream, wrapped, first)
                else:
                    await self._serve(stream, wrapped, first)
        except (ProtocolError, trio.TooSlowError) as e:
            log.debug("dial-back stream from %s: %s", stream.muxed_conn.peer_id, e)
            with trio.move_on_after(2):
                await wrapped.reset()
            return
        with trio.move_on_after(2):
            await wrapped.aclose()

    async def _accept_probe(
        self, stream: INetStream, wrapped: LibP2PByteStream, probe: DialbackProbe
    ) -> None:
        """Record a probe if it is for a request of ours and came in from the outside, fresh."""
        pending = self._pending.get(probe.nonce)
        remote = stream.muxed_conn.peer_id
        ok = pending is not None and remote != pending.helper and not is_relayed_stream(stream)
        if pending is not None and ok:
            pending.received = True
        await send_msg(wrapped, ProbeAck(ok=ok))

    # --- helper --------------------------------------------------------------------------------------

    async def _serve(self, stream: INetStream, wrapped: LibP2PByteStream, request: DialbackRequest) -> None:
        asker = stream.muxed_conn.peer_id
        result = await self._dial_back(stream, asker, request)
        await send_msg(wrapped, result)

    async def _dial_back(self, stream: INetStream, asker: ID, request: DialbackRequest) -> DialbackResult:
        if is_relayed_stream(stream):
            return DialbackResult(DialStatus.RELAYED, detail="we only reach you through a relay")
        remote = stream.get_remote_address()
        observed_ip = remote[0] if remote else ""
        now = self.clock()
        last = self._last_served.get(asker)
        if last is not None and now - last < MIN_SERVE_INTERVAL_S:
            return DialbackResult(DialStatus.BUSY, observed_ip=observed_ip, detail="asked too often")
        targets = select_targets(request.addrs, observed_ip)
        if not targets:
            return DialbackResult(
                DialStatus.NO_ADDRESS, observed_ip=observed_ip, detail="no TCP address offered"
            )
        try:
            self._serving.acquire_nowait()
        except trio.WouldBlock:
            return DialbackResult(DialStatus.BUSY, observed_ip=observed_ip, detail="too many dial-backs")
        try:
            self._last_served[asker] = now
            self._last_served.move_to_end(asker)
            while len(self._last_served) > 1024:
                self._last_served.popitem(last=False)
            self.served += 1
            results = await self._probe_all(targets, asker, request.nonce)
        finally:
            self._serving.release()
        reached = [(a, s, d) for a, s, d in results if s is DialStatus.REACHED]
        if reached:
            return DialbackResult(DialStatus.REACHED, str(reached[0][0]), observed_ip)
        addr, status, detail = min(results, key=lambda r: _FAILURE_RANK.index(r[1]))
        return DialbackResult(status, str(addr), observed_ip, detail[:200])

    async def _probe_all(
        self, targets: list[multiaddr.Multiaddr], asker: ID, nonce: bytes
    ) -> list[tuple[multiaddr.Multiaddr, DialStatus, str]]:
        """Probe every target concurrently; the first that gets through ends the others."""
        results: list[tuple[multiaddr.Multiaddr, DialStatus, str]] = []
        async with trio.open_nursery() as nursery:

            async def one(target: multiaddr.Multiaddr) -> None:
                status, detail = await self.probe(target, asker, nonce)
                results.append((target, status, detail))
                if status is DialStatus.REACHED:
                    nursery.cancel_scope.cancel()

            for target in targets:
                nursery.start_soon(one, target)
        return results

    async def probe(self, target: multiaddr.Multiaddr, asker: ID, nonce: bytes) -> tuple[DialStatus, str]:
        """Dial `asker` at `target` from a throwaway host and hand it the nonce; (status, detail)."""
        prober = self.make_prober()
        opened = _note_tcp_opened(prober)
        try:
            async with prober.run([]):
                try:
                    with trio.fail_after(self.dial_timeout):
                        await prober.connect(PeerInfo(asker, [target]))
                except Exception as e:
                    status, detail = classify_dial_error(e)
                    if status is DialStatus.TIMEOUT and opened.is_set():
                        # The address took the TCP connection: no NAT in the way (one that drops unsolicited
                        # SYNs never lets it open), only a handshake slower than our deadline. Seen on a
                        # 0.08 Mbit/s link whose queue held seconds of a transfer: that trainer judged
                        # itself private. Inconclusive, like any answer that says nothing of NATs.
                        return DialStatus.ERROR, (f"the TCP connection opened, but the handshake did not finish "
                                                  f"within {self.dial_timeout:.0f} s (a slow or congested link)")
                    if status is DialStatus.TIMEOUT:
                        detail = f"no answer within {self.dial_timeout:.0f} s"
                    return status, detail
                try:
                    with trio.fail_after(READ_TIMEOUT_S):
                        stream = LibP2PByteStream(await prober.new_stream(asker, [PROTOCOL_ID]))
                        await send_msg(stream, DialbackProbe(nonce=nonce))
                        ack = await recv_as(stream, ProbeAck, MAX_MSG_BYTES)
                        await stream.aclose()
                except Exception as e:
                    # The connection above reached the asker's own peer id at that address (the security
                    # handshake proves it), so the address is reachable whatever became of the probe
                    # stream: a stream reset or refused on a node that is starting up (seen in the network
                    # lab: nodes judged themselves private for minutes) says nothing about NATs. Unverified,
                    # so inconclusive: the asker asks again soon.
                    return DialStatus.ERROR, f"connected, but the probe stream failed: {type(e).__name__}: {e}"[:200]
                finally:
                    with trio.move_on_after(2):
                        await prober.disconnect(asker)  # promptly, so the asker does not keep a dead peer
                if not ack.ok:
                    return DialStatus.FAILED, "the peer at that address did not recognise the request"
                return DialStatus.REACHED, ""
        except Exception as e:  # the throwaway host itself failed
            return DialStatus.FAILED, f"{type(e).__name__}: {e}"[:200]
