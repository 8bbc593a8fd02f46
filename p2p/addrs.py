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
    if not is_peer_id(peer_text):
        raise AddrError(f"{text!r}: {peer_text[:80]!r} is not a PeerID (the 12D3KooW... that `starling init` or "
                        "`starling status` prints on that node)")
    peer_id = ID.from_base58(peer_text)
    transport = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{peer_text}"))
    if not str(transport):
        raise AddrError(f"{text!r}: no address before /p2p/")
    return PeerInfo(peer_id, [transport])


def is_peer_id(text: str) -> bool:
    """Whether `text` is a base58 libp2p PeerID: a multihash, identity (an inlined ed25519 key, 12D3KooW...)
    or sha2-256 (Qm...). Stricter than py-libp2p's ID.from_base58, which takes any base58 text: a mistyped
    bootstrap PeerID would otherwise be dialled (and refused) forever, a mistyped founder would leave the
    swarm without a manifest."""
    import base58

    try:
        raw = base58.b58decode(text)
    except ValueError:
        return False
    if base58.b58encode(raw).decode() != text or len(raw) < 3:
        return False
    # identity: the public key itself, as libp2p's protobuf (field 1 the key type 0-3, field 2 the key bytes).
    identity = (raw[0] == 0x00 and raw[1] == len(raw) - 2 and 8 <= len(raw) <= 44 and raw[2] == 0x08
                and raw[3] <= 3 and raw[4] == 0x12 and raw[5] == len(raw) - 6)
    sha256 = raw[0] == 0x12 and raw[1] == 0x20 and len(raw) == 34
    return identity or sha256
