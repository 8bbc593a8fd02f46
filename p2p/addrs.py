"""Parsing and checking multiaddrs given by operators, with errors that say what is wrong."""

from __future__ import annotations

import multiaddr
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo


class AddrError(ValueError):
    """A malformed or unusable address; the message quotes it."""


def parse_multiaddr(text: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as e:  # the multiaddr library raises several unrelated types
        raise AddrError(f"{text!r} is not a valid multiaddr ({e})") from None


def parse_listen(text: str, *, allow_wildcard: bool = True) -> multiaddr.Multiaddr:
    """A TCP listen (or announce) address: /ip4/A/tcp/P or /ip6/A/tcp/P or /dns*/H/tcp/P."""
    addr = parse_multiaddr(text)
    protos = [p.name for p in addr.protocols()]
    if len(protos) != 2 or protos[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") or protos[1] != "tcp":
        raise AddrError(f"{text!r}: expected /ip4/<address>/tcp/<port> (TCP is the only transport)")
    try:
        port = int(addr.value_for_protocol("tcp"))
    except ValueError:
        raise AddrError(f"{text!r}: bad TCP port") from None
    if not 0 <= port <= 65535:
        raise AddrError(f"{text!r}: bad TCP port")
    if not allow_wildcard and addr.value_for_protocol(protos[0]) in ("0.0.0.0", "::"):
        raise AddrError(f"{text!r}: a wildcard address cannot be announced")
    return addr


def parse_bootstrap(text: str) -> PeerInfo:
    """A bootstrap peer: a dialable multiaddr ending in /p2p/<peer id>."""
    addr = parse_multiaddr(text)
    try:
        peer_text = addr.value_for_protocol("p2p")
    except Exception:
        peer_text = None
    if not peer_text:
        raise AddrError(f"{text!r}: a bootstrap address must end in /p2p/<peer id>")
    try:
        peer_id = ID.from_base58(peer_text)
    except Exception:
        raise AddrError(f"{text!r}: {peer_text!r} is not a valid peer id") from None
    transport = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{peer_text}"))
    if not str(transport):
        raise AddrError(f"{text!r}: no address before /p2p/")
    return PeerInfo(peer_id, [transport])
