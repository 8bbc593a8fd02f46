"""Build the libp2p host: TCP, Noise only, yamux only, and honest announce addresses.

Why not `libp2p.new_host()` with defaults: its default security options also accept `/plaintext/2.0.0`
and secio, and with plaintext a dialer that presents someone else's public key is registered under their
PeerID (see shared/design/py-libp2p-notes.md, pitfall 1). We pass exactly one security transport, Noise,
so every connection is encrypted and its PeerID is proven by the Noise handshake.

Listening on 0.0.0.0 would otherwise advertise `/ip4/0.0.0.0/...` (pitfall 3), which no peer can dial; we
expand the wildcard into the machine's interface addresses, or use the operator's `announce` list.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Sequence

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

log = logging.getLogger("starling.host")

_SIOCGIFADDR = 0x8915


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


def build_host(
    key_pair: KeyPair,
    *,
    announce: Sequence[multiaddr.Multiaddr] = (),
    max_connections: int = 64,
    dial_timeout: float = 10.0,
    psk: str | None = None,
) -> IHost:
    """A host with TCP transport, Noise security and yamux muxing, nothing else.

    `announce`, when given, replaces the advertised addresses (e.g. a public IP or DNS name in front of a
    port forward); otherwise the listen addresses are advertised with wildcards expanded.
    `psk` (64 hex digits) makes this a private network: see p2p/auth.py.
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
    )
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        enable_tcp=True,
        addrs_factory=addrs_factory,
        connection_config=connection_config,
        negotiate_timeout=10,
        psk=psk,
    )
    _disable_auto_connector(host)
    return host


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
