"""Build the libp2p host: TCP, Noise only, yamux only, and honest announce addresses.

Why not `libp2p.new_host()` with defaults: its default security options also accept `/plaintext/2.0.0`
and secio, and with plaintext a dialer that presents someone else's public key is registered under their
PeerID (see shared/design/py-libp2p-notes.md, pitfall 1). We pass exactly one security transport, Noise,
so every connection is encrypted and its PeerID is proven by the Noise handshake.

Listening on 0.0.0.0 would otherwise advertise `/ip4/0.0.0.0/...` (pitfall 3), which no peer can dial; we
expand the wildcard into the machine's interface addresses, or use the operator's `announce` list.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.rcmgr import Direction
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID

from p2p.limits import (
    MuxerOffences,
    drop_after_handlers,
    release_inbound_slots_on_close,
    survive_removed_handlers,
    use_registered_muxers,
    yamux_with_limits,
)
from p2p.multiselect import PipelinedMultiselectClient

log = logging.getLogger("starling.host")

#: How long the advertised addresses are reused while the listeners stay the same (what can change meanwhile:
#: the machine's interfaces behind a 0.0.0.0 listener, and addresses that peers observed).
ADDRS_CACHE_S = 10.0

_SIOCGIFADDR = 0x8915

#: How long py-libp2p may negotiate the protocol of a stream this node opens (its default: 10 s). Callers bound
#: each open with their own deadline (the replicator's state stream 30 s, SWIM's 10 s); this only keeps the
#: library from cutting them short: at a 64-daemon join the bootstrap node took 9-14 s to negotiate newcomers'
#: streams, and a 10 s limit here failed their state sessions whatever the replicator allowed
#: (docs/benchmarks.md, "Scale: real daemons", 2026-11-27). Streams the peer opens keep the library's 10 s.
OUTBOUND_NEGOTIATION_TIMEOUT_S = 30.0


def interface_ipv4_addrs() -> list[str]:
    """IPv4 addresses of this machine's interfaces that are up (Linux ioctl; no extra dependency)."""
    addrs: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # interface without an IPv4 address, or down
            addrs.append(socket.inet_ntoa(packed[20:24]))
    return addrs


