"""Circuit relay v2 as py-libp2p gives it: circuit addresses (``[<relay>]/p2p/R/p2p-circuit/p2p/D``),
whether a connection runs through a relay, a relay's advertised transport address, and a HOP answer's
status.

Why a module apart from node/swarm/nat.py: these are pure functions of addresses, connections and
messages, with no policy; the NAT service decides when to reserve, dial or serve a relay, and uses them
to read what it gets back.
"""

from __future__ import annotations

import multiaddr
from libp2p.abc import INetConn
from libp2p.connection_types import ConnectionType
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode


def is_circuit_addr(addr: multiaddr.Multiaddr | str) -> bool:
    return "/p2p-circuit" in str(addr)


def parse_circuit_addr(addr: multiaddr.Multiaddr | str) -> tuple[multiaddr.Multiaddr | None, ID, ID]:
    """(relay transport address or None, relay id, destination id) of ``[<ma>]/p2p/R/p2p-circuit/p2p/D``.

    Raises ValueError, quoting the address, for anything else.
    """
    text = str(addr)
    try:
        multiaddr.Multiaddr(text)  # validates every component, peer ids included
    except Exception:
        raise ValueError(f"{text!r} is not a valid multiaddr") from None
    head, sep, tail = text.partition("/p2p-circuit")
    if not sep or not tail.startswith("/p2p/") or tail.count("/") != 2 or "/p2p/" not in head:
        raise ValueError(
            f"{text!r} is not a circuit address (<relay>/p2p/<relay id>/p2p-circuit/p2p/<peer id>)"
        )
    transport, _, relay_text = head.rpartition("/p2p/")
    try:
        relay, dest = ID.from_base58(relay_text), ID.from_base58(tail[len("/p2p/") :])
        relay_addr = multiaddr.Multiaddr(transport) if transport else None
    except Exception:
        raise ValueError(f"{text!r}: bad peer id or relay address") from None
    return relay_addr, relay, dest


def connection_is_relayed(conn: INetConn) -> bool:
    """True for a connection that runs through a relay (its raw connection is a circuit stream)."""
    try:
        kind = conn.get_connection_type()
    except Exception:
        kind = ConnectionType.UNKNOWN
    if kind == ConnectionType.RELAYED:
        return True
    if kind == ConnectionType.DIRECT:
        return False
    try:
        return any(is_circuit_addr(a) for a in conn.get_transport_addresses())
    except Exception:
        return False


def short_id(peer_id: ID | str) -> str:
    text = str(peer_id)
    return f"{text[:6]}..{text[-6:]}" if len(text) > 14 else text


def transport_part(addr: multiaddr.Multiaddr) -> multiaddr.Multiaddr | None:
    """The transport part (/ip4|ip6/X/tcp/P) of a relay's advertised address, or None if unusable."""
    text = str(addr)
    if is_circuit_addr(text):
        return None
    base = text.split("/p2p/")[0]
    parts = base.split("/")
    if (
        len(parts) != 5
        or parts[1] not in ("ip4", "ip6")
        or parts[3] != "tcp"
        or parts[2] in ("0.0.0.0", "::")
    ):
        return None
    try:
        return multiaddr.Multiaddr(base)
    except Exception:
        return None


def hop_ok(msg: HopMessage) -> bool:
    return msg.type == HopMessage.STATUS and msg.HasField("status") and msg.status == StatusCode.OK


def hop_status_name(msg: HopMessage) -> str:
    """The relay's status code by name (NO_RESERVATION, RESOURCE_LIMIT_EXCEEDED, ...)."""
    if not msg.HasField("status"):
        return "no status in the answer"
    try:
        return StatusCode(msg.status).name
    except ValueError:
        return f"unknown status {msg.status}"