def expand_wildcards(candidates: Sequence[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """Replace /ip4/0.0.0.0 listen addresses by one address per interface.

    Loopback addresses are kept only when the machine has nothing else, so that a peer on another host
    is never told to dial its own 127.0.0.1.
    """
    local = interface_ipv4_addrs()
    non_loopback = [a for a in local if not ipaddress.ip_address(a).is_loopback]
    usable = non_loopback or local
    out: list[multiaddr.Multiaddr] = []
    seen: set[str] = set()
    for addr in candidates:
        text = str(addr)
        if text.startswith("/ip4/0.0.0.0/"):
            rest = text[len("/ip4/0.0.0.0") :]
            expanded = [multiaddr.Multiaddr(f"/ip4/{ip}{rest}") for ip in usable]
        else:
            expanded = [addr]
        for a in expanded:
            if str(a) not in seen:
                seen.add(str(a))
                out.append(a)
    return out


def port_in_use(host: str, port: int) -> bool:
    """True if something already listens on TCP (host, port), a Starling daemon included.

    Why not just let the listener fail: py-libp2p opens its listeners with SO_REUSEPORT (hole punching
    dials from the listen port), and Linux then lets a second process of the same user bind the same
    port: two daemons with different homes would share one address and split its dials between two
    PeerIDs. This probe sets SO_REUSEADDR (a restart must not trip over its old connections in TIME_WAIT)
    but not SO_REUSEPORT, so its bind fails wherever any socket listens on that port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _proc_net_ip(hex_addr: str) -> str:
    """The IP of a /proc/net/tcp{,6} address column (hex, in 32-bit words of host byte order)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _overlap(a: str, b: str) -> bool:
    """Whether listeners on IPs `a` and `b` (same port) would take the same connections."""
    if a == b or "::" in (a, b):  # a [::] listener is dual-stack on Linux by default
        return True
    return "0.0.0.0" in (a, b) and ":" not in a + b


def foreign_listeners(host: str, port: int) -> int:
    """How many TCP sockets listen on (`host`, `port`) (or a wildcard covering it) in this network
    namespace without being this process's own.

    Closes the window `port_in_use` leaves between its probe and the real bind (two daemons started at
    the same moment): once our listener is up, any other listener there is a second process sharing the
    port through SO_REUSEPORT. Linux only (/proc); 0 where /proc cannot be read.
    """
    listening: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...; st 0A = LISTEN
            if len(fields) <= 9 or fields[3] != "0A":
                continue
            ip_hex, _, port_hex = fields[1].partition(":")
            if int(port_hex, 16) == port and _overlap(_proc_net_ip(ip_hex), host):
                listening.add(fields[9])
    if not listening:
        return 0
    own: set[str] = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                own.add(target[len("socket:[") : -1])
    except OSError:
        return 0
    return len(listening - own)


def build_host(
    key_pair: KeyPair,
    *,
    announce: Sequence[multiaddr.Multiaddr] = (),
    max_connections: int = 64,
    dial_timeout: float = 10.0,
    psk: str | None = None,
    muxer_offences: MuxerOffences | None = None,
) -> IHost:
    """A host with TCP transport, Noise security and yamux muxing, nothing else.

    `announce`, when given, replaces the advertised addresses (e.g. a public IP or DNS name in front of a
    port forward); otherwise the listen addresses are advertised with wildcards expanded.
    `psk` (64 hex digits) makes this a private network: see p2p/auth.py.
    `muxer_offences` counts peers that break Yamux flow control (p2p/limits.py); one is made if not given.
    """
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    fixed = list(announce)

    def addrs_factory(candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        if fixed:
            return fixed
        return [a for a in expand_wildcards(candidates) if "/ip4/0.0.0.0/" not in str(a)]

    connection_config = ConnectionConfig(
        max_connections=max_connections,
        # Starling's own connection manager (p2p/connmgr.py) decides whom to dial; libp2p's auto-connector
        # and pruning stay out of the way.
        min_connections=0,
        low_watermark=0,
        high_watermark=max_connections,
        dial_timeout=dial_timeout,
        outbound_stream_protocol_negotiation_timeout=OUTBOUND_NEGOTIATION_TIMEOUT_S,
    )
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        # Yamux with its receive windows enforced (py-libp2p 0.8.1 buffers past them without bound).
        muxer_opt={YAMUX_PROTOCOL_ID: yamux_with_limits(muxer_offences or MuxerOffences())},
        enable_tcp=True,
        addrs_factory=addrs_factory,
        connection_config=connection_config,
        negotiate_timeout=10,
        psk=psk,
    )
    cache_addrs(host)
    _disable_auto_connector(host)
    release_inbound_slots_on_close(host.get_network())  # else 64 connect/disconnect cycles lock us out
    use_registered_muxers(host.get_network().upgrader)  # else a plain Yamux, whatever muxer_opt says
    drop_after_handlers(host)  # else a stream we answered buffers what the peer sends, window after window
    survive_removed_handlers(host)  # else a handler removed mid-negotiation ends the whole connection
    host.multiselect_client = PipelinedMultiselectClient()  # else 2 round trips before a new stream's first byte
    return host


def cache_addrs(host: IHost, ttl: float = ADDRS_CACHE_S, clock: Callable[[], float] = time.monotonic) -> None:
    """Narrow, instance-level patch: ``host.get_addrs()`` computed again only when the listeners' addresses
    change or ``ttl`` seconds have passed.

    py-libp2p asks for them whenever it attaches this host's signed peer record to a gossipsub RPC, that is
    for every message published or forwarded, and each time builds every address anew (the addrs factory,
    the interface list, multiaddr parsing: about 2 ms); that was 6% of an idle daemon's CPU with 8 daemons
    (bench/scale.py --profile), for a record that p2p/gossip.py then leaves off the RPC.
    """
    compute = host.get_addrs
    cached: list[object] = [None, -ttl, []]  # key, when, addresses

    def get_addrs() -> list[multiaddr.Multiaddr]:
        key = tuple(a.to_bytes() for a in host.get_transport_addrs())
        now = clock()
        if key != cached[0] or now - float(cached[1]) >= ttl:  # type: ignore[arg-type]
            cached[:] = [key, now, compute()]
        return list(cached[2])  # type: ignore[call-overload]

    host.get_addrs = get_addrs  # type: ignore[method-assign]


def _disable_auto_connector(host: IHost) -> None:
    """Narrow patch: keep py-libp2p's AutoConnector from starting.

    It dials every peer in the peerstore up to the midpoint of its watermarks (32 here), which would
    override our target and cap; p2p/connmgr.py owns dialing. Setting the watermarks to 0 instead would
    make the pruner close every connection, so we stop the connector itself.
    """
    connector = getattr(host.get_network(), "auto_connector", None)
    if connector is None:
        return

    async def start_disabled() -> None:
        return None

    connector.start = start_disabled  # type: ignore[method-assign]


def last_data_from(host: IHost, peer: ID) -> float:
    """When any open connection with ``peer`` last delivered a DATA frame, on any stream (trio clock; -inf:
    none did, or no connection has a muxer that records it: :class:`p2p.limits.BoundedYamux` does)."""
    last = -math.inf
    for conn in host.get_network().get_connections(peer):
        if getattr(conn, "is_closed", False):
            continue
        at = getattr(getattr(conn, "muxed_conn", None), "last_data_at", None)
        if isinstance(at, (int, float)):
            last = max(last, float(at))
    return last


def dialed_by_us(host: IHost, peer: ID) -> bool | None:
    """Whether this node opened its connection to ``peer``: True when every open connection to it is one we
    dialled, False when every one was dialled by the peer, None when there are both kinds, none, or a
    direction py-libp2p did not record (callers then fall back on a rule of their own).

    Why callers care: the side that dialled is the one that wants something of the connection (a newcomer
    that dials the bootstrap node, a member that dials a candidate), and a node that accepted the connection
    may be the node every newcomer dials first, with no time to spare for each (node/swarm/replicator.py)."""
    kinds: set[int] = set()
    for conn in host.get_network().get_connections(peer):
        if getattr(conn, "is_closed", False):
            continue
        kinds.add(int(getattr(conn, "direction", Direction.UNKNOWN)))
    if kinds == {Direction.OUTBOUND}:
        return True
    if kinds == {Direction.INBOUND}:
        return False
    return None
